"""Public entry points of torch_ref: validate the arguments, pick the implementation
(`torch_ref.registry`), run the variant's eager reference or its Triton autograd Function.

  softmax attention:         `flash_attention`, `flash_attention_reference`
                             (torch_ref.ops.softmax: reference.py, triton.py)
  stick-breaking ("ExpoSB"): `stick_breaking_attention`, `stick_breaking_reference`
                             (torch_ref.ops.stick_breaking: reference.py, triton.py)
  dilated (LongNet):         `dilated_attention` (torch_ref.ops.dilated: reference.py, triton.py)

Triton is imported lazily (only when the Triton path runs), so the choice of interpreter
(`TRITON_INTERPRET=1`) can still be made after `import torch_ref`.
"""
from __future__ import annotations

import types

import torch

from attn_spec import varlen

from . import registry
from .ops.common.validation import (validate, validate_alibi, validate_dilated, validate_offsets, validate_rope,
                                    validate_stick_breaking)
from .ops.softmax import reference as softmax_ref
from .ops.stick_breaking import reference as stick_breaking_ref

__all__ = ["flash_attention", "flash_attention_reference", "stick_breaking_attention", "stick_breaking_reference",
           "dilated_attention"]


# ----------------------------------------------------------------------------------------------
# Softmax attention
# ----------------------------------------------------------------------------------------------
def flash_attention(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None,
                    rope=None, positions=None, q_offset=0, kv_offset=0, alibi_slopes=None, return_lse=False,
                    implementation=None, config=None):
    """Scaled dot-product attention, FlashAttention-style.

    Args:
      q: `[B, Sq, Hq, D]`; k, v: `[B, Sk, Hkv, D]` with Hq % Hkv == 0 (query head h reads kv head
        h // (Hq // Hkv): GQA / MQA). D in 1..256, any Sq, Sk. dtype float16, bfloat16 or float32
        (float64 with implementation="eager" only); output in the input dtype.
      causal: query i sees key j only if j <= i (top-left aligned when Sq != Sk; see q_offset).
      scale: score multiplier, default D ** -0.5. Scores are s_ij = scale * q_i . k_j.
      segment_ids: one integer tensor `[B, S]` (self-attention, Sq == Sk) or a pair
        (q_ids `[B, Sq]`, kv_ids `[B, Sk]`); i sees j only where the ids are equal.
      window: (left, right) non-negative ints; i sees j only if i - left <= j <= i + right.
      softcap: c > 0 applies s = c * tanh(s / c) before masking.
      rope: a `torch_ref.Rope` (rotary position embedding: q and k, not v, are rotated by their
        positions before the scores; see torch_ref.ops.common.rope) or None. Needs an even D. The
        Triton kernels rotate q and k tiles after loading them (no extra pass over memory),
        forward and backward (the gradients are rotated back).
      positions: with rope only. None: q at arange(Sq), k at arange(Sk); one integer tensor
        `[B, S]` (Sq == Sk; the same positions for q and k, e.g. restarting at 0 in each packed
        sequence); or a pair (q_pos `[B, Sq]`, kv_pos `[B, Sk]`). None with offsets: the
        absolute positions q_offset + arange(Sq), kv_offset + arange(Sk).
      q_offset, kv_offset: ints >= 0, the absolute positions of the first query and the first key:
        causality and windows compare i + q_offset with j + kv_offset. Bottom-right alignment
        (FlashAttention's, for Sq != Sk) is q_offset = Sk - Sq. Fully masked tiles are still skipped.
      alibi_slopes: float tensor `[Hq]` or None: ALiBi, scores get -slope_h |i + q_offset - j - kv_offset|
        before the mask (FlashAttention's alibi_slopes; not differentiated).
      return_lse: also return lse `[B, Hq, Sq]`, lse_i = log sum_{visible j} exp(s_ij) (natural log;
        float32, float64 for float64 eager). A row with no visible key gets out 0, lse -inf and
        zero gradients.
      implementation: None, "triton" or "eager".
        - "eager": plain PyTorch (materialised scores), differentiable by autograd.
        - "triton": the Triton kernels in a torch.autograd.Function, gradients for q, k, v
          (lse is differentiable as well).
        - None: "triton" when q is on CUDA or the Triton interpreter is active
          (os.environ["TRITON_INTERPRET"] == "1"), else "eager".
        Anything else raises `UnknownImplementationError` (ValueError and NotImplementedError);
        "triton" raises NotImplementedError when it cannot serve the call (float64, or a CPU tensor
        without the interpreter). There is no silent fallback (`torch_ref.registry`).
      config: for "triton", a `torch_ref.BlockSizes` (the fields of jax_attn's); "eager" takes
        none. None: the default for the call (`default_block_sizes`). TypeError for another type.

    Precision: softmax statistics in float32. On the GPU, float32 inputs use IEEE fp32 dots unless
    torch.backends.cuda.matmul.allow_tf32 is True, then TF32.

    Returns: out `[B, Sq, Hq, D]`, or (out, lse) when return_lse.
    """
    scale, q_ids, kv_ids, window, softcap = validate(q, k, v, causal, scale, segment_ids, window, softcap)
    causal, window = validate_offsets(causal, window, q_offset, kv_offset, q.shape[1], k.shape[1])
    alibi = validate_alibi(alibi_slopes, q, q_offset, kv_offset)
    q_pos, kv_pos = validate_rope(q, k, rope, positions, q_offset, kv_offset)
    call = registry.Call.of(q)
    entry = registry.resolve("softmax", implementation, call)
    config = registry.check_config(entry, config, call)
    out, lse = entry.fn(q, k, v, causal=causal, scale=scale, q_ids=q_ids, kv_ids=kv_ids, window=window,
                        softcap=softcap, rope=rope, q_pos=q_pos, kv_pos=kv_pos, config=config, alibi=alibi)
    return (out, lse) if return_lse else out


