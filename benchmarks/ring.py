#!/usr/bin/env python3
"""Sequence parallelism: ring attention (zigzag, contiguous) and all-gather context parallelism on
every visible GPU, against the one-GPU kernel.

Run on the GPU machine from the repository root (uses `jax.devices()`: 1, 2, 4 or 8 GPUs):

    PYTHONPATH=. python3 benchmarks/ring.py --out benchmarks/results [--quick]

Cases: bf16, B=1, 16 heads of 128, causal, forward and forward+backward, at 128k and 512k tokens
(and 1M on 4 or more GPUs); --quick: 32k (a smoke run in under two minutes); --smoke: tiny float32
shapes on 4 CPU devices (the code paths only); --lengths picks others. A full run on 4 GPUs times
the one-GPU kernel at 1M tokens too (tens of seconds a call): `--repeats 1` or `--budget` keep it short.
The run sets XLA's latency-hiding scheduler (`--xla_gpu_enable_latency_hiding_scheduler=true`
appended to XLA_FLAGS; the results record the flags), which overlaps the ring's transfers with
the steps' kernels; `--default-scheduling` leaves XLA's default.

Columns (each row one (case, column, mode)):
    one_gpu          jax_attn.flash_attention on the first GPU (the default implementation)
    ring_zigzag      ring_attention(layout="zigzag", strategy="ring") under shard_map over all GPUs
    ring_contiguous  the same, layout="contiguous"
    all_gather       ring_attention(layout="zigzag", strategy="all_gather")
The sequence-parallel columns take their inputs already sharded (zigzag order where the layout says
so), as a model keeping its activations sequence-sharded would: placement is outside the timing.
TF/s are per call over all GPUs (FLOPs: forward 4*B*S*S*H*D/2, causal; forward+backward 3.5x);
`efficiency` = one_gpu ms / (column ms * GPUs). relerr: against the one-GPU output (S <= 128k).
"""
from __future__ import annotations

import os
import sys

LATENCY_HIDING = "--xla_gpu_enable_latency_hiding_scheduler=true"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--smoke" in sys.argv:  # four CPU devices, before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
if "--default-scheduling" not in sys.argv:  # let XLA overlap the K/V transfers with the steps' kernels
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + LATENCY_HIDING).strip()
from benchmarks import harness  # noqa: E402  (before jax: allocator and platform settings)

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

COLUMNS = {"one_gpu": None, "ring_zigzag": ("zigzag", "ring"), "ring_contiguous": ("contiguous", "ring"),
           "all_gather": ("zigzag", "all_gather")}


def lengths(opts, devices: int):
    if opts.smoke:
        return [128 * devices]
    if opts.lengths:
        return [int(s) for s in opts.lengths.split(",")]
    if opts.quick:  # one length: compilation dominates a quick run
        return [32768]
    return [131072, 524288] + ([1048576] if devices >= 4 else [])


def inputs(seed: int, seq: int, heads: int, dim: int, dtype):
    """q, k, v, do ~ N(0, 1) on the first device."""
    keys = jax.random.split(jax.random.key(seed), 4)
    make = jax.jit(lambda key: jax.random.normal(key, (1, seq, heads, dim), jnp.float32).astype(dtype))
    return [jax.block_until_ready(make(key)) for key in keys]


def parallel_fn(mesh, layout, strategy, implementation):
    import jax_attn
    spec = P(None, "sp")
    body = lambda q, k, v: jax_attn.ring_attention(q, k, v, axis_name="sp", causal=True, layout=layout,
                                                   strategy=strategy, implementation=implementation)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)


def _timed(f, args, mode, opts):
    g = harness.jax_forward(f) if mode == "fwd" else harness.jax_forward_backward(f)
    return harness.time_jax(g, args if mode == "fwdbwd" else args[:3], opts.target_ms, opts.repeats)


