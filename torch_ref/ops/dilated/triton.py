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

The glue moves each branch's rows through views (`_pieces`: per offset, `as_strided` views of the
full tensors at the rows it keeps, beside slices of the compact ones): nothing is broadcast over
the slot axis, and the statistics (1/D of a full tensor) stay compact or [B, H, S]. Its traffic
in full-size passes (one = B*S*H*D elements of fp32 read or written; bf16 counts half), with
c = sum_k 1 / r_k the compact branch results together (1.75 for rates 1, 2, 4), merge "lse":
  forward   the first branch at rate 1 without padding, scaled in place, is the fp32 accumulator
            (2; else zeros, 1); every other branch adds w_k o_k at its rows (3 / r_k, one fused
            addcmul); the cast to q.dtype (1.5 for bf16, none for fp32)
            -> 2 + 3 (c - 1) + 1.5 = 5.75 for bf16 at rates 1, 2, 4 (was 24: each branch's out
            and statistics one-hot broadcast to full fp32 rows, scaled, added)
  backward  delta = rowsum(dO * O) once (dO upcast 1.5, times O in place 2.5, the sum 1); for each
            of dq, dk, dv the first branch at rate 1 without padding is the fp32 accumulator as
            the engine wrote it (0; else zeros, 1), every other branch adds its rows (3 / r_k),
            the cast (1.5) -> 5 + 3 (3 (c - 1) + 1.5) = 16.25 for bf16 (was 56: three one-hot
            expansions and an index_add_ per branch, fp32 upcasts and product for delta)
Measured with the kernels stubbed (1x4096x16x64, D = 64 so statistics weigh twice their share
at D = 128): forward 24.4 -> 7.0 passes, forward + backward 80.4 -> 23.4 (bf16).

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
    q_pieces: tuple  # `_pieces` of out / dq / statistics (compact query heads -> query heads)
    kv_pieces: tuple  # `_pieces` of dk / dv (compact dk heads -> kv heads)


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
        plans.append(_BranchPlan(br, rm, heads, q_heads, q_offsets, per_qhead, kv_heads, kv_offsets,
                                 _pieces(br, q_heads, q_offsets), _pieces(br, kv_heads, kv_offsets)))
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
# The slot view, and a branch's rows as views of the full tensors
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


class _Heads(tuple):
    """An arithmetic run of heads (start, step, count): a strided slice of the head axis."""


def _arith(x: np.ndarray):
    """x as `_Heads` if it is an increasing arithmetic run (or one head), else a tuple of ints."""
    steps = set(np.diff(x).tolist())
    if len(x) == 1 or (len(steps) == 1 and min(steps) > 0):
        return _Heads((int(x[0]), int(x[1] - x[0]) if len(x) > 1 else 1, len(x)))
    return tuple(x.tolist())


def _head_list(heads) -> tuple:
    if isinstance(heads, _Heads):
        start, step, count = heads
        return tuple(range(start, start + step * count, step))
    return heads


def _pieces(br: Branch, targets: np.ndarray, offsets: np.ndarray) -> tuple:
    """((run, J, T), ...): every piece of a branch's compact result and where it lands.

    run = (offset, first segment, segments, kept rows): for each offset, the segments that keep the
    same number of rows (all but a partial last segment keep as many). J: the compact heads at that
    offset, T: the full heads they land on (`targets`), in rounds of distinct targets (GQA: query
    heads of one group that share an offset add into one kv head), each `_Heads` when arithmetic."""
    kept = br.kept_rows()
    pieces = []
    for o in sorted(set(offsets.tolist())):
        js = np.flatnonzero(offsets == o)
        ts = targets[js]
        nth = np.array([np.count_nonzero(ts[:i] == t) for i, t in enumerate(ts)])  # round of each head
        rounds = [(js[nth == i], ts[nth == i]) for i in range(int(nth.max()) + 1)]
        seg = 0
        while seg < br.num_segments:
            end = seg + 1
            while end < br.num_segments and kept[end, o] == kept[seg, o]:
                end += 1
            if kept[seg, o]:
                run = (o, seg, end - seg, int(kept[seg, o]))
                pieces += [(run, _arith(J), _arith(T)) for J, T in rounds]
            seg = end
    return tuple(pieces)