def flash_attention_reference(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None,
                              rope=None, positions=None, q_offset=0, kv_offset=0):
    """The eager reference with the same arguments as `flash_attention`; returns (out, lse).

    Works in float64 too (the golden; with rope the rotation then runs in float64). Differentiable
    by autograd.
    """
    scale, q_ids, kv_ids, window, softcap = validate(q, k, v, causal, scale, segment_ids, window, softcap)
    causal, window = validate_offsets(causal, window, q_offset, kv_offset, q.shape[1], k.shape[1])
    q_pos, kv_pos = validate_rope(q, k, rope, positions, q_offset, kv_offset)
    return softmax_ref.attention(q, k, v, causal=causal, scale=scale, q_ids=q_ids, kv_ids=kv_ids, window=window,
                                 softcap=softcap, rope=rope, q_pos=q_pos, kv_pos=kv_pos)


# ----------------------------------------------------------------------------------------------
# Stick-breaking attention (ExpoSB)
# ----------------------------------------------------------------------------------------------
def stick_breaking_attention(q, k, v, *, scale=None, decay=0.0, rope=None, positions=None, return_remainder=False,
                             implementation=None, config=None):
    """Stick-breaking attention (ExpoSB), strictly causal: token i attends to keys j < i.

    Args:
      q: `[B, S, Hq, D]`; k, v: `[B, S, Hkv, D]` (the same S), Hq % Hkv == 0 (query head h reads kv
        head h // (Hq // Hkv): GQA / MQA). D in 1..256, any S. dtype float16, bfloat16 or float32
        (float64 with implementation="eager" only); output in the input dtype.
      scale: logit multiplier, default D ** -0.5.
      decay: lambda >= 0 of the distance penalty -lambda * (i - j): a float, a 0-d tensor or a
        tensor `[Hq]` (per head), finite and >= 0 (checked). A tensor may require grad: it gets
        its gradient with its own shape and dtype. The distance is the token index difference
        i - j, whatever the RoPE positions.
      rope: a `torch_ref.Rope` or None: q and k (not v) are rotated by their positions before the
        scores (inside the kernels after load; the backward rotates dq, dk back). Needs an even D.
      positions: with rope only. None: arange(S) in every batch row; one integer tensor `[B, S]`
        (the same positions for q and k); or a pair (q_pos, kv_pos) of `[B, S]` tensors.
      return_remainder: also return rem `[B, Hq, S]` float32 (float64 for float64 eager), the
        unspent stick 1 - sum_j A_ij = exp(-sum_{j<i} softplus(z_ij)); differentiable.
      implementation: None, "triton" or "eager", with the rule of `torch_ref.flash_attention`:
        None picks "triton" when q is on CUDA or the Triton interpreter is active, else "eager";
        "triton" raises NotImplementedError when it cannot serve the call (float64, CPU tensor
        without the interpreter); anything else raises (ValueError and NotImplementedError).
      config: for "triton", a `torch_ref.StickBreakingBlockSizes`; "eager" takes none. None: the
        default for the call (`default_stick_breaking_block_sizes`). TypeError for another type.

    Row 0 has no key: out 0, rem 1, zero gradients. Log-space math in float32; on the GPU
    float32 inputs use IEEE fp32 dots unless torch.backends.cuda.matmul.allow_tf32 is True.

    Returns: out `[B, S, Hq, D]`, or (out, rem) when return_remainder.
    """
    scale, decay, q_pos, kv_pos = validate_stick_breaking(q, k, v, scale, decay, rope, positions)
    call = registry.Call.of(q)
    entry = registry.resolve("stick_breaking", implementation, call)
    config = registry.check_config(entry, config, call)
    out, rem = entry.fn(q, k, v, scale=scale, decay=decay, rope=rope, q_pos=q_pos, kv_pos=kv_pos, config=config)
    return (out, rem) if return_remainder else out


