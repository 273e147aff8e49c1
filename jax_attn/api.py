"""The public functions: validate the call, build its spec, run the implementation the registry picks."""
from __future__ import annotations

import types

import jax.numpy as jnp

from attn_spec import dilation, varlen
from jax_attn import registry
from jax_attn.ops.common import validation
from jax_attn.ops.common.rope import Rope
from jax_attn.ops.common.spec import AttentionSpec


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                    segment_ids=None, window: tuple[int, int] | None = None,
                    softcap: float | None = None, rope: Rope | None = None, positions=None,
                    q_offset: int = 0, kv_offset: int = 0, alibi_slopes=None,
                    return_lse: bool = False, implementation: str | None = None, config=None):
    """Multi-head attention, `softmax(scale * q k^T + mask) v`, FlashAttention-style.

    Args:
      q: [B, Sq, Hq, D] queries (float32, float16 or bfloat16; float64 with "xla" only, under
        jax.enable_x64, for golden references).
      k, v: [B, Sk, Hkv, D] keys and values, Hq % Hkv == 0 (query head h reads kv head
        h // (Hq // Hkv)). D <= 256; any Sq, Sk.
      causal: query i sees keys j <= i (top-left aligned when Sq != Sk; see q_offset for bottom-right).
      scale: score scale, default D ** -0.5.
      segment_ids: int [B, S] (Sq == Sk) or a pair (q_ids [B, Sq], kv_ids [B, Sk]); queries see
        only keys with the same id.
      window: (left, right) >= 0: query i sees keys i - left <= j <= i + right.
      softcap: c > 0: scores become c * tanh(s / c) before masking.
      rope: a `Rope(base, style)`: q and k are rotated inside the kernels after load (RoPE,
        pairs (2i, 2i+1) for style "interleaved", (i, i + D/2) for "half"); D must be even.
      positions: RoPE positions, int [B, S] (Sq == Sk) or a pair (q_pos [B, Sq], kv_pos [B, Sk]);
        default arange from the offsets (per-token positions serve packed sequences).
      q_offset, kv_offset: absolute positions (Python ints >= 0) of the first query and the first
        key: causality and windows compare i + q_offset with j + kv_offset. Bottom-right
        alignment (FlashAttention's, for Sq != Sk: a decode step or a prefill chunk against the
        cache before it) is q_offset = Sk - Sq. Fully masked tiles are still skipped.
      alibi_slopes: float [Hq] or None: ALiBi, scores get -slope_h * |i + q_offset - j - kv_offset|
        before the mask (FlashAttention's alibi_slopes; not differentiated).
      return_lse: also return lse [B, Hq, Sq] float32 (natural log; -inf on rows with no
        visible key). The lse output is differentiable.
      implementation: None (the rule of `jax_attn.registry.choose`: "xla" where Pallas Triton
        cannot run, "mosaic" where its Hopper kernels serve the call, else "triton"), "triton"
        (the Pallas engine, Triton lowering; interpreted on CPU), "mosaic" (Hopper GPUs; 16-bit
        attention, causal and/or windowed, RoPE at the default positions, without softcap or
        segments, D <= 128: warp-specialised TMA/wgmma kernels, forward and backward) or "xla"
        (plain jnp). "pallas_triton" and "mosaic_gpu" are accepted spellings of "triton" and
        "mosaic". An implementation that cannot serve the call raises NotImplementedError saying
        why; an unknown name raises UnknownImplementationError (ValueError, NotImplementedError).
      config: the tile config of the chosen implementation: a `BlockSizes` for "triton", a
        `MosaicBlockSizes` for "mosaic" (with RoPE: block_q = block_q_bwd = block_k_bwd = 64);
        "xla" takes none. None: its default for the call (`registry.REGISTRY[...].default_config`).
        TypeError for another type, ValueError for a config that cannot serve the call.

    Float32 inputs use the matmul precision JAX is configured with
    (`jax.default_matmul_precision`): "highest"/"float32" gives exact fp32 dots, anything else
    lets the GPU use TF32, as XLA does.

    A row with no visible key returns 0 (lse -inf) and zero gradients, never NaN.

    Returns:
      out [B, Sq, Hq, D] in q.dtype, or (out, lse) when return_lse.
    """
    validation.check_arrays(q, k, v)
    batch, q_len, _, head_dim = q.shape
    kv_len = k.shape[1]
    q_ids, kv_ids = validation.check_segment_ids(segment_ids, batch, q_len, kv_len)
    left, right = validation.check_window(window)
    q_pos, kv_pos = validation.check_rope(rope, positions, batch, q_len, kv_len, head_dim)
    offset = validation.check_offset("q_offset", q_offset) - validation.check_offset("kv_offset", kv_offset)
    if rope is not None and positions is None and (q_offset or kv_offset):  # RoPE at the absolute positions
        q_pos, kv_pos = (jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) + start, (batch, n))
                         for n, start in ((q_len, q_offset), (kv_len, kv_offset)))
    softcap = validation.check_positive("softcap", softcap)
    scale = validation.check_positive("scale", scale)
    slopes = validation.check_slopes(alibi_slopes, q.shape[2], q.dtype)
    spec = AttentionSpec(
        scale=head_dim ** -0.5 if scale is None else scale,
        causal=bool(causal), window_left=left, window_right=right, softcap=softcap,
        has_segments=q_ids is not None, precision=validation.fp32_precision(q.dtype), rope=rope, offset=offset,
        alibi=slopes is not None)
    call = registry.Call(spec, head_dim, q.dtype, positions=q_pos is not None)
    entry = registry.resolve("softmax", implementation, call)
    config = registry.check_config(entry, config, call)
    out, lse = entry.fn(q, k, v, q_ids, kv_ids, spec, q_pos=q_pos, kv_pos=kv_pos, slopes=slopes, config=config)
    return (out, lse) if return_lse else out


