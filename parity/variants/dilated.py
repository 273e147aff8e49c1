"""The dilated record: `dilated_attention` (LongNet; self-attention, Sq == Sk) in both frameworks
(JAX triton / mosaic / xla, torch triton / eager).

Compared: out, lse, dq, dk, dv (a random cotangent on the merged lse unless the case says not).
A case's kwargs are the call's: segment_lengths, dilation_rates, causal, merge, scale.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

import jax_attn
import jax_attn.registry
import torch_ref
from parity.cases import Case, case, draw
from parity import variants as v


def _dl_case(name, shape, segments, rates, dtype="float32", merge="lse", stat_grad=True, **kw) -> Case:
    """Shape (B, S, Hq, Hkv, D); `segments`, `rates`: the branches' segment lengths and dilation rates."""
    b, s, hq, hkv, d = shape
    return case(name, (b, s, s, hq, hkv, d), dtype, variant="dilated", stat_grad=stat_grad,
                segment_lengths=tuple(segments), dilation_rates=tuple(rates), merge=merge, **kw)


def run_jax(case: Case, implementation: str, dtype: str, inputs) -> list:
    q, k, vv, do, dstat, _, _ = inputs
    cast = lambda x: jnp.asarray(x, v.JAX_DTYPES[dtype])

    def f(q, k, vv):
        return jax_attn.dilated_attention(q, k, vv, return_lse=True, implementation=implementation,
                                          **case.call_kwargs())

    (out, lse), vjp = jax.vjp(jax.jit(f), cast(q), cast(k), cast(vv))
    grads = vjp((cast(do), jnp.asarray(dstat, v.JAX_DTYPES[v.stat_dtype(dtype)])))
    return [v.to_numpy(x) for x in (out, lse, *grads)]


def run_torch(case: Case, implementation: str, dtype: str, inputs, device="cpu") -> list:
    q, k, vv, do, dstat, _, _ = inputs
    tdt = v.TORCH_DTYPES[dtype]
    leaves = [torch.tensor(x, dtype=tdt, device=device, requires_grad=True) for x in (q, k, vv)]
    out, lse = torch_ref.dilated_attention(*leaves, return_lse=True, implementation=implementation,
                                           **case.call_kwargs())
    cotangents = (torch.tensor(do, dtype=tdt, device=device), torch.tensor(dstat, dtype=lse.dtype, device=device))
    grads = torch.autograd.grad((out, lse), leaves, cotangents)
    return [v.to_numpy(x) for x in (out, lse, *grads)]


def jax_call(case: Case):
    kw = case.call_kwargs()
    spec = jax_attn.AttentionSpec(scale=1.0, causal=kw.get("causal", False),
                                  ordered=kw.get("ordering") not in (None, "identity"))
    return jax_attn.registry.Call(spec, case.shape[5], jnp.dtype(case.dtype))


