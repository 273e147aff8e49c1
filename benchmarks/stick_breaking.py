#!/usr/bin/env python3
"""Stick-breaking attention (ExpoSB): this library's kernels beside fla-org's and the plain jnp path.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/stick_breaking.py --out benchmarks/results [--quick]

Cases (bf16, strictly causal, forward and forward+backward; FLOPs counted as for causal attention,
so TF/s compare with softmax.py; the cumsum and transcendentals are not counted):
    sb-decay0      2x8192x16x128, decay 0 (the setting fla-org's kernel computes)
    sb             2x8192x16x128, decay 0.01 per head
    sb-unspent     the same, with q features D/2-1 and D-1 set to 8 and k's to -8: logits about
                   N(-11, 1), no stick is ever spent, so the kernels walk every tile (their dense
                   speed; on N(0, 1) data they skip the tiles of spent sticks). Not in --quick
    sb-short       2x2048x16x128, decay 0.01 (where the plain jnp path fits in memory)

Columns:
    softmax_causal   jax_attn.flash_attention(causal=True), the speed reference (not compared)
    pallas_triton    jax_attn.stick_breaking_attention(implementation="pallas_triton")
    mosaic_gpu       the same, implementation="mosaic_gpu" (Hopper forward; Triton backward)
    triton_rope      pallas_triton with fused RoPE ("half"; compared with xla_rope)
    xla              implementation="xla", plain jnp ([B, H, S, S] fp32 in memory), S <= --xla-max-seq
    torch_ref        torch_ref.stick_breaking_attention (the Triton twin)
    fla              fla-org's parallel_stickbreaking_attn (no decay: decay-0 cases only)

The relerr reference is `xla` where it runs, else `pallas_triton` (named in relerr_ref). The plain
jnp path at S=8192 needs about 36 GB: pass --xla-max-seq 8192 and, to let XLA hold that,
XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 with --columns without torch.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness  # noqa: E402  (before jax: allocator and platform settings)
from benchmarks.harness import Absent, Case, Column  # noqa: E402

import jax.numpy as jnp  # noqa: E402

DECAY = 0.01


def unspent(q, k, v, do):
    """Logits far below zero: every stick stays unspent (see the module doc)."""
    D = q.shape[-1]
    for x, a in ((q, 8.0), (k, -8.0)):
        x[..., D // 2 - 1] = a
        x[..., D - 1] = a
    return q, k, v, do


def cases(opts):
    if opts.smoke:
        return [Case("sb-decay0", 1, 128, 2, 64, causal=True, params={"decay": 0.0}),
                Case("sb", 1, 128, 2, 64, causal=True, params={"decay": DECAY})]
    full = [Case("sb-decay0", 2, 8192, 16, 128, causal=True, params={"decay": 0.0}),
            Case("sb", 2, 8192, 16, 128, causal=True, params={"decay": DECAY}),
            Case("sb-unspent", 2, 8192, 16, 128, causal=True, params={"decay": DECAY, "data": "unspent"},
                 transform=unspent),
            Case("sb-short", 2, 2048, 16, 128, causal=True, params={"decay": DECAY})]
    return [c for c in full if c.tag != "sb-unspent"] if opts.quick else full


def ours(implementation, rope=False):
    def build(case, opts):
        import jax_attn
        if implementation == "xla" and case.S > opts.xla_max_seq:
            raise Absent(f"plain jnp path: S={case.S} over --xla-max-seq {opts.xla_max_seq} ([B, H, S, S] fp32)")
        decay = jnp.full((case.H,), case.params["decay"], jnp.float32)
        kw = dict(rope=jax_attn.Rope(style="half")) if rope else {}
        return lambda q, k, v: jax_attn.stick_breaking_attention(q, k, v, decay=decay,
                                                                 implementation=implementation, **kw)
    return build


def softmax_causal(case, opts):
    import jax_attn
    return lambda q, k, v: jax_attn.flash_attention(q, k, v, causal=True)


def torch_ref_build(case, opts):
    torch_ref, why = harness.optional_import("torch_ref")
    if torch_ref is None:
        raise Absent(f"torch_ref does not import: {why}")
    torch, _, _ = harness.torch_modules()
    impl = "eager" if opts.smoke else "triton"  # smoke: no Triton on the CPU
    dev = "cpu" if opts.smoke or not torch.cuda.is_available() else "cuda"
    decay = torch.full((case.H,), case.params["decay"], device=dev)
    return lambda q, k, v: torch_ref.stick_breaking_attention(q, k, v, decay=decay, implementation=impl)


def fla_function():
    """fla-org's parallel_stickbreaking_attn, or (None, why not)."""
    why = None
    for name in ("fla.ops.stickbreaking_attn", "fla.ops.stick_breaking", "fla.ops"):
        mod, err = harness.optional_import(name)
        if mod is not None and hasattr(mod, "parallel_stickbreaking_attn"):
            return mod.parallel_stickbreaking_attn, None
        why = why or err
    return None, why or "fla imports but has no parallel_stickbreaking_attn"


def fla_build(case, opts):
    if case.params["decay"] != 0.0:
        raise Absent("fla's parallel_stickbreaking_attn has no decay term (decay-0 cases only)")
    if opts.smoke:
        raise Absent("fla runs Triton kernels: GPU only")
    f, why = fla_function()
    if f is None:
        raise Absent(f"fla does not import: {why}")
    return lambda q, k, v: f(q, k, v, attend_current=False)[0]


COLUMNS = [
    Column("softmax_causal", softmax_causal, compare=False),
    Column("pallas_triton", ours("pallas_triton")),
    Column("mosaic_gpu", ours("mosaic_gpu")),
    Column("triton_rope", ours("pallas_triton", rope=True), compare=False, quick=False),
    Column("xla", ours("xla")),
    Column("torch_ref", torch_ref_build, framework="torch"),
    Column("fla", fla_build, framework="torch"),
]


def main(argv=None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--xla-max-seq", type=int, default=2048,
                   help="longest S of the plain jnp column (memory grows as S^2)")
    opts = harness.finish_options(p.parse_args(argv))
    cs = harness.select(cases(opts), opts.cases, key=lambda c: c.tag, what="case")
    columns = harness.select(COLUMNS, opts.columns, key=lambda c: c.name, quick=opts.quick)
    fla_fn, fla_why = fla_function() if not opts.smoke else (None, "not tried in --smoke")
    doc, stem = harness.new_document("stick-breaking", opts,
                                     anchors={"fla": "imported" if fla_fn else fla_why})
    # reference: the plain jnp path where it runs, else the Triton kernels (relerr_ref names it)
    harness.run("stick-breaking", cs, columns, opts, reference=harness.pick(COLUMNS, "xla", "pallas_triton"),
                doc=doc, path=stem + ".json")
    harness.finish(doc, stem, [c.name for c in columns], opts, metric="ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