def stick_breaking_reference(q, k, v, *, scale=None, decay=0.0, rope=None, positions=None):
    """The eager reference with the arguments of `stick_breaking_attention` (less
    return_remainder and implementation); returns (out, rem).

    Works in float64 too (the golden). Differentiable by autograd, decay tensors included.
    """
    scale, decay, q_pos, kv_pos = validate_stick_breaking(q, k, v, scale, decay, rope, positions)
    return stick_breaking_ref.attention(q, k, v, scale=scale, decay=decay, rope=rope, q_pos=q_pos, kv_pos=kv_pos)


# ----------------------------------------------------------------------------------------------
# Dilated attention (LongNet)
# ----------------------------------------------------------------------------------------------
def dilated_attention(q, k, v, *, segment_lengths, dilation_rates, causal=False, merge="lse", scale=None,
                      return_lse=False, implementation=None, config=None):
    """Dilated attention (LongNet, arXiv 2307.02486; docs/design/dilated.md), self-attention.

    Branch k cuts the sequence into segments of `segment_lengths[k]` (the last may be partial; a
    segment longer than the sequence is cut to it) and keeps rows `offset + m * dilation_rates[k]`
    of each; the kept rows of a segment attend densely among themselves.

    Args:
      q: `[B, S, Hq, D]`; k, v: `[B, S, Hkv, D]` (the same S), Hq % Hkv == 0 (query head h reads kv
        head h // (Hq // Hkv)). D in 1..256, any S. dtype float16, bfloat16 or float32 (float64
        with implementation="eager" only); output in the input dtype.
      segment_lengths, dilation_rates: sequences of positive ints, one per branch, each rate at
        most its segment length.
      causal: kept row m sees kept rows m' <= m of its dilated segment.
      merge: "lse" (LongNet Eq. 10): every head runs every branch with offset h mod r_k; row i's
        output is sum_k exp(lse_ik - logsumexp_k' lse_ik') o_ik over the branches that keep it.
        "head_groups": the heads split into len(segment_lengths) equal groups (Hq must be a
        multiple of the branch count), group k runs branch k alone with offset k mod r_k.
        A row no branch keeps gets out 0, lse -inf and zero gradients.
      scale: score multiplier, default D ** -0.5.
      return_lse: also return lse `[B, Hq, S]` (the merged log-sum-exp; float32, float64 for
        float64 eager); differentiable.
      implementation: None, "triton" or "eager", with the rule of `torch_ref.flash_attention`:
        "triton" runs each branch through the softmax kernels over a slot view of q, k, v (a
        free reshape when S is a multiple of the segment and the segment of the rate) and merges
        the compact results; "eager" is the plain reference (torch_ref.ops.dilated.reference).
      config: for "triton", a `torch_ref.BlockSizes` (the softmax kernels' tiles); "eager" takes none.

    Returns: out `[B, S, Hq, D]`, or (out, lse) when return_lse.
    """
    scale, lengths, rates = validate_dilated(q, k, v, causal, scale, segment_lengths, dilation_rates, merge)
    call = registry.Call.of(q)
    entry = registry.resolve("dilated", implementation, call)
    config = registry.check_config(entry, config, call)
    out, lse = entry.fn(q, k, v, segment_lengths=lengths, dilation_rates=rates, causal=causal, merge=merge,
                        scale=scale, config=config)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# Variable-length batches (cu_seqlens)
