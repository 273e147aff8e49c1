"""Dilated attention (LongNet) on the softmax engine's row map (docs/design/dilated.md).

Each branch (`attn_spec.dilation.branches`) is dense attention over a slot view
`x.reshape(B * num_segments, rows, rate * H, D)` (a free reshape unless the branch pads): the engine
(`torch_ref.ops.softmax.triton`) reads it through the branch's `RowMap` (`head_plan`) and writes
compact results, out `[B', rows, heads, D]` and statistics `[B', heads, rows]`. Padded branches
mark each virtual sequence's padded suffix with segment ids (real rows 0, padding 1), so real
queries never see padded keys.

Forward, then the merge: `lse` combines the branches' (m2, inv_l) per original row in base 2
(M = max_k m2_k, L = sum_k 2^(m2_k - M) / inv_l_k; out = sum_k w_k o_k with w_k = 2^(m2_k - M) /
(inv_l_k L)); `head_groups` places each group's rows. Backward: the LSE merge is one softmax over
the union of the branches' key sets, so each branch runs the engine's backward kernels with the
merged statistics of its rows: P = 2^(s2 - m2_k) * 2^(m2_k - M) / L (the branch's own m2 keeps
the exponent exact) and delta = rowsum(dO * O_merged) - dlse, all read through the same row map;
the branches' compact dq, dk, dv add up into the full gradients (float32, cast once).

Layout BSHD: q `[B, S, H, D]`, k / v `[B, S, Hkv, D]`; lse `[B, H, S]` float32.
Importing this module imports triton (see `torch_ref.ops.softmax.triton`).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
import torch.nn.functional as F

from attn_spec.dilation import Branch, RowMap, branches, head_plan

from ..softmax import triton as engine
from ..softmax.triton import INTERPRETED, BlockSizes, default_block_sizes

LN2 = 0.6931471805599453

__all__ = ["dilated_attention_triton", "DilatedAttentionFn", "BlockSizes", "default_block_sizes", "INTERPRETED"]


# ----------------------------------------------------------------------------------------------
# Plan: each branch's geometry and row map, once per configuration
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _BranchPlan:
    branch: Branch
    row_map: RowMap
    heads: int  # the grid's (compact) query heads
    q_heads: np.ndarray  # [heads] global query head of each compact head
    q_offsets: np.ndarray  # [heads] its offset (row slot)
    per_qhead: bool  # dk / dv come per query head (else per kv head of the grid)
    kv_heads: np.ndarray  # [compact dk heads] global kv head of each compact dk / dv head
    kv_offsets: np.ndarray  # [compact dk heads] its offset


@functools.lru_cache(maxsize=128)
def _plan(segment_lengths: tuple, dilation_rates: tuple, seq_len: int, merge: str, H: int, Hkv: int):
    plans = []
    group = H // Hkv
    branch_list = branches(segment_lengths, dilation_rates, seq_len)
    for i, br in enumerate(branch_list):
        rm = head_plan(merge, H, len(branch_list), i, br.rate, Hkv)
        heads = H if merge == "lse" else H // len(branch_list)
        local = np.arange(heads)
        q_heads = rm.head_base + local
        q_offsets = np.asarray([rm.offset_of(int(h)) for h in local])
        per_qhead = engine.dkv_per_query_head(rm, heads)
        if per_qhead:
            kv_heads, kv_offsets = q_heads // group, q_offsets
        else:
            first = local[::group]  # each kv grid head's first query head: its offset is the group's
            kv_heads, kv_offsets = q_heads[first] // group, q_offsets[first]
        plans.append(_BranchPlan(br, rm, heads, q_heads, q_offsets, per_qhead, kv_heads, kv_offsets))
    return tuple(plans)


@functools.lru_cache(maxsize=128)
def _segment_ids(branch: Branch, batch: int, device: torch.device) -> torch.Tensor:
    """int32 [B * num_segments * rate, rows]: 0 on the real rows of each virtual sequence, 1 on its
    padded suffix (row b * rate + o is virtual sequence b at offset o)."""
    kept = torch.from_numpy(np.array(branch.kept_rows()))  # [num_segments, rate]
    ids = (torch.arange(branch.rows)[None, None, :] >= kept[:, :, None]).to(torch.int32)
    return ids.expand(batch, *ids.shape).reshape(-1, branch.rows).contiguous().to(device)


@functools.lru_cache(maxsize=256)
def _index(values: tuple, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------------------------
# The slot view and its way back
# ----------------------------------------------------------------------------------------------
def _slot_view(x: torch.Tensor, br: Branch, fill=0.0) -> torch.Tensor:
    """x [B, S, n, ...] -> [B * num_segments, rows, rate * n, ...]: row m of slot o * n + h is row
    seg * segment + m * rate + o of head h; padding (if any) holds `fill`."""
    B, S, n = x.shape[:3]
    tail = x.shape[3:]
    if br.padded:
        lead = (0, 0) * len(tail) + (0, 0)  # F.pad counts from the last dim: tail dims, then n
        x = F.pad(x, lead + (0, br.num_segments * br.segment - S), value=fill)
        x = x.reshape(B, br.num_segments, br.segment, n, *tail)
        if br.padded_segment != br.segment:
            x = F.pad(x, lead + (0, br.padded_segment - br.segment), value=fill)
    return x.reshape(B * br.num_segments, br.rows, br.rate * n, *tail)


def _to_full(c: torch.Tensor, br: Branch, offsets: torch.Tensor, batch: int, fill: float) -> torch.Tensor:
    """Compact c [B', rows, n, ...] (head j at row slot offsets[j]) -> [B, S, n, ...], `fill` at
    the rows a head's offset does not keep."""
    n, tail = c.shape[2], c.shape[3:]
    slot = torch.arange(br.rate, device=c.device)[:, None] == offsets[None, :]  # [rate, n]
    slot = slot.reshape(1, 1, br.rate, n, *([1] * len(tail)))
    x = torch.where(slot, c[:, :, None], torch.full((), fill, dtype=c.dtype, device=c.device))
    x = x.reshape(batch, br.num_segments, br.padded_segment, n, *tail)
    if br.padded:
        x = x[:, :, :br.segment].reshape(batch, br.num_segments * br.segment, n, *tail)[:, :br.seq_len]
    return x.reshape(batch, br.seq_len, n, *tail)


def _to_compact(x: torch.Tensor, br: Branch, offsets: torch.Tensor, fill: float) -> torch.Tensor:
    """x [B, S, n, ...] -> compact [B', rows, n, ...] (head j's rows at offsets[j]); padding reads `fill`."""
    n = x.shape[2]
    view = _slot_view(x, br, fill)
    view = view.reshape(view.shape[0], br.rows, br.rate, n, *x.shape[3:])
    return view[:, :, offsets, torch.arange(n, device=x.device)]


# ----------------------------------------------------------------------------------------------
# Forward and backward
# ----------------------------------------------------------------------------------------------
def _branch_inputs(plan: _BranchPlan, q, k, v):
    br = plan.branch
    ids = _segment_ids(br, q.shape[0], q.device) if br.padded else None
    return _slot_view(q, br), _slot_view(k, br), _slot_view(v, br), ids


def _forward(q, k, v, plans, *, causal, merge, scale, config):
    """-> (out [B, S, H, D] in q.dtype, lse [B, H, S] fp32, per-branch backward stats)."""
    B, S, H, D = q.shape
    dev = q.device
    results = []
    for p in plans:
        qv, kv, vv, ids = _branch_inputs(p, q, k, v)
        o, lse, (m2, inv_l) = engine.forward(qv, kv, vv, causal=causal, scale=scale, q_ids=ids, kv_ids=ids,
                                             config=config, row_map=p.row_map, grid_heads=p.heads,
                                             out_dtype=torch.float32)
        results.append((o, lse, m2, inv_l))
    out = torch.zeros((B, S, H, D), dtype=torch.float32, device=dev)
    if merge == "head_groups":
        lse_full = torch.full((B, S, H), float("-inf"), dtype=torch.float32, device=dev)
        for p, (o, lse, m2, inv_l) in zip(plans, results):
            offs = _index(tuple(p.q_offsets.tolist()), dev)
            heads = slice(int(p.q_heads[0]), int(p.q_heads[-1]) + 1)
            out[:, :, heads] = _to_full(o, p.branch, offs, B, 0.0)
            lse_full[:, :, heads] = _to_full(lse.transpose(1, 2), p.branch, offs, B, float("-inf"))
        stats = [(m2, inv_l) for (_, _, m2, inv_l) in results]
        return out.to(q.dtype), lse_full.transpose(1, 2).contiguous(), stats
    # LSE merge in base 2: M = max_k m2_k, L = sum_k 2^(m2_k - M) l_k over the branches keeping the row
    m2_full, l_full = [], []
    for p, (o, lse, m2, inv_l) in zip(plans, results):
        offs = _index(tuple(p.q_offsets.tolist()), dev)
        kept = inv_l > 0
        m2_full.append(_to_full(torch.where(kept, m2, float("-inf")).transpose(1, 2), p.branch, offs, B,
                                float("-inf")))
        l_full.append(_to_full(torch.where(kept, 1.0 / torch.where(kept, inv_l, 1.0), 0.0).transpose(1, 2),
                               p.branch, offs, B, 0.0))
    M = functools.reduce(torch.maximum, m2_full)
    M_safe = torch.where(M == float("-inf"), 0.0, M)
    scales = [torch.exp2(m - M_safe) for m in m2_full]  # 2^(m2_k - M), 0 where not kept
    L = sum(a * l for a, l in zip(scales, l_full))
    seen = L > 0
    L_safe = torch.where(seen, L, 1.0)
    stats = []
    for p, (o, lse, m2, inv_l), a, l in zip(plans, results, scales, l_full):
        offs = _index(tuple(p.q_offsets.tolist()), dev)
        out += (a * l / L_safe)[..., None] * _to_full(o, p.branch, offs, B, 0.0)
        # the backward's P = 2^(s2 - m2_k) * 2^(m2_k - M) / L: inv_l of the merged softmax
        merged_inv_l = _to_compact(a / L_safe, p.branch, offs, 0.0).transpose(1, 2).contiguous()
        stats.append((m2, merged_inv_l))
    lse_full = torch.where(seen, (M + torch.log2(L_safe)) * LN2, float("-inf"))
    return out.to(q.dtype), lse_full.transpose(1, 2).contiguous(), stats


def _backward(dout, dlse, q, k, v, out, plans, stats, *, causal, scale, config):
    B, S, H, D = q.shape
    dev = q.device
    delta = (dout.float() * out.float()).sum(-1)  # [B, S, H]
    if dlse is not None:
        delta = delta - dlse.float().transpose(1, 2)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=dev)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=dev)
    for p, (m2, inv_l) in zip(plans, stats):
        br = p.branch
        offs = _index(tuple(p.q_offsets.tolist()), dev)
        qv, kv, vv, ids = _branch_inputs(p, q, k, v)
        heads = _index(tuple(p.q_heads.tolist()), dev)
        delta_c = _to_compact(delta[:, :, heads], br, offs, 0.0).transpose(1, 2).contiguous()
        dq_c, dk_c, dv_c = engine.backward(_slot_view(dout, br), qv, kv, vv, None, (m2, inv_l), causal=causal,
                                           scale=scale, q_ids=ids, kv_ids=ids, config=config, delta=delta_c,
                                           row_map=p.row_map, grid_heads=p.heads, grad_dtype=torch.float32)
        dq.index_add_(2, heads, _to_full(dq_c, br, offs, B, 0.0))
        kv_heads = _index(tuple(p.kv_heads.tolist()), dev)
        kv_offs = _index(tuple(p.kv_offsets.tolist()), dev)
        dk.index_add_(2, kv_heads, _to_full(dk_c, br, kv_offs, B, 0.0))
        dv.index_add_(2, kv_heads, _to_full(dv_c, br, kv_offs, B, 0.0))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class DilatedAttentionFn(torch.autograd.Function):
    """Triton forward + backward of dilated attention. Outputs (out, lse); both differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, segment_lengths, dilation_rates, causal, merge, scale, config=None):
        plans = _plan(segment_lengths, dilation_rates, q.shape[1], merge, q.shape[2], k.shape[2])
        out, lse, stats = _forward(q, k, v, plans, causal=causal, merge=merge, scale=scale, config=config)
        ctx.save_for_backward(q, k, v, out, *(t for s in stats for t in s))
        ctx.plans = plans
        ctx.opts = dict(causal=causal, scale=scale, config=config)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, *flat = ctx.saved_tensors
        stats = list(zip(flat[0::2], flat[1::2]))
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(dout, dlse, q, k, v, out, ctx.plans, stats, **ctx.opts)
        return dq, dk, dv, None, None, None, None, None, None


def dilated_attention_triton(q, k, v, *, segment_lengths, dilation_rates, causal: bool, merge: str, scale: float,
                             config: BlockSizes | None = None):
    """q [B, S, H, D], k / v [B, S, Hkv, D] -> (out [B, S, H, D] in q.dtype, lse [B, H, S] fp32).

    Dilated attention over checked arguments (`attn_spec.dilation.check_config`, the q / k / v
    checks of `torch_ref.ops.common.validation`); see `torch_ref.dilated_attention`. Differentiable
    in q, k, v (a cotangent on lse included).
    """
    if q.numel() == 0:  # no rows (or no batch): nothing to attend; gradients are zeros
        B, S, H, _ = q.shape
        return q * 0, torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
    return DilatedAttentionFn.apply(q, k, v, tuple(segment_lengths), tuple(dilation_rates), causal, merge, scale,
                                    config)
