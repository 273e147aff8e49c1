"""Public entry points of torch_ref: validate the arguments, pick the implementation
(`torch_ref.registry`), run the variant's eager reference or its Triton autograd Function.

  softmax attention:         `flash_attention`, `flash_attention_reference`
                             (torch_ref.ops.softmax: reference.py, triton.py)
  stick-breaking ("ExpoSB"): `stick_breaking_attention`, `stick_breaking_reference`
                             (torch_ref.ops.stick_breaking: reference.py, triton.py)
  dilated (LongNet):         `dilated_attention` (torch_ref.ops.dilated: reference.py, triton.py)
  NSA (native sparse):       `nsa_attention`, `selection_attention`, `compress_kv`,
                             `compression_attention`, `select_blocks` (torch_ref.ops.nsa)

Triton is imported lazily (only when the Triton path runs), so the choice of interpreter
(`TRITON_INTERPRET=1`) can still be made after `import torch_ref`.
"""
from __future__ import annotations

import types

import torch

from attn_spec import autotune as tuning
from attn_spec import varlen

from . import orderings, registry
from .ops.common.rope import apply_rope
from .ops.common.validation import (validate, validate_alibi, validate_dilated, validate_dropout, validate_offsets,
                                    validate_rope, validate_stick_breaking)
from .ops.softmax import reference as softmax_ref
from .ops.nsa import reference as nsa_ref
from .ops.nsa.validation import validate_compress as validate_nsa_compress
from .ops.nsa.validation import validate_compression as validate_nsa_compression
from .ops.nsa.validation import validate_nsa
from .ops.nsa.validation import validate_select as validate_nsa_select
from .ops.nsa.validation import validate_selection as validate_nsa_selection
from .ops.stick_breaking import reference as stick_breaking_ref

__all__ = ["flash_attention", "flash_attention_reference", "stick_breaking_attention", "stick_breaking_reference",
           "dilated_attention", "flash_attention_varlen", "stick_breaking_attention_varlen", "selection_attention",
           "compress_kv", "compression_attention", "select_blocks", "nsa_attention"]


# ----------------------------------------------------------------------------------------------
# Softmax attention
# ----------------------------------------------------------------------------------------------
def device_kind(device: torch.device) -> str:
    """The device's name as the autotune cache keys it: the CUDA device name (as JAX's device_kind,
    e.g. "NVIDIA H100 80GB HBM3"), else the device type ("cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def autotune_key(variant, q, k, flags) -> str:
    """The autotune cache key of a call of `variant` (`attn_spec.autotune.call_key`): device kind,
    shape class, dtype and the variant's features that change which kernels run (`flags`)."""
    return tuning.call_key("torch", device_kind(q.device), variant, q.shape, k.shape,
                           str(q.dtype).removeprefix("torch."), flags)