def _full_view(x: torch.Tensor, br: Branch, run, heads, row_dim: int = 1, head_dim: int = 2) -> torch.Tensor:
    """The rows of a piece in a full tensor, as a view: x [B, S, n, D] -> [B, segments, kept,
    count, D]; statistics (3-D, rows and heads at row_dim, head_dim) -> [B, segments, count, kept].
    heads: `_Heads`."""
    o, seg0, segs, kept = run
    start, step, count = heads
    sr, sh = x.stride(row_dim), x.stride(head_dim)
    base = x.storage_offset() + (seg0 * br.segment + o) * sr + start * sh
    if x.dim() == 4:
        size = (x.shape[0], segs, kept, count, x.shape[3])
        stride = (x.stride(0), br.segment * sr, br.rate * sr, step * sh, x.stride(3))
    else:
        size = (x.shape[0], segs, count, kept)
        stride = (x.stride(0), br.segment * sr, step * sh, br.rate * sr)
    return x.as_strided(size, stride, base)


def _compact_view(c: torch.Tensor, br: Branch, run, heads, batch: int) -> torch.Tensor:
    """The same piece of a compact tensor, as a view: [B', rows, n, D] -> [B, segments, kept,
    count, D]; statistics [B', n, rows] -> [B, segments, count, kept]."""
    _, seg0, segs, kept = run
    start, step, count = heads
    hs = slice(start, start + (count - 1) * step + 1, step)
    if c.dim() == 4:
        return c.view(batch, br.num_segments, br.rows, *c.shape[2:])[:, seg0:seg0 + segs, :kept, hs]
    return c.view(batch, br.num_segments, c.shape[1], br.rows)[:, seg0:seg0 + segs, hs, :kept]


def _add_rows(acc: torch.Tensor, c: torch.Tensor, br: Branch, pieces, batch: int) -> None:
    """acc [B, S, n, D] += compact c [B', rows, nc, D] at the pieces' rows and heads, in place."""
    for run, J, T in pieces:
        if isinstance(J, _Heads) and isinstance(T, _Heads):
            _full_view(acc, br, run, T).add_(_compact_view(c, br, run, J, batch))
        else:  # heads in no arithmetic run: gathered, then added at their (distinct) targets
            src = _compact_view(c, br, run, _Heads((0, 1, c.shape[2])), batch)
            src = src.index_select(3, _index(_head_list(J), c.device))
            _full_view(acc, br, run, _Heads((0, 1, acc.shape[2]))).index_add_(3, _index(_head_list(T), c.device), src)


def _covers_all(p: _BranchPlan, kv: bool) -> bool:
    """Whether the branch's compact result is the full tensor already ([B * n, w, heads, D] is
    [B, S, heads, D]): rate 1, no padding, every head in order (dk / dv: every kv head)."""
    if p.branch.rate != 1 or p.branch.padded or (kv and p.per_qhead):
        return False
    heads, total = (p.kv_heads, p.row_map.kv_heads) if kv else (p.q_heads, p.row_map.heads)
    return np.array_equal(heads, np.arange(total))


# ----------------------------------------------------------------------------------------------
# Forward and backward
# ----------------------------------------------------------------------------------------------
def _branch_inputs(plan: _BranchPlan, q, k, v):
    br = plan.branch
    ids = _segment_ids(br, q.shape[0], q.device) if br.padded else None
    return _slot_view(q, br), _slot_view(k, br), _slot_view(v, br), ids


