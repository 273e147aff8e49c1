#!/usr/bin/env python3
"""Softmax attention: this library beside cuDNN, XLA, JAX's Pallas `mha`, tokamax and torch.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/softmax.py --out benchmarks/results [--quick]

Cases (bf16, forward and forward+backward): the anchors table's shapes, 2x8192x16x128 non-causal
and causal, 1x32768x16x128 causal, GQA 4x4096x32x128 with 8 kv heads (both), head dim 64
16x1024x16x64 (both). --quick: 2x8192x16x128 only.

Columns:
    default          jax_attn.flash_attention, implementation=None (the note names what it picked)
    pallas_triton    jax_attn.flash_attention(implementation="pallas_triton")
    mosaic_gpu       jax_attn.flash_attention(implementation="mosaic_gpu")
    cudnn            jax.nn.dot_product_attention(implementation="cudnn")  (the relerr reference)
    xla              jax.nn.dot_product_attention(implementation="xla")
    mha              jax.experimental.pallas.ops.gpu.attention.mha, 128x128 blocks, 8 warps, 3 stages
    mha_default      the same with its own defaults (not in --quick)
    tokamax_mosaic   tokamax.dot_product_attention(implementation="mosaic")
    tokamax_triton   tokamax.dot_product_attention(implementation="triton")
    torch_flash      torch SDPA, SDPBackend.FLASH_ATTENTION (BHSD inputs, transposed untimed)
    torch_cudnn      torch SDPA, SDPBackend.CUDNN_ATTENTION
    torch_ref        torch_ref.flash_attention(implementation="triton")
    alibi_triton     pallas_triton with ALiBi (the paper's slopes): its cost over pallas_triton
    torch_ref_alibi  torch_ref with ALiBi: its cost over torch_ref
    dropout_triton   pallas_triton with attention dropout 0.1: its cost over pallas_triton
    torch_ref_dropout  torch_ref with attention dropout 0.1: its cost over torch_ref
    torch_flash_dropout  torch_flash with dropout_p 0.1 (FlashAttention-2's Philox dropout): its cost
                     over torch_flash, the anchor for ours

Anchors that do not import (tokamax, torch) or do not take a case (mha with GQA) are "absent" rows.
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness  # noqa: E402  (before jax: allocator and platform settings)
from benchmarks.harness import Absent, Case, Column  # noqa: E402

import jax  # noqa: E402

CASES = [
    Case("std", 2, 8192, 16, 128, causal=False),
    Case("std", 2, 8192, 16, 128, causal=True),
    Case("long", 1, 32768, 16, 128, causal=True),
    Case("gqa", 4, 4096, 32, 128, causal=False, kv_heads=8),
    Case("gqa", 4, 4096, 32, 128, causal=True, kv_heads=8),
    Case("d64", 16, 1024, 16, 64, causal=False),
    Case("d64", 16, 1024, 16, 64, causal=True),
]
QUICK_CASES = CASES[:2]
SMOKE_CASES = [Case("smoke", 1, 128, 2, 64, causal=False), Case("smoke", 1, 128, 4, 64, causal=True, kv_heads=2)]

MHA_TUNED = dict(block_sizes=dict(block_q=128, block_k=128, block_q_dkv=64, block_kv_dkv=128,
                                  block_q_dq=128, block_kv_dq=64), num_warps=8, num_stages=3)


def alibi_slopes(heads: int):
    """The ALiBi paper's geometric slopes, 2^(-8 (h + 1) / H)."""
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


DROPOUT = 0.1


def ours(implementation, alibi=False, dropout=False):
    def build(case, opts):
        import jax.numpy as jnp
        import jax_attn
        slopes = jnp.asarray(alibi_slopes(case.H), jnp.float32) if alibi else None
        extra = dict(dropout_rate=DROPOUT, dropout_key=jax.random.key(0)) if dropout else {}
        return lambda q, k, v: jax_attn.flash_attention(q, k, v, causal=case.causal, alibi_slopes=slopes,
                                                        implementation=implementation, **extra)
    return build


def jax_nn(implementation):
    def build(case, opts):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=case.causal,
                                                            implementation=implementation)
    return build


def mha(tuned: bool):
    def build(case, opts):
        if case.Hkv != case.H:
            raise Absent("JAX's Pallas mha takes as many kv heads as query heads (no GQA)")
        from jax.experimental.pallas.ops.gpu import attention
        kw = dict(sm_scale=case.D ** -0.5, causal=case.causal, interpret=opts.smoke)
        if tuned:
            fields = {f.name for f in dataclasses.fields(attention.BlockSizes)}
            blocks = {k: v for k, v in MHA_TUNED["block_sizes"].items() if k in fields}
            kw.update(block_sizes=attention.BlockSizes(**blocks), num_warps=MHA_TUNED["num_warps"],
                      num_stages=MHA_TUNED["num_stages"])
        return lambda q, k, v: attention.mha(q, k, v, segment_ids=None, **kw)
    return build