def flash_attention(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None,
                    rope=None, positions=None, q_offset=0, kv_offset=0, alibi_slopes=None, dropout_rate=0.0,
                    dropout_seed=None, generator=None, ordering=None, grid=None, return_lse=False, implementation=None,
                    config=None):
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
      dropout_rate: attention dropout, in [0, 1): probabilities zeroed after the softmax, the rest
        scaled by 1 / (1 - rate) (the lse is the softmax's). The mask is a counter-based hash of
        (seed, batch, query head, query row, key row) (`attn_spec.dropout`), evaluated in the
        kernels and regenerated by the backward; the same seed gives the same mask in every
        implementation and in jax_attn (`dropout_key`). A layer applies it only in training (pass
        0.0 in eval).
      dropout_seed: an int in [0, 2**64), or None: with dropout_rate > 0, a seed is then drawn from
        torch's default CPU generator (`torch.randint`, as torch's own dropout draws from its
        generator: `torch.manual_seed` makes it reproducible), or from `generator`. Seed s gives
        the mask of jax_attn's `dropout_key=jax.random.key(s)` (s < 2**32, or under
        jax_enable_x64 s < 2**63) or of `jax.random.wrap_key_data` of its words (s >> 32, s & 0xffffffff).
      generator: a `torch.Generator` to draw the seed from instead of the default one (on its own
        device: a CUDA generator costs a device sync); not with dropout_seed.
      ordering: a space-filling-curve ordering of the tokens (Sq == Sk), as
        `jax_attn.flash_attention`'s: a name of `torch_ref.orderings.ORDERINGS` laid over `grid`,
        or a permutation pi (int tensor or array [S]: position t of the ordered sequence holds
        token pi[t]; checked on the host). `unpermute(attention(permute(q), permute(k),
        permute(v)))`: the window on the ordered sequence, causality and segment ids on the
        original positions and tokens; out, lse, gradients in the original order. Without a
        window it changes nothing (softmax attention is permutation-equivariant) and the call runs
        as without it. With a window the Triton kernels gather every tile's rows through pi and
        store the results at those rows (no permuted copies); window tiles are skipped, causal
        ones cannot be. "eager" runs the explicit composite. With rope, q and k are rotated at
        their original positions before the gathering kernels (one pass over q and k). Dropout
        drops the pairs of tokens the unordered call drops. ALiBi takes the tokens' original
        distance |pi[t] - pi[u]|. Not with offsets (NotImplementedError).
      grid: the token grid of a named ordering, (rows, cols) or (depth, rows, cols), holding
        exactly S tokens; None: `orderings.default_grid(S)`.
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
        none. None: the autotune cache's entry for the call if there is one (`torch_ref.autotune`),
        else the default for the call (`default_block_sizes`). TypeError for another type.

    Precision: softmax statistics in float32. On the GPU, float32 inputs use IEEE fp32 dots unless
    torch.backends.cuda.matmul.allow_tf32 is True, then TF32.

    Returns: out `[B, Sq, Hq, D]`, or (out, lse) when return_lse.
    """
    scale, q_ids, kv_ids, window, softcap = validate(q, k, v, causal, scale, segment_ids, window, softcap)
    causal, window = validate_offsets(causal, window, q_offset, kv_offset, q.shape[1], k.shape[1])
    alibi = validate_alibi(alibi_slopes, q, q_offset, kv_offset)
    q_pos, kv_pos = validate_rope(q, k, rope, positions, q_offset, kv_offset)
    order = None
    if ordering is not None or grid is not None:
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"ordering permutes one sequence for q and k: Sq == Sk needed, got "
                             f"q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)}")
        order = orderings.resolve(ordering, grid, q.shape[1], q.device)
        if window is None:  # no locality pattern: the ordering changes nothing
            order = None
        if order is not None and (q_offset or kv_offset):
            raise NotImplementedError("ordering with a window does not combine with q_offset/kv_offset")
        if order is not None and rope is not None:  # rotated at the original positions, then gathered
            q, k = apply_rope(q, q_pos, rope), apply_rope(k, kv_pos, rope)
            rope = q_pos = kv_pos = None
    call = registry.Call.of(q)
    flags = dict(causal=bool(causal), window=window is not None, softcap=softcap is not None,
                 segments=q_ids is not None, rope=rope is not None, positions=positions is not None,
                 alibi=alibi is not None, dropout=bool(dropout_rate), ordered=order is not None,
                 offset=q_offset != kv_offset)
    entry, config = tuning.select(registry.REGISTRY, "softmax", implementation, config, call,
                                  lambda: autotune_key("softmax", q, k, flags))
    dropout = validate_dropout(dropout_rate, dropout_seed, generator)  # last: a drawn seed advances the generator
    extra = {} if order is None else {"order": order}
    out, lse = entry.fn(q, k, v, causal=causal, scale=scale, q_ids=q_ids, kv_ids=kv_ids, window=window,
                        softcap=softcap, rope=rope, q_pos=q_pos, kv_pos=kv_pos, config=config, alibi=alibi,
                        dropout=dropout, **extra)
    return (out, lse) if return_lse else out


def flash_attention_reference(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None,
                              rope=None, positions=None, q_offset=0, kv_offset=0, alibi_slopes=None,
                              dropout_rate=0.0, dropout_seed=None, generator=None):
    """The eager reference with the same arguments as `flash_attention`; returns (out, lse).

    Works in float64 too (the golden; with rope the rotation then runs in float64; with dropout the
    same seed replays the kernels' mask). Differentiable by autograd.
    """
    scale, q_ids, kv_ids, window, softcap = validate(q, k, v, causal, scale, segment_ids, window, softcap)
    causal, window = validate_offsets(causal, window, q_offset, kv_offset, q.shape[1], k.shape[1])
    alibi = validate_alibi(alibi_slopes, q, q_offset, kv_offset)
    q_pos, kv_pos = validate_rope(q, k, rope, positions, q_offset, kv_offset)
    dropout = validate_dropout(dropout_rate, dropout_seed, generator)
    return softmax_ref.attention(q, k, v, causal=causal, scale=scale, q_ids=q_ids, kv_ids=kv_ids, window=window,
                                 softcap=softcap, rope=rope, q_pos=q_pos, kv_pos=kv_pos, alibi=alibi,
                                 dropout=dropout)


# ----------------------------------------------------------------------------------------------
# Stick-breaking attention (ExpoSB)
# ----------------------------------------------------------------------------------------------
def stick_breaking_attention(q, k, v, *, scale=None, decay=0.0, attend_current=False, segment_ids=None, rope=None,
                             positions=None, return_remainder=False, implementation=None, config=None):
    """Stick-breaking attention (ExpoSB), causal: token i attends to keys j < i (j <= i with attend_current).

    Query i sits at key position p_i = i + Sk - Sq: the queries are the last Sq positions of the
    key sequence (bottom-right, as FlashAttention; decoding against a longer key prefix). Over the
    keys j it sees, z_ij = scale q~_i . k~_j - lambda_h (p_i - j), A_ij = sigmoid(z_ij)
    prod_{m seen, m > j} (1 - sigmoid(z_im)), out_i = sum_j A_ij v_j.

    Args:
      q: `[B, Sq, Hq, D]`; k, v: `[B, Sk, Hkv, D]` with Sq <= Sk, Hq % Hkv == 0 (query head h
        reads kv head h // (Hq // Hkv): GQA / MQA). D in 1..256, any lengths. dtype float16,
        bfloat16 or float32 (float64 with implementation="eager" only); output in the input dtype.
      scale: logit multiplier, default D ** -0.5.
      decay: lambda >= 0 of the distance penalty -lambda * (p_i - j): a float, a 0-d tensor or a
        tensor `[Hq]` (per head), finite and >= 0 (checked). A tensor may require grad: it gets
        its gradient with its own shape and dtype. The distance is the token index difference,
        whatever the RoPE positions.
      attend_current: token i also attends to itself (keys j <= p_i; the diagonal's stick
        included), as fla-org's and shawntan's option of that name: row 0 then has one key.
      segment_ids: one integer tensor `[B, S]` (Sq == Sk) or a pair (q_ids `[B, Sq]`, kv_ids
        `[B, Sk]`): a query sees only keys with its id; the others take no weight and spend none
        of its stick (packed sequences: the stick restarts in every segment). See
        `stick_breaking_attention_varlen`.
      rope: a `torch_ref.Rope` or None: q and k (not v) are rotated by their positions before the
        scores (inside the kernels after load; the backward rotates dq, dk back). Needs an even D.
      positions: with rope only. None: keys at arange(Sk), queries at Sk - Sq + arange(Sq) in
        every batch row; one integer tensor `[B, S]` (Sq == Sk: the same positions for q and k);
        or a pair (q_pos `[B, Sq]`, kv_pos `[B, Sk]`).
      return_remainder: also return rem `[B, Hq, Sq]` float32 (float64 for float64 eager), the
        unspent stick 1 - sum_j A_ij = exp(-sum_j softplus(z_ij)); differentiable.
      implementation: None, "triton" or "eager", with the rule of `torch_ref.flash_attention`:
        None picks "triton" when q is on CUDA or the Triton interpreter is active, else "eager";
        "triton" raises NotImplementedError when it cannot serve the call (float64, CPU tensor
        without the interpreter); anything else raises (ValueError and NotImplementedError).
      config: for "triton", a `torch_ref.StickBreakingBlockSizes`; "eager" takes none. None: the
        autotune cache's entry for the call if there is one, else the default for the call
        (`default_stick_breaking_block_sizes`). TypeError for another type.

    A row that sees no key (row 0 without attend_current): out 0, rem 1, zero gradients.
    Log-space math in float32; on the GPU float32 inputs use IEEE fp32 dots unless
    torch.backends.cuda.matmul.allow_tf32 is True.

    Returns: out `[B, Sq, Hq, D]`, or (out, rem) when return_remainder.
    """
    scale, decay, q_pos, kv_pos, q_ids, kv_ids = validate_stick_breaking(q, k, v, scale, decay, rope, positions,
                                                                          attend_current, segment_ids)
    call = registry.Call.of(q)
    flags = dict(attend_current=bool(attend_current), segments=q_ids is not None, rope=rope is not None,
                 positions=positions is not None, kv_positions=isinstance(positions, (tuple, list)),
                 offset=q.shape[1] != k.shape[1])
    entry, config = tuning.select(registry.REGISTRY, "stick_breaking", implementation, config, call,
                                  lambda: autotune_key("stick_breaking", q, k, flags))
    out, rem = entry.fn(q, k, v, scale=scale, decay=decay, rope=rope, q_pos=q_pos, kv_pos=kv_pos,
                        attend_current=attend_current, q_ids=q_ids, kv_ids=kv_ids, config=config)
    return (out, rem) if return_remainder else out


def stick_breaking_reference(q, k, v, *, scale=None, decay=0.0, attend_current=False, segment_ids=None, rope=None,
                             positions=None):
    """The eager reference with the arguments of `stick_breaking_attention` (less
    return_remainder and implementation); returns (out, rem).

    Works in float64 too (the golden). Differentiable by autograd, decay tensors included.
    """
    scale, decay, q_pos, kv_pos, q_ids, kv_ids = validate_stick_breaking(q, k, v, scale, decay, rope, positions,
                                                                          attend_current, segment_ids)
    return stick_breaking_ref.attention(q, k, v, scale=scale, decay=decay, rope=rope, q_pos=q_pos, kv_pos=kv_pos,
                                        attend_current=attend_current, q_ids=q_ids, kv_ids=kv_ids)


# ----------------------------------------------------------------------------------------------
# Dilated attention (LongNet)
# ----------------------------------------------------------------------------------------------
def dilated_attention(q, k, v, *, segment_lengths, dilation_rates, causal=False, merge="lse", scale=None,
                      ordering=None, grid=None, return_lse=False, implementation=None, config=None):
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
      ordering, grid: a space-filling-curve ordering, as for `flash_attention`: the segments and
        their dilation are laid on the ORDERED sequence, causality on the original positions;
        out, lse, gradients in the original order. The Triton kernels gather each branch's rows
        through the permutation and the merge kernels read the branches' compact rows through
        its inverse (no permuted copies); "eager" runs the explicit composite.
      return_lse: also return lse `[B, Hq, S]` (the merged log-sum-exp; float32, float64 for
        float64 eager); differentiable.
      implementation: None, "triton" or "eager", with the rule of `torch_ref.flash_attention`:
        "triton" runs each branch through the softmax kernels over a slot view of q, k, v (a
        free reshape when S is a multiple of the segment and the segment of the rate) and merges
        the compact results; "eager" is the plain reference (torch_ref.ops.dilated.reference).
      config: for "triton", a `torch_ref.BlockSizes` (the softmax kernels' tiles); "eager" takes none.
        None: the autotune cache's entry for the call if there is one, else the default.

    Returns: out `[B, S, Hq, D]`, or (out, lse) when return_lse.
    """
    scale, lengths, rates = validate_dilated(q, k, v, causal, scale, segment_lengths, dilation_rates, merge)
    order = orderings.resolve(ordering, grid, q.shape[1], q.device)
    call = registry.Call.of(q)
    flags = dict(causal=bool(causal), merge=merge, ordered=order is not None,
                 branches=tuning.branches_flag(lengths, rates))
    entry, config = tuning.select(registry.REGISTRY, "dilated", implementation, config, call,
                                  lambda: autotune_key("dilated", q, k, flags))
    extra = {} if order is None else {"order": order}
    out, lse = entry.fn(q, k, v, segment_lengths=lengths, dilation_rates=rates, causal=causal, merge=merge,
                        scale=scale, config=config, **extra)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# Variable-length batches (cu_seqlens)
# ----------------------------------------------------------------------------------------------
def _torch_varlen_ops(device):
    return types.SimpleNamespace(arange=lambda n: torch.arange(n, device=device), maximum=torch.maximum,
                                 cumsum=lambda x: torch.cumsum(x, 0),
                                 searchsorted_right=lambda a, v: torch.searchsorted(a, v, right=True))


def _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k):
    """The checks of a packed call and its layout (`attn_spec.varlen`) -> (plan, whether q and k
    share their sequence lengths)."""
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
    return plan, same


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal=False, scale=None, window=None,
                           softcap=None, rope=None, dropout_rate=0.0, dropout_seed=None, generator=None,
                           return_lse=False, implementation=None, config=None):
    """`flash_attention` on a packed variable-length batch, FlashAttention's varlen form (the same
    as `jax_attn.flash_attention_varlen`): q `[total_q, Hq, D]`, k, v `[total_k, Hkv, D]`,
    cu_seqlens_q / cu_seqlens_k integer `[N + 1]` (None: as cu_seqlens_q); each sequence bottom-right
    aligned for causal, window and RoPE positions. Segment ids serve it without a copy where the
    packing allows; otherwise the aligned layout of `attn_spec.varlen`. dropout_rate, dropout_seed,
    generator: as `flash_attention`; the mask is that of the rows of the layout the call runs (the
    packed rows, batch 1, or the aligned layout's), as in `jax_attn.flash_attention_varlen`.

    Returns: out `[total_q, Hq, D]`, or (out, lse `[Hq, total_q]`) when return_lse.
    """
    plan, same = _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k)
    dropout = validate_dropout(dropout_rate, dropout_seed, generator)  # a seed to draw is drawn here, once
    seed = None if dropout is None else (dropout[1][0] << 32) | dropout[1][1]
    rows = q.shape[0] + k.shape[0]  # the aligned layout's
    out, lse = varlen.attend(
        plan, q, k, v, aligned=not same and (causal or window is not None), rope=rope is not None,
        scatter=lambda x, slots, fill: torch.full((rows, *x.shape[1:]), fill, dtype=x.dtype,
                                                  device=x.device).index_put((slots,), x),
        call=lambda q, k, v, ids, positions: flash_attention(
            q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, rope=rope, segment_ids=ids,
            positions=positions, dropout_rate=dropout_rate, dropout_seed=seed, return_lse=True,
            implementation=implementation, config=config))
    return (out, lse) if return_lse else out


