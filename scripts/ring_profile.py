"""Where a sequence-parallel fwd+bwd waits: the call `benchmarks/ring.py` times (causal, B=1, 16
heads of 128, bf16, zigzag layout, every visible GPU) once under `jax.profiler`, then per device the
kernel time by name, the time some kernel ran (busy) and the span, and on the first device every
NCCL kernel with the time no compute kernel ran beside it ("exposed").

  PYTHONPATH=. python3 scripts/ring_profile.py [--strategy ring|all_gather] [--length 131072]
                                               [--timeline] [--trace-dir DIR] [--default-scheduling]

XLA flags: as benchmarks/ring.py, XLA_FLAGS plus the latency-hiding scheduler unless
--default-scheduling. GPU only: it reads the GPU streams of the trace."""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.ring import inputs, parallel_fn  # noqa: E402  (before jax: the benchmark's XLA flags)
from benchmarks import harness  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_attn  # noqa: E402

NOT_KERNELS = ("XLA", "Step", "Module", "Ops", "TraceMe")  # trace lines that are not GPU streams


def profile(strategy: str, length: int, trace_dir: str) -> str:
    """Run the call three times untraced, once traced; -> the trace file."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("sp",))
    sharding = NamedSharding(mesh, P(None, "sp"))
    args = [jax.device_put(jax_attn.to_zigzag(x, len(devices)), sharding)
            for x in inputs(0, length, 16, 128, jnp.bfloat16)]
    fwd_bwd = harness.jax_forward_backward(parallel_fn(mesh, "zigzag", strategy, None))
    for _ in range(3):  # compile, and (under JAX's profile-guided scheduling) its profiling runs
        jax.block_until_ready(fwd_bwd(*args))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(fwd_bwd(*args))
    return glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]


def kernels(path: str) -> dict[str, list[tuple[float, float, str]]]:
    """GPU -> [(start us, end us, kernel name)] from a perfetto trace."""
    events = json.load(gzip.open(path))["traceEvents"]
    meta = lambda kind: {(e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]: e["args"]["name"]
                         for e in events if e.get("ph") == "M" and e.get("name") == kind}
    process, thread = meta("process_name"), meta("thread_name")
    by = collections.defaultdict(list)
    for e in events:
        name = process.get(e.get("pid"), "")
        if (e.get("ph") == "X" and "GPU" in name and e.get("dur", 0) > 0
                and not any(w in thread.get((e["pid"], e["tid"]), "") for w in NOT_KERNELS)):
            by[name].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    return {k: sorted(v) for k, v in by.items()}


def exposed(a: float, b: float, compute: list[tuple[float, float]]) -> float:
    """The part of [a, b] no compute interval covers (compute sorted by start)."""
    t, cur = 0.0, a
    for x, y in compute:
        if y <= cur or x >= b:
            continue
        t += max(0.0, x - cur)
        cur = max(cur, y)
        if cur >= b:
            return t
    return t + max(0.0, b - cur)


def report(by: dict, strategy: str, timeline: bool) -> None:
    if not by:
        raise SystemExit("no GPU kernels in the trace: this script profiles GPUs")
    for device, events in sorted(by.items()):
        totals = collections.Counter()
        for a, b, name in events:
            totals[name[:60]] += (b - a) / 1e3
        start, end = events[0][0], max(b for _, b, _ in events)
        idle = exposed(start, end, [(a, b) for a, b, _ in events])  # no kernel running
        print(f"[{strategy}] {device}: kernels {sum(totals.values()):.1f} ms  busy {(end - start - idle) / 1e3:.1f}  "
              f"span {(end - start) / 1e3:.1f}")
        for name, t in totals.most_common(4):
            print(f"   {t:9.2f}  {name}")
    device = sorted(by)[0]
    events = by[device]
    compute = [(a, b) for a, b, name in events if "nccl" not in name.lower()]
    nccl = [(a, b, name) for a, b, name in events if "nccl" in name.lower()]
    print(f"{device}: NCCL time with no compute kernel beside it "
          f"{sum(exposed(a, b, compute) for a, b, _ in nccl) / 1e3:.2f} ms")
    if timeline:
        t0 = events[0][0]
        for a, b, name in events:
            if "nccl" in name.lower():
                print(f"  {(a - t0) / 1e3:8.2f} {name[:28]:28s} {(b - a) / 1e3:7.2f}  exposed "
                      f"{exposed(a, b, compute) / 1e3:6.2f}")
            elif b - a > 300:
                print(f"  {(a - t0) / 1e3:8.2f} {name[:28]:28s} {(b - a) / 1e3:7.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="ring", choices=("ring", "all_gather"))
    p.add_argument("--length", type=int, default=131072)
    p.add_argument("--timeline", action="store_true", help="list the first device's kernels (> 0.3 ms) and NCCL")
    p.add_argument("--trace-dir", default="/tmp/ring-trace")
    p.add_argument("--default-scheduling", action="store_true",
                   help="leave XLA's scheduler as it is (read by benchmarks/ring.py at import)")
    opts = p.parse_args()
    report(kernels(profile(opts.strategy, opts.length, opts.trace_dir)), opts.strategy, opts.timeline)


if __name__ == "__main__":
    main()
