#!/usr/bin/env python3
"""Fused RoPE: q and k rotated inside the kernels against a separate rotation pass, both styles.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/rope.py --out benchmarks/results [--quick]

Cases (bf16, causal, forward and forward+backward): 2x8192x16x128, RoPE style "half" and
"interleaved" (--quick: "half").

Columns:
    plain             jax_attn.flash_attention without RoPE (the cost floor; not compared)
    fused             jax_attn.flash_attention(rope=Rope(style)), the default implementation
    fused_triton      the same, implementation="pallas_triton"
    fused_positions   the same with positions passed as an array (the general cos/sin path)
    rotate_ours       jax_attn.apply_rope on q and k (XLA), then jax_attn.flash_attention
    rotate_cudnn      jax_attn.apply_rope, then jax.nn.dot_product_attention(implementation="cudnn")
                      (the relerr reference; plain XLA attention where cuDNN does not run)

plain, fused and rotate_ours are then timed again in turn (--paired-rounds): the ratios of their
times are medians of per-round ratios, so drift between the table's rows cancels. FLOPs are those
of the attention alone, so TF/s compare directly with softmax.py.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness  # noqa: E402  (before jax: allocator and platform settings)
from benchmarks.harness import Case, Column  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

STYLES = ("half", "interleaved")


def cases(opts):
    if opts.smoke:
        return [Case("rope", 1, 128, 2, 64, causal=True, params={"style": "half"})]
    styles = STYLES[:1] if opts.quick else STYLES
    return [Case("rope", 2, 8192, 16, 128, causal=True, params={"style": s}) for s in styles]


def _rope(case):
    import jax_attn
    return jax_attn, jax_attn.Rope(style=case.params["style"])


def _positions(case):
    return jnp.broadcast_to(jnp.arange(case.S, dtype=jnp.int32), (case.B, case.S))


def plain(case, opts):
    import jax_attn
    return lambda q, k, v: jax_attn.flash_attention(q, k, v, causal=case.causal)


def fused(implementation=None, positions=False):
    def build(case, opts):
        jax_attn, rope = _rope(case)
        kw = dict(positions=_positions(case)) if positions else {}
        return lambda q, k, v: jax_attn.flash_attention(q, k, v, causal=case.causal, rope=rope,
                                                        implementation=implementation, **kw)
    return build


def rotate_then(attend: str):
    def build(case, opts):
        jax_attn, rope = _rope(case)
        pos = _positions(case)

        def f(q, k, v):
            q, k = jax_attn.apply_rope(q, pos, rope), jax_attn.apply_rope(k, pos, rope)
            if attend == "ours":
                return jax_attn.flash_attention(q, k, v, causal=case.causal)
            return jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, implementation=attend)
        return f
    return build


COLUMNS = [
    Column("plain", plain, compare=False),
    Column("fused", fused()),
    Column("fused_triton", fused("pallas_triton")),
    Column("fused_positions", fused(positions=True), quick=False),
    Column("rotate_ours", rotate_then("ours")),
    Column("rotate_cudnn", rotate_then("cudnn")),
    Column("rotate_xla", rotate_then("xla"), timed=False),
]


def main(argv=None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--paired-rounds", type=int, default=None,
                   help="rounds of plain, fused, rotate_ours timed in turn (default 9; 3 quick; 0: none)")
    opts = harness.finish_options(p.parse_args(argv))
    if opts.paired_rounds is None:
        opts.paired_rounds = 1 if opts.smoke else (3 if opts.quick else 9)
    columns = harness.select(COLUMNS, opts.columns, key=lambda c: c.name, quick=opts.quick)
    doc, stem = harness.new_document("rope", opts)
    harness.run("rope", cases(opts), columns, opts, reference=harness.pick(COLUMNS, "rotate_cudnn", "rotate_xla"),
                paired=("plain", "fused", "rotate_ours"), paired_rounds=opts.paired_rounds,
                doc=doc, path=stem + ".json")
    paired = "\n".join(
        f"- {e['params'].get('style')} {e['mode']}: time / {e['ratio_to']} "
        + ", ".join(f"{n} {r:.3f}" for n, r in e["ratio"].items()) for e in doc.get("paired", []))
    harness.finish(doc, stem, [c.name for c in columns], opts,
                   row_key=lambda r: (f"{r['params']['style']} {r['B']}x{r['S']}x{r['H']}x{r['D']}",
                                      "yes" if r["causal"] else "no", r["mode"]),
                   extra_markdown=f"Paired rounds (median per-round time ratios):\n{paired}" if paired else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