def stick_breaking_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, scale=None, decay=0.0,
                                    attend_current=False, rope=None, return_remainder=False, implementation=None,
                                    config=None):
    """`stick_breaking_attention` on a packed variable-length batch (fla-org's `cu_seqlens`,
    shawntan's `sb_attn_varlen`; the same as `jax_attn.stick_breaking_attention_varlen`): q
    `[total_q, Hq, D]`, k, v `[total_k, Hkv, D]`, cu_seqlens_q / cu_seqlens_k integer `[N + 1]`
    (None: as cu_seqlens_q). Every sequence attends within itself, its stick restarting; each is
    bottom-right aligned (its query i at key position i + len_k - len_q, for causality, the decay
    distance and RoPE positions: keys 0, 1, ... within their sequence). scale, decay,
    attend_current, rope, implementation, config: as `stick_breaking_attention`. Segment ids over
    the packing serve it without a copy where q and k share their lengths; otherwise the aligned
    layout of `attn_spec.varlen` (its padding has ids no token has: never seen).

    Returns: out `[total_q, Hq, D]`, or (out, rem `[Hq, total_q]`) when return_remainder.
    """
    plan, same = _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k)
    rows = q.shape[0] + k.shape[0]  # the aligned layout's
    out, rem = varlen.attend(
        plan, q, k, v, aligned=not same, rope=rope is not None,
        scatter=lambda x, slots, fill: torch.full((rows, *x.shape[1:]), fill, dtype=x.dtype,
                                                  device=x.device).index_put((slots,), x),
        call=lambda q, k, v, ids, positions: stick_breaking_attention(
            q, k, v, scale=scale, decay=decay, attend_current=attend_current, segment_ids=ids, rope=rope,
            positions=positions, return_remainder=True, implementation=implementation, config=config))
    return (out, rem) if return_remainder else out


