"""Dilated attention (LongNet, arXiv 2307.02486) for PyTorch: the plain (eager) reference.

Branch k cuts the sequence into segments of w_k and keeps rows `offset + m * r_k` of each; the kept
rows of a segment attend densely among themselves (causal inside the dilated segment if asked).
`merge="lse"`: every head in every branch with offset h mod r_k, merged by the branches' lse (Eq. 10);
`merge="head_groups"`: head group k runs branch k alone with offset k mod r_k (docs/design/dilated.md;
the same as `jax_attn.ops.dilated.reference.dilated_reference`).

Each branch is the slot view of `attn_spec.dilation` made explicit: pad, reshape, gather every head's
slot, run the softmax reference over the virtual batch (padding masked by segment ids), and scatter
the compact rows back by a one-hot over the slot axis. Float64 for float64 inputs (the golden);
gradients by autograd.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from attn_spec.dilation import Branch, RowMap, branches, check_config, head_plan

from ..softmax import reference as softmax_ref

__all__ = ["attention"]


def _slot_view(x, branch: Branch):
    """[B, S, Hx, D] -> [B, n, L, r * Hx, D]: zero-padded to n segments of `rows * rate`, then
    row m of head slot `o * Hx + h` is row `seg * w + m * r + o` of head h."""
    B, S, Hx, D = x.shape
    n, w = branch.num_segments, branch.segment
    x = F.pad(x, (0, 0, 0, 0, 0, n * w - S)).reshape(B, n, w, Hx, D)
    x = F.pad(x, (0, 0, 0, 0, 0, branch.padded_segment - w))
    return x.reshape(B, n, branch.rows, branch.rate * Hx, D)


def _branch(q, k, v, branch: Branch, plan: RowMap, num_heads: int, causal: bool, scale: float, positions=None):
    """The `num_heads` heads that `plan` maps (global heads plan.head_base + h), through one branch
    -> (out [B, S, num_heads, D] in q.dtype, lse [B, num_heads, S]): rows the branch does not keep
    give out 0, lse -inf. positions: `[S]`, the rows' positions for causality (an ordered
    sequence's original ones), None: the row indices."""
    B, S, _, D = q.shape
    n, rows, r = branch.num_segments, branch.rows, branch.rate
    device = q.device
    heads = range(num_heads)
    offsets = np.array([plan.offset_of(h) for h in heads])
    q_slots = torch.tensor([plan.q_slot(h) for h in heads], device=device)
    kv_slots = torch.tensor([plan.kv_slot(h) for h in heads], device=device)  # per query head: GQA resolved here

    # Gather every head's kept rows, the heads folded into the batch: [B * n * heads, rows, 1, D].
    def gather(x, slots):
        x = _slot_view(x, branch).index_select(3, slots)  # [B, n, rows, heads, D]
        return x.permute(0, 1, 3, 2, 4).reshape(B * n * num_heads, rows, 1, D)

    # Padded rows are a suffix of each virtual sequence: id 1, never visible to the real rows (id 0).
    kept = branch.kept_rows()[:, offsets]  # [n, heads]
    ids = (np.arange(rows)[None, None, :] >= kept[:, :, None]).astype(np.int64)
    ids = torch.tensor(np.broadcast_to(ids[None], (B, n, num_heads, rows))).reshape(-1, rows)
    ids = ids.to(device)
    if positions is None:
        o, lse = softmax_ref.attention(gather(q, q_slots), gather(k, kv_slots), gather(v, kv_slots),
                                       causal=causal, scale=scale, q_ids=ids, kv_ids=ids)
    else:  # each virtual sequence's rows' positions, as the rows are gathered
        pos = positions.to(device)[None, :, None, None].expand(B, S, 1, 1).to(torch.float64)
        pos = _slot_view(pos, branch)[:, :, :, torch.from_numpy(offsets).to(device)]  # [B, n, rows, heads, 1]
        pos = pos.permute(0, 1, 3, 2, 4).reshape(B * n * num_heads, rows).to(torch.int64)
        o, lse = softmax_ref.attention(gather(q, q_slots), gather(k, kv_slots), gather(v, kv_slots),
                                       causal=causal, scale=scale, q_ids=ids, kv_ids=ids, orig=pos)

    # Back to the original rows: kept row m of head h sits at slot offset(h) of padded row m * r.
    own = torch.from_numpy(np.arange(r)[:, None] == offsets[None, :]).to(device)  # [r, heads]
    o = o.reshape(B, n, num_heads, rows, D).permute(0, 1, 3, 2, 4)[:, :, :, None]
    o = torch.where(own[:, :, None], o, torch.zeros((), dtype=o.dtype, device=device))  # [B, n, rows, r, heads, D]
    lse = lse.reshape(B, n, num_heads, rows).permute(0, 1, 3, 2)[:, :, :, None]
    lse = torch.where(own, lse, torch.full((), float("-inf"), dtype=lse.dtype, device=device))

    def unview(x):  # [B, n, rows, r, heads, ...] -> [B, S, heads, ...]
        x = x.reshape(B, n, rows * r, *x.shape[4:])[:, :, :branch.segment]
        return x.reshape(B, n * branch.segment, *x.shape[3:])[:, :S]

    return unview(o), unview(lse).transpose(1, 2)


