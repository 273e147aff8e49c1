#!/usr/bin/env python3
"""Tile sweep of the Pallas Triton softmax engine: which `BlockSizes` is fastest per head dim.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/sweep_blocks.py --out benchmarks/results [--quick] [--rope [--positions]]

For each case (bf16, 2x8192x16x128 and 16x1024x16x64, causal and not; --quick: 2x8192x16x128
causal) it times the forward over a grid of forward tiles (block_q, block_k, warps, stages), then
forward+backward over a grid of backward tiles with the forward at `default_block_sizes`, and
reports each candidate beside the default. `default_block_sizes` is chosen from these figures.
Calls `jax_attn.ops.softmax.triton.flash_attention_pallas` directly (the tiles are not public).
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness  # noqa: E402  (before jax: allocator and platform settings)
from benchmarks.harness import Case, Column  # noqa: E402

import jax.numpy as jnp  # noqa: E402

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
SMOKE_FWD_GRID = [(32, 32, 4, 2), (64, 32, 4, 2)]
SMOKE_BWD_GRID = [(32, 32, 32, 32, 4, 2)]


def cases(opts):
    if opts.smoke:
        return [Case("sweep", 1, 128, 2, 64, causal=True)]
    full = [Case("sweep", B, S, H, D, causal=c) for B, S, H, D in ((2, 8192, 16, 128), (16, 1024, 16, 64))
            for c in (False, True)]
    return full[1:2] if opts.quick else full


def default_blocks(case, opts):
    import jax_attn
    return jax_attn.default_block_sizes(case.D, opts.smoke, opts.dtype, rope=opts.rope, rope_positions=opts.positions)


def candidate(kind: str, cfg: tuple):
    """A column running the engine with `cfg` applied over the default tiles of the case."""
    def blocks_for(case, opts):
        d = default_blocks(case, opts)
        if kind == "fwd":
            a, b, w, s = cfg
            return dataclasses.replace(d, block_q=a, block_k=b, num_warps=w, num_stages=s)
        a, b, c, e, w, s = cfg
        return dataclasses.replace(d, block_q_dkv=a, block_k_dkv=b, block_q_dq=c, block_k_dq=e,
                                   num_warps_bwd=w, num_stages_bwd=s)

    def build(case, opts):
        import jax_attn
        from jax_attn.ops.softmax.triton import flash_attention_pallas
        rope = jax_attn.Rope(style="half") if opts.rope else None
        spec = jax_attn.AttentionSpec(scale=case.D ** -0.5, causal=case.causal, rope=rope)
        pos = (jnp.broadcast_to(jnp.arange(case.S, dtype=jnp.int32), (case.B, case.S))
               if rope is not None and opts.positions else None)
        blocks = blocks_for(case, opts)
        return lambda q, k, v: flash_attention_pallas(q, k, v, None, None, spec, q_pos=pos, kv_pos=pos,
                                                      blocks=blocks)[0]

    def note(case, opts):
        b = blocks_for(case, opts)
        return f"{'default; ' if b == default_blocks(case, opts) else ''}{b}"

    return Column(f"{kind}{'x'.join(map(str, cfg))}", build, modes=(kind,), compare=False, note=note,
                  params={"grid": kind, "config": list(cfg)})


def main(argv=None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--rope", action="store_true", help="fused RoPE (style half) with its own grids")
    p.add_argument("--positions", action="store_true",
                   help="with --rope: positions passed as an array (the general cos/sin path)")
    opts = harness.finish_options(p.parse_args(argv))
    if opts.smoke:
        fwd, bwd = SMOKE_FWD_GRID, SMOKE_BWD_GRID
    else:
        fwd, bwd = (ROPE_FWD_GRID, ROPE_BWD_GRID) if opts.rope else (FWD_GRID, BWD_GRID)
        if opts.quick:
            fwd, bwd = fwd[:3], bwd[:3]
    columns = [candidate("fwd", c) for c in fwd] + [candidate("fwdbwd", c) for c in bwd]
    columns = harness.select(columns, opts.columns, key=lambda c: c.name)
    name = f"sweep{'-rope' if opts.rope else ''}{'-positions' if opts.positions else ''}"
    doc, stem = harness.new_document(name, opts)
    harness.run(name, cases(opts), columns, opts, doc=doc, path=stem + ".json")
    best = []
    for key in {(r["B"], r["S"], r["H"], r["D"], r["causal"], r["mode"]) for r in doc["rows"]}:
        ok = [r for r in doc["rows"] if (r["B"], r["S"], r["H"], r["D"], r["causal"], r["mode"]) == key
              and r["status"] == "ok"]
        if ok:
            r = min(ok, key=lambda r: r["ms"])
            dflt = next((x for x in ok if (x["note"] or "").startswith("default")), None)
            gain = f"{dflt['ms'] / r['ms']:.3f}x the default's speed" if dflt else "default not in the grid"
            best.append(f"- {key[0]}x{key[1]}x{key[2]}x{key[3]} causal={int(key[4])} {key[5]}: "
                        f"{r['impl']} {r['tflops']:.1f} TF/s, {gain}")
    doc["best"] = sorted(best)
    harness.finish(doc, stem, [c.name for c in columns], opts, extra_markdown="Best:\n" + "\n".join(sorted(best)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