# ----------------------------------------------------------------------------------------------
# Native Sparse Attention (attn_spec.nsa)
# ----------------------------------------------------------------------------------------------
def selection_attention(q, k, v, block_indices=None, block_counts=None, *, ranges=None, block_size=64, causal=True,
                        scale=None, segment_ids=None, return_lse=False, implementation=None, config=None):
    """NSA's selection attention: query t attends to the keys of its selected blocks (or ranges).

    Args:
      q: `[B, S, Hq, D]`; k, v: `[B, S, Hkv, D]` (self-attention), Hq % Hkv == 0, any ratio (the
        query heads of a kv head share its selection). dtype float16, bfloat16 or float32
        (float64: eager only).
      block_indices: integer `[B, S, Hkv, n]`: key blocks `[j * block_size, (j + 1) * block_size)`
        of query t, kv head g. Entries that are negative, past the sequence, beyond the causal
        frontier (j > t // block_size when causal), at slots >= `block_counts`, or repeated are
        ignored: a key counts once.
      block_counts: integer `[B, S, Hkv]` or None: only the first block_counts slots count.
      ranges: integer `[B, S, Hkv, R, 2]`, instead of block_indices: R `[start, end)` key ranges
        per row, their union (start > end is an error; empty ranges are ignored).
      block_size: a power of two (block_indices only).
      causal: keys at positions <= t only.
      scale: default D ** -0.5.
      segment_ids: integer `[B, S]`: keys only within the query's id (packed sequences).
      return_lse: also return lse `[B, Hq, S]` float32 (-inf where nothing is visible; out 0 there).
      implementation: None, "triton" or "eager" (the rule of `flash_attention`).
      config: for "triton", a `torch_ref.NSABlockSizes`; None: the default.

    Returns: out `[B, S, Hq, D]`, or (out, lse). Differentiable in q, k, v (and through lse).
    """
    scale, block_size = validate_nsa_selection(q, k, v, block_indices, block_counts, ranges, block_size, causal, scale,
                                               segment_ids)
    call = registry.Call.of(q)
    entry = registry.resolve("nsa", implementation, call)
    config = registry.check_config(entry, config, call)
    S = q.shape[1]
    if ranges is not None:  # the implementation takes them as they are (or in their canonical form)
        out, lse = entry.fn("selection_ranges", q, k, v, ranges, causal=causal, scale=scale, segment_ids=segment_ids,
                            config=config)
        return (out, lse) if return_lse else out
    with torch.no_grad():  # the canonical form: disjoint ranges, causality folded in
        blocks = nsa_ref.canonical_blocks(block_indices, block_counts, block_size, causal, S)
        spans = nsa_ref.blocks_to_ranges(blocks, block_size, causal, S)
    out, lse = entry.fn("selection", q, k, v, spans, scale=scale, segment_ids=segment_ids, block_size=block_size,
                        config=config)
    return (out, lse) if return_lse else out