def stick_breaking_attention(q, k, v, *, scale: float | None = None, decay=0.0, rope: Rope | None = None,
                             positions=None, return_remainder: bool = False,
                             implementation: str | None = None, config=None):
    """Stick-breaking attention (ExpoSB), strictly causal: token i attends to keys j < i.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] (same S), Hq % Hkv == 0 (GQA/MQA); D <= 256; any S.
        float32, float16, bfloat16 (float64 with "xla" only, under jax.enable_x64).
      scale: logit scale, default D ** -0.5.
      decay: lambda >= 0 of the distance penalty -lambda (i - j): a float, a scalar array or an
        array [Hq] (per head). Differentiable (a learnable decay gets its gradient, same shape).
        The distance is the token index difference, whatever the RoPE positions.
      rope: a `Rope`: q and k are rotated inside the kernels.
      positions: RoPE positions, int [B, S] shared by q and k (default arange), or a pair
        (q_pos [B, S], kv_pos [B, S]): "xla" only (the kernels rotate q and k by one array; they
        refuse a pair, saying so).
      return_remainder: also return rem [B, Hq, S] float32, the unspent stick 1 - sum_j A_ij
        (1 on row 0, which has no key; its output is 0). Differentiable.
      implementation: None ("triton" where Pallas Triton runs, else "xla"), "triton" (the
        Pallas kernels, Triton lowering), "mosaic" (Hopper, 16-bit, head dim 33 to 128, no RoPE:
        the forward on a Mosaic GPU kernel, the backward on Pallas Triton's) or "xla" (plain jnp,
        [B, Hq, S, S] in memory); "pallas_triton" and "mosaic_gpu" are accepted spellings of
        "triton" and "mosaic". Errors as for `flash_attention`. Not "mosaic" by default even
        where it serves the call: its forward walks every tile, while the Triton forward ends a
        row block's walk where its sticks are spent (docs/design/stick_breaking.md).
      config: a `StickBreakingBlockSizes` for "triton" and "mosaic" (for "mosaic" the backward's
        tiles, with block_k = 64); "xla" takes none. None: the implementation's default for the
        call. TypeError for another type, ValueError for a config that cannot serve the call.

    Returns: out [B, S, Hq, D] in q.dtype, or (out, rem).
    """
    validation.check_arrays(q, k, v)
    batch, seq_len, num_heads, head_dim = q.shape
    if k.shape[1] != seq_len:
        raise ValueError(f"stick-breaking attention is causal self-attention: q and k need the same "
                         f"length, got {q.shape=} and {k.shape=}")
    pos, kv_pos = validation.check_rope(rope, positions, batch, seq_len, seq_len, head_dim)
    kv_pos = kv_pos if isinstance(positions, (tuple, list)) else None  # keys with positions of their own
    scale = validation.check_positive("scale", scale)
    decay = validation.check_decay(decay, num_heads, q.dtype)
    spec = AttentionSpec(scale=head_dim ** -0.5 if scale is None else scale, causal=True,
                         precision=validation.fp32_precision(q.dtype), rope=rope)
    call = registry.Call(spec, head_dim, q.dtype, positions=pos is not None, kv_positions=kv_pos is not None)
    entry = registry.resolve("stick_breaking", implementation, call)
    config = registry.check_config(entry, config, call)
    out, rem = entry.fn(q, k, v, decay, spec, pos=pos, kv_pos=kv_pos, config=config)
    return (out, rem) if return_remainder else out