def _merge_lse(outs, lses):
    """LongNet Eq. 10: lse = logsumexp_k lse_k, out = sum_k exp(lse_k - lse) o_k, in the lse dtype.
    Rows no branch keeps: out 0, lse -inf, zero (never NaN) gradients."""
    lse_k = torch.stack(lses)  # [K, B, H, S]
    zero = torch.zeros((), dtype=lse_k.dtype, device=lse_k.device)
    top = lse_k.amax(0).detach()
    top = torch.where(torch.isfinite(top), top, zero)
    total = torch.exp(lse_k - top).sum(0)
    kept = total > 0
    lse = torch.where(kept, top + torch.log(torch.where(kept, total, torch.ones_like(total))),
                      torch.full((), float("-inf"), dtype=total.dtype, device=total.device))
    lse_safe = torch.where(kept, lse, zero)
    weights = torch.exp(lse_k - lse_safe).transpose(2, 3)[..., None]  # [K, B, S, H, 1]
    out = (weights * torch.stack(outs).to(weights.dtype)).sum(0)
    return out, lse


def attention(q, k, v, *, segment_lengths, dilation_rates, causal: bool, merge: str, scale: float, positions=None):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] (query head h reads kv head h // (Hq / Hkv)) ->
    (out [B, S, Hq, D] in q.dtype, lse [B, Hq, S]; float32 for 16-bit inputs, float64 for float64).

    Eager PyTorch through the softmax reference (scores materialised per branch and segment).
    Differentiable by autograd."""
    B, S, Hq, D = q.shape
    if k.shape[1] != S or v.shape[1] != S:
        raise ValueError(f"dilated attention needs Sq == Sk, got {tuple(q.shape)=}, {tuple(k.shape)=}, "
                         f"{tuple(v.shape)=}")
    if Hq % k.shape[2]:
        raise ValueError(f"number of heads in k/v ({k.shape[2]}) must divide heads in q ({Hq})")
    lengths, rates = check_config(segment_lengths, dilation_rates, merge, Hq)
    Hkv = k.shape[2]
    parts = branches(lengths, rates, S)
    if merge == "lse":
        results = [_branch(q, k, v, b, head_plan(merge, Hq, len(parts), i, b.rate, Hkv), Hq, causal, scale, positions)
                   for i, b in enumerate(parts)]
        out, lse = _merge_lse([o for o, _ in results], [l for _, l in results])
        return out.to(q.dtype), lse
    # head_groups: group i (heads i * size .. (i + 1) * size - 1) runs branch i alone.
    size = Hq // len(parts)
    results = [_branch(q, k, v, b, head_plan(merge, Hq, len(parts), i, b.rate, Hkv), size, causal, scale, positions)
               for i, b in enumerate(parts)]
    return torch.cat([o for o, _ in results], dim=2), torch.cat([l for _, l in results], dim=1)
