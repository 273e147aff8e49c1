"""The softmax record: `flash_attention` in both frameworks (with or without fused RoPE).

Compared: out, lse, dq, dk, dv (cotangent on lse: zero unless the case asks for a random one).
Dropout cases carry torch's arguments (dropout_rate, dropout_seed); JAX gets the key of the same
seed words (`dropout_key`), so every implementation, the float64 goldens included, applies one mask.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_attn
import jax_attn.registry
import torch_ref
from attn_spec.dropout import seed_words
from parity.cases import Case, case, draw
from parity import variants as v


def _case(name, shape, dtype="float32", **kw) -> Case:
    return case(name, shape, dtype, variant="softmax", **kw)


def _rope_case(name, shape, style, dtype="float32", base=10000.0, **kw) -> Case:
    return _case(name, shape, dtype, rope=(style, base), **kw)


def run_jax(case: Case, implementation: str, dtype: str, inputs) -> list:
    q, k, vv, do, dstat, seg, pos = inputs
    cast = lambda x: jnp.asarray(x, v.JAX_DTYPES[dtype])
    extra = {} if case.rope is None else dict(rope=jax_attn.Rope(style=case.rope[0], base=case.rope[1]),
                                             positions=v.jax_ints(pos))

    kw = case.call_kwargs()
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = np.asarray(kw["alibi_slopes"], np.float64 if dtype == "float64" else np.float32)
    if "dropout_seed" in kw:  # torch's int seed -> the key of its two words
        kw["dropout_key"] = jax.random.wrap_key_data(jnp.asarray(seed_words(kw.pop("dropout_seed")), jnp.uint32))

    def f(q, k, vv):
        return jax_attn.flash_attention(q, k, vv, segment_ids=v.jax_ints(seg), return_lse=True,
                                        implementation=implementation, **kw, **extra)

    (out, lse), vjp = jax.vjp(jax.jit(f), cast(q), cast(k), cast(vv))
    grads = vjp((cast(do), jnp.asarray(dstat, v.JAX_DTYPES[v.stat_dtype(dtype)])))
    return [v.to_numpy(x) for x in (out, lse, *grads)]


def run_torch(case: Case, implementation: str, dtype: str, inputs, device="cpu") -> list:
    q, k, vv, do, dstat, seg, pos = inputs
    tdt = v.TORCH_DTYPES[dtype]
    leaves = [torch.tensor(x, dtype=tdt, device=device, requires_grad=True) for x in (q, k, vv)]
    extra = {} if case.rope is None else dict(rope=torch_ref.Rope(style=case.rope[0], base=case.rope[1]),
                                             positions=v.torch_ints(pos, device))
    kw = case.call_kwargs()
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = torch.tensor(kw["alibi_slopes"], dtype=torch.float64 if dtype == "float64" else torch.float32,
                                          device=device)
    out, lse = torch_ref.flash_attention(*leaves, segment_ids=v.torch_ints(seg, device), return_lse=True,
                                         implementation=implementation, **kw, **extra)
    cotangents = (torch.tensor(do, dtype=tdt, device=device), torch.tensor(dstat, dtype=lse.dtype, device=device))
    grads = torch.autograd.grad((out, lse), leaves, cotangents)
    return [v.to_numpy(x) for x in (out, lse, *grads)]


def jax_call(case: Case):
    kw = case.call_kwargs()
    left, right = kw.get("window") or (None, None)
    # an ordering matters (gathers rows) only with a locality pattern, the window; RoPE then runs
    # before the kernels, which see none
    ordered = kw.get("ordering") not in (None, "identity") and left is not None
    rope = None if case.rope is None or ordered else jax_attn.Rope(style=case.rope[0], base=case.rope[1])
    spec = jax_attn.AttentionSpec(
        scale=1.0, causal=kw.get("causal", False), window_left=left, window_right=right,
        softcap=kw.get("softcap"), has_segments=case.segments is not None, rope=rope,
        offset=kw.get("q_offset", 0) - kw.get("kv_offset", 0), alibi="alibi_slopes" in kw,
        dropout=kw.get("dropout_rate", 0.0), ordered=ordered)
    offsets_position_rope = rope is not None and (kw.get("q_offset", 0) or kw.get("kv_offset", 0))
    return jax_attn.registry.Call(spec, case.shape[5], jnp.dtype(case.dtype),
                                  positions=rope is not None and (case.positions is not None
                                                                  or bool(offsets_position_rope)))


CASES = (
    # CPU and GPU (fp32 with exact matmuls on both sides).
    _case("dense", (2, 64, 64, 4, 4, 32), quick=True),
    _case("causal_gqa", (1, 77, 77, 6, 2, 40), causal=True, quick=True),
    _case("cross_window_mqa", (1, 47, 95, 4, 1, 64), window=(16, 8)),
    _case("packed_segments_causal", (2, 80, 80, 4, 2, 32), segments="packed", causal=True),
    _case("softcap_cross", (1, 50, 70, 2, 2, 16), softcap=5.0, scale=0.2),
    _case("empty_rows", (1, 40, 56, 2, 1, 16), segments="pair_with_empty_rows", quick=True),
    _case("fp16_causal", (1, 64, 64, 2, 2, 64), dtype="float16", causal=True),
    # Absolute positions of the first query / key: bottom-right alignment (q_offset = Sk - Sq), a
    # decode step, a prefill chunk with a window, both offsets with RoPE at the absolute positions
    _case("bottom_right_decode_gqa", (2, 1, 37, 4, 2, 32), causal=True, q_offset=36),
    _case("bottom_right_chunk_window_gqa", (1, 17, 53, 6, 2, 40), causal=True, window=(8, 0), q_offset=36),
    _case("offsets_window_fp16", (1, 29, 45, 4, 1, 64), "float16", window=(5, 3), q_offset=20, kv_offset=4),
    # ALiBi (FlashAttention's alibi_slopes): -slope_h |i + q_offset - j - kv_offset| before the mask
    _case("alibi_causal_gqa", (1, 47, 47, 4, 2, 32), causal=True, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    _case("alibi_bottom_right_window_fp16", (2, 19, 40, 2, 1, 64), "float16", window=(9, 0), causal=True,
          q_offset=21, alibi_slopes=(0.3, 0.05)),
    _case("alibi_dense_cross_softcap", (1, 33, 50, 2, 2, 16), softcap=4.0, alibi_slopes=(0.1, 1.0)),
    # Attention dropout: one seed, one mask (attn_spec.dropout) in both frameworks and the goldens;
    # a seed above 2^32 (both words used)
    _case("dropout_causal_gqa", (1, 53, 53, 6, 2, 40), causal=True, dropout_rate=0.1, dropout_seed=2 ** 40 + 17),
    _case("dropout_window_segments_fp16", (2, 37, 61, 4, 1, 32), "float16", window=(12, 4),
          segments="pair_sorted", dropout_rate=0.5, dropout_seed=12345, stat_grad=True),
    _case("bf16_dropout_causal_1k_gqa", (2, 1024, 1024, 8, 2, 64), "bfloat16", causal=True, dropout_rate=0.1,
          dropout_seed=2 ** 63 + 5, gpu=True),
    # FlashAttention's bwd_overflow: fp16, two or three keys, large logits (very negative lse on
    # some rows: a key block of padding run unmasked made the Hopper dQ NaN there)
    _case("fp16_overflow_2x2_d64", (2, 2, 2, 5, 5, 64), dtype="float16", amp=4.0),
    _case("fp16_overflow_3x3_d128", (2, 3, 3, 5, 5, 128), dtype="float16", amp=4.0),
    # GPU only: half precision (the Triton interpreter computes bf16 dots wrongly), long sequences.
    _case("bf16_causal_1k_gqa", (2, 1024, 1024, 8, 2, 128), "bfloat16", causal=True, gpu=True),
    _case("bf16_dense_4k", (1, 4096, 4096, 4, 4, 128), "bfloat16", gpu=True),
    _case("bf16_bottom_right_chunk_1k_of_4k_gqa", (2, 1024, 4096, 8, 2, 128), "bfloat16", causal=True,
          q_offset=3072, gpu=True),
    _case("bf16_alibi_causal_2k_gqa", (2, 2048, 2048, 8, 2, 128), "bfloat16", causal=True,
          alibi_slopes=tuple(2.0 ** (-8 * (h + 1) / 8) for h in range(8)), gpu=True),
    _case("bf16_causal_4k", (1, 4096, 4096, 4, 4, 128), "bfloat16", causal=True, gpu=True),
    _case("fp16_window_4k_d64", (1, 4096, 4096, 8, 2, 64), "float16", window=(512, 128), gpu=True),
    _case("bf16_packed_2k", (2, 2048, 2048, 4, 4, 128), "bfloat16", segments="packed", causal=True, gpu=True),
    _case("fp16_softcap_cross_d96", (1, 1000, 3000, 4, 1, 96), "float16", softcap=30.0, gpu=True),
    _case("bf16_empty_rows_d256", (1, 700, 900, 4, 2, 256), "bfloat16", segments="pair_with_empty_rows", gpu=True),
    _case("fp32_causal_2k", (1, 2048, 2048, 4, 2, 128), causal=True, gpu=True),
    # Fused RoPE (q, k rotated inside the kernels), both pairings.
    _rope_case("rope_interleaved_causal_gqa", (1, 64, 64, 6, 2, 32), "interleaved", causal=True, quick=True),
    _rope_case("rope_half_packed", (2, 72, 72, 4, 2, 40), "half", segments="packed",
               positions="restart_per_segment", causal=True),
    _rope_case("rope_half_cross_pair", (1, 40, 56, 2, 1, 64), "half", positions="pair_random", base=500.0,
               window=(20, 20)),
    _rope_case("rope_interleaved_fp16", (1, 64, 64, 2, 2, 64), "interleaved", dtype="float16"),
    _rope_case("rope_half_bf16_2k", (2, 2048, 2048, 8, 2, 128), "half", dtype="bfloat16", causal=True, gpu=True),
    # Space-filling-curve orderings (the window on the ordered sequence, causality and segment ids on
    # the original positions; out, lse and gradients in the original order)
    _case("ordered_hilbert_window_causal_gqa", (1, 48, 48, 4, 2, 32), ordering="hilbert", grid=(6, 8),
          window=(6, 6), causal=True, quick=True),
    _case("ordered_zorder_window_segments_fp16", (2, 37, 37, 2, 1, 16), "float16", ordering="zorder",
          window=(5, 2), segments="sorted", stat_grad=True),
    _case("ordered_snake_dense_causal", (1, 40, 40, 2, 2, 16), ordering="snake", causal=True),
    _rope_case("ordered_hilbert_window_rope_causal_gqa", (1, 42, 42, 4, 2, 32), "half", base=500.0,
               ordering="hilbert", grid=(6, 7), window=(6, 6), causal=True),
    _case("ordered_zorder_window_dropout_gqa", (1, 36, 36, 4, 2, 32), ordering="zorder", grid=(6, 6), window=(5, 5),
          dropout_rate=0.2, dropout_seed=2 ** 33 + 9),
    # ALiBi on the tokens' original distance
    _case("ordered_hilbert_window_alibi_causal_gqa", (1, 40, 40, 4, 2, 32), ordering="hilbert", grid=(5, 8),
          window=(6, 6), causal=True, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    _case("ordered_hilbert_window_bf16_4k_gqa", (1, 4096, 4096, 8, 2, 128), "bfloat16", ordering="hilbert",
          grid=(64, 64), window=(256, 256), causal=True, gpu=True),
    _case("ordered_gray_window_fp16_2k", (2, 2000, 2000, 4, 4, 64), "float16", ordering="gray", window=(128, 64),
          segments="packed", gpu=True),
    _rope_case("rope_interleaved_bf16_4k_packed", (1, 4096, 4096, 4, 4, 128), "interleaved", dtype="bfloat16",
               segments="packed", positions="restart_per_segment", causal=True, gpu=True),
)


def _shape_name(shape):
    return "x".join(map(str, shape))


# The awkward-shape grid of the tests: lengths 1, 17, 31/47, 65/129, 113/203 (Sq != Sk),
# head dims 1..256 (16, 40, 59, 64, 72, 128 among them), GQA and MQA, every feature and combinations,
# fully masked rows, fp32 and fp16 (bf16 on the GPU: the Triton interpreter computes bf16 dots wrongly).
# Rows with exactly one visible key (Sq = 1 causal, window (0, 0)) have d out / d s = 0: with a
# cotangent on out alone the golden dq, dk are 0 and the rule's floor is 0, so those cases put a
# random cotangent on lse too (stat_grad) and run in fp16 (test_single_visible_key covers fp32).
_SHAPES = [(1, 1, 19, 2, 2, 16), (2, 17, 17, 2, 1, 40), (1, 31, 47, 6, 2, 59), (1, 65, 129, 4, 1, 64),
           (1, 113, 203, 2, 2, 72), (1, 47, 31, 2, 2, 128)]
_SLOW_SHAPES = {(1, 65, 129, 4, 1, 64), (1, 113, 203, 2, 2, 72)}
_SLOW_DENSE = {(1, 31, 47, 6, 2, 59), (1, 47, 31, 2, 2, 128)}  # their causal twins stay in the fast tier
GRID = (
    *(_case(f"{'causal' if causal else 'dense'}_{_shape_name(s)}",
            (s[0], 2, *s[2:]) if causal and s[1] == 1 else s, causal=causal, slow=s in _SLOW_SHAPES or (not causal and s in _SLOW_DENSE), seed=0)
      for s in _SHAPES for causal in (False, True)),
    _case("fp16_causal_mqa_65x129_d64", (1, 65, 129, 4, 1, 64), "float16", causal=True, slow=True, seed=0),
    _case("fp16_causal_gqa_31x47_d40", (2, 31, 47, 6, 2, 40), "float16", causal=True, seed=0),
    _case("window", (1, 71, 71, 4, 2, 32), window=(9, 4), seed=0),
    _case("window_causal", (1, 71, 71, 4, 2, 32), window=(20, 3), causal=True, slow=True, seed=0),
    _case("window_zero_left", (1, 71, 71, 4, 2, 32), window=(0, 5), slow=True, seed=0),
    _case("softcap", (1, 71, 71, 4, 2, 32), softcap=3.0, slow=True, seed=0),
    _case("softcap_causal_window", (1, 71, 71, 4, 2, 32), softcap=2.0, causal=True, window=(16, 0), seed=0),
    _case("scale_causal", (1, 71, 71, 4, 2, 32), scale=0.3, causal=True, slow=True, seed=0),
    _case("packed_window", (2, 90, 90, 4, 2, 32), segments="packed", window=(40, 40), slow=True, seed=0),
    _case("packed_causal_window", (2, 90, 90, 4, 2, 32), segments="packed", causal=True, window=(40, 40), seed=0),
    _case("pair_unsorted_softcap_mqa", (1, 37, 70, 2, 1, 16), segments="pair_unsorted", softcap=4.0, seed=0),
    _case("boundary_d256_gqa8_window_0_3_pair", (1, 20, 24, 8, 1, 256), segments="pair_zeros", window=(0, 3), seed=0),
    # (from the torch grid)
    _case("single_token_fp16", (1, 1, 1, 1, 1, 16), "float16", stat_grad=True, slow=True),
    _case("single_token_causal_mqa_fp16", (2, 1, 1, 4, 1, 64), "float16", causal=True, stat_grad=True),
    _case("causal_17_d16", (1, 17, 17, 2, 2, 16), causal=True, slow=True),
    _case("sorted_segments_gqa_d72_fp16", (2, 17, 17, 6, 2, 72), "float16", segments="sorted"),
    _case("causal_gqa_31x47_d40", (1, 31, 47, 6, 2, 40), causal=True, slow=True),
    _case("window_mqa_31x47_d59_fp16", (1, 31, 47, 4, 1, 59), "float16", window=(5, 9)),
    _case("causal_47x31_mqa_lse_grad", (1, 47, 31, 2, 1, 64), causal=True, stat_grad=True),
    _case("causal_window_65x129_d59", (1, 65, 129, 2, 2, 59), causal=True, window=(20, 0), slow=True),
    _case("softcap_65x129_gqa_d128_fp16", (1, 65, 129, 6, 2, 128), "float16", softcap=4.0, amp=2.0, slow=True),
    _case("causal_pair_113x203_mqa_fp16", (1, 113, 203, 4, 1, 64), "float16", causal=True,
          segments="pair_sorted", slow=True),
    _case("one_key_per_row_113x203_fp16", (1, 113, 203, 2, 2, 40), "float16", window=(0, 0), stat_grad=True,
          slow=True),
    _case("all_features_65_d72", (2, 65, 65, 4, 2, 72), causal=True, window=(7, 3), segments="sorted",
          softcap=2.5, scale=0.3, amp=2.0, slow=True),
    _case("rows_past_keys_see_nothing_fp16", (1, 47, 17, 2, 2, 16), "float16", window=(0, 0), stat_grad=True),
    _case("widest_d256_fp16", (1, 31, 31, 2, 1, 256), "float16", causal=True),
    _case("narrowest_d1_softcap", (1, 17, 31, 2, 2, 1), softcap=1.0, amp=3.0),
    _case("empty_tail_pair_d128_lse_grad", (1, 40, 40, 4, 2, 128), causal=True, segments="pair_empty_tail",
          stat_grad=True),
    _case("window_pair_softcap_65x129_d72_fp16", (1, 65, 129, 2, 1, 72), "float16", window=(30, 50),
          segments="pair_sorted", softcap=3.0, amp=2.0, slow=True),
    # fused RoPE
    _rope_case("rope_interleaved_causal_gqa", (1, 47, 47, 4, 2, 32), "interleaved", base=500.0, causal=True, seed=0),
    _rope_case("rope_half_cross_window_d40", (2, 31, 58, 6, 2, 40), "half", base=500.0, window=(12, 5), seed=0),
    _rope_case("rope_interleaved_mqa_softcap_d16", (1, 33, 33, 4, 1, 16), "interleaved", base=500.0, softcap=4.0, seed=0),
    _rope_case("rope_half_d72", (1, 20, 20, 2, 2, 72), "half", base=500.0, seed=0, slow=True),
    _rope_case("rope_half_fp16_causal", (1, 64, 64, 2, 2, 64), "half", "float16", causal=True, seed=0),
    _rope_case("rope_interleaved_packed_positions", (1, 70, 70, 4, 2, 32), "interleaved", causal=True,
               segments="packed", positions="restart_per_segment", slow=True, seed=0),
    _rope_case("rope_half_packed_positions", (1, 70, 70, 4, 2, 32), "half", causal=True,
               segments="packed", positions="restart_per_segment", seed=0),
    _rope_case("rope_position_pair_cross_mqa", (1, 25, 41, 2, 1, 32), "interleaved", positions="pair_random", seed=0),
    _rope_case("rope_interleaved_causal_gqa_d64", (1, 33, 33, 6, 2, 64), "interleaved", causal=True, slow=True),
    _rope_case("rope_half_window_mqa_d40_fp16", (1, 31, 47, 4, 1, 40), "half", "float16", window=(5, 9)),
    _rope_case("rope_interleaved_sorted_restart_d16_fp16", (2, 40, 40, 2, 2, 16), "interleaved", "float16",
               segments="sorted", positions="restart_per_segment", causal=True, slow=True),
    _rope_case("rope_half_sorted_restart_window_d72", (2, 40, 40, 4, 2, 72), "half", segments="sorted",
               positions="restart_per_segment", causal=True, window=(7, 3), slow=True),
    _rope_case("rope_interleaved_offset_pair_gqa", (1, 23, 57, 6, 2, 40), "interleaved", positions="pair_offset"),
    _rope_case("rope_half_offset_pair_57x23_fp16", (1, 57, 23, 2, 1, 64), "half", "float16", base=500000.0,
               positions="pair_offset", stat_grad=True),
    _rope_case("rope_interleaved_sorted_restart_softcap_d72_fp16", (1, 45, 45, 4, 2, 72), "interleaved",
               "float16", segments="sorted", positions="restart_per_segment", softcap=4.0, slow=True),
    _rope_case("rope_half_large_positions", (1, 37, 37, 2, 2, 16), "half", positions="pair_large", slow=True),
    _rope_case("rope_interleaved_large_positions_causal_fp16", (1, 37, 41, 4, 1, 64), "interleaved", "float16",
               base=100.0, positions="pair_large", causal=True, slow=True),
    _rope_case("rope_half_empty_tail_fp16", (1, 40, 35, 4, 2, 40), "half", "float16", segments="pair_empty_tail",
               positions="restart_per_segment", causal=True, stat_grad=True),
    _rope_case("rope_offsets_causal_gqa", (1, 23, 31, 4, 2, 32), "half", causal=True, q_offset=40, kv_offset=32),
    _case("alibi_offsets_window_gqa", (1, 33, 40, 4, 2, 32), causal=True, window=(9, 0), q_offset=7,
          alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    _case("alibi_dense_mqa_fp16", (2, 17, 29, 2, 1, 40), "float16", alibi_slopes=(0.2, 0.7)),
    # Compiled kernels at realistic shapes (make test-gpu).
    *(_case(f"gpu_{dt}_{'causal' if causal else 'dense'}_{'gqa' if hkv == 2 else 'mha'}",
            (2, 1024, 1024, 8, hkv, 128), dt, causal=causal, gpu=True)
      for dt in ("bfloat16", "float16") for causal in (False, True) for hkv in (8, 2)),
    _case("gpu_bf16_window_cross_d64", (1, 2000, 3001, 8, 2, 64), "bfloat16", window=(256, 64), gpu=True),
    _case("gpu_bf16_causal_softcap_d72", (2, 777, 777, 6, 2, 72), "bfloat16", causal=True, softcap=20.0, gpu=True),
    _case("gpu_bf16_causal_d256", (1, 1537, 1537, 4, 1, 256), "bfloat16", causal=True, gpu=True),
    _case("gpu_fp32_causal_d40", (1, 513, 513, 4, 4, 40), causal=True, gpu=True),
    _case("gpu_bf16_packed_2k", (2, 2048, 2048, 8, 2, 128), "bfloat16", causal=True, segments="packed", gpu=True),
    *(_case(f"gpu_all_features_d{d}_{dt}", (1, 300, 517, 4, 2, d), dt, causal=True, window=(200, 0),
            segments="pair_sorted", softcap=8.0, amp=2.0, stat_grad=True, gpu=True)
      for d in (16, 72, 128, 256) for dt in ("float16", "bfloat16", "float32")),
    *(_case(f"gpu_sorted_window_d{d}_{dt}", (2, 777, 777, 4, 1, d), dt, segments="sorted", window=(100, 300),
            gpu=True) for d in (64, 96) for dt in ("bfloat16", "float32")),
    _case("gpu_bf16_causal_ragged_d64", (1, 1000, 1000, 4, 2, 64), "bfloat16", causal=True, gpu=True),
    _case("gpu_bf16_cross_mqa_d96", (1, 777, 1111, 4, 1, 96), "bfloat16", gpu=True),
    _case("gpu_bf16_causal_rows_past_keys", (1, 1111, 777, 4, 4, 128), "bfloat16", causal=True, gpu=True),
    _case("gpu_fp16_causal_scale_d40", (1, 300, 300, 2, 1, 40), "float16", causal=True, scale=0.3, gpu=True),
    _case("gpu_bf16_causal_keys_past_rows", (1, 300, 700, 4, 2, 64), "bfloat16", causal=True, gpu=True),
    _case("gpu_bf16_sliding_window", (2, 1500, 1500, 8, 2, 128), "bfloat16", causal=True, window=(256, 0), gpu=True),
    _case("gpu_fp16_window_cross_d64", (1, 1000, 1200, 4, 4, 64), "float16", window=(100, 37), gpu=True),
    *(_rope_case(f"gpu_rope_{style}_bf16_causal", (2, 1024, 1024, 8, 2, 128), style, "bfloat16", causal=True,
                 gpu=True) for style in ("interleaved", "half")),
    _rope_case("gpu_rope_interleaved_bf16_4k_2waves", (1, 4096, 4096, 8, 2, 128), "interleaved", "bfloat16",
               causal=True, gpu=True),
    _rope_case("gpu_rope_half_bf16_ragged", (1, 1000, 1000, 4, 4, 128), "half", "bfloat16", causal=True, gpu=True),
    _rope_case("gpu_rope_half_fp16_cross_d96", (1, 777, 1111, 4, 1, 96), "half", "float16", gpu=True),
    _rope_case("gpu_rope_fp16_window_d64", (1, 600, 600, 4, 2, 64), "interleaved", "float16", base=500.0,
               causal=True, window=(200, 0), gpu=True),
    _rope_case("gpu_rope_half_bf16_4k_mha", (1, 4096, 4096, 8, 8, 128), "half", "bfloat16", causal=True, gpu=True),
    _rope_case("gpu_rope_fp16_more_rows_than_keys", (1, 1111, 777, 4, 2, 64), "interleaved", "float16",
               causal=True, gpu=True),
    _rope_case("gpu_rope_half_bf16_packed_2k_d64", (2, 2048, 2048, 8, 8, 64), "half", "bfloat16", base=500000.0,
               segments="sorted", positions="restart_per_segment", causal=True, gpu=True),
    _rope_case("gpu_rope_half_bf16_large_window", (1, 777, 1500, 8, 1, 128), "half", "bfloat16",
               positions="pair_large", window=(300, 200), stat_grad=True, gpu=True),
    _rope_case("gpu_rope_fp16_mha_d64", (2, 1024, 1024, 4, 4, 64), "interleaved", "float16", gpu=True),
    _rope_case("gpu_rope_half_bf16_mha", (1, 1024, 1024, 4, 4, 128), "half", "bfloat16", gpu=True),
)

SOFTMAX = v.VariantRecord(
    name="softmax", quantities=("out", "lse", "dq", "dk", "dv"), forward=("out", "lse"), draw=draw,
    run_jax=run_jax, run_torch=run_torch, jax_call=jax_call, cases=CASES, grid=GRID)