def _compact_stat(like: torch.Tensor, br: Branch, fill: float) -> torch.Tensor:
    """A compact statistic shaped like `like` [B', heads, rows], for the pieces to fill; the padded
    rows (which no piece covers) hold `fill`."""
    return torch.full_like(like, fill) if br.padded else torch.empty_like(like)


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
    if merge == "head_groups":  # each head has one branch: its rows copied, zeros (lse -inf) elsewhere
        out = torch.zeros((B, S, H, D), dtype=q.dtype, device=dev)
        lse_full = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=dev)
        for p, (o, lse, _, _) in zip(plans, results):
            for run, J, T in p.q_pieces:
                _full_view(out, p.branch, run, T).copy_(_compact_view(o, p.branch, run, J, B))
                _full_view(lse_full, p.branch, run, T, 2, 1).copy_(_compact_view(lse, p.branch, run, J, B))
        return out, lse_full, [(m2, inv_l) for (_, _, m2, inv_l) in results]
    # LSE merge in base 2 per original row: M = max_k m2_k, L = sum_k a_k l_k with a_k = 2^(m2_k - M)
    # over the branches keeping the row; out = sum_k (a_k l_k / L) o_k. M and L are full [B, H, S];
    # a_k, l_k stay compact; each branch reads / writes the full rows it keeps through views.
    M = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=dev)
    compact = []
    for p, (o, lse, m2, inv_l) in zip(plans, results):
        kept = inv_l > 0
        m2k = torch.where(kept, m2, float("-inf"))
        l = torch.where(kept, 1.0 / inv_l, 0.0)
        for run, J, T in p.q_pieces:
            Mv = _full_view(M, p.branch, run, T, 2, 1)
            torch.maximum(Mv, _compact_view(m2k, p.branch, run, J, B), out=Mv)
        compact.append((m2k, l))
    M.masked_fill_(M == float("-inf"), 0.0)  # rows kept by none: M = 0, L = 0
    L = torch.zeros_like(M)
    scales = []
    for p, (m2k, l) in zip(plans, compact):
        a = _compact_stat(m2k, p.branch, float("-inf"))
        for run, J, T in p.q_pieces:
            av = _compact_view(a, p.branch, run, J, B)
            torch.sub(_compact_view(m2k, p.branch, run, J, B), _full_view(M, p.branch, run, T, 2, 1), out=av)
        a.exp2_()  # 2^(m2_k - M), 0 where not kept
        for run, J, T in p.q_pieces:
            _full_view(L, p.branch, run, T, 2, 1).add_(_compact_view(a, p.branch, run, J, B) *
                                                          _compact_view(l, p.branch, run, J, B))
        scales.append(a)
    seen = L > 0
    L.masked_fill_(~seen, 1.0)
    acc, stats = None, []
    for i, (p, (o, lse, m2, inv_l), (m2k, l), a) in enumerate(zip(plans, results, compact, scales)):
        br = p.branch
        # the backward's P = 2^(s2 - m2_k) * 2^(m2_k - M) / L: inv_l of the merged softmax, compact
        merged_inv_l = _compact_stat(a, br, 0.0)
        w = l.mul_(a)  # a_k l_k, then / L: the weight of o_k
        for run, J, T in p.q_pieces:
            Lv = _full_view(L, br, run, T, 2, 1)
            torch.div(_compact_view(a, br, run, J, B), Lv, out=_compact_view(merged_inv_l, br, run, J, B))
            wv = _compact_view(w, br, run, J, B)
            torch.div(wv, Lv, out=wv)
        stats.append((m2, merged_inv_l))
        if i == 0 and _covers_all(p, kv=False):  # the first branch's compact out is the full accumulator
            acc = o.mul_(w.transpose(1, 2)[..., None]).view(B, S, H, D)
            continue
        if acc is None:
            acc = torch.zeros((B, S, H, D), dtype=torch.float32, device=dev)
        for run, J, T in p.q_pieces:
            wv = _compact_view(w, br, run, J, B).transpose(2, 3)[..., None]
            _full_view(acc, br, run, T).addcmul_(_compact_view(o, br, run, J, B), wv)
    lse_full = L.log2_().add_(M).mul_(LN2).masked_fill_(~seen, float("-inf"))
    return acc.to(q.dtype), lse_full, stats


def _backward(dout, dlse, q, k, v, out, plans, stats, *, causal, scale, config):
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    dev = q.device
    # delta = rowsum(dO * O) - dlse, once, [B, S, H] fp32 (each branch gathers its rows compact)
    if dout.dtype == torch.float32:
        delta = (dout * out).sum(-1)
    else:
        delta = dout.float().mul_(out).sum(-1)  # one fp32 temporary, the product in place
    if dlse is not None:
        delta.sub_(dlse.float().transpose(1, 2))
    dq = dk = dv = None  # fp32 accumulators
    for i, (p, (m2, inv_l)) in enumerate(zip(plans, stats)):
        br = p.branch
        qv, kv, vv, ids = _branch_inputs(p, q, k, v)
        delta_c = _compact_stat(inv_l, br, 0.0)
        for run, J, T in p.q_pieces:
            _compact_view(delta_c, br, run, J, B).copy_(_full_view(delta, br, run, T))
        dq_c, dk_c, dv_c = engine.backward(_slot_view(dout, br), qv, kv, vv, None, (m2, inv_l), causal=causal,
                                           scale=scale, q_ids=ids, kv_ids=ids, config=config, delta=delta_c,
                                           row_map=p.row_map, grid_heads=p.heads, grad_dtype=torch.float32)
        if i == 0 and _covers_all(p, kv=False):  # the first branch's compact dq is the full accumulator
            dq = dq_c.view(B, S, H, D)
        else:
            if dq is None:
                dq = torch.zeros((B, S, H, D), dtype=torch.float32, device=dev)
            _add_rows(dq, dq_c, br, p.q_pieces, B)
        if i == 0 and _covers_all(p, kv=True):
            dk, dv = dk_c.view(B, S, Hkv, D), dv_c.view(B, S, Hkv, D)
            continue
        if dk is None:
            dk, dv = (torch.zeros((B, S, Hkv, D), dtype=torch.float32, device=dev) for _ in range(2))
        _add_rows(dk, dk_c, br, p.kv_pieces, B)
        _add_rows(dv, dv_c, br, p.kv_pieces, B)
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
        with torch.no_grad():
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