def dilated_attention(q, k, v, *, segment_lengths, dilation_rates, causal: bool = False, merge: str = "lse",
                      scale: float | None = None, return_lse: bool = False, implementation: str | None = None,
                      config=None):
    """Dilated attention (LongNet, arXiv 2307.02486).

    Branch k cuts the sequence into segments of segment_lengths[k] (the last one may be partial)
    and keeps rows `offset + m * dilation_rates[k]` of each; the kept rows of a segment attend
    densely among themselves (causal inside the dilated segment when causal=True).

    Args:
      q: [B, S, H, D]; k, v: [B, S, Hkv, D] (same S), H % Hkv == 0; D <= 256; any S (segments
        need not divide it or each other, and may be longer than it). float32, float16,
        bfloat16 (float64 with "xla" only, under jax.enable_x64).
      segment_lengths, dilation_rates: sequences of positive ints of the same count, each rate
        at most its segment length.
      merge: "lse" (LongNet Eq. 10): every head in every branch, head h with offset h mod r_k;
        row i's output is sum_k exp(lse_ik - logsumexp_k lse_ik) o_ik over the branches that
        keep it (differentiable through the weights). "head_groups": the heads split into K
        equal groups (H % K == 0), group k runs branch k alone with offset k mod r_k. A row no
        branch keeps returns 0 (lse -inf), never NaN.
      scale: score scale, default D ** -0.5.
      return_lse: also return lse [B, H, S] float32 (natural log, the merged statistic).
      implementation: None ("triton" where Pallas Triton runs, else "xla"), "triton" (every
        branch one call of the flash engine reading the dilated rows in place through a row
        map; merged on the row statistics) or "xla" (plain jnp: gather, dense attention per
        segment, merge). Errors as for `flash_attention`.
      config: a `BlockSizes` for "triton" (each branch's tiles); None: its default.

    Returns: out [B, S, H, D] in q.dtype, or (out, lse).
    """
    validation.check_arrays(q, k, v)
    seq_len, num_heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    if k.shape[1] != seq_len:
        raise ValueError(f"dilated attention is self-attention: q and k need the same length, got "
                         f"{q.shape=} and {k.shape=}")
    lengths, rates = dilation.check_config(segment_lengths, dilation_rates, merge, num_heads)
    scale = validation.check_positive("scale", scale)
    spec = AttentionSpec(scale=head_dim ** -0.5 if scale is None else scale, causal=bool(causal),
                         precision=validation.fp32_precision(q.dtype))
    call = registry.Call(spec, head_dim, q.dtype)
    entry = registry.resolve("dilated", implementation, call)
    config = registry.check_config(entry, config, call)
    out, lse = entry.fn(q, k, v, spec, segment_lengths=lengths, dilation_rates=rates, merge=merge, config=config)
    return (out, lse) if return_lse else out


_JNP_VARLEN_OPS = types.SimpleNamespace(arange=jnp.arange, maximum=jnp.maximum, cumsum=jnp.cumsum,
                                        searchsorted_right=lambda a, v: jnp.searchsorted(a, v, side="right"))


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal: bool = False,
                           scale: float | None = None, window: tuple[int, int] | None = None,
                           softcap: float | None = None, rope: Rope | None = None, return_lse: bool = False,
                           implementation: str | None = None, config=None):
    """`flash_attention` on a packed variable-length batch, FlashAttention's varlen form.

    Args:
      q: [total_q, Hq, D], the queries of every sequence one after the other; k, v: [total_k, Hkv, D].
      cu_seqlens_q: int [N + 1], 0 = cu[0] <= ... <= cu[N] = total_q: sequence s holds queries
        cu[s] .. cu[s+1] - 1. cu_seqlens_k: the same for the keys (None: as cu_seqlens_q).
      causal, window: per sequence, bottom-right aligned (query i of a sequence sits at key
        position i + len_k - len_q, as FlashAttention); RoPE positions likewise (keys 0, 1, ...
        within their sequence). scale, softcap, implementation, config: as `flash_attention`.

    Segment ids serve it without a copy where the packing allows (cu_seqlens_k None or equal to
    cu_seqlens_q, or neither causal nor window); otherwise q, k, v are scattered into an aligned
    layout of total_q + total_k rows (`attn_spec.varlen`) and the output gathered back.

    Returns: out [total_q, Hq, D], or (out, lse [Hq, total_q]) when return_lse.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name} must be 3-D [total, heads, head_dim] (packed), got {getattr(x, 'shape', x)}")
    same = cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
    cu_q = jnp.asarray(cu_seqlens_q)
    cu_k = cu_q if same else jnp.asarray(cu_seqlens_k)
    concrete_q, concrete_k = validation.concrete(cu_q), validation.concrete(cu_k)  # None while traced
    for name, cu, total, values in (("cu_seqlens_q", cu_q, q.shape[0], concrete_q),
                                    ("cu_seqlens_k", cu_k, k.shape[0], concrete_k)):
        if not jnp.issubdtype(cu.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {cu.dtype}")
        varlen.check_cu_seqlens(name, cu, total, values)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k count different sequences: {cu_q.shape} and {cu_k.shape}")
    same = same or (concrete_q is not None and concrete_k is not None and (concrete_q == concrete_k).all())
    plan = varlen.layout(cu_q.astype(jnp.int32), cu_k.astype(jnp.int32), q.shape[0], k.shape[0], _JNP_VARLEN_OPS)
    rows = q.shape[0] + k.shape[0]  # the aligned layout's
    out, lse = varlen.attend(
        plan, q, k, v, aligned=not same and (causal or window is not None), rope=rope is not None,
        scatter=lambda x, slots, fill: jnp.full((rows, *x.shape[1:]), fill, x.dtype).at[slots].set(x),
        call=lambda q, k, v, ids, positions: flash_attention(
            q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, rope=rope, segment_ids=ids,
            positions=positions, return_lse=True, implementation=implementation, config=config))
    return (out, lse) if return_lse else out
