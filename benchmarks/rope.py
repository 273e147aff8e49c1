#!/usr/bin/env python3
"""Fused RoPE benchmark (GPU): is rotating q/k inside the kernels cheaper than a separate pass?

Run from the repository root: `PYTHONPATH=. python3 benchmarks/rope.py --out benchmarks/results`.

Rows (bf16, causal, forward and forward+backward; default shape 2x8192x16x128):
  plain      jax_attn.flash_attention without RoPE (the cost floor)
  fused      jax_attn.flash_attention(..., rope=Rope(style))        (q, k rotated after load;
             the default implementation: the Mosaic GPU kernels on Hopper)
  fused-tri  the same on the Triton engine (implementation="pallas_triton")
  fused+pos  the same with positions given as an array (general cos/sin table path: Triton)
  xla+ours   jax_attn.apply_rope on q, k by XLA, then jax_attn.flash_attention
  xla+cudnn  jax_attn.apply_rope by XLA, then jax.nn.dot_product_attention(implementation="cudnn")
Targets (issue 4): fused fwd+bwd <= 1.05x the time of plain, and >= 1.05x faster than xla+ours.
Those three are then timed again in turn (--paired-rounds), and the targets' ratios are the
medians of the per-round ratios: drift during the run (the same call has timed 4-8 % apart in
the table's rows) cancels in them.
FLOPs counted as for attention alone (4*B*S*S*H*D, halved for causal, x3.5 for fwd+bwd), so
TF/s compare directly with benchmarks/attention.py.
"""
from __future__ import annotations

import argparse
import statistics

from benchmarks.attention import _make_fwdbwd, device_info, flops, log, ms_table_row, save_run, time_jax

import jax  # noqa: E402  (benchmarks.attention configured the allocator before importing jax)
import jax.numpy as jnp  # noqa: E402

import jax_attn  # noqa: E402
from jax_attn import Rope, apply_rope, flash_attention  # noqa: E402


def candidates(style: str, causal: bool, positions):
    rope = Rope(style=style)
    rotate = lambda q, k: (apply_rope(q, positions, rope), apply_rope(k, positions, rope))
    return {
        "plain": lambda q, k, v: flash_attention(q, k, v, causal=causal),
        "fused": lambda q, k, v: flash_attention(q, k, v, causal=causal, rope=rope),
        "fused-tri": lambda q, k, v: flash_attention(q, k, v, causal=causal, rope=rope,
                                                     implementation="pallas_triton"),
        "fused+pos": lambda q, k, v: flash_attention(q, k, v, causal=causal, rope=rope, positions=positions),
        "xla+ours": lambda q, k, v: flash_attention(*rotate(q, k), v, causal=causal),
        "xla+cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            *rotate(q, k), v, is_causal=causal, implementation="cudnn"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--shape", default="2,8192,16,128", help="B,S,H,D")
    parser.add_argument("--styles", default="half,interleaved")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target-ms", type=float, default=30.0)
    parser.add_argument("--paired-rounds", type=int, default=9,
                        help="then time plain, fused and xla+ours in turn, this many rounds: the targets' "
                             "ratios per round, so that drift between the rows above cancels")
    args = parser.parse_args(argv)
    B, S, H, D = (int(x) for x in args.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in keys)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    name, kind, _ = device_info(False)
    rows, compiled = [], {}
    for style in args.styles.split(","):
        for mode in ("fwd", "fwdbwd"):
            for impl, f in candidates(style, True, positions).items():
                row = dict(impl=impl, style=style, mode=mode, B=B, S=S, H=H, D=D, causal=True,
                           dtype="bfloat16")
                try:
                    g = jax.jit(f) if mode == "fwd" else jax.jit(_make_fwdbwd(f))
                    call_args = (q, k, v) if mode == "fwd" else (q, k, v, do)
                    ms, _, first_s = time_jax(g, call_args, args.target_ms, args.repeats)
                    compiled[style, mode, impl] = g, call_args
                    row.update(ms=ms, tflops=flops(B, S, H, D, True, mode) / (ms * 1e-3) / 1e12,
                               first_call_s=first_s)
                    log(f"{style:12s} {mode:7s} {impl:10s} {ms:8.3f} ms {row['tflops']:7.1f} TF/s")
                except Exception as e:  # recorded, the run goes on
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                    log(f"{style:12s} {mode:7s} {impl:10s} error {row['error'][:120]}")
                rows.append(row)
    by = {(r["style"], r["mode"], r["impl"]): r.get("ms") for r in rows}
    impls = ("plain", "fused", "xla+ours", "fused-tri", "fused+pos", "xla+cudnn")
    print("\n| style | mode | " + " | ".join(f"{i} ms" for i in impls) + " | fused/plain | xla+ours/fused |")
    print("|---|---|" + "---|" * (len(impls) + 2))
    for style in args.styles.split(","):
        for mode in ("fwd", "fwdbwd"):
            t = [by.get((style, mode, i)) for i in impls]
            print(ms_table_row((style, mode), t, [(t[1], t[0]), (t[2], t[1])]))
    paired = []
    if args.paired_rounds:
        print(f"\nPaired ({args.paired_rounds} rounds of plain, fused, xla+ours in turn; medians):")
        print("| style | mode | plain ms | fused ms | xla+ours ms | fused/plain | xla+ours/fused |")
        print("|---|---|---|---|---|---|---|")
    for style in args.styles.split(",") if args.paired_rounds else ():
        for mode in ("fwd", "fwdbwd"):
            turn = [i for i in ("plain", "fused", "xla+ours") if (style, mode, i) in compiled]
            if len(turn) < 3:
                continue
            times = {i: [] for i in turn}
            for _ in range(args.paired_rounds):
                for i in turn:
                    times[i].append(time_jax(*compiled[style, mode, i], args.target_ms, 1)[0])
            ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))
            entry = dict(style=style, mode=mode, ms={i: statistics.median(t) for i, t in times.items()},
                         fused_over_plain=ratio("fused", "plain"), xla_ours_over_fused=ratio("xla+ours", "fused"),
                         rounds=times)
            paired.append(entry)
            print(ms_table_row((style, mode), [entry["ms"][i] for i in turn],
                               [(entry["fused_over_plain"], 1.0), (entry["xla_ours_over_fused"], 1.0)]))
    save_run(args.out, "rope", kind, name, rows, jax_attn_device=str(jax_attn.device_info()), paired=paired)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
