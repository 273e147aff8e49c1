#!/usr/bin/env python3
"""Block-size sweep of the softmax engine (GPU): which `BlockSizes` is fastest per head dim.

Run from the repository root: `PYTHONPATH=. python3 benchmarks/sweep_blocks.py --out benchmarks/results`.

For one bf16 shape per head dim (default 2x8192x16x128 and 16x1024x16x64), causal and not, it
times the forward over a grid of forward tiles (block_q, block_k, warps, stages) and then
forward+backward over a grid of backward tiles (the forward fixed at the default), and reports
each candidate's ms and TF/s and the best, next to the current `default_block_sizes`. The
figures are what `default_block_sizes` is chosen from (METHOD.md: measure, then pick).
"""
from __future__ import annotations

import argparse
import dataclasses

from benchmarks.attention import _make_fwdbwd, device_info, flops, log, save_run, time_jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_attn.api import _fp32_precision  # noqa: E402
from jax_attn.ops.softmax.triton import default_block_sizes, flash_attention_pallas  # noqa: E402
from jax_attn.ops.common.rope import Rope  # noqa: E402
from jax_attn.ops.common.spec import AttentionSpec  # noqa: E402

FWD_GRID = [  # block_q, block_k, num_warps, num_stages
    (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 64, 4, 4),
    (128, 64, 4, 3),
]
BWD_GRID = [  # block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, num_warps_bwd, num_stages_bwd
    (64, 64, 64, 64, 4, 2), (64, 64, 64, 64, 4, 3), (64, 64, 64, 64, 8, 2), (32, 64, 64, 32, 4, 3),
    (32, 64, 64, 32, 4, 2), (64, 64, 128, 64, 8, 2), (64, 128, 128, 64, 8, 2),
]


ROPE_FWD_GRID = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3),
                 (64, 64, 4, 2)]
ROPE_BWD_GRID = [(64, 64, 64, 64, 4, 2), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 2), (32, 32, 32, 32, 4, 2),
                 (64, 64, 64, 64, 8, 2), (64, 128, 128, 64, 8, 2)]


def run(B, S, H, D, causal, blocks, mode, args):
    rope = Rope(style="half") if args.rope else None
    spec = AttentionSpec(scale=D ** -0.5, causal=causal, precision=_fp32_precision(jnp.bfloat16), rope=rope)
    # positions arange (None) take the angle-addition path; --positions passes them as an array
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)) if rope and args.positions else None
    f = lambda q, k, v: flash_attention_pallas(q, k, v, None, None, spec, q_pos=pos, kv_pos=pos, blocks=blocks,
                                               interpret=False)[0]
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in keys)
    g = jax.jit(f) if mode == "fwd" else jax.jit(_make_fwdbwd(f))
    ms, _, first = time_jax(g, (q, k, v) if mode == "fwd" else (q, k, v, do), args.target_ms, args.repeats)
    return ms, flops(B, S, H, D, causal, mode) / (ms * 1e-3) / 1e12, first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--shapes", default="2,8192,16,128;16,1024,16,64", help="B,S,H,D;...")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target-ms", type=float, default=20.0)
    parser.add_argument("--rope", action="store_true", help="fused RoPE (style half) with its own grids")
    parser.add_argument("--positions", action="store_true",
                        help="with --rope: pass positions as an array (the general cos/sin table path)")
    parser.add_argument("--causal", default="0,1", help="which causal settings (0, 1)")
    args = parser.parse_args(argv)
    name, kind, _ = device_info(False)
    rows = []
    for shape in args.shapes.split(";"):
        B, S, H, D = (int(x) for x in shape.split(","))
        default = default_block_sizes(D, False, jnp.bfloat16, rope=args.rope, rope_positions=args.positions)
        fwd_grid, bwd_grid = (ROPE_FWD_GRID, ROPE_BWD_GRID) if args.rope else (FWD_GRID, BWD_GRID)
        for causal in (c == "1" for c in args.causal.split(",")):
            grids = {"fwd": [dataclasses.replace(default, block_q=a, block_k=b, num_warps=w, num_stages=s)
                             for a, b, w, s in fwd_grid],
                     "fwdbwd": [dataclasses.replace(default, block_q_dkv=a, block_k_dkv=b, block_q_dq=c,
                                                    block_k_dq=d, num_warps_bwd=w, num_stages_bwd=s)
                                for a, b, c, d, w, s in bwd_grid]}
            for mode in args.modes.split(","):
                for blocks in grids[mode]:
                    row = dict(shape=[B, S, H, D], causal=causal, mode=mode, blocks=dataclasses.asdict(blocks),
                               is_default=blocks == default)
                    try:
                        row["ms"], row["tflops"], row["first_s"] = run(B, S, H, D, causal, blocks, mode, args)
                        log(f"D={D} causal={causal:d} {mode:6s} {row['ms']:8.3f} ms {row['tflops']:6.1f} TF/s "
                            f"{'(default) ' if row['is_default'] else ''}{blocks}")
                    except Exception as e:  # recorded, the sweep goes on
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                        log(f"D={D} causal={causal:d} {mode:6s} error {row['error'][:100]} {blocks}")
                    rows.append(row)
                ok = [r for r in rows if r["shape"] == [B, S, H, D] and r["causal"] == causal
                      and r["mode"] == mode and "ms" in r]
                if ok:
                    best = min(ok, key=lambda r: r["ms"])
                    ref = next((r for r in ok if r["is_default"]), None)
                    gain = f"{ref['ms'] / best['ms']:.3f}x over the default" if ref else "default failed"
                    log(f"BEST D={D} causal={causal:d} {mode}: {best['tflops']:.1f} TF/s, {gain}: {best['blocks']}")
    save_run(args.out, f"sweep{'-rope' * args.rope}{'-positions' * args.positions}", kind, name, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
