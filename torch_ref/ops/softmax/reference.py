"""Plain PyTorch attention: materialised scores, masks and softmax, differentiable by autograd.

This is the golden reference (run it in float64) and the `implementation="eager"` path. It
computes the matmuls in the input dtype (that is what "naive" means in the tolerance rule) and
the softmax statistics in float32 (float64 for float64 inputs, so the golden stays float64); the
log-sum-exp it returns has that statistics dtype. With RoPE, q and k are rotated first
(`torch_ref.ops.common.rope.apply_rope`: angles in float32, float64 for float64 inputs), then attended.
With dropout, the probabilities (in the statistics dtype) are dropped by the mask of
`attn_spec.dropout` and the rest scaled by 1 / (1 - rate), before the PV product; the lse stays the
softmax's.
"""
from __future__ import annotations

import torch

from attn_spec import dropout as plan
from ..common import dropout as drop
from ..common.rope import apply_rope


def visibility(Sq: int, Sk: int, *, causal: bool, window, q_ids, kv_ids, device, orig=None) -> torch.Tensor:
    """Boolean mask `[B or 1, Sq, Sk]`: query i sees key j. orig: the rows' original positions
    `[S]` or `[B, S]` when they are an ordered sequence's (Sq == Sk): causality compares those."""
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Sk, device=device)[None, :]
    vis = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if causal and orig is None:
        vis = vis & (j <= i)
    if window is not None:
        left, right = window
        vis = vis & (j >= i - left) & (j <= i + right)
    vis = vis[None]
    if causal and orig is not None:
        orig = orig.reshape(-1, Sq)
        vis = vis & (orig[:, None, :] <= orig[:, :, None])
    if q_ids is not None:
        vis = vis & (q_ids[:, :, None] == kv_ids[:, None, :])
    return vis


def attention(q, k, v, *, causal: bool, scale: float, q_ids=None, kv_ids=None, window=None, softcap=None,
              rope=None, q_pos=None, kv_pos=None, alibi=None, dropout=None, orig=None):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, Hq, D] in q.dtype, lse [B, Hq, Sq]).

    Inputs are assumed validated (see torch_ref.ops.common.validation). Rows with no visible key give out 0 and
    lse -inf, with zero (never NaN) gradients. rope: a `Rope` (then q_pos [B, Sq] and kv_pos
    [B, Sk] are the integer positions of q and k) or None. alibi: (slopes [Hq], offset) or None:
    scores get -slope_h |i + offset - j|. dropout: (rate, (s0, s1)) (the seed words of
    `attn_spec.dropout`) or None. orig: `[S]` (Sq == Sk), the rows' original positions in an
    ordered sequence (or `[B, S]`), for causality and the ALiBi distance.
    """
    if rope is not None:
        q = apply_rope(q, q_pos, rope)
        k = apply_rope(k, kv_pos, rope)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32

    vis = visibility(Sq, Sk, causal=causal, window=window, q_ids=q_ids, kv_ids=kv_ids, device=q.device, orig=orig)
    vis = vis.expand(B, Sq, Sk)
    # Zero keys/values no query can see, and queries that see nothing: whatever they hold
    # (NaN, inf, garbage padding) would otherwise reach other rows through 0 * x in the matmuls.
    key_seen = vis.any(1)[:, :, None, None]  # [B, Sk, 1, 1]
    row_sees = vis.any(2)[:, :, None, None]  # [B, Sq, 1, 1]
    q = torch.where(row_sees, q, torch.zeros((), dtype=q.dtype, device=q.device))
    k = torch.where(key_seen, k, torch.zeros((), dtype=k.dtype, device=k.device))
    v = torch.where(key_seen, v, torch.zeros((), dtype=v.dtype, device=v.device))
    if group > 1:  # query head h reads kv head h // group
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)

    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # [B, Hq, Sq, Sk]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis[:, None], float("-inf"))

    # Softmax statistics in float32 (float64 for float64): scores are rounded to the input dtype,
    # then max, exp and sum run in `stat`; p is rounded back to the input dtype for the PV product.
    # Safe shift: rows with no visible key have max -inf; shift them by 0 so exp gives 0
    # everywhere and l = 0 (no -inf - -inf = NaN, forward or backward).
    s = s.to(stat)
    if alibi is not None:
        slopes, offset = alibi
        if orig is not None:  # the tokens' original distance, [B or 1, 1, S, S]
            o = orig.reshape(-1, Sq).to(q.device)
            distance = o[:, None, :, None] - o[:, None, None, :]
        else:
            distance = torch.arange(Sq, device=q.device)[:, None] + offset - torch.arange(Sk, device=q.device)[None, :]
        s = s - slopes.to(stat)[None, :, None, None] * distance.abs().to(stat)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=stat, device=m.device))
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    empty = l == 0
    l_safe = torch.where(empty, torch.ones((), dtype=stat, device=l.device), l)
    p = e / l_safe
    if dropout is not None:  # after the softmax (its l and lse unchanged), before PV
        rate, seed = dropout
        keep = drop.keep_mask(seed, B, Hq, Sq, Sk, rate, device=q.device)
        if orig is not None:  # the ordered rows' tokens' pairs: the mask of the unordered call
            tokens = orig.reshape(-1).to(torch.int64)
            keep = keep.index_select(2, tokens).index_select(3, tokens)
        p = torch.where(keep, p * plan.scale(rate), torch.zeros((), dtype=stat, device=p.device))
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype), v)

    lse = torch.where(empty, torch.full((), float("-inf"), dtype=stat, device=l.device), m + torch.log(l_safe))
    return out, lse.squeeze(-1)