CASES = (
    # CPU and GPU (fp32 with exact matmuls on both sides). Segments that divide neither S nor each
    # other, a segment past the sequence, r = 1 branches, GQA / MQA, both merges, causal or not.
    _dl_case("dl_coprime_gqa_37", (1, 37, 4, 2, 32), (5, 7), (2, 3), quick=True),
    _dl_case("dl_free_view_causal_128", (1, 128, 4, 4, 32), (32, 64, 128), (1, 2, 4), causal=True, quick=True),
    _dl_case("dl_head_groups_causal_gqa_100", (2, 100, 4, 2, 48), (24, 40), (1, 2), merge="head_groups",
             causal=True),
    _dl_case("dl_segment_past_sequence_causal", (1, 37, 4, 2, 16), (16, 100), (1, 4), causal=True),
    # one branch w=4, r=2: head h keeps the rows of parity h mod 2, the others are kept by no branch
    _dl_case("dl_rows_kept_by_none_mqa", (1, 30, 2, 1, 16), (4,), (2,), quick=True),
    _dl_case("dl_fp16_causal_gqa_64", (1, 64, 4, 2, 64), (16, 32), (1, 2), "float16", causal=True),
    _dl_case("dl_fp16_head_groups_scale_50", (1, 50, 6, 2, 40), (8, 20, 64), (1, 2, 4), "float16",
             merge="head_groups", scale=0.3),
    # GPU only: half precision at realistic sizes (the Triton interpreter computes bf16 dots wrongly).
    # (head_groups: four branches, two heads each)
    _dl_case("dl_bf16_lse_causal_1000_gqa", (2, 1000, 8, 4, 64), (128, 256, 512), (1, 2, 4), "bfloat16",
             causal=True, gpu=True),
    _dl_case("dl_bf16_head_groups_causal_1000_gqa", (2, 1000, 8, 4, 64), (128, 256, 512, 1000), (1, 2, 4, 8),
             "bfloat16", merge="head_groups", causal=True, gpu=True),
    _dl_case("dl_bf16_free_view_4k", (1, 4096, 8, 2, 128), (1024, 2048, 4096), (1, 2, 4), "bfloat16", gpu=True),
    _dl_case("dl_fp16_coprime_1k", (1, 1000, 6, 2, 64), (300, 700), (3, 7), "float16", causal=True, gpu=True),
    _dl_case("dl_fp32_head_groups_2k", (1, 2048, 4, 2, 64), (512, 2048), (1, 4), merge="head_groups", gpu=True),
    # Space-filling-curve orderings: the segments cut from the ordered sequence, causality on the
    # original positions; out, lse and gradients in the original order
    _dl_case("dl_ordered_hilbert_causal_gqa_42", (1, 42, 4, 2, 16), (8, 16), (1, 2), ordering="hilbert",
             grid=(6, 7), causal=True, quick=True),
    _dl_case("dl_ordered_zorder_head_groups_fp16", (1, 40, 4, 2, 16), (10, 20), (1, 2), "float16",
             ordering="zorder", merge="head_groups"),
    _dl_case("dl_ordered_hilbert_bf16_4k", (1, 4096, 8, 2, 128), (512, 1024, 2048), (1, 2, 4), "bfloat16",
             ordering="hilbert", grid=(64, 64), gpu=True),
    _dl_case("dl_ordered_bit_reversal_causal_fp16_2k", (2, 2000, 4, 2, 64), (256, 1000), (1, 4), "float16",
             ordering="bit_reversal", causal=True, gpu=True),
)


