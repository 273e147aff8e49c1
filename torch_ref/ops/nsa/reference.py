"""Native Sparse Attention in plain PyTorch (the definition of `attn_spec.nsa`, dense masks).

The golden (run in float64) and `implementation="eager"`. Matmuls run in the input dtype, softmax
statistics in float32 (float64 for float64 inputs), as `torch_ref.ops.softmax.reference`. Every
branch is a masked softmax attention over a dense visibility mask built from the definition:

- selection: `ranges_mask` over canonical ranges per (batch, query, kv head): block lists through
  `canonical_blocks` and `blocks_to_ranges`, ranges through `canonical_ranges` (disjoint, the
  non-empty ones first, causality folded in: both backends read this form);
- compression: `compression_mask` (block i visible to query t iff `compressed_end(i) <= t`, and,
  with segment ids, iff every key of the block is in t's segment: a block that straddles two
  packed sequences belongs to neither);
- the top-n rule: `top_n` over importances (`importance`, its scores in the statistics dtype);
- the gates: `combine` (in the statistics dtype, out in the branches' dtype).

Inputs are assumed validated (`torch_ref.ops.nsa.validation`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_spec import nsa as spec


def zeros_like_connected(x):
    """Zeros shaped like x that autograd still connects to x (zero gradient), whatever x holds."""
    never = torch.zeros((), dtype=torch.bool, device=x.device)
    return torch.where(never, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# Masked softmax attention (the common core of every branch)
# ----------------------------------------------------------------------------------------------
def masked_attention(q, k, v, vis, scale: float):
    """q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D], vis bool [B, Hkv, Sq, Sk] (per kv head: shared by
    its query heads) -> (out [B, Sq, Hq, D] in q.dtype, lse [B, Hq, Sq] in the statistics dtype).
    Rows with no visible key: out 0, lse -inf, zero gradients (never NaN)."""
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    stat = _stat_dtype(q.dtype)
    if k.shape[1] == 0:  # no keys (no complete compression block yet): nothing is visible
        return zeros_like_connected(q), torch.full((B, Hq, Sq), float("-inf"), dtype=stat, device=q.device)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    # zero what no row sees (garbage must not reach other rows through 0 * x)
    key_seen = vis.any(2).transpose(1, 2)[..., None]  # [B, Sk, Hkv, 1]
    row_sees = vis.any(3).transpose(1, 2).repeat_interleave(G, dim=2)[..., None]  # [B, Sq, Hq, 1]
    q = torch.where(row_sees, q, zero)
    k = torch.where(key_seen, k, zero)
    v = torch.where(key_seen, v, zero)
    qg = q.reshape(B, Sq, Hkv, G, D)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale  # [B, Hkv, G, Sq, Sk]
    s = s.to(stat).masked_fill(~vis[:, :, None], float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=stat, device=m.device))
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    empty = l == 0
    l_safe = torch.where(empty, torch.ones((), dtype=stat, device=l.device), l)
    p = e / l_safe
    out = torch.einsum("bhgqk,bkhd->bqhgd", p.to(q.dtype), v).reshape(B, Sq, Hq, D)
    lse = torch.where(empty, torch.full((), float("-inf"), dtype=stat, device=l.device), m + torch.log(l_safe))
    return out, lse.squeeze(-1).reshape(B, Hq, Sq)


# ----------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------
def canonical_blocks(block_indices, block_counts, block_size: int, causal: bool, seq_len: int):
    """int32 [B, S, Hkv, n]: the entries that count, each once, ascending, then -1. Ignored: -1 (any
    negative), blocks past the sequence, beyond the causal frontier (j > t // block_size), slots
    past `block_counts` [B, S, Hkv], repeats."""
    idx = block_indices.to(torch.int64)
    B, S, Hkv, n = idx.shape
    limit = -(-seq_len // block_size)
    ok = (idx >= 0) & (idx < limit)
    if causal:
        t = torch.arange(S, device=idx.device)[None, :, None, None]
        ok = ok & (idx <= t // block_size)
    if block_counts is not None:
        slot = torch.arange(n, device=idx.device)
        ok = ok & (slot < block_counts.to(torch.int64)[..., None])
    big = torch.iinfo(torch.int64).max
    srt = torch.sort(torch.where(ok, idx, big), dim=-1).values
    repeat = torch.zeros_like(ok)
    repeat[..., 1:] = srt[..., 1:] == srt[..., :-1]
    srt = torch.sort(torch.where(repeat, big, srt), dim=-1).values  # repeats to the end, with the ignored
    return torch.where(srt == big, -1, srt).to(torch.int32)


def canonical_ranges(ranges, causal: bool, seq_len: int):
    """int64 [B, S, Hkv, R, 2]: disjoint ranges with the union of `ranges` (clipped to [0, S) and,
    if causal, to keys <= t), the non-empty ones first, sorted by start; empty ranges are (0, 0)."""
    r = ranges.to(torch.int64)
    S = r.shape[1]
    start, end = r[..., 0].clamp(0, seq_len), r[..., 1].clamp(0, seq_len)
    if causal:
        t1 = torch.arange(1, S + 1, device=r.device)[None, :, None, None]
        end = torch.minimum(end, t1)
    empty = start >= end
    start = torch.where(empty, seq_len, start)  # empties sort last
    start, order = torch.sort(start, dim=-1, stable=True)
    end = torch.where(empty, 0, end).gather(-1, order)
    # a range keeps only what no earlier (lower-start) range covers: start >= max of earlier ends
    prev = torch.cummax(end, dim=-1).values
    prev = torch.cat([torch.zeros_like(prev[..., :1]), prev[..., :-1]], dim=-1)
    start = torch.maximum(start, prev)
    keep = start < end
    # ranges a lower one covers became empty: the non-empty ones first again (the kernels loop over those)
    order = torch.sort(torch.where(keep, start, seq_len), dim=-1, stable=True).indices
    start, end, keep = (x.gather(-1, order) for x in (start, end, keep))
    return torch.stack([torch.where(keep, start, 0), torch.where(keep, end, 0)], dim=-1)


def blocks_to_ranges(blocks, block_size: int, causal: bool, seq_len: int):
    """Canonical block lists int [B, S, Hkv, n] (ascending, -1 last) -> disjoint ranges int64
    [B, S, Hkv, n, 2], the non-empty ones first (-1: (0, 0))."""
    j = blocks.to(torch.int64)
    start = j * block_size
    end = torch.clamp(start + block_size, max=seq_len)
    if causal:
        end = torch.minimum(end, torch.arange(1, blocks.shape[1] + 1, device=j.device)[None, :, None, None])
    keep = j >= 0
    return torch.stack([torch.where(keep, start, 0), torch.where(keep, end, 0)], dim=-1)


def ranges_mask(ranges, seq_len: int):
    """Canonical (disjoint) ranges [B, S, Hkv, R, 2] -> bool [B, Hkv, S, Sk]: key j in some range."""
    j = torch.arange(seq_len, device=ranges.device)
    inside = (j >= ranges[..., 0:1]) & (j < ranges[..., 1:2])  # [B, S, Hkv, R, Sk]
    return inside.any(3).permute(0, 2, 1, 3)


def segment_mask(segment_ids):
    """[B, 1, S, S]: key within the query's segment."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def selection(q, k, v, ranges, *, scale: float, segment_ids=None, block_size=None):
    """Selection attention over canonical ranges [B, S, Hkv, R, 2] (`canonical_ranges` or
    `blocks_to_ranges`: causality already folded into them) -> (out, lse). block_size: where the
    ranges are blocks of that size (the kernels' tiling hint; the dense mask needs none)."""
    vis = ranges_mask(ranges, k.shape[1])
    if segment_ids is not None:
        vis = vis & segment_mask(segment_ids)
    return masked_attention(q, k, v, vis, scale)


def selection_ranges(q, k, v, ranges, *, causal: bool, scale: float, segment_ids=None):
    """Selection attention over raw ranges [B, S, Hkv, R, 2] (validated): their canonical form."""
    return selection(q, k, v, canonical_ranges(ranges, causal, q.shape[1]), scale=scale, segment_ids=segment_ids)


# ----------------------------------------------------------------------------------------------
# Compression
# ----------------------------------------------------------------------------------------------
def _windows(x, block: int, stride: int):
    """x [B, S, H, D] -> [B, Nc, H, block, D]: compression block i = rows [i * stride, i * stride + block)."""
    B, S, H, D = x.shape
    n = spec.compressed_count(S, block, stride)
    if n == 0:
        return x.new_zeros((B, 0, H, block, D))
    return x[:, :(n - 1) * stride + block].unfold(1, block, stride).permute(0, 1, 2, 4, 3)


def compress(x, block: int, stride: int, params=None):
    """One of k, v [B, S, H, D] -> [B, Nc, H, D]: mean pooling, or the MLP of `CompressParams`
    `gelu((x + pos).reshape(block * D) @ w1 + b1) @ w2 + b2` (exact erf GELU), in x's dtype."""
    w = _windows(x, block, stride)
    if params is None:
        return w.mean(3)
    pos, w1, b1, w2, b2 = (p.to(x.dtype) for p in params)
    B, Nc, H, _, D = w.shape
    h = F.gelu((w + pos).reshape(B, Nc, H, block * D) @ w1 + b1, approximate="none")
    return h @ w2 + b2


def compress_kv(k, v, *, block: int, stride: int, params=None):
    pk, pv = (None, None) if params is None else params
    return compress(k, block, stride, pk), compress(v, block, stride, pv)


def compressed_segments(segment_ids, block: int, stride: int):
    """int64 [B, Nc]: each compression block's segment, doubled (2 * id) where all its keys share
    one, odd (2 * first id + 1) where it straddles segments: compared with doubled query ids, a
    straddling block matches no query."""
    ids = segment_ids.to(torch.int64)
    n = spec.compressed_count(ids.shape[1], block, stride)
    w = ids[:, :(n - 1) * stride + block].unfold(1, block, stride) if n else ids.new_zeros((ids.shape[0], 0, block))
    first = w[..., 0]
    uniform = (w == first[..., None]).all(-1)
    return torch.where(uniform, 2 * first, 2 * first + 1)


def compression_mask(seq_len: int, num_blocks: int, block: int, stride: int, segment_ids=None, device=None):
    """bool [B or 1, 1, S, Nc]: query t sees compression block i."""
    t = torch.arange(seq_len, device=device)[:, None]
    i = torch.arange(num_blocks, device=device)[None, :]
    vis = (spec.compressed_end(i, block, stride) <= t)[None, None]
    if segment_ids is not None:
        blk = compressed_segments(segment_ids, block, stride)
        vis = vis & (2 * segment_ids.to(torch.int64)[:, :, None] == blk[:, None, :])[:, None]
    return vis


def compression(q, k_cmp, v_cmp, *, block: int, stride: int, scale: float, segment_ids=None):
    vis = compression_mask(q.shape[1], k_cmp.shape[1], block, stride, segment_ids, q.device)
    vis = vis.expand(q.shape[0], k_cmp.shape[2], q.shape[1], k_cmp.shape[1])
    return masked_attention(q, k_cmp, v_cmp, vis, scale)


# ----------------------------------------------------------------------------------------------
# Importance and the top-n rule
# ----------------------------------------------------------------------------------------------
def importance(q, k_cmp, lse_cmp, *, block: int, stride: int, select_block: int, scale: float, segment_ids=None):
    """[B, S, Hkv, Nsel] in the statistics dtype: imp[b, t, g, j] = sum over the group's heads h and
    compression blocks i of p_cmp[b, t, h, i] * overlap[i, j], p_cmp = exp(scale q.k_cmp - lse_cmp)
    on the blocks t sees (block-causal, and with segment ids within t's segment, as the compression
    branch that gave lse_cmp; rows with lse -inf give 0)."""
    B, S, Hq, D = q.shape
    Nc, Hkv = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    stat = _stat_dtype(q.dtype)
    # scores in the statistics dtype (not rounded to a 16-bit input dtype): the choice is discrete
    s = torch.einsum("bqhgd,bkhd->bhgqk", q.reshape(B, S, Hkv, G, D).to(stat), k_cmp.to(stat)) * scale
    lse = lse_cmp.to(stat).reshape(B, Hkv, G, S)[..., None]
    vis = compression_mask(S, Nc, block, stride, segment_ids, q.device)[:, :, None]
    seen = torch.isfinite(lse)
    p = torch.where(vis & seen, torch.exp(s - torch.where(seen, lse, 0)), 0)
    overlap = torch.from_numpy(spec.overlap_matrix(S, block, stride, select_block).copy()).to(q.device, stat)
    return torch.einsum("bhgqk,kj->bqhj", p, overlap)


def top_n(imp, num_selected: int, select_block: int):
    """The top-n rule of `attn_spec.nsa` over importances [B, S, Hkv, Nsel] -> int32 [B, S, Hkv, n]:
    blocks beyond t's frontier are out, the forced blocks always in (they outrank any importance;
    among themselves the lower index first), the rest by importance, larger first, ties to the
    lower index; ascending, then -1."""
    B, S, Hkv, Nsel = imp.shape
    t = torch.arange(S, device=imp.device)[None, :, None, None]
    j = torch.arange(Nsel, device=imp.device)
    score = imp.clone()
    for f in spec.forced_blocks(t, select_block):
        score = torch.where(j == f, float("inf"), score)
    score = torch.where(j > t // select_block, float("-inf"), score)
    # a stable descending sort keeps equal scores in index order: ties go to the lower index
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :num_selected]
    chosen = torch.gather(score, -1, order) > float("-inf")
    big = torch.iinfo(torch.int64).max
    out = torch.sort(torch.where(chosen, order, big), dim=-1).values
    if out.shape[-1] < num_selected:  # fewer blocks than slots
        out = torch.cat([out, out.new_full((*out.shape[:-1], num_selected - out.shape[-1]), big)], dim=-1)
    return torch.where(out == big, -1, out).to(torch.int32)


def select_blocks(q, k_cmp, lse_cmp, *, block: int, stride: int, select_block: int, num_selected: int,
                  scale: float, segment_ids=None):
    """int32 [B, S, Hkv, num_selected]: `top_n` of `importance` (not differentiated)."""
    with torch.no_grad():
        imp = importance(q, k_cmp, lse_cmp, block=block, stride=stride, select_block=select_block, scale=scale,
                         segment_ids=segment_ids)
        return top_n(imp, num_selected, select_block)


# ----------------------------------------------------------------------------------------------
# Gates
# ----------------------------------------------------------------------------------------------
def combine(gates, o_cmp, o_slc, o_win=None):
    """`g[..., 0] o_cmp + g[..., 1] o_slc + g[..., 2] o_win` in float32 (float64 for float64), in
    o_cmp's dtype; o_win None: the window branch is off."""
    stat = _stat_dtype(o_cmp.dtype)
    g = gates.to(stat)
    out = g[..., 0:1] * o_cmp.to(stat) + g[..., 1:2] * o_slc.to(stat)
    if o_win is not None:
        out = out + g[..., 2:3] * o_win.to(stat)
    return out.to(o_cmp.dtype)