def compress_kv(k, v, *, block=32, stride=16, params=None):
    """NSA's compression of keys and values: k, v `[B, S, Hkv, D]` -> (k_cmp, v_cmp) `[B, Nc, Hkv, D]`,
    block i covering keys `[i * stride, i * stride + block)` (complete blocks only:
    `attn_spec.nsa.compressed_count`). params None: mean pooling; or a pair
    (`attn_spec.nsa.CompressParams` for k, for v) of torch tensors: the MLP with an intra-block
    position embedding, `gelu((x + pos).reshape(block * D) @ w1 + b1) @ w2 + b2` (exact erf GELU),
    computed in k's dtype. Plain torch ops (one unfold and matmuls), differentiable in k, v and params.
    """
    block, stride = validate_nsa_compress(k, v, block, stride, params)
    return nsa_ref.compress_kv(k, v, block=block, stride=stride, params=params)


def compression_attention(q, k_cmp, v_cmp, *, block=32, stride=16, scale=None, segment_ids=None, return_lse=False,
                          implementation=None):
    """NSA's compression branch: attention of q `[B, S, Hq, D]` over the compressed keys and values
    `[B, Nc, Hkv, D]` (`compress_kv`), block-causal: query t sees block i iff
    `compressed_end(i) = i * stride + block - 1 <= t`; with segment_ids `[B, S]`, iff moreover every
    key of the block is in t's segment. Rows that see no block: out 0, lse -inf.

    implementation: None, "triton" (the softmax kernels on a folded layout: the `stride` queries
    that see the same blocks become rows of one causal attention) or "eager".
    Returns out `[B, S, Hq, D]`, or (out, lse `[B, Hq, S]` float32). Differentiable.
    """
    scale, block, stride = validate_nsa_compression(q, k_cmp, v_cmp, block, stride, scale, segment_ids)
    entry = registry.resolve("nsa", implementation, registry.Call.of(q))
    out, lse = entry.fn("compression", q, k_cmp, v_cmp, block=block, stride=stride, scale=scale,
                        segment_ids=segment_ids)
    return (out, lse) if return_lse else out