# ----------------------------------------------------------------------------------------------
def _torch_varlen_ops(device):
    return types.SimpleNamespace(arange=lambda n: torch.arange(n, device=device), maximum=torch.maximum,
                                 cumsum=lambda x: torch.cumsum(x, 0),
                                 searchsorted_right=lambda a, v: torch.searchsorted(a, v, right=True))


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal=False, scale=None, window=None,
                           softcap=None, rope=None, return_lse=False, implementation=None, config=None):
    """`flash_attention` on a packed variable-length batch, FlashAttention's varlen form (the same
    as `jax_attn.flash_attention_varlen`): q `[total_q, Hq, D]`, k, v `[total_k, Hkv, D]`,
    cu_seqlens_q / cu_seqlens_k integer `[N + 1]` (None: as cu_seqlens_q); each sequence bottom-right
    aligned for causal, window and RoPE positions. Segment ids serve it without a copy where the
    packing allows; otherwise the aligned layout of `attn_spec.varlen`.

    Returns: out `[total_q, Hq, D]`, or (out, lse `[Hq, total_q]`) when return_lse.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [total, heads, head_dim] (packed), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    same = cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
    cu_q = cu_seqlens_q
    cu_k = cu_q if same else cu_seqlens_k
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype.is_floating_point or cu.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {getattr(cu, 'dtype', type(cu).__name__)}")
    host_q = cu_q.cpu().numpy()  # one copy of each to the host, for the checks and the comparison
    host_k = host_q if same else cu_k.cpu().numpy()
    varlen.check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0], host_q)
    varlen.check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], host_k)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k count different sequences: {tuple(cu_q.shape)} and "
                         f"{tuple(cu_k.shape)}")
    same = same or bool((host_q == host_k).all())
    plan = varlen.layout(cu_q.to(q.device, torch.int64), cu_k.to(q.device, torch.int64), q.shape[0], k.shape[0],
                         _torch_varlen_ops(q.device))
    rows = q.shape[0] + k.shape[0]  # the aligned layout's
    out, lse = varlen.attend(
        plan, q, k, v, aligned=not same and (causal or window is not None), rope=rope is not None,
        scatter=lambda x, slots, fill: torch.full((rows, *x.shape[1:]), fill, dtype=x.dtype,
                                                  device=x.device).index_put((slots,), x),
        call=lambda q, k, v, ids, positions: flash_attention(
            q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, rope=rope, segment_ids=ids,
            positions=positions, return_lse=True, implementation=implementation, config=config))
    return (out, lse) if return_lse else out
