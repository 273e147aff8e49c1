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

The glue is three small kernels over full rows (`_merge_kernel`, `_delta_kernel`,
`_gather_kernel`): a program takes a block of rows of one head and reads each branch's compact
rows that hold them (row s of a branch: virtual sequence b * n + s // w, compact row (s % w) // r,
for the compact heads whose offset is (s % w) % r, from the plan's pair tables), so every full
tensor is read or written once and every compact one once. Traffic in full-size passes (one =
B*S*H*D fp32 elements read or written, bf16 half of one; statistics, 1/D of a pass, left out),
with c = sum_k 1 / r_k (the compact branch results together: 1.75 for rates 1, 2, 4), bf16:
  forward   merge: the compact o_k (fp32) once, out written once         c + 0.5  = 2.25
  backward  delta: dO and O once (written compact per branch)            1
            dq, dk, dv: each branch's compact fp32 gradient once, the
            result written once in the input dtype                       3 (c + 0.5) = 6.75
The branches' compact fp32 gradients live together until the gathers (3c full-size at the peak,
MHA). The kernels are deterministic (no atomics; each output element has one program).

Under an ordering pi (docs/design/orderings.md) the segments are cut from the ordered sequence:
no slot view exists; each branch's kernels gather their rows from q, k, v at pi[seg * w + m * r +
offset] (the engine's ORDERED mode, `_orig`), and the merge kernels take full row s from ordered
position inv[s] of the compact branch results (INV), so the traffic above is unchanged.

Layout BSHD: q `[B, S, H, D]`, k / v `[B, S, Hkv, D]`; lse `[B, H, S]` float32.
Importing this module imports triton (see `torch_ref.ops.softmax.triton`).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from attn_spec.dilation import Branch, RowMap, branches, head_plan

from ..common.triton_tiles import block_d, device_ctx
from ..softmax import triton as engine
from ..softmax.triton import INTERPRETED, BlockSizes, default_block_sizes

LN2 = tl.constexpr(0.6931471805599453)
ROWS_PER_PROGRAM = 32  # the merge kernels' row block (memory bound: any block that fills the warps)

__all__ = ["dilated_attention_triton", "DilatedAttentionFn", "BlockSizes", "default_block_sizes", "INTERPRETED"]


# ----------------------------------------------------------------------------------------------
# Plan: each branch's geometry and row map, once per configuration
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class _BranchPlan:
    branch: Branch
    row_map: RowMap
    heads: int  # the grid's (compact) query heads
    q_heads: np.ndarray  # [heads] global query head of each compact head
    q_offsets: np.ndarray  # [heads] its offset (row slot)
    per_qhead: bool  # dk / dv come per query head (else per kv head of the grid)
    kv_heads: np.ndarray  # [compact dk heads] global kv head of each compact dk / dv head
    kv_offsets: np.ndarray  # [compact dk heads] its offset


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    branches: tuple  # _BranchPlan per branch
    q_pairs: np.ndarray  # int32 [K, H, 1, 2]: (compact head, offset) of query head h in branch k; (0, -1): none
    kv_pairs: np.ndarray  # int32 [K, Hkv, P, 2]: the compact dk / dv heads that add into kv head g, and offsets
    geometry: tuple  # ((segment, rate, num_segments), ...): the merge kernels' constexprs
    q_counts: tuple  # per branch, the most pairs of a query head (0 or 1)
    kv_counts: tuple  # per branch, the most pairs of a kv head


def _pairs(targets: np.ndarray, offsets: np.ndarray, n: int) -> list:
    """[n][...]: (compact head, offset) of the compact heads landing on each of n full heads."""
    pairs = [[] for _ in range(n)]
    for j, (t, o) in enumerate(zip(targets.tolist(), offsets.tolist())):
        pairs[t].append((j, o))
    return pairs


def _pad_pairs(per_branch: list) -> np.ndarray:
    """[K, n, width, 2] int32, padded with (0, -1): offset -1 is no row's slot, so it adds nothing."""
    width = max(1, max(len(x) for pairs in per_branch for x in pairs))
    table = np.tile(np.array([0, -1], np.int32), (len(per_branch), len(per_branch[0]), width, 1))
    for k, pairs in enumerate(per_branch):
        for g, x in enumerate(pairs):
            if x:
                table[k, g, :len(x)] = x
    return table


@functools.lru_cache(maxsize=128)
def _plan(segment_lengths: tuple, dilation_rates: tuple, seq_len: int, merge: str, H: int, Hkv: int) -> _Plan:
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
    q_pairs = _pad_pairs([_pairs(p.q_heads, p.q_offsets, H) for p in plans])
    kv_pairs = _pad_pairs([_pairs(p.kv_heads, p.kv_offsets, Hkv) for p in plans])
    geometry = tuple((p.branch.segment, p.branch.rate, p.branch.num_segments) for p in plans)
    counts = [tuple(int((t[..., 1] >= 0).sum(-1).max()) for t in table) for table in (q_pairs, kv_pairs)]
    return _Plan(tuple(plans), q_pairs, kv_pairs, geometry, *counts)


@functools.lru_cache(maxsize=128)
def _tables(plan: _Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's (q_pairs, kv_pairs) on `device`."""
    return tuple(torch.from_numpy(t).to(device) for t in (plan.q_pairs, plan.kv_pairs))


@functools.lru_cache(maxsize=128)
def _segment_ids(branch: Branch, batch: int, device: torch.device) -> torch.Tensor:
    """int32 [B * num_segments * rate, rows]: 0 on the real rows of each virtual sequence, 1 on its
    padded suffix (row b * rate + o is virtual sequence b at offset o)."""
    kept = torch.from_numpy(np.array(branch.kept_rows()))  # [num_segments, rate]
    ids = (torch.arange(branch.rows)[None, None, :] >= kept[:, :, None]).to(torch.int32)
    return ids.expand(batch, *ids.shape).reshape(-1, branch.rows).contiguous().to(device)


# ----------------------------------------------------------------------------------------------
# The slot view
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


def _compact_stat(like: torch.Tensor, br: Branch) -> torch.Tensor:
    """A compact statistic shaped like `like` [B', heads, rows] for a kernel to fill at the real
    rows; the padded rows, which it does not write, hold 0."""
    return torch.zeros_like(like) if br.padded else torch.empty_like(like)


# ----------------------------------------------------------------------------------------------
# Merge kernels: one program per (block of full rows, head, batch row); each full row is read or
# written once, each branch's compact row once
# ----------------------------------------------------------------------------------------------
@triton.jit
def _locate(PAIRS, i, g, j, WIDTH: tl.constexpr, s, b, s_ok, SEGMENT: tl.constexpr, RATE: tl.constexpr,
            SEGMENTS: tl.constexpr):
    """Where branch i holds full rows s of batch row b for pair j of head g (PAIRS [K, G, WIDTH,
    2], (compact head, offset)): -> (virtual sequence b', compact row m, compact head c, keep), keep
    the rows whose slot (s % SEGMENT) % RATE is the pair's offset."""
    within = s % SEGMENT
    pair = PAIRS + ((i * tl.num_programs(1) + g) * WIDTH + j) * 2
    keep = s_ok & (within % RATE == tl.load(pair + 1))
    return b * SEGMENTS + s // SEGMENT, within // RATE, tl.load(pair), keep


@triton.jit
def _compact_rows(X, STRIDES, bp, m, c, d, keep, d_ok):
    """Rows [b', m] of compact head c of X [B', rows, heads, D] (STRIDES), 0 where not `keep`."""
    return tl.load(X + bp[:, None] * STRIDES[0] + m[:, None] * STRIDES[1] + c * STRIDES[2] + d[None, :] * STRIDES[3],
                   mask=keep[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _branch_stats(M2, INV_L, st, keep):
    """(m2, inv_l, kept) of a branch at compact offsets st: m2 -inf and inv_l 0 where it keeps no
    row or the row sees no key."""
    inv_l = tl.load(INV_L + st, mask=keep, other=0.0)
    kept = inv_l > 0
    m2 = tl.where(kept, tl.load(M2 + st, mask=keep, other=0.0), float("-inf"))
    return m2, inv_l, kept


@triton.jit
def _row_sum(inv_l, kept):
    """l = 1 / inv_l, 0 where the row is not kept (IEEE division, as torch's)."""
    return tl.where(kept, tl.div_rn(1.0, tl.where(kept, inv_l, 1.0)), 0.0)


@triton.jit
def _ordered_rows(INV, s, s_ok, ORDERED: tl.constexpr):
    """The rows of the branches' (ordered) sequence holding full rows s: inv[s] under an ordering."""
    if ORDERED:
        return tl.load(INV + s, mask=s_ok, other=0).to(tl.int64)
    else:
        return s


@triton.jit
def _merge_kernel(OUT, LSE, O, M2, INV_L, BRANCH_LSE, MERGED_INV_L, PAIRS, S, sob, sos, soh, sod, slb, slh, sls,
                  O_STRIDES, STAT_STRIDES, INV, GEOMETRY: tl.constexpr, MERGE_LSE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ORDERED: tl.constexpr):
    """The forward merge of query head h at rows s: O_i [B', rows, heads, D] fp32 and the stats
    [B', heads, rows] of the branches that keep each row (PAIRS [K, H, 1, 2]) -> OUT in its dtype,
    LSE [B, H, S]. MERGE_LSE: M = max_i m2_i, a_i = 2^(m2_i - M), L = sum_i a_i / inv_l_i, out =
    sum_i (a_i / inv_l_i / L) o_i, lse = (M + log2 L) ln 2 (-inf, out 0 where no branch sees a
    key), and MERGED_INV_L_i = a_i / L at the branch's compact rows (its backward's inv_l). Else
    (head groups, one branch per head): out = o_i, lse = BRANCH_LSE_i, 0 / -inf where none.
    ORDERED: the branches hold full row s at ordered position INV[s]."""
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    s = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < S
    d_ok = d < HEAD_DIM
    t = _ordered_rows(INV, s, s_ok, ORDERED)
    acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    if MERGE_LSE:
        M = tl.full((BLOCK_S,), float("-inf"), tl.float32)
        for i in tl.static_range(len(GEOMETRY)):
            bp, m, c, keep = _locate(PAIRS, i, h, 0, 1, t, b, s_ok, GEOMETRY[i][0], GEOMETRY[i][1],
                                     GEOMETRY[i][2])
            st = bp * STAT_STRIDES[i][0] + c * STAT_STRIDES[i][1] + m * STAT_STRIDES[i][2]
            m2, _, _ = _branch_stats(M2[i], INV_L[i], st, keep)
            M = tl.maximum(M, m2)
        M = tl.where(M == float("-inf"), 0.0, M)  # rows kept by none: M = 0, L = 0
        L = tl.zeros((BLOCK_S,), dtype=tl.float32)
        for i in tl.static_range(len(GEOMETRY)):
            bp, m, c, keep = _locate(PAIRS, i, h, 0, 1, t, b, s_ok, GEOMETRY[i][0], GEOMETRY[i][1],
                                     GEOMETRY[i][2])
            st = bp * STAT_STRIDES[i][0] + c * STAT_STRIDES[i][1] + m * STAT_STRIDES[i][2]
            m2, inv_l, kept = _branch_stats(M2[i], INV_L[i], st, keep)
            L += tl.exp2(m2 - M) * _row_sum(inv_l, kept)
        seen = L > 0
        L = tl.where(seen, L, 1.0)
        for i in tl.static_range(len(GEOMETRY)):
            bp, m, c, keep = _locate(PAIRS, i, h, 0, 1, t, b, s_ok, GEOMETRY[i][0], GEOMETRY[i][1],
                                     GEOMETRY[i][2])
            st = bp * STAT_STRIDES[i][0] + c * STAT_STRIDES[i][1] + m * STAT_STRIDES[i][2]
            m2, inv_l, kept = _branch_stats(M2[i], INV_L[i], st, keep)
            a = tl.exp2(m2 - M)
            tl.store(MERGED_INV_L[i] + st, tl.div_rn(a, L), mask=keep)
            w = tl.div_rn(a * _row_sum(inv_l, kept), L)
            acc += _compact_rows(O[i], O_STRIDES[i], bp, m, c, d, keep, d_ok) * w[:, None]
        lse = tl.where(seen, (M + tl.log2(L)) * LN2, float("-inf"))
    else:
        lse = tl.full((BLOCK_S,), float("-inf"), tl.float32)
        for i in tl.static_range(len(GEOMETRY)):
            bp, m, c, keep = _locate(PAIRS, i, h, 0, 1, t, b, s_ok, GEOMETRY[i][0], GEOMETRY[i][1],
                                     GEOMETRY[i][2])
            st = bp * STAT_STRIDES[i][0] + c * STAT_STRIDES[i][1] + m * STAT_STRIDES[i][2]
            lse = tl.maximum(lse, tl.load(BRANCH_LSE[i] + st, mask=keep, other=float("-inf")))
            acc += _compact_rows(O[i], O_STRIDES[i], bp, m, c, d, keep, d_ok)
    tl.store(OUT + b * sob + s[:, None] * sos + h * soh + d[None, :] * sod, acc.to(OUT.dtype.element_ty),
             mask=s_ok[:, None] & d_ok[None, :])
    tl.store(LSE + b * slb + h * slh + s * sls, lse, mask=s_ok)


@triton.jit
def _gather_kernel(OUT, SRC, PAIRS, S, sob, sos, soh, sod, SRC_STRIDES, INV, GEOMETRY: tl.constexpr,
                   NUM_PAIRS: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr, ORDERED: tl.constexpr):
    """OUT[b, s, g] = the sum over branches i and the pairs (c, o) of head g (PAIRS [K, G, WIDTH,
    2]) whose offset o is row s's slot of SRC_i[b', m, c] (fp32), stored once in OUT's dtype; 0
    where no branch keeps the row."""
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    s = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < S
    d_ok = d < HEAD_DIM
    t = _ordered_rows(INV, s, s_ok, ORDERED)
    acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for i in tl.static_range(len(GEOMETRY)):
        for j in tl.static_range(tl.constexpr(NUM_PAIRS[i])):
            bp, m, c, keep = _locate(PAIRS, i, g, j, WIDTH, t, b, s_ok, GEOMETRY[i][0], GEOMETRY[i][1], GEOMETRY[i][2])
            acc += _compact_rows(SRC[i], SRC_STRIDES[i], bp, m, c, d, keep, d_ok)
    tl.store(OUT + b * sob + s[:, None] * sos + g * soh + d[None, :] * sod, acc.to(OUT.dtype.element_ty),
             mask=s_ok[:, None] & d_ok[None, :])


@triton.jit
def _delta_kernel(DO, O, DLSE, DELTA, PAIRS, S, sdob, sdos, sdoh, sdod, sob, sos, soh, sod, slb, slh, sls,
                  DELTA_STRIDES, INV, GEOMETRY: tl.constexpr, HAS_DLSE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ORDERED: tl.constexpr):
    """delta = rowsum(dO * O) - dlse (fp32) of query head h at rows s, stored compact into every
    branch that keeps the row: DELTA_i[b', c, m] for the pair (c, o) of h (PAIRS [K, H, 1, 2])."""
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    s = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < S
    mask = s_ok[:, None] & (d < HEAD_DIM)[None, :]
    do = tl.load(DO + b * sdob + s[:, None] * sdos + h * sdoh + d[None, :] * sdod, mask=mask, other=0.0)
    o = tl.load(O + b * sob + s[:, None] * sos + h * soh + d[None, :] * sod, mask=mask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + b * slb + h * slh + s * sls, mask=s_ok, other=0.0)
    t = _ordered_rows(INV, s, s_ok, ORDERED)
    for i in tl.static_range(len(GEOMETRY)):
        bp, m, c, keep = _locate(PAIRS, i, h, 0, 1, t, b, s_ok, GEOMETRY[i][0], GEOMETRY[i][1],
                                 GEOMETRY[i][2])
        tl.store(DELTA[i] + bp * DELTA_STRIDES[i][0] + c * DELTA_STRIDES[i][1] + m * DELTA_STRIDES[i][2], delta,
                 mask=keep)


def _launch_args(out: torch.Tensor) -> dict:
    return dict(HEAD_DIM=out.shape[3], BLOCK_S=ROWS_PER_PROGRAM, BLOCK_D=block_d(out.shape[3]), num_warps=4)


def _grid(out: torch.Tensor) -> tuple:
    B, S, n, _ = out.shape
    return (triton.cdiv(S, ROWS_PER_PROGRAM), n, B)


def _strides(tensors) -> tuple:
    return tuple(tuple(x.stride()) for x in tensors)


def _inv_args(inv, out):
    """(INV, ORDERED) of the merge kernels: the inverse permutation, or a dummy never read."""
    if inv is None:
        return torch.zeros(1, dtype=torch.int32, device=out.device), False
    return inv, True


def _merge(out, lse, results, plan: _Plan, merged_inv_l, inv=None) -> None:
    """Fills out [B, S, H, D] and lse [B, H, S] from the branches' (o, lse, m2, inv_l); with
    merged_inv_l (a list, the LSE merge) those too, else one branch per head (head groups)."""
    outs, lses, m2s, inv_ls = zip(*results)  # the statistics (and merged_inv_l) share one layout
    merge_lse = merged_inv_l is not None
    inv, ordered = _inv_args(inv, out)
    with device_ctx(out):
        _merge_kernel[_grid(out)](
            out, lse, outs, m2s, inv_ls, lses, tuple(merged_inv_l) if merge_lse else lses, _tables(plan, out.device)[0],
            out.shape[1], *out.stride(), *lse.stride(), _strides(outs), _strides(inv_ls), inv, GEOMETRY=plan.geometry,
            MERGE_LSE=merge_lse, ORDERED=ordered, **_launch_args(out))


def _gather(out: torch.Tensor, srcs, plan: _Plan, kv: bool, inv=None) -> torch.Tensor:
    """out [B, S, n, D] (any dtype) = the branches' compact srcs [B', rows, heads, D] (fp32) summed
    at the full rows and heads they hold (kv: the kv heads the compact dk / dv heads add into)."""
    table = _tables(plan, out.device)[1 if kv else 0]
    inv, ordered = _inv_args(inv, out)
    with device_ctx(out):
        _gather_kernel[_grid(out)](
            out, tuple(srcs), table, out.shape[1], *out.stride(), _strides(srcs), inv, GEOMETRY=plan.geometry,
            NUM_PAIRS=plan.kv_counts if kv else plan.q_counts, WIDTH=table.shape[2], ORDERED=ordered,
            **_launch_args(out))
    return out


def _deltas(dout, out, dlse, plan: _Plan, deltas, inv=None) -> None:
    """Fills the branches' compact deltas [B', heads, rows] (fp32) with rowsum(dO * O) - dlse."""
    dlse_args = (dlse, *dlse.stride()) if dlse is not None else (out, 0, 0, 0)  # a dummy, never read
    inv, ordered = _inv_args(inv, out)
    with device_ctx(out):
        _delta_kernel[_grid(out)](
            dout, out, dlse_args[0], tuple(deltas), _tables(plan, out.device)[0], out.shape[1], *dout.stride(),
            *out.stride(), *dlse_args[1:], _strides(deltas), inv, GEOMETRY=plan.geometry, HAS_DLSE=dlse is not None,
            ORDERED=ordered, **_launch_args(out))


# ----------------------------------------------------------------------------------------------
# Forward and backward
# ----------------------------------------------------------------------------------------------
def _orig(br: Branch, perm: torch.Tensor, batch: int) -> torch.Tensor:
    """int32 [B * num_segments * rate, rows]: the original row of row m of virtual sequence
    (b, seg, offset) of the ordered sequence, perm[seg * w + m * r + offset]; padding rows get
    positions past the end (S + p: never visible under causality, clamped when loaded)."""
    m = torch.arange(br.rows, device=perm.device)[None, None, :] * br.rate + \
        torch.arange(br.rate, device=perm.device)[None, :, None]
    p = torch.arange(br.num_segments, device=perm.device)[:, None, None] * br.segment + m  # [n, r, rows]
    real = (m < br.segment) & (p < br.seq_len)
    orig = torch.where(real, perm[torch.where(real, p, 0)], br.seq_len + p).to(torch.int32)
    return orig.expand(batch, *orig.shape).reshape(-1, br.rows).contiguous()


def _branch_inputs(plan: _BranchPlan, q, k, v, perm=None):
    """(q, k, v of the branch, its segment ids, the engine's gather argument): the slot views, or
    under an ordering the whole arrays with the rows' original positions."""
    br = plan.branch
    ids = _segment_ids(br, q.shape[0], q.device) if br.padded else None
    if perm is not None:
        return q, k, v, ids, (_orig(br, perm, q.shape[0]), False, br.num_segments)
    return _slot_view(q, br), _slot_view(k, br), _slot_view(v, br), ids, None


def _forward(q, k, v, plan: _Plan, *, causal, merge, scale, config, perm=None, inv=None):
    """-> (out [B, S, H, D] in q.dtype, lse [B, H, S] fp32, per-branch backward stats)."""
    B, S, H, D = q.shape
    results = []
    for p in plan.branches:
        qv, kv, vv, ids, gather = _branch_inputs(p, q, k, v, perm)
        o, lse, (m2, inv_l) = engine.forward(qv, kv, vv, causal=causal, scale=scale, q_ids=ids, kv_ids=ids,
                                             config=config, row_map=p.row_map, grid_heads=p.heads,
                                             out_dtype=torch.float32, gather=gather)
        results.append((o, lse, m2, inv_l))
    out = torch.empty((B, S, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    if merge == "head_groups":  # one branch per head: its rows, zeros (lse -inf) elsewhere
        _merge(out, lse, results, plan, None, inv)
        return out, lse, [(m2, inv_l) for (_, _, m2, inv_l) in results]
    # the backward's P = 2^(s2 - m2_k) * 2^(m2_k - M) / L: inv_l of the merged softmax, compact
    merged_inv_l = [_compact_stat(inv_l, p.branch) for p, (_, _, _, inv_l) in zip(plan.branches, results)]
    _merge(out, lse, results, plan, merged_inv_l, inv)
    return out, lse, [(m2, mi) for (_, _, m2, _), mi in zip(results, merged_inv_l)]


def _backward(dout, dlse, q, k, v, out, plan: _Plan, stats, *, causal, scale, config, perm=None, inv=None):
    deltas = [_compact_stat(inv_l, p.branch) for p, (_, inv_l) in zip(plan.branches, stats)]
    _deltas(dout, out, dlse, plan, deltas, inv)
    grads = []
    for p, (m2, inv_l), delta in zip(plan.branches, stats, deltas):
        br = p.branch
        qv, kv, vv, ids, gather = _branch_inputs(p, q, k, v, perm)
        grads.append(engine.backward(dout if perm is not None else _slot_view(dout, br), qv, kv, vv, None,
                                     (m2, inv_l), causal=causal, scale=scale, q_ids=ids, kv_ids=ids, config=config,
                                     delta=delta, row_map=p.row_map, grid_heads=p.heads, grad_dtype=torch.float32,
                                     gather=gather))
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    _gather(dq, [g[0] for g in grads], plan, kv=False, inv=inv)
    _gather(dk, [g[1] for g in grads], plan, kv=True, inv=inv)
    _gather(dv, [g[2] for g in grads], plan, kv=True, inv=inv)
    return dq, dk, dv


class DilatedAttentionFn(torch.autograd.Function):
    """Triton forward + backward of dilated attention. Outputs (out, lse); both differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, segment_lengths, dilation_rates, causal, merge, scale, config=None, order=None):
        plan = _plan(segment_lengths, dilation_rates, q.shape[1], merge, q.shape[2], k.shape[2])
        perm = inv = None
        if order is not None:  # the permutation and its inverse, int32 on q's device
            perm = order.to(q.device, torch.int32)
            inv = torch.empty_like(perm)
            inv[perm.long()] = torch.arange(perm.shape[0], dtype=torch.int32, device=q.device)
        out, lse, stats = _forward(q, k, v, plan, causal=causal, merge=merge, scale=scale, config=config, perm=perm,
                                   inv=inv)
        ctx.save_for_backward(q, k, v, out, *(t for s in stats for t in s))
        ctx.plan = plan
        ctx.opts = dict(causal=causal, scale=scale, config=config, perm=perm, inv=inv)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, *flat = ctx.saved_tensors
        stats = list(zip(flat[0::2], flat[1::2]))
        if dout is None:
            dout = torch.zeros_like(out)
        with torch.no_grad():
            dq, dk, dv = _backward(dout, dlse, q, k, v, out, ctx.plan, stats, **ctx.opts)
        return dq, dk, dv, None, None, None, None, None, None, None


def dilated_attention_triton(q, k, v, *, segment_lengths, dilation_rates, causal: bool, merge: str, scale: float,
                             config: BlockSizes | None = None, order=None):
    """q [B, S, H, D], k / v [B, S, Hkv, D] -> (out [B, S, H, D] in q.dtype, lse [B, H, S] fp32).

    Dilated attention over checked arguments (`attn_spec.dilation.check_config`, the q / k / v
    checks of `torch_ref.ops.common.validation`); see `torch_ref.dilated_attention`. Differentiable
    in q, k, v (a cotangent on lse included). order: int [S], an ordering whose ordered sequence
    the segments are cut from (rows gathered in the kernels).
    """
    if q.numel() == 0:  # no rows (or no batch): nothing to attend; gradients are zeros
        B, S, H, _ = q.shape
        return q * 0, torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
    return DilatedAttentionFn.apply(q, k, v, tuple(segment_lengths), tuple(dilation_rates), causal, merge, scale,
                                    config, order)