def tokamax(implementation):
    def build(case, opts):
        mod, why = harness.import_tokamax()
        if mod is None:
            raise Absent(f"tokamax does not import: {why}")
        return lambda q, k, v: mod.dot_product_attention(q, k, v, is_causal=case.causal,
                                                         implementation=implementation)
    return build


def torch_sdpa(backend: str, dropout: bool = False):
    def build(case, opts):
        torch, _, why = harness.torch_modules()
        if torch is None:
            raise Absent(f"torch does not import: {why}")
        from torch.nn.attention import SDPBackend, sdpa_kernel
        b = SDPBackend.MATH if opts.smoke else getattr(SDPBackend, backend)
        gqa = case.Hkv != case.H

        def f(q, k, v):
            with sdpa_kernel(b):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal,
                                                                        enable_gqa=gqa, dropout_p=p)
        p = DROPOUT if dropout else 0.0
        return f
    return build


def torch_ref_build(alibi=False, dropout=False):
    def build(case, opts):
        torch_ref, why = harness.optional_import("torch_ref")
        if torch_ref is None:
            raise Absent(f"torch_ref does not import: {why}")
        impl = "eager" if opts.smoke else "triton"  # smoke: no Triton on the CPU
        slopes = None
        if alibi:
            import torch
            slopes = torch.tensor(alibi_slopes(case.H), dtype=torch.float32,
                                  device="cpu" if opts.smoke else "cuda")
        extra = dict(dropout_rate=DROPOUT, dropout_seed=0) if dropout else {}
        return lambda q, k, v: torch_ref.flash_attention(q, k, v, causal=case.causal, alibi_slopes=slopes,
                                                         implementation=impl, **extra)
    return build


def smoke_note(case, opts) -> str | None:
    return "smoke: SDPA MATH backend / torch_ref eager on the CPU" if opts.smoke else None


COLUMNS = [
    Column("default", ours(None), note=lambda case, opts: f"picked {default_note(case, opts)!r}"),
    Column("pallas_triton", ours("pallas_triton")),
    Column("mosaic_gpu", ours("mosaic_gpu")),
    Column("cudnn", jax_nn("cudnn")),
    Column("xla", jax_nn("xla")),
    Column("mha", mha(tuned=True)),
    Column("mha_default", mha(tuned=False), quick=False),
    Column("tokamax_mosaic", tokamax("mosaic")),
    Column("tokamax_triton", tokamax("triton")),
    Column("torch_flash", torch_sdpa("FLASH_ATTENTION"), framework="torch", layout="bhsd", note=smoke_note),
    Column("torch_cudnn", torch_sdpa("CUDNN_ATTENTION"), framework="torch", layout="bhsd", note=smoke_note),
    Column("torch_ref", torch_ref_build(), framework="torch", note=smoke_note),
    Column("alibi_triton", ours("pallas_triton", alibi=True)),
    Column("torch_ref_alibi", torch_ref_build(alibi=True), framework="torch", note=smoke_note),
    Column("dropout_triton", ours("pallas_triton", dropout=True)),
    Column("torch_ref_dropout", torch_ref_build(dropout=True), framework="torch", note=smoke_note),
    Column("torch_flash_dropout", torch_sdpa("FLASH_ATTENTION", dropout=True), framework="torch", layout="bhsd",
           note=smoke_note),
]


def default_note(case, opts) -> str:
    """What implementation=None picks for this case."""
    try:
        import jax_attn
        spec = jax_attn.AttentionSpec(scale=case.D ** -0.5, causal=case.causal)
        return jax_attn.default_implementation(spec, case.D, opts.dtype)
    except Exception as e:
        return f"unknown ({type(e).__name__})"


def main(argv=None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0])
    opts = harness.finish_options(p.parse_args(argv))
    cases = SMOKE_CASES if opts.smoke else (QUICK_CASES if opts.quick else CASES)
    cases = harness.select(cases, opts.cases, key=lambda c: c.tag, what="case")
    columns = harness.select(COLUMNS, opts.columns, key=lambda c: c.name, quick=opts.quick)
    tokamax_mod, tokamax_note = harness.import_tokamax()
    torch_mod, _, torch_why = harness.torch_modules()
    anchors = {"tokamax": tokamax_note or ("imported" if tokamax_mod else None),
               "torch": torch_why or "imported",
               "mha_tuned_config": MHA_TUNED}
    doc, stem = harness.new_document("softmax", opts, anchors=anchors,
                                     default_implementation={c.label(): default_note(c, opts) for c in cases})
    harness.run("softmax", cases, columns, opts, reference=harness.pick(COLUMNS, "cudnn", "xla"),
                doc=doc, path=stem + ".json")
    harness.finish(doc, stem, [c.name for c in columns], opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