def main(argv=None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (overrides the defaults)")
    p.add_argument("--implementation", default=None, help="the engine of every call (default: the library's rule)")
    p.add_argument("--default-scheduling", action="store_true",
                   help=f"leave XLA's scheduler as it is (without it the run sets {LATENCY_HIDING})")
    opts = p.parse_args(argv)
    if opts.repeats is None:
        opts.repeats = 2 if opts.smoke else 3
    opts = harness.finish_options(opts)
    import jax_attn

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("sp",))
    n = len(devices)
    columns = harness.select([harness.Column(c, None) for c in COLUMNS], opts.columns, key=lambda c: c.name)
    heads, dim = (4, 32) if opts.smoke else (16, 128)
    doc, stem = harness.new_document("ring", opts, anchors={}, devices=n,
                                     device_names=[d.device_kind for d in devices],
                                     xla_flags=os.environ.get("XLA_FLAGS", ""))
    sharding = NamedSharding(mesh, P(None, "sp"))
    for i, seq in enumerate(lengths(opts, n)):
        case = harness.Case("causal", 1, seq, heads, dim, causal=True, params={"devices": n})
        harness.log(f"=== {case.label()} on {n} devices ({opts.dtype_name}) ===")
        host = inputs(opts.seed + i, seq, heads, dim, opts.dtype)
        reference, one_ms = {}, {}
        for mode in harness.MODES:
            for col in columns:
                row = harness._new_row("ring", case, col, mode, opts.dtype_name)
                row["params"] = {"devices": n, "column": col.name}
                try:
                    if time.perf_counter() - harness.T_START > opts.budget:
                        row.update(status="skipped", error=f"time budget ({opts.budget:.0f} s) spent")
                        raise StopIteration
                    if col.name == "one_gpu":
                        f = lambda q, k, v: jax_attn.flash_attention(q, k, v, causal=True,
                                                                     implementation=opts.implementation)
                        ms, out, _ = _timed(f, host, mode, opts)
                        one_ms[mode] = ms
                        if seq <= 131072:
                            reference[mode] = out
                    else:
                        layout, strategy = COLUMNS[col.name]
                        order = (lambda x: jax_attn.to_zigzag(x, n)) if layout == "zigzag" else (lambda x: x)
                        args = [jax.device_put(order(x), sharding) for x in host]
                        ms, out, _ = _timed(parallel_fn(mesh, layout, strategy, opts.implementation), args, mode, opts)
                        if mode in reference:
                            outs = [out] if mode == "fwd" else list(out)
                            refs = [reference[mode]] if mode == "fwd" else list(reference[mode])
                            errs = [harness.relerr(jax.device_put(a, devices[0]), order(b)) for a, b in zip(outs, refs)]
                            row["relerr" if mode == "fwd" else "relerr_grad"] = max(errs)
                            row["relerr_ref"] = "one_gpu"
                        del args
                    row.update(status="ok", ms=ms, tflops=case.flops(mode) / (ms * 1e-3) / 1e12)
                    if mode in one_ms:
                        row["params"]["efficiency"] = one_ms[mode] / (ms * n)
                except StopIteration:
                    pass
                except Exception as e:  # a row that fails records its error
                    row.update(status="error", error=harness.error_text(e))
                doc["rows"].append(row)
                harness._print_row(row)
                if row["status"] == "ok" and "efficiency" in row["params"]:
                    harness.log(f"    scaling efficiency on {n} devices: {row['params']['efficiency']:.2f}")
        del host, reference
        harness.write_json(stem + ".json", doc)
    harness.finish(doc, stem, [c.name for c in columns], opts, metric="ms",
                   extra_markdown=_efficiency_table(doc["rows"], n))
    return 0


def _efficiency_table(rows, n: int) -> str:
    lines = [f"Scaling efficiency on {n} devices (one-GPU ms / (ms x {n})):", "",
             "| S | mode | " + " | ".join(c for c in COLUMNS if c != "one_gpu") + " |",
             "|---" * (2 + len(COLUMNS) - 1) + "|"]
    keys = sorted({(r["S"], r["mode"]) for r in rows})
    for s, mode in keys:
        cells = []
        for c in COLUMNS:
            if c == "one_gpu":
                continue
            r = next((r for r in rows if r["S"] == s and r["mode"] == mode and r["impl"] == c), None)
            eff = None if r is None else r["params"].get("efficiency")
            cells.append("-" if eff is None else f"{eff:.2f}")
        lines.append(f"| {s} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