# The awkward-shape grid of the tests: S = 1, 30, 37, 50, 64, 100, 128 against segments that divide
# neither S nor each other ((5, 7) / (2, 3), (24, 40) / (1, 2)), a segment longer than the sequence,
# r = 1 branches, the free view (S = 128, (32, 64, 128) / (1, 2, 4)), rows kept by no branch (one branch
# w = 4, r = 2), GQA and MQA, head dims 16 to 64, both merges causal or not; fp32 and fp16, and bf16 where
# the JAX kernels run it (the torch Triton kernels run bf16 on the GPU only, `variants.unsupported_reason`).
GRID = (
    *(_dl_case(f"coprime_{merge}_{'causal' if causal else 'dense'}_37", (1, 37, 4, 2, 32), (5, 7), (2, 3),
               merge=merge, causal=causal, seed=0)
      for merge in ("lse", "head_groups") for causal in (False, True)),
    *(_dl_case(f"s100_24_40_{merge}_{'causal' if causal else 'dense'}", (2, 100, 4, 2, 16), (24, 40), (1, 2),
               merge=merge, causal=causal, seed=0, slow=not causal)
      for merge in ("lse", "head_groups") for causal in (False, True)),
    _dl_case("free_view_128_causal", (1, 128, 4, 4, 32), (32, 64, 128), (1, 2, 4), causal=True, seed=0),
    _dl_case("free_view_128_head_groups_gqa", (1, 128, 6, 2, 32), (32, 64, 128), (1, 2, 4), merge="head_groups",
             seed=0, slow=True),
    _dl_case("segment_past_sequence_d40", (1, 37, 2, 2, 40), (16, 100), (1, 4), seed=0, slow=True),
    _dl_case("segment_past_sequence_causal_groups", (1, 37, 2, 1, 16), (16, 100), (1, 4), merge="head_groups",
             causal=True, seed=0),
    _dl_case("r1_only_local_50", (1, 50, 2, 2, 32), (16,), (1,), causal=True, seed=0),
    _dl_case("rows_kept_by_none_w4_r2", (1, 30, 2, 1, 16), (4,), (2,), seed=0),
    _dl_case("rows_kept_by_none_w4_r2_causal_fp16", (2, 30, 4, 2, 16), (4,), (2,), "float16", causal=True, seed=0,
             slow=True),
    _dl_case("single_row", (1, 1, 2, 1, 16), (2, 3), (1, 2), seed=0),
    _dl_case("fp16_coprime_gqa_d64", (1, 37, 4, 2, 64), (5, 7), (2, 3), "float16", causal=True, seed=0),
    _dl_case("fp16_groups_scale_d48", (1, 50, 6, 2, 48), (8, 20, 64), (1, 2, 4), "float16", merge="head_groups",
             scale=0.3, seed=0),
    _dl_case("no_lse_grad_mqa_d40", (1, 64, 4, 1, 40), (16, 32), (1, 2), stat_grad=False, seed=0, slow=True),
    _dl_case("bf16_lse_gqa_d32", (1, 64, 4, 2, 32), (16, 32), (1, 2), "bfloat16", causal=True, seed=0),
    _dl_case("bf16_head_groups_d16", (1, 37, 4, 2, 16), (5, 7), (2, 3), "bfloat16", merge="head_groups", seed=0,
             slow=True),
    # the slow tier: longer sequences, more branches
    _dl_case("s257_four_branches_causal_d64", (1, 257, 4, 2, 64), (16, 32, 64, 128), (1, 2, 4, 8), causal=True,
             slow=True, seed=0),
    _dl_case("s256_fp16_free_view_groups", (2, 256, 4, 4, 32), (64, 256), (2, 4), "float16", merge="head_groups",
             slow=True, seed=0),
    # Compiled kernels at realistic shapes (make test-gpu).
    # (tests/test_dilated.py adds bf16 B=2, S=1000, H=8, Hkv=4, D=64, causal, both merges, and determinism)
    _dl_case("gpu_bf16_lse_dense_2000_d128", (1, 2000, 8, 2, 128), (256, 512, 1024), (1, 2, 4), "bfloat16",
             gpu=True),
    _dl_case("gpu_bf16_head_groups_dense_2000_d128", (1, 2000, 8, 2, 128), (256, 512, 1024, 2000), (1, 2, 4, 8),
             "bfloat16", merge="head_groups", gpu=True),
    *(_dl_case(f"gpu_fp16_{merge}_coprime_1000", (2, 1000, 8, 4, 64), (300, 700), (3, 7), "float16", merge=merge,
               causal=True, gpu=True) for merge in ("lse", "head_groups")),
    _dl_case("gpu_bf16_free_view_4k_d128", (1, 4096, 8, 2, 128), (1024, 2048, 4096), (1, 2, 4), "bfloat16",
             causal=True, gpu=True),
    _dl_case("gpu_bf16_segment_past_sequence", (1, 1500, 4, 1, 64), (512, 4096), (1, 8), "bfloat16", gpu=True),
    _dl_case("gpu_fp32_lse_1k", (1, 1024, 4, 2, 64), (256, 1024), (1, 4), causal=True, gpu=True),
)

DILATED = v.VariantRecord(
    name="dilated", quantities=("out", "lse", "dq", "dk", "dv"), forward=("out", "lse"), draw=draw,
    run_jax=run_jax, run_torch=run_torch, jax_call=jax_call, cases=CASES, grid=GRID)
