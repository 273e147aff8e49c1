#!/usr/bin/env python3
"""Sequence-parallel dilated attention (`ring_dilated_attention`) on every visible GPU against the
one-GPU `dilated_attention`, with the bytes each device sends counted in the compiled program.

Run on the GPU machine from the repository root (uses `jax.devices()`: 1, 2, 4 or 8 GPUs):

    PYTHONPATH=. python3 benchmarks/ring_dilated.py --out benchmarks/results

Cases (bf16, B=1, 16 heads of 128, not causal, merge="lse", forward and forward+backward, S = 128k
and 512k; --lengths picks others; --smoke: S = 1024, 4 heads of 32, float32 on 4 CPU devices):
    ladder     LongNet's ladder, segments (2048 .. 32768) at rates (1 .. 16): with shards of 32k
               rows or more every segment lies inside a shard, so nothing travels
    ladder_s   the ladder continued to the whole sequence, segments 2048 * 2^k at rates 2^k up to
               S (every branch 2048 rows a segment): the branches longer than a shard are rings over
               the shards they span, which exchange only their dilated rows
Columns:
    one_gpu       jax_attn.dilated_attention on the first GPU
    ring_dilated  ring_dilated_attention under shard_map over all GPUs, inputs already sharded
                  contiguously (placement outside the timing)
Traffic: the collective-permute, all-gather and reduce-scatter results of the compiled sharded
program, in bytes per device (`sent_bytes`), beside `rows_bytes`: the dilated K and V rows of the
other shards in each spanning segment, the least a forward can receive (no gathered whole shards).
`efficiency` = one_gpu ms / (ring_dilated ms x GPUs); TF/s on the dilated FLOPs (benchmarks/dilated.py).
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--smoke" in sys.argv:  # four CPU devices, before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
if "--default-scheduling" not in sys.argv:  # overlap the spanning branches' transfers with kernels
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_gpu_enable_latency_hiding_scheduler=true").strip()
from benchmarks import harness  # noqa: E402  (before jax: allocator and platform settings)
from benchmarks.dilated import LADDER, DilatedCase  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(collective-permute-done|collective-permute|all-gather-done|"
                        r"all-gather|reduce-scatter)\(")
SHAPE = re.compile(r"(bf16|f16|f32|f64|s32|u32|pred)\[([\d,]*)\]")
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "u32": 4, "pred": 1}


def configs(seq: int, base: int):
    """The cases' (segments, rates); `base`: the first segment (2048; smaller in a smoke run)."""
    ladder = (tuple(w * base // LADDER[0][0] for w in LADDER[0]), LADDER[1])
    ladder_s = [(base << k, 1 << k) for k in range(64) if base << k <= seq]
    return {"ladder": ladder, "ladder_s": (tuple(w for w, _ in ladder_s), tuple(r for _, r in ladder_s))}


def sent_bytes(compiled_text: str) -> int:
    """Bytes a device receives (= sends, in a ring) through the program's collectives: the result
    shapes of every collective-permute (its done op when asynchronous), all-gather, reduce-scatter."""
    total = 0
    for shapes, op in COLLECTIVE.findall(compiled_text):
        for dtype, dims in SHAPE.findall(shapes):
            total += BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def rows_bytes(seq: int, devices: int, heads: int, dim: int, itemsize: int, segments, rates) -> int:
    """Dilated K and V rows of the other shards of every spanning segment a device needs."""
    shard, total = seq // devices, 0
    for w, r in zip(segments, rates):
        w = min(w, seq)
        if w > shard:
            total += (w // shard - 1) * (shard // r) * heads * dim * itemsize * 2
    return total


def main(argv=None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 131072,524288)")
    p.add_argument("--default-scheduling", action="store_true", help="leave XLA's scheduler as it is")
    opts = harness.finish_options(p.parse_args(argv))
    import jax_attn

    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("sp",))
    sharding = NamedSharding(mesh, P(None, "sp"))
    heads, dim, base = (4, 32, 32) if opts.smoke else (16, 128, 2048)
    seqs = [1024] if opts.smoke else [int(s) for s in (opts.lengths or "131072,524288").split(",")]
    doc, stem = harness.new_document("ring-dilated", opts, anchors={}, devices=n,
                                     xla_flags=os.environ.get("XLA_FLAGS", ""))
    for seq in seqs:
        for tag, (segments, rates) in configs(seq, base).items():
            if opts.cases and tag not in opts.cases.split(","):
                continue
            config = dict(segment_lengths=segments, dilation_rates=rates)
            case = DilatedCase(tag, 1, seq, heads, dim, params={"segments": segments, "rates": rates, "devices": n})
            harness.log(f"=== {case.label()} segments {segments} rates {rates} on {n} devices ===")
            keys = jax.random.split(jax.random.key(opts.seed), 4)
            host = [jax.random.normal(key, (1, seq, heads, dim), jnp.float32).astype(opts.dtype) for key in keys]
            one = lambda q, k, v: jax_attn.dilated_attention(q, k, v, **config)
            body = lambda q, k, v: jax_attn.ring_dilated_attention(q, k, v, axis_name="sp", **config)
            sharded = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"),
                                    check_vma=False)
            placed = [jax.device_put(x, sharding) for x in host]
            one_ms, reference = {}, {}
            for mode in harness.MODES:
                args = host if mode == "fwdbwd" else host[:3]
                for name, f, xs in (("one_gpu", one, args), ("ring_dilated", sharded, placed[:len(args)])):
                    row = harness._new_row("ring-dilated", case, harness.Column(name, None), mode, opts.dtype_name)
                    row["params"] = dict(case.params, column=name)
                    try:
                        g = jax.jit(f) if mode == "fwd" else jax.jit(
                            lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
                        ms, out, _ = harness.time_jax(g, xs, opts.target_ms, opts.repeats)
                        row.update(status="ok", ms=ms, tflops=case.flops(mode) / (ms * 1e-3) / 1e12)
                        if name == "one_gpu":
                            one_ms[mode] = ms
                            reference[mode] = out
                        else:
                            outs = [out] if mode == "fwd" else list(out)
                            refs = [reference[mode]] if mode == "fwd" else list(reference[mode])
                            row["relerr" if mode == "fwd" else "relerr_grad"] = max(
                                harness.relerr(jax.device_put(a, devices[0]), b) for a, b in zip(outs, refs))
                            row["relerr_ref"] = "one_gpu"
                            row["params"]["efficiency"] = one_ms[mode] / (ms * n)
                            row["params"]["sent_bytes"] = sent_bytes(g.lower(*xs).compile().as_text())
                            row["params"]["rows_bytes"] = rows_bytes(seq, n, heads, dim, jnp.dtype(opts.dtype).itemsize,
                                                                     segments, rates)
                    except Exception as e:  # a row that fails records its error
                        row.update(status="error", error=harness.error_text(e))
                    doc["rows"].append(row)
                    harness._print_row(row)
                    if "efficiency" in row["params"]:
                        harness.log(f"    efficiency {row['params']['efficiency']:.2f}, sent "
                                    f"{row['params']['sent_bytes'] / 2**20:.1f} MiB per device (dilated rows of "
                                    f"spanning segments: {row['params']['rows_bytes'] / 2**20:.1f} MiB)")
            del host, placed, reference
            harness.write_json(stem + ".json", doc)
    harness.finish(doc, stem, ["one_gpu", "ring_dilated"], opts, metric="ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
