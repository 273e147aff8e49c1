"""Ordered attention, the explicit composite: `unpermute(attn(permute(q), permute(k), permute(v)))`
with causality on the original positions and segment ids per original token (docs/design/orderings.md).

Eager PyTorch around the variants' references: the `"eager"` implementation of ordered calls and
the reference every kernel is tested against (float64 for the golden). It materialises the
permuted copies that the kernels never make."""
from __future__ import annotations

import torch

from ..dilated import reference as dilated_ref
from ..softmax import reference as softmax_ref


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0], dtype=perm.dtype, device=perm.device)
    return inv


def attention(q, k, v, perm, *, q_ids=None, kv_ids=None, **kwargs):
    """`softmax_ref.attention` on the ordered sequence (perm int [S], Sq == Sk): the window on it,
    causality and the ALiBi distance on the original positions perm[t], ids per original token;
    out [B, S, Hq, D] and lse [B, Hq, S] in the original order."""
    perm = perm.to(q.device, torch.int64)
    take = lambda x: x.index_select(1, perm)
    ids = {} if q_ids is None else dict(q_ids=take(q_ids), kv_ids=take(kv_ids))
    out, lse = softmax_ref.attention(take(q), take(k), take(v), orig=perm, **ids, **kwargs)
    inv = _inverse(perm)
    return out.index_select(1, inv), lse.index_select(2, inv)


def dilated_attention(q, k, v, perm, **kwargs):
    """`dilated_ref.attention` with the segments cut from the ordered sequence, causality on the
    original positions perm[t]; out [B, S, H, D] and lse [B, H, S] in the original order."""
    perm = perm.to(q.device, torch.int64)
    take = lambda x: x.index_select(1, perm)
    out, lse = dilated_ref.attention(take(q), take(k), take(v), positions=perm, **kwargs)
    inv = _inverse(perm)
    return out.index_select(1, inv), lse.index_select(2, inv)