def select_blocks(q, k_cmp, lse_cmp, *, block=32, stride=16, select_block=64, num_selected=16, scale=None,
                  implementation=None):
    """NSA's top-n block selection -> int32 `[B, S, Hkv, num_selected]`.

    Importance of selection block j for query t and kv head g: the compression probabilities
    `exp(scale q.k_cmp - lse_cmp)` of the group's heads (lse_cmp `[B, Hq, S]` from
    `compression_attention(..., return_lse=True)`) summed through `attn_spec.nsa.overlap_matrix`.
    Rule (`attn_spec.nsa`): blocks beyond t's frontier are out; block 0 and the blocks t // select_block
    - 1 and t // select_block are always in; the rest by importance, larger first, ties to the lower
    index; the result ascending, -1 for slots no block fills. Not differentiated.
    """
    scale, cfg = validate_nsa_select(q, k_cmp, lse_cmp, block, stride, select_block, num_selected, scale)
    entry = registry.resolve("nsa", implementation, registry.Call.of(q))
    return entry.fn("select_blocks", q.detach(), k_cmp.detach(), lse_cmp.detach(), block=cfg.compress_block,
                    stride=cfg.compress_stride, select_block=cfg.select_block, num_selected=cfg.num_selected,
                    scale=scale)


def nsa_attention(q, k, v, gates, *, compress_block=32, compress_stride=16, select_block=64, num_selected=16,
                  window=512, compress_params=None, scale=None, segment_ids=None, implementation=None):
    """Native Sparse Attention (Yuan et al. 2025; `attn_spec.nsa`): per query token
    `o = g[..., 0] * o_cmp + g[..., 1] * o_slc + g[..., 2] * o_win`.

    q `[B, S, Hq, D]`, k, v `[B, S, Hkv, D]`, gates `[B, S, Hq, 3]` (compression, selection, window;
    e.g. sigmoids of a projection). o_cmp: `compression_attention` over `compress_kv(k, v,
    params=compress_params)`; o_slc: `selection_attention` over the blocks of `select_blocks` (from
    the compression branch's probabilities; with segment_ids those of the segment-masked branch);
    o_win: causal sliding-window attention over the last `window` keys (`flash_attention`, window
    (window - 1, 0)); window 0 turns it off. The branches combine in float32; out in q's dtype.
    Gradients reach q, k, v, gates and compress_params (the selection itself is not differentiated).
    implementation: None, "triton" or "eager", for every branch.
    """
    scale, cfg = validate_nsa(q, k, v, gates, compress_block, compress_stride, select_block, num_selected, window,
                              compress_params, scale, segment_ids)
    call = registry.Call.of(q)
    entry = registry.resolve("nsa", implementation, call)
    S = q.shape[1]
    k_cmp, v_cmp = nsa_ref.compress_kv(k, v, block=cfg.compress_block, stride=cfg.compress_stride,
                                       params=compress_params)
    o_cmp, lse_cmp = entry.fn("compression", q, k_cmp, v_cmp, block=cfg.compress_block, stride=cfg.compress_stride,
                              scale=scale, segment_ids=segment_ids)
    blocks = entry.fn("select_blocks", q.detach(), k_cmp.detach(), lse_cmp.detach(), block=cfg.compress_block,
                      stride=cfg.compress_stride, select_block=cfg.select_block, num_selected=cfg.num_selected,
                      scale=scale, segment_ids=segment_ids)
    spans = nsa_ref.blocks_to_ranges(blocks, cfg.select_block, True, S)
    o_slc, _ = entry.fn("selection", q, k, v, spans, scale=scale, segment_ids=segment_ids,
                        block_size=cfg.select_block, config=registry.check_config(entry, None, call))
    o_win = None
    if cfg.window > 0:
        o_win = flash_attention(q, k, v, causal=True, window=(cfg.window - 1, 0), scale=scale, segment_ids=segment_ids,
                                implementation=entry.name)
    return entry.fn("combine", gates, o_cmp, o_slc, o_win)
