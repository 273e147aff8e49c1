"""NSA on Triton: the group-centric selection kernels (forward, dQ, dK/dV over a transpose plan),
the compression branch on the softmax kernels, and the importance + top-n of the block selection.

Read top to bottom: block configuration, the selection kernels, the transpose plan, the autograd
Function, then the compression branch and the selection of blocks; the functions at the end
(`selection`, `compression`, `select_blocks`, `compress_kv`) are the operations the registry calls
(`torch_ref.registry`, variant "nsa"), with the arguments of `torch_ref.ops.nsa.reference`'s.

Selection (the paper's Section 3.3.2 kernel): every query row's keys are R disjoint `[start, end)`
ranges (`reference.canonical_ranges` / `blocks_to_ranges`: block lists become one range per block,
causality is folded in as end <= t + 1). One program per (query token, kv head, batch row): the
GQA group's query heads are the tile's rows (padded to a power of two >= 16, the tl.dot minimum,
for any ratio, 1 included), and the program walks its ranges in key tiles of BLOCK_N with an online
softmax in fp32 (base 2; the element mask is `key < end` and the segment ids). The non-empty ranges
come first and a per-row count bounds the loop; blocks that fit one tile (ONE_TILE) make it one flat
loop. The dQ kernel walks the same tiles. The dK/dV kernel runs over a transpose plan
(`_dkv_plan`): for every (batch row, kv head, aligned key tile) the pieces (query token, [lo, hi))
of the ranges that touch it, sorted by token (a sort of (tile, token, range) keys with torch ops);
the rows of one step are `tokens_dkv` tokens times the padded group. Long lists (block 0 is every
token's) are cut into chunks of `chunk_dkv` pieces, one program each, whose fp32 partial dk / dv a
second kernel sums in chunk order: deterministic, no atomics. Offsets along the sequence are int32
within a batch row and head (S * H * D < 2^31), as in the softmax kernels.

Row statistics as the softmax kernels (`torch_ref.ops.softmax.triton`): m2 (base-2 row max) and
inv_l = 1 / l, [B, Hq, S] fp32; the backward recomputes P = 2^(s2 - m2) inv_l; rows that see no key
store m2 = +inf, inv_l = 0 (P = 0), out 0, lse -inf.

Importing this module imports triton: the interpreter (`TRITON_INTERPRET=1`) must be chosen in
the environment before that happens.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from attn_spec import nsa as spec

from ..common.triton_tiles import INTERPRETED, block_d, device_ctx, precision
from . import reference
from .reference import zeros_like_connected

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
MIN_ROWS = 16  # tl.dot's smallest tile side: the padded GQA group

__all__ = ["NSABlockSizes", "default_nsa_block_sizes", "SelectionFn", "RangesScanFn", "CombineFn", "selection",
           "selection_ranges", "compression",
           "select_blocks", "compress_kv", "combine", "INTERPRETED"]


# ----------------------------------------------------------------------------------------------
# Block configuration
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NSABlockSizes:
    """Tiles of the selection kernels.

    block_n: key tile of the forward and dQ kernels (a block of block_size keys is walked in tiles of
      min(block_n, block_size)); block_n_dkv: the dK/dV kernel's aligned key tile (the plan's unit;
      min(block_n_dkv, block_size) for block lists); tokens_dkv: query tokens per dK/dV step for a
      group of up to 16 (rows = tokens_dkv * 16; larger groups take proportionally fewer tokens);
      chunk_dkv: the most plan pieces one dK/dV program takes (longer lists are split; their
      partials are summed in order); query_chunk: query tokens per step of the block selection
      (bounds its int64 top-n keys [B, chunk, Hkv, Nsel]); block_imp, num_warps_imp: the importance
      kernel's query tile (and its compression / selection tile) and warps."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    block_n_dkv: int = 64
    tokens_dkv: int = 4
    chunk_dkv: int = 1024
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2
    query_chunk: int = 8192
    block_imp: int = 64
    num_warps_imp: int = 8

    def __post_init__(self):
        for name in ("block_n", "block_n_dkv", "tokens_dkv", "block_imp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"NSABlockSizes.{name} must be a power of two, got {value!r}")
        if min(self.block_n, self.block_n_dkv, self.block_imp) < 16:
            raise ValueError(f"NSABlockSizes.block_n, block_n_dkv and block_imp must be >= 16 (tl.dot), got {self}")
        for name in ("num_warps", "num_stages", "chunk_dkv", "num_warps_bwd", "num_stages_bwd", "query_chunk",
                     "num_warps_imp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"NSABlockSizes.{name} must be an int >= 1, got {value!r}")


def default_nsa_block_sizes(head_dim: int, dtype: torch.dtype, on_gpu: bool) -> NSABlockSizes:
    """GPU: key tiles of 64 (the paper's and fla's selection block). The backward and the importance
    run 8 warps and the dK/dV kernel 2 tokens a step (32 rows for a group of 16): the smallest
    configurations that compile without register spills for sm_90 at head dim 128 (16-bit). Wide
    tiles (fp32, or a head dim past 128) halve the key and query tiles. The interpreter: small tiles
    and chunks, so CPU tests cross tile and chunk edges."""
    if not on_gpu:
        return NSABlockSizes(block_n=16, num_warps=4, num_stages=1, block_n_dkv=16, tokens_dkv=2, chunk_dkv=8,
                             num_warps_bwd=4, num_stages_bwd=1, query_chunk=24, block_imp=16, num_warps_imp=4)
    if dtype != torch.float32 and block_d(head_dim) <= 128:
        return NSABlockSizes(block_n=64, num_warps=4, num_stages=2, block_n_dkv=64, tokens_dkv=2, chunk_dkv=1024,
                             num_warps_bwd=8, num_stages_bwd=2, query_chunk=8192, block_imp=64, num_warps_imp=8)
    return NSABlockSizes(block_n=32, num_warps=8, num_stages=2, block_n_dkv=32, tokens_dkv=1, chunk_dkv=1024,
                         num_warps_bwd=8, num_stages_bwd=2, query_chunk=8192, block_imp=32, num_warps_imp=8)


def _rows(group: int) -> int:
    return max(MIN_ROWS, triton.next_power_of_2(group))


# ----------------------------------------------------------------------------------------------
# Selection kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _token_program(GROUP, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """The forward / dQ program's coordinates, grid (S, Hkv, B): (t, g, b, the group's query heads
    hq [BLOCK_G] and their mask, d [BLOCK_D] and its mask, n [BLOCK_N], the [rows, D] mask)."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BLOCK_G)
    r_ok = rows < GROUP
    hq = g * GROUP + rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    return t, g, b, hq, r_ok, d, d_ok, n, r_ok[:, None] & d_ok[None, :]


@triton.jit
def _heads_at(X, b, t, hq, d, sxb, sxs, sxh, sxd, PER_ROW: tl.constexpr):
    """Pointers [rows, D] of X [B, S, H, D] at batch row b, heads hq [rows] and token t: a scalar,
    or PER_ROW one token per row (t [rows])."""
    x = X + b * sxb
    if PER_ROW:
        x = x + t[:, None] * sxs
    else:
        x = x + t * sxs
    return x + hq[:, None] * sxh + d[None, :] * sxd


@triton.jit
def _token_keys(K, V, SEG, RANGES, COUNTS, b, t, g, skb, skh, svb, svh, ssb, sss, srb, srs, srh, scb, scs, sch,
                HAS_SEGMENTS: tl.constexpr):
    """What the forward / dQ walk of token t, kv head g needs: (the key and value bases of head g,
    the query's segment id (0 without segments), the row's ranges and their non-empty count)."""
    k_base = K + b * skb + g * skh
    v_base = V + b * svb + g * svh
    qs = 0
    if HAS_SEGMENTS:
        qs = tl.load(SEG + b * ssb + t * sss)
    r_base = RANGES + b * srb + t * srs + g * srh
    return k_base, v_base, qs, r_base, tl.load(COUNTS + b * scb + t * scs + g * sch)


@triton.jit
def _range_at(r_base, r, srr, src):
    """[lo, hi) of the row's range r, int32."""
    return tl.load(r_base + r * srr).to(tl.int32), tl.load(r_base + r * srr + src).to(tl.int32)


@triton.jit
def _tile_coords(tile_id, NT, Hkv):
    """Key tile id (b, g, tile) flattened as (b * Hkv + g) * NT + tile -> (tile, g, b)."""
    return tile_id % NT, (tile_id // NT) % Hkv, tile_id // (NT * Hkv)


@triton.jit
def _key_tile(k_base, v_base, SEG, b, ssb, sss, qs, start, hi, n, d, d_ok, sks, skd, svs, svd,
              HAS_SEGMENTS: tl.constexpr, V_TRANS: tl.constexpr):
    """Keys [start, start + BLOCK_N) below hi (and in the query's segment): (kT [D, N], v [N, D] or
    vT [D, N] if V_TRANS, the column mask)."""
    cols = start + n
    c_ok = cols < hi
    if HAS_SEGMENTS:
        c_ok = c_ok & (tl.load(SEG + b * ssb + cols * sss, mask=c_ok, other=0) == qs)
    mask = c_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + cols[:, None] * sks + d[None, :] * skd, mask=mask, other=0.0)
    v = tl.load(v_base + cols[:, None] * svs + d[None, :] * svd, mask=mask, other=0.0)
    if V_TRANS:
        v = tl.trans(v)
    return tl.trans(k), v, c_ok


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_base, v_base, SEG, b, ssb, sss, qs, start, hi, n, d, d_ok, sks, skd, svs, svd,
              score_mul, HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr):
    kT, v, c_ok = _key_tile(k_base, v_base, SEG, b, ssb, sss, qs, start, hi, n, d, d_ok, sks, skd, svs, svd,
                            HAS_SEGMENTS, False)
    s2 = tl.dot(q, kT, input_precision=PRECISION) * score_mul
    s2 = tl.where(c_ok[None, :], s2, float("-inf"))
    # online softmax update (base 2); rows with nothing visible yet shift by a safe 0
    m_new = tl.maximum(m_i, tl.max(s2, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s2 - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, M2, INV_L, RANGES, COUNTS, SEG,
                sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sob, sos, soh, sod,
                srb, srs, srh, srr, src, scb, scs, sch, ssb, sss,
                S, Hq, GROUP, score_mul,
                HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                ONE_TILE: tl.constexpr, HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr):
    """grid (S, Hkv, B): query token t of kv head g over its COUNTS[b, t, g] non-empty ranges (they
    come first). ONE_TILE: every range fits one key tile (blocks of at most BLOCK_N): one flat loop
    the compiler can pipeline. Writes O [B, S, Hq, D] at the group's heads and LSE, M2, INV_L
    [B, Hq, S]."""
    t, g, b, hq, r_ok, d, d_ok, n, rd_ok = _token_program(GROUP, HEAD_DIM, BLOCK_G, BLOCK_N, BLOCK_D)
    q = tl.load(_heads_at(Q, b, t, hq, d, sqb, sqs, sqh, sqd, False), mask=rd_ok, other=0.0)
    k_base, v_base, qs, r_base, count = _token_keys(K, V, SEG, RANGES, COUNTS, b, t, g, skb, skh, svb, svh, ssb, sss,
                                                    srb, srs, srh, scb, scs, sch, HAS_SEGMENTS)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for r in range(count):
        lo, hi = _range_at(r_base, r, srr, src)
        if ONE_TILE:
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, SEG, b, ssb, sss, qs, lo, hi, n, d, d_ok,
                                      sks, skd, svs, svd, score_mul, HAS_SEGMENTS, PRECISION)
        else:
            for start in range(lo, hi, BLOCK_N):
                acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, SEG, b, ssb, sss, qs, start, hi, n, d,
                                          d_ok, sks, skd, svs, svd, score_mul, HAS_SEGMENTS, PRECISION)
    seen = l_i > 0
    inv_l = tl.where(seen, tl.div_rn(1.0, tl.where(seen, l_i, 1.0)), 0.0)
    out = acc * inv_l[:, None]
    tl.store(_heads_at(O, b, t, hq, d, sob, sos, soh, sod, False), out.to(O.dtype.element_ty), mask=rd_ok)
    stat = (b * Hq + hq) * S + t
    tl.store(LSE + stat, tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf")), mask=r_ok)
    tl.store(M2 + stat, tl.where(seen, m_i, float("inf")), mask=r_ok)
    tl.store(INV_L + stat, inv_l, mask=r_ok)


@triton.jit
def _dq_tile(dq, q, do, m2, inv_l, delta, k_base, v_base, SEG, b, ssb, sss, qs, start, hi, n, d, d_ok, sks, skd,
             svs, svd, score_mul, HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr):
    kT, vT, c_ok = _key_tile(k_base, v_base, SEG, b, ssb, sss, qs, start, hi, n, d, d_ok, sks, skd, svs, svd,
                             HAS_SEGMENTS, True)
    s2 = tl.dot(q, kT, input_precision=PRECISION) * score_mul
    p = tl.where(c_ok[None, :], tl.exp2(s2 - m2[:, None]) * inv_l[:, None], 0.0)
    dp = tl.dot(do, vT, input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)


@triton.jit
def _dq_rows(Q, DO, O, M2, INV_L, DLSE, DELTA, b, t, hq, d, r_ok, rd_ok, sqb, sqs, sqh, sqd, sdb, sds, sdh, sdd,
             sob, sos, soh, sod, S, Hq, HAS_DLSE: tl.constexpr, PER_ROW: tl.constexpr):
    """A dQ program's rows (token t, or PER_ROW one token per row): q, dO, m2, 1 / l and delta =
    rowsum(dO * O) - dlse, which it also stores to DELTA [B, Hq, S] for the dK/dV kernel."""
    q = tl.load(_heads_at(Q, b, t, hq, d, sqb, sqs, sqh, sqd, PER_ROW), mask=rd_ok, other=0.0)
    do = tl.load(_heads_at(DO, b, t, hq, d, sdb, sds, sdh, sdd, PER_ROW), mask=rd_ok, other=0.0)
    o = tl.load(_heads_at(O, b, t, hq, d, sob, sos, soh, sod, PER_ROW), mask=rd_ok, other=0.0)
    stat = (b * Hq + hq) * S + t
    m2 = tl.load(M2 + stat, mask=r_ok, other=float("inf"))
    inv_l = tl.load(INV_L + stat, mask=r_ok, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + stat, mask=r_ok, other=0.0)
    tl.store(DELTA + stat, delta, mask=r_ok)
    return q, do, m2, inv_l, delta


@triton.jit
def _dq_kernel(Q, K, V, O, DO, DLSE, DQ, M2, INV_L, DELTA, RANGES, COUNTS, SEG,
               sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sob, sos, soh, sod, sdb, sds, sdh, sdd,
               sgb, sgs, sgh, sgd, srb, srs, srh, srr, src, scb, scs, sch, ssb, sss,
               S, Hq, GROUP, score_mul, scale,
               HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               ONE_TILE: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_DLSE: tl.constexpr,
               PRECISION: tl.constexpr):
    """grid (S, Hkv, B): dQ of query token t at the group's heads, over the forward's tiles.
    delta = rowsum(dO * O) - dlse (stored to DELTA [B, Hq, S] for the dK/dV kernel), dS = P (dP -
    delta), dq = scale dS k."""
    t, g, b, hq, r_ok, d, d_ok, n, rd_ok = _token_program(GROUP, HEAD_DIM, BLOCK_G, BLOCK_N, BLOCK_D)
    q, do, m2, inv_l, delta = _dq_rows(Q, DO, O, M2, INV_L, DLSE, DELTA, b, t, hq, d, r_ok, rd_ok, sqb, sqs, sqh, sqd,
                                       sdb, sds, sdh, sdd, sob, sos, soh, sod, S, Hq, HAS_DLSE, False)
    k_base, v_base, qs, r_base, count = _token_keys(K, V, SEG, RANGES, COUNTS, b, t, g, skb, skh, svb, svh, ssb, sss,
                                                    srb, srs, srh, scb, scs, sch, HAS_SEGMENTS)
    dq = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for r in range(count):
        lo, hi = _range_at(r_base, r, srr, src)
        if ONE_TILE:
            dq = _dq_tile(dq, q, do, m2, inv_l, delta, k_base, v_base, SEG, b, ssb, sss, qs, lo, hi, n, d, d_ok,
                          sks, skd, svs, svd, score_mul, HAS_SEGMENTS, PRECISION)
        else:
            for start in range(lo, hi, BLOCK_N):
                dq = _dq_tile(dq, q, do, m2, inv_l, delta, k_base, v_base, SEG, b, ssb, sss, qs, start, hi, n, d,
                              d_ok, sks, skd, svs, svd, score_mul, HAS_SEGMENTS, PRECISION)
    tl.store(_heads_at(DQ, b, t, hq, d, sgb, sgs, sgh, sgd, False), (dq * scale).to(DQ.dtype.element_ty), mask=rd_ok)


@triton.jit
def _add_tile(acc, a, b, PRECISION: tl.constexpr):
    """acc + a @ b. With fp32 inputs the product starts from a zero that Triton's dot-add folding
    cannot see as one (acc * 0), so a tile's products are summed from zero and meet acc in one
    rounding; folded, the GPU's fp32 dot adds each product to acc in turn, an FMA chain as long as
    the rows visited (docs/design/nsa.md). 16-bit inputs keep the accumulating MMA."""
    if a.dtype == tl.float32:
        return acc + tl.dot(a, b, acc * 0.0, input_precision=PRECISION)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _dkv_kernel(Q, K, V, DO, M2, INV_L, DELTA, SEG, TOK, LO, HI, CHUNK_TILE, CHUNK_START, CHUNK_END, DKP, DVP,
                sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sdb, sds, sdh, sdd, ssb, sss,
                S, Hq, Hkv, NT, GROUP, score_mul, scale,
                HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                TOKENS: tl.constexpr, HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr):
    """grid (chunks,): one chunk of the plan pieces of key tile (b, g, tile) = CHUNK_TILE[c]; rows of
    a step: TOKENS pieces x the padded group (row i: piece i // BLOCK_G, head i % BLOCK_G). Writes
    the chunk's fp32 partial dk, dv [BLOCK_N, BLOCK_D] to DKP[c], DVP[c]."""
    c = tl.program_id(0).to(tl.int64)
    tile_id = tl.load(CHUNK_TILE + c).to(tl.int64)
    p_lo = tl.load(CHUNK_START + c)
    p_hi = tl.load(CHUNK_END + c)
    tile, g, b = _tile_coords(tile_id, NT, Hkv)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < S
    k = tl.load(K + b * skb + g * skh + cols[:, None] * sks + d[None, :] * skd, mask=c_ok[:, None] & d_ok[None, :],
                other=0.0)
    v = tl.load(V + b * svb + g * svh + cols[:, None] * svs + d[None, :] * svd, mask=c_ok[:, None] & d_ok[None, :],
                other=0.0)
    ks = 0
    if HAS_SEGMENTS:
        ks = tl.load(SEG + b * ssb + cols * sss, mask=c_ok, other=0)
    kT = tl.trans(k)
    vT = tl.trans(v)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    i = tl.arange(0, TOKENS * BLOCK_G)
    head = i % BLOCK_G
    for p0 in range(p_lo, p_hi, TOKENS):
        piece = p0 + i // BLOCK_G
        p_ok = piece < p_hi
        row_ok = p_ok & (head < GROUP)
        tok = tl.load(TOK + piece, mask=p_ok, other=0).to(tl.int64)
        lo = tl.load(LO + piece, mask=p_ok, other=0)
        hi = tl.load(HI + piece, mask=p_ok, other=0)
        hq = g * GROUP + head
        rd_ok = row_ok[:, None] & d_ok[None, :]
        q = tl.load(_heads_at(Q, b, tok, hq, d, sqb, sqs, sqh, sqd, True), mask=rd_ok, other=0.0)
        do = tl.load(_heads_at(DO, b, tok, hq, d, sdb, sds, sdh, sdd, True), mask=rd_ok, other=0.0)
        stat = (b * Hq + hq) * S + tok
        m2 = tl.load(M2 + stat, mask=row_ok, other=float("inf"))
        inv_l = tl.load(INV_L + stat, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
        vis = row_ok[:, None] & (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        if HAS_SEGMENTS:
            qs = tl.load(SEG + b * ssb + tok * sss, mask=p_ok, other=0)
            vis = vis & (qs[:, None] == ks[None, :])
        s2 = tl.dot(q, kT, input_precision=PRECISION) * score_mul
        p = tl.where(vis, tl.exp2(s2 - m2[:, None]) * inv_l[:, None], 0.0)
        dv = _add_tile(dv, tl.trans(p.to(do.dtype)), do, PRECISION)
        dp = tl.dot(do, vT, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk = _add_tile(dk, tl.trans(ds.to(q.dtype)), q, PRECISION)
    out = c * BLOCK_N * BLOCK_D + tl.arange(0, BLOCK_N)[:, None] * BLOCK_D + d[None, :]
    tl.store(DKP + out, dk * scale)
    tl.store(DVP + out, dv)


@triton.jit
def _dkv_sum_kernel(DKP, DVP, TILE_CHUNKS, DK, DV, sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd, S, Hkv, NT,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid (B * Hkv * NT,): dk, dv of key tile (b, g, tile) = the sum of its chunks' partials, in
    chunk order (TILE_CHUNKS [tiles + 1]: the chunks of tile i are [TILE_CHUNKS[i], TILE_CHUNKS[i + 1]));
    0 for a tile no query selected."""
    tile_id = tl.program_id(0).to(tl.int64)
    tile, g, b = _tile_coords(tile_id, NT, Hkv)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    cols = tile * BLOCK_N + n
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    c_lo = tl.load(TILE_CHUNKS + tile_id)
    part = c_lo.to(tl.int64) * (BLOCK_N * BLOCK_D) + n[:, None] * BLOCK_D + d[None, :]
    for _ in range(c_lo, tl.load(TILE_CHUNKS + tile_id + 1)):
        dk += tl.load(DKP + part)
        dv += tl.load(DVP + part)
        part += BLOCK_N * BLOCK_D
    mask = (cols < S)[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(DK + b * sdkb + g * sdkh + cols[:, None] * sdks + d[None, :] * sdkd, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + b * sdvb + g * sdvh + cols[:, None] * sdvs + d[None, :] * sdvd, dv.to(DV.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Ranges on short sequences (up to spec.RANGES_SCAN_KEYS tokens): programs of T consecutive tokens
# scan the key tiles between their ranges' lowest start and highest end, a key visible to a row when
# some range of the row's token holds it (the union: raw ranges, no canonical form), tiles no range
# meets skipped. dK/dV: key tiles walking the tokens in steps of T, the walk cut into chunks whose
# fp32 partials `_dkv_sum_kernel` adds in order. No plan, no host synchronisation.
# ----------------------------------------------------------------------------------------------
@triton.jit
def _scan_rows(t0, S, GROUP, GP: tl.constexpr, ROWS: tl.constexpr):
    """Rows of a scan tile: ROWS // GP consecutive tokens from t0, each with its padded group's GP
    heads -> (token [rows], head within the group [rows], row mask)."""
    i = tl.arange(0, ROWS)
    tok = t0 + i // GP
    head = i % GP
    return tok, head, (tok < S) & (head < GROUP)


@triton.jit
def _scan_visible(RANGES, b, g, tok, ok, cols, S, NR, srb, srs, srh, srr, src, CAUSAL: tl.constexpr):
    """[rows, N]: key cols some range of the row's token holds, inside the sequence (and causal)."""
    r_base = RANGES + b * srb + tok * srs + g * srh
    inside = tl.zeros((tok.shape[0], cols.shape[0]), dtype=tl.int32)
    for r in range(NR):
        lo = tl.load(r_base + r * srr, mask=ok, other=0)
        hi = tl.load(r_base + r * srr + src, mask=ok, other=0)
        inside = inside | ((cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])).to(tl.int32)
    vis = (inside != 0) & ok[:, None] & (cols < S)[None, :]
    if CAUSAL:
        vis = vis & (cols[None, :] <= tok[:, None])
    return vis


@triton.jit
def _scan_bounds(RANGES, b, g, tok, ok, S, NR, srb, srs, srh, srr, src, CAUSAL: tl.constexpr):
    """[lowest start, highest end) of the non-empty ranges of the tile's tokens (clipped to the
    sequence and, causal, to the token); start >= end when there is none."""
    r_base = RANGES + b * srb + tok * srs + g * srh
    first = S + 0
    last = S - S
    for r in range(NR):
        lo = tl.maximum(tl.load(r_base + r * srr, mask=ok, other=0), 0)
        hi = tl.minimum(tl.load(r_base + r * srr + src, mask=ok, other=0), S)
        if CAUSAL:
            hi = tl.minimum(hi, tok + 1)
        some = ok & (hi > lo)
        first = tl.minimum(first, tl.min(tl.where(some, lo, S)))
        last = tl.maximum(last, tl.max(tl.where(some, hi, 0)))
    return first, last


@triton.jit
def _scan_key_tile(K, V, SEG, b, g, cols, d, d_ok, skb, sks, skh, skd, svb, svs, svh, svd, ssb, sss, S,
                   HAS_SEGMENTS: tl.constexpr):
    """Keys and values at cols [N, D] (zero past the sequence) and their segment ids (0 without)."""
    c_ok = cols < S
    mask = c_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + g * skh + cols[:, None] * sks + d[None, :] * skd, mask=mask, other=0.0)
    v = tl.load(V + b * svb + g * svh + cols[:, None] * svs + d[None, :] * svd, mask=mask, other=0.0)
    ks = 0
    if HAS_SEGMENTS:
        ks = tl.load(SEG + b * ssb + cols * sss, mask=c_ok, other=0)
    return k, v, ks


@triton.jit
def _scan_program(RANGES, SEG, S, GROUP, NR, srb, srs, srh, srr, src, ssb, sss, HEAD_DIM: tl.constexpr,
                  GP: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_SEGMENTS: tl.constexpr):
    """A forward / dQ scan program, grid (cdiv(S, T), Hkv, B): (g, b, its rows' tokens, query heads
    and mask, d and its mask, the [rows, D] mask, the rows' segment ids (0 without), the scan's
    [first, last) keys)."""
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    tok, head, ok = _scan_rows(tl.program_id(0) * (ROWS // GP), S, GROUP, GP, ROWS)  # int32: S is short
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    qs = 0
    if HAS_SEGMENTS:
        qs = tl.load(SEG + b * ssb + tok * sss, mask=ok, other=0)
    first, last = _scan_bounds(RANGES, b, g, tok, ok, S, NR, srb, srs, srh, srr, src, CAUSAL)
    return g, b, tok, g * GROUP + head, ok, d, d_ok, ok[:, None] & d_ok[None, :], qs, first, last


@triton.jit
def _scan_fwd_kernel(Q, K, V, O, LSE, M2, INV_L, RANGES, SEG,
                     sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sob, sos, soh, sod,
                     srb, srs, srh, srr, src, ssb, sss, S, Hq, GROUP, NR, score_mul,
                     HEAD_DIM: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                     PRECISION: tl.constexpr):
    """grid (cdiv(S, T), Hkv, B): the forward of T tokens x the group (`_fwd_kernel`'s outputs)."""
    g, b, tok, hq, ok, d, d_ok, rd_ok, qs, first, last = _scan_program(
        RANGES, SEG, S, GROUP, NR, srb, srs, srh, srr, src, ssb, sss, HEAD_DIM, GP, ROWS, BLOCK_D, CAUSAL, HAS_SEGMENTS)
    q = tl.load(_heads_at(Q, b, tok, hq, d, sqb, sqs, sqh, sqd, True), mask=rd_ok, other=0.0)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for start in range(first // BLOCK_N * BLOCK_N, last, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        vis = _scan_visible(RANGES, b, g, tok, ok, cols, S, NR, srb, srs, srh, srr, src, CAUSAL)
        if tl.max(vis.to(tl.int32)) > 0:
            k, v, ks = _scan_key_tile(K, V, SEG, b, g, cols, d, d_ok, skb, sks, skh, skd, svb, svs, svh, svd,
                                      ssb, sss, S, HAS_SEGMENTS)
            if HAS_SEGMENTS:
                vis = vis & (qs[:, None] == ks[None, :])
            s2 = tl.where(vis, tl.dot(q, tl.trans(k), input_precision=PRECISION) * score_mul, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s2, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s2 - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
    seen = l_i > 0
    inv_l = tl.where(seen, tl.div_rn(1.0, tl.where(seen, l_i, 1.0)), 0.0)
    tl.store(_heads_at(O, b, tok, hq, d, sob, sos, soh, sod, True), (acc * inv_l[:, None]).to(O.dtype.element_ty),
             mask=rd_ok)
    stat = (b * Hq + hq) * S + tok
    tl.store(LSE + stat, tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf")), mask=ok)
    tl.store(M2 + stat, tl.where(seen, m_i, float("inf")), mask=ok)
    tl.store(INV_L + stat, inv_l, mask=ok)


@triton.jit
def _scan_dq_kernel(Q, K, V, O, DO, DLSE, DQ, M2, INV_L, DELTA, RANGES, SEG,
                    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sob, sos, soh, sod,
                    sdb, sds, sdh, sdd, sgb, sgs, sgh, sgd, srb, srs, srh, srr, src, ssb, sss,
                    S, Hq, GROUP, NR, score_mul, scale,
                    HEAD_DIM: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                    HAS_DLSE: tl.constexpr, PRECISION: tl.constexpr):
    """grid (cdiv(S, T), Hkv, B): dQ of T tokens x the group over the forward's scan; stores delta
    = rowsum(dO * O) - dlse for the dK/dV kernel (`_dq_kernel`)."""
    g, b, tok, hq, ok, d, d_ok, rd_ok, qs, first, last = _scan_program(
        RANGES, SEG, S, GROUP, NR, srb, srs, srh, srr, src, ssb, sss, HEAD_DIM, GP, ROWS, BLOCK_D, CAUSAL, HAS_SEGMENTS)
    q, do, m2, inv_l, delta = _dq_rows(Q, DO, O, M2, INV_L, DLSE, DELTA, b, tok, hq, d, ok, rd_ok, sqb, sqs, sqh, sqd,
                                       sdb, sds, sdh, sdd, sob, sos, soh, sod, S, Hq, HAS_DLSE, True)
    dq = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for start in range(first // BLOCK_N * BLOCK_N, last, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        vis = _scan_visible(RANGES, b, g, tok, ok, cols, S, NR, srb, srs, srh, srr, src, CAUSAL)
        if tl.max(vis.to(tl.int32)) > 0:
            k, v, ks = _scan_key_tile(K, V, SEG, b, g, cols, d, d_ok, skb, sks, skh, skd, svb, svs, svh, svd,
                                      ssb, sss, S, HAS_SEGMENTS)
            if HAS_SEGMENTS:
                vis = vis & (qs[:, None] == ks[None, :])
            s2 = tl.dot(q, tl.trans(k), input_precision=PRECISION) * score_mul
            p = tl.where(vis, tl.exp2(s2 - m2[:, None]) * inv_l[:, None], 0.0)
            ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    tl.store(_heads_at(DQ, b, tok, hq, d, sgb, sgs, sgh, sgd, True), (dq * scale).to(DQ.dtype.element_ty),
             mask=rd_ok)


@triton.jit
def _scan_dkv_kernel(Q, K, V, DO, M2, INV_L, DELTA, RANGES, SEG, DKP, DVP,
                     sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sdb, sds, sdh, sdd,
                     srb, srs, srh, srr, src, ssb, sss, S, Hq, Hkv, NT, GROUP, NR, CHUNKS, STEPS, score_mul, scale,
                     HEAD_DIM: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                     PRECISION: tl.constexpr):
    """grid (NT * CHUNKS, Hkv, B): key tile pid // CHUNKS over token steps [chunk * STEPS, (chunk + 1)
    * STEPS) of T tokens each; writes the chunk's fp32 partial dk, dv to DKP, DVP at chunk index
    ((b * Hkv + g) * NT + tile) * CHUNKS + chunk (`_dkv_sum_kernel` adds a tile's chunks in order)."""
    tile = tl.program_id(0) // CHUNKS
    chunk = tl.program_id(0) % CHUNKS
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k, v, ks = _scan_key_tile(K, V, SEG, b, g, cols, d, d_ok, skb, sks, skh, skd, svb, svs, svh, svd, ssb, sss, S,
                              HAS_SEGMENTS)
    kT = tl.trans(k)
    vT = tl.trans(v)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    tokens = ROWS // GP
    first = chunk * STEPS
    if CAUSAL:  # earlier tokens see none of the tile
        first = tl.maximum(first, tile * BLOCK_N // tokens)
    for step in range(first, tl.minimum((chunk + 1) * STEPS, tl.cdiv(S, tokens))):
        tok, head, ok = _scan_rows(step * tokens, S, GROUP, GP, ROWS)
        vis = _scan_visible(RANGES, b, g, tok, ok, cols, S, NR, srb, srs, srh, srr, src, CAUSAL)
        if tl.max(vis.to(tl.int32)) > 0:
            hq = g * GROUP + head
            rd_ok = ok[:, None] & d_ok[None, :]
            q = tl.load(_heads_at(Q, b, tok, hq, d, sqb, sqs, sqh, sqd, True), mask=rd_ok, other=0.0)
            do = tl.load(_heads_at(DO, b, tok, hq, d, sdb, sds, sdh, sdd, True), mask=rd_ok, other=0.0)
            stat = (b * Hq + hq) * S + tok
            m2 = tl.load(M2 + stat, mask=ok, other=float("inf"))
            inv_l = tl.load(INV_L + stat, mask=ok, other=0.0)
            delta = tl.load(DELTA + stat, mask=ok, other=0.0)
            if HAS_SEGMENTS:
                vis = vis & (tl.load(SEG + b * ssb + tok * sss, mask=ok, other=0)[:, None] == ks[None, :])
            s2 = tl.dot(q, kT, input_precision=PRECISION) * score_mul
            p = tl.where(vis, tl.exp2(s2 - m2[:, None]) * inv_l[:, None], 0.0)
            dv = _add_tile(dv, tl.trans(p.to(do.dtype)), do, PRECISION)
            ds = p * (tl.dot(do, vT, input_precision=PRECISION) - delta[:, None])
            dk = _add_tile(dk, tl.trans(ds.to(q.dtype)), q, PRECISION)
    part = ((b * Hkv + g) * NT + tile) * CHUNKS + chunk
    out = part * BLOCK_N * BLOCK_D + tl.arange(0, BLOCK_N)[:, None] * BLOCK_D + d[None, :]
    tl.store(DKP + out, dk * scale)
    tl.store(DVP + out, dv)


# ----------------------------------------------------------------------------------------------
# The transpose plan of dK/dV
# ----------------------------------------------------------------------------------------------
def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _dkv_plan(spans: torch.Tensor, block_n: int, chunk: int):
    """spans int64 [B, S, Hkv, R, 2] (disjoint, sorted) -> the pieces (token, lo, hi) int32 [P] of
    every (batch row, kv head, key tile of block_n) in tile-then-token order, the chunks (tile id,
    first piece, end piece) int32 [C] of at most `chunk` pieces, and tile_chunks int32 [tiles + 1]."""
    B, S, Hkv, R, _ = spans.shape
    nt = -(-S // block_n)
    dev = spans.device
    start, end = spans[..., 0], spans[..., 1]
    valid = start < end
    b, t, h, r = valid.nonzero(as_tuple=True)
    lo_r, hi_r = start[b, t, h, r], end[b, t, h, r]
    first = lo_r // block_n
    count = (hi_r - 1) // block_n - first + 1
    parent = torch.repeat_interleave(torch.arange(count.numel(), device=dev), count)
    tile = first[parent] + torch.arange(parent.numel(), device=dev) - _exclusive_cumsum(count)[parent]
    b, t, h, r = b[parent], t[parent], h[parent], r[parent]
    lo = torch.maximum(lo_r[parent], tile * block_n)
    hi = torch.minimum(hi_r[parent], (tile + 1) * block_n)
    tile_id = (b * Hkv + h) * nt + tile
    order = torch.argsort((tile_id * S + t) * R + r)  # unique keys: one order, deterministic
    tile_id, t, lo, hi = tile_id[order], t[order], lo[order], hi[order]
    tiles = B * Hkv * nt
    per_tile = torch.bincount(tile_id, minlength=tiles)
    tile_start = _exclusive_cumsum(per_tile)
    chunks = -(-per_tile // chunk)
    chunk_tile = torch.repeat_interleave(torch.arange(tiles, device=dev), chunks)
    within = torch.arange(chunk_tile.numel(), device=dev) - _exclusive_cumsum(chunks)[chunk_tile]
    chunk_start = tile_start[chunk_tile] + within * chunk
    chunk_end = torch.minimum(chunk_start + chunk, tile_start[chunk_tile] + per_tile[chunk_tile])
    tile_chunks = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(chunks, 0)])
    i32 = torch.int32
    return ((t.to(i32), lo.to(i32), hi.to(i32)), (chunk_tile.to(i32), chunk_start.to(i32), chunk_end.to(i32)),
            tile_chunks.to(i32), nt)


# ----------------------------------------------------------------------------------------------
# Launchers and the autograd Function
# ----------------------------------------------------------------------------------------------
def _seg_args(segment_ids, q):
    if segment_ids is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
        return dummy, (0, 0)
    return segment_ids, tuple(segment_ids.stride())


def _tile(config: NSABlockSizes, field: str, block_size):
    size = getattr(config, field)
    return size if block_size is None else max(16, min(size, block_size))


def _forward(q, k, v, spans, counts, segment_ids, scale, config, block_size):
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    out = torch.empty_like(q)
    lse, m2, inv_l = (torch.empty((B, Hq, S), dtype=torch.float32, device=q.device) for _ in range(3))
    seg, seg_strides = _seg_args(segment_ids, q)
    tile = _tile(config, "block_n", block_size)
    with device_ctx(q):
        _fwd_kernel[(S, Hkv, B)](
            q, k, v, out, lse, m2, inv_l, spans, counts, seg, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            *spans.stride(), *counts.stride(), *seg_strides, S, Hq, G, scale * LOG2E,
            HEAD_DIM=D, BLOCK_G=_rows(G), BLOCK_N=tile, BLOCK_D=block_d(D),
            ONE_TILE=block_size is not None and block_size <= tile, HAS_SEGMENTS=segment_ids is not None,
            PRECISION=precision(q.dtype), num_warps=config.num_warps, num_stages=config.num_stages)
    return out, lse, m2, inv_l


def _backward(do, q, k, v, out, m2, inv_l, dlse, spans, counts, segment_ids, scale, config, block_size):
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    delta = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)  # the dQ kernel fills it
    dlse = None if dlse is None else dlse.float().contiguous()
    seg, seg_strides = _seg_args(segment_ids, q)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    common = dict(HEAD_DIM=D, BLOCK_G=_rows(G), BLOCK_D=block_d(D), HAS_SEGMENTS=segment_ids is not None,
                  PRECISION=precision(q.dtype), num_warps=config.num_warps_bwd, num_stages=config.num_stages_bwd)
    block_n = _tile(config, "block_n_dkv", block_size)
    with torch.no_grad():
        pieces, chunks, tile_chunks, nt = _dkv_plan(spans, block_n, config.chunk_dkv)
    n_chunks = chunks[0].numel()
    dkp = torch.empty((max(n_chunks, 1), block_n, block_d(D)), dtype=torch.float32, device=q.device)
    dvp = torch.empty_like(dkp)
    with device_ctx(q):
        tile = _tile(config, "block_n", block_size)
        _dq_kernel[(S, Hkv, B)](
            q, k, v, out, do, delta if dlse is None else dlse, dq, m2, inv_l, delta, spans, counts, seg,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *do.stride(), *dq.stride(), *spans.stride(),
            *counts.stride(), *seg_strides, S, Hq, G, scale * LOG2E, scale, BLOCK_N=tile,
            ONE_TILE=block_size is not None and block_size <= tile, HAS_DLSE=dlse is not None, **common)
        if n_chunks:
            _dkv_kernel[(n_chunks,)](
                q, k, v, do, m2, inv_l, delta, seg, *pieces, *chunks, dkp, dvp, *q.stride(), *k.stride(),
                *v.stride(), *do.stride(), *seg_strides, S, Hq, Hkv, nt, G, scale * LOG2E, scale,
                BLOCK_N=block_n, TOKENS=max(1, config.tokens_dkv * MIN_ROWS // _rows(G)), **common)
        _dkv_sum_kernel[(B * Hkv * nt,)](
            dkp, dvp, tile_chunks, dk, dv, *dk.stride(), *dv.stride(), S, Hkv, nt, HEAD_DIM=D, BLOCK_N=block_n,
            BLOCK_D=block_d(D), num_warps=8)
    return dq, dk, dv


class SelectionFn(torch.autograd.Function):
    """Triton forward + backward of selection attention over canonical ranges. Outputs (out, lse),
    both differentiable (a cotangent on lse enters as delta -= dlse)."""

    @staticmethod
    def forward(ctx, q, k, v, spans, counts, segment_ids, scale, config, block_size):
        out, lse, m2, inv_l = _forward(q, k, v, spans, counts, segment_ids, scale, config, block_size)
        ctx.save_for_backward(q, k, v, out, m2, inv_l, spans, counts, segment_ids)
        ctx.opts = (scale, config, block_size)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, m2, inv_l, spans, counts, segment_ids = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, m2, inv_l, dlse, spans, counts, segment_ids,
                               *ctx.opts)
        return dq, dk, dv, None, None, None, None, None, None


def selection(q, k, v, ranges, *, scale: float, segment_ids=None, block_size=None, config: NSABlockSizes = None):
    """(out [B, S, Hq, D], lse [B, Hq, S] fp32) of selection attention over canonical ranges
    [B, S, Hkv, R, 2] (see `reference.selection`: disjoint, the non-empty ones first)."""
    config = config or default_nsa_block_sizes(q.shape[3], q.dtype, q.is_cuda and not INTERPRETED)
    B, S, Hq, _ = q.shape
    if q.numel() == 0 or k.shape[2] == 0:
        return zeros_like_connected(q), torch.full((B, Hq, S), float("-inf"), device=q.device)
    spans = ranges.to(torch.int32).contiguous()
    counts = (spans[..., 0] < spans[..., 1]).sum(-1, dtype=torch.int32)  # the non-empty ranges lead
    ids = None if segment_ids is None else segment_ids.contiguous()  # its own integer dtype: no wrap-around
    return SelectionFn.apply(q, k, v, spans, counts, ids, scale, config, block_size)


def _scan_rows_per_tile(G: int, interpret: bool) -> tuple[int, int]:
    """(padded group GP, rows of a scan tile): about 64 rows on a GPU (16 in the interpreter), at
    most 16 tokens, at least the smallest dot."""
    gp = triton.next_power_of_2(G)
    tokens = max(1, min(16, (MIN_ROWS if interpret else 64) // gp))
    return gp, max(MIN_ROWS, tokens * gp)


def _scan_common(q, ranges, segment_ids, config):
    B, S, Hq, D = q.shape
    G = Hq // ranges.shape[2]
    gp, rows = _scan_rows_per_tile(G, not q.is_cuda or INTERPRETED)
    seg, seg_strides = _seg_args(segment_ids, q)
    return (B, S, Hq, G, gp, rows), (seg, seg_strides), (*ranges.stride(), ranges.shape[3])


class RangesScanFn(torch.autograd.Function):
    """Triton forward + backward of selection attention over raw ranges [B, S, Hkv, R, 2] int32 on
    short sequences (the scan kernels). Outputs (out, lse), both differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, ranges, segment_ids, scale, causal, config):
        (B, S, Hq, G, gp, rows), (seg, seg_strides), (*r_strides, nr) = _scan_common(q, ranges, segment_ids, config)
        Hkv, D = k.shape[2], q.shape[3]
        out = torch.empty_like(q)
        lse, m2, inv_l = (torch.empty((B, Hq, S), dtype=torch.float32, device=q.device) for _ in range(3))
        with device_ctx(q):
            _scan_fwd_kernel[(triton.cdiv(S, rows // gp), Hkv, B)](
                q, k, v, out, lse, m2, inv_l, ranges, seg, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                *r_strides, *seg_strides, S, Hq, G, nr, scale * LOG2E,
                HEAD_DIM=D, GP=gp, ROWS=rows, BLOCK_N=config.block_n, BLOCK_D=block_d(D), CAUSAL=causal,
                HAS_SEGMENTS=segment_ids is not None, PRECISION=precision(q.dtype), num_warps=config.num_warps,
                num_stages=config.num_stages)
        ctx.save_for_backward(q, k, v, out, m2, inv_l, ranges, segment_ids)
        ctx.opts = (scale, causal, config)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, m2, inv_l, ranges, segment_ids = ctx.saved_tensors
        scale, causal, config = ctx.opts
        do = torch.zeros_like(out) if dout is None else dout.contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        (B, S, Hq, G, gp, rows), (seg, seg_strides), (*r_strides, nr) = _scan_common(q, ranges, segment_ids, config)
        Hkv, D = k.shape[2], q.shape[3]
        delta = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)  # the dQ kernel fills it
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        block_n = config.block_n_dkv
        nt, steps = triton.cdiv(S, block_n), triton.cdiv(S, rows // gp)
        # few key tiles (short sequences): each tile's token walk cut into chunks, about 256 programs
        chunks = max(1, min(steps, 256 // (nt * B * Hkv)))
        per_chunk = triton.cdiv(steps, chunks)
        dkp = torch.empty((B * Hkv * nt * chunks, block_n, block_d(D)), dtype=torch.float32, device=q.device)
        dvp = torch.empty_like(dkp)
        tile_chunks = torch.arange(0, B * Hkv * nt + 1, device=q.device, dtype=torch.int32) * chunks
        common = dict(HEAD_DIM=D, GP=gp, ROWS=rows, BLOCK_D=block_d(D), CAUSAL=causal,
                      HAS_SEGMENTS=segment_ids is not None, PRECISION=precision(q.dtype),
                      num_warps=config.num_warps_bwd, num_stages=config.num_stages_bwd)
        with device_ctx(q):
            _scan_dq_kernel[(steps, Hkv, B)](
                q, k, v, out, do, delta if dlse is None else dlse, dq, m2, inv_l, delta, ranges, seg,
                *q.stride(), *k.stride(), *v.stride(), *out.stride(), *do.stride(), *dq.stride(), *r_strides,
                *seg_strides, S, Hq, G, nr, scale * LOG2E, scale, BLOCK_N=config.block_n, HAS_DLSE=dlse is not None,
                **common)
            _scan_dkv_kernel[(nt * chunks, Hkv, B)](
                q, k, v, do, m2, inv_l, delta, ranges, seg, dkp, dvp, *q.stride(), *k.stride(), *v.stride(),
                *do.stride(), *r_strides, *seg_strides, S, Hq, Hkv, nt, G, nr, chunks, per_chunk, scale * LOG2E,
                scale, BLOCK_N=block_n, **common)
            _dkv_sum_kernel[(B * Hkv * nt,)](
                dkp, dvp, tile_chunks, dk, dv, *dk.stride(), *dv.stride(), S, Hkv, nt, HEAD_DIM=D, BLOCK_N=block_n,
                BLOCK_D=block_d(D), num_warps=8)
        return dq, dk, dv, None, None, None, None, None


def selection_ranges(q, k, v, ranges, *, causal: bool, scale: float, segment_ids=None, config: NSABlockSizes = None):
    """(out, lse) of selection attention over raw ranges [B, S, Hkv, R, 2] (their union, clipped to
    the sequence and, causal, to keys <= t; validated). Up to spec.RANGES_SCAN_KEYS tokens the scan
    kernels take them as they are; beyond, their canonical form goes to `selection`."""
    config = config or default_nsa_block_sizes(q.shape[3], q.dtype, q.is_cuda and not INTERPRETED)
    B, S, Hq, _ = q.shape
    if q.numel() == 0 or k.shape[2] == 0 or ranges.shape[3] == 0:
        return zeros_like_connected(q), torch.full((B, Hq, S), float("-inf"), device=q.device)
    if S > spec.RANGES_SCAN_KEYS:
        with torch.no_grad():
            spans = reference.canonical_ranges(ranges, causal, S)
        return selection(q, k, v, spans, scale=scale, segment_ids=segment_ids, config=config)
    ids = None if segment_ids is None else segment_ids.contiguous()
    return RangesScanFn.apply(q, k, v, ranges.to(torch.int32).contiguous(), ids, scale, bool(causal), config)


# ----------------------------------------------------------------------------------------------
# Compression branch
# ----------------------------------------------------------------------------------------------
def compress_kv(k, v, *, block: int, stride: int, params=None):
    """Mean pooling or the MLP: one unfold and matmuls (plain torch ops, `reference.compress_kv`)."""
    return reference.compress_kv(k, v, block=block, stride=stride, params=params)


def compression(q, k_cmp, v_cmp, *, block: int, stride: int, scale: float, segment_ids=None, config=None):
    """Compression attention on the softmax kernels: queries t = block - 1 + m * stride + r (r <
    stride) all see blocks 0..m, so row m of a causal attention over the Nc compressed keys serves
    the stride queries of fold r. The folds become batch rows (B * stride; the compressed keys a
    stride-0 view where B = 1), so the kernels keep the GQA group and their parallelism; with segment
    ids each fold has its own query ids, doubled, and a block's id is
    `reference.compressed_segments`' (a straddling block matches no query). Queries t < block - 1
    see no block: out 0, lse -inf."""
    from ... import api  # the softmax entry point (validated, differentiable)

    B, S, Hq, D = q.shape
    Nc = k_cmp.shape[1]
    head = block - 1
    if Nc == 0:
        return zeros_like_connected(q), torch.full((B, Hq, S), float("-inf"), device=q.device)
    rows = Nc * stride  # folded queries: t in [head, head + rows) (the tail past S is padding)
    qf = torch.nn.functional.pad(q[:, head:], (0, 0, 0, 0, 0, rows - (S - head)))
    qf = qf.reshape(B, Nc, stride, Hq, D).transpose(1, 2).reshape(B * stride, Nc, Hq, D)
    kf, vf = (x[:, None].expand(B, stride, *x.shape[1:]).reshape(B * stride, *x.shape[1:]) for x in (k_cmp, v_cmp))
    ids = None
    if segment_ids is not None:
        q_ids = torch.nn.functional.pad(2 * segment_ids[:, head:].to(torch.int64), (0, rows - (S - head)))
        q_ids = q_ids.reshape(B, Nc, stride).transpose(1, 2).reshape(B * stride, Nc)
        kv_ids = reference.compressed_segments(segment_ids, block, stride)
        ids = (q_ids, kv_ids[:, None].expand(B, stride, Nc).reshape(B * stride, Nc))
    o, lse = api.flash_attention(qf, kf, vf, causal=True, scale=scale, segment_ids=ids, return_lse=True,
                                 implementation="triton")
    o = o.reshape(B, stride, Nc, Hq, D).transpose(1, 2).reshape(B, rows, Hq, D)
    lse = lse.reshape(B, stride, Hq, Nc).permute(0, 2, 3, 1).reshape(B, Hq, rows)
    o = torch.cat([o.new_zeros((B, head, Hq, D)), o[:, :S - head]], dim=1)
    lse = torch.cat([lse.new_full((B, Hq, head), float("-inf")), lse[..., :S - head]], dim=-1)
    return o, lse


# ----------------------------------------------------------------------------------------------
# Gates: one pass over the branches' outputs, forward and backward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _combine_fwd_kernel(G, OC, OS, OW, OUT, N, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows r of the flattened [N, D] outputs: out = g0 o_cmp + g1 o_slc (+ g2 o_win), fp32."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < N
    mask = r_ok[:, None] & (d < HEAD_DIM)[None, :]
    at = r[:, None] * HEAD_DIM + d[None, :]
    g0 = tl.load(G + r * 3, mask=r_ok, other=0.0).to(tl.float32)
    g1 = tl.load(G + r * 3 + 1, mask=r_ok, other=0.0).to(tl.float32)
    out = g0[:, None] * tl.load(OC + at, mask=mask, other=0.0).to(tl.float32)
    out += g1[:, None] * tl.load(OS + at, mask=mask, other=0.0).to(tl.float32)
    if HAS_WINDOW:
        g2 = tl.load(G + r * 3 + 2, mask=r_ok, other=0.0).to(tl.float32)
        out += g2[:, None] * tl.load(OW + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + at, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _combine_bwd_kernel(DOUT, G, OC, OS, OW, DG, DOC, DOS, DOW, N, HEAD_DIM: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """d o_i = g_i dout, d g_i = sum_d dout o_i (fp32 products, stored in the tensors' dtypes)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < N
    mask = r_ok[:, None] & (d < HEAD_DIM)[None, :]
    at = r[:, None] * HEAD_DIM + d[None, :]
    dout = tl.load(DOUT + at, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(3):
        if i < 2 or HAS_WINDOW:
            if i == 0:
                src, dst = OC, DOC
            elif i == 1:
                src, dst = OS, DOS
            else:
                src, dst = OW, DOW
            g = tl.load(G + r * 3 + i, mask=r_ok, other=0.0).to(tl.float32)
            o = tl.load(src + at, mask=mask, other=0.0).to(tl.float32)
            tl.store(dst + at, (g[:, None] * dout).to(dst.dtype.element_ty), mask=mask)
            tl.store(DG + r * 3 + i, tl.sum(dout * o, axis=1).to(DG.dtype.element_ty), mask=r_ok)


_COMBINE_ROWS = 16


class CombineFn(torch.autograd.Function):
    """The gated sum of the branches (`reference.combine`) in one pass; o_win may be None."""

    @staticmethod
    def forward(ctx, gates, o_cmp, o_slc, o_win):
        gates, o_cmp, o_slc = (x.contiguous() for x in (gates, o_cmp, o_slc))
        o_win = None if o_win is None else o_win.contiguous()
        out = torch.empty_like(o_cmp)
        D = o_cmp.shape[-1]
        N = o_cmp.numel() // max(D, 1)
        if N:
            with device_ctx(o_cmp):
                _combine_fwd_kernel[(triton.cdiv(N, _COMBINE_ROWS),)](
                    gates, o_cmp, o_slc, o_cmp if o_win is None else o_win, out, N, HEAD_DIM=D,
                    HAS_WINDOW=o_win is not None, BLOCK_R=_COMBINE_ROWS, BLOCK_D=triton.next_power_of_2(D))
        ctx.save_for_backward(gates, o_cmp, o_slc, o_win)
        return out

    @staticmethod
    def backward(ctx, dout):
        gates, o_cmp, o_slc, o_win = ctx.saved_tensors
        dout = dout.contiguous()
        dg = torch.zeros_like(gates)
        doc, dos = torch.empty_like(o_cmp), torch.empty_like(o_slc)
        dow = None if o_win is None else torch.empty_like(o_win)
        D = o_cmp.shape[-1]
        N = o_cmp.numel() // max(D, 1)
        if N:
            with device_ctx(o_cmp):
                _combine_bwd_kernel[(triton.cdiv(N, _COMBINE_ROWS),)](
                    dout, gates, o_cmp, o_slc, o_cmp if o_win is None else o_win, dg, doc, dos,
                    doc if dow is None else dow, N, HEAD_DIM=D, HAS_WINDOW=o_win is not None, BLOCK_R=_COMBINE_ROWS,
                    BLOCK_D=triton.next_power_of_2(D))
        return dg, doc, dos, dow


def combine(gates, o_cmp, o_slc, o_win=None, config=None):
    """`reference.combine` in one pass (`CombineFn`)."""
    return CombineFn.apply(gates, o_cmp, o_slc, o_win)


# ----------------------------------------------------------------------------------------------
# Block selection: importance (chunks of queries) and the top-n rule
# ----------------------------------------------------------------------------------------------
def _top_n(keys, num_selected: int):
    """The rule of `reference.top_n` from the importance kernel's unique int64 keys [..., Nsel]
    (importance bits << 32 | Nsel - 1 - j, forced blocks with +inf's bits, -1 beyond the frontier):
    one torch.topk (unique keys: one answer, ties to the lower index), decoded, ascending, -1 last."""
    Nsel = keys.shape[-1]
    top = torch.topk(keys, num_selected, dim=-1, sorted=False).values
    big = torch.iinfo(torch.int32).max
    idx = torch.where(top >= 0, (Nsel - 1) - (top & 0xFFFFFFFF), big)
    idx = torch.sort(idx, dim=-1).values
    return torch.where(idx == big, -1, idx).to(torch.int32)


@triton.jit
def _importance_kernel(Q, KC, LSE, SEG, BLK_SEG, KEYS, t0, C, S, Nc, Nsel, NJ, GROUP,
                       sqb, sqs, sqh, sqd, skb, sks, skh, skd, slb, slh, sls, ssb, sss, sbb, sbn,
                       sib, sis, sih, sij, score_mul,
                       BLOCK: tl.constexpr, STRIDE: tl.constexpr, SELECT: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
                       IDENTITY: tl.constexpr, HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr):
    """grid (cdiv(C, BLOCK_M), Hkv * NJ, B): KEYS[b, t - t0, g, j] (int64, `_top_n`'s) of the
    importance of selection block j for query t in [t0, t0 + C) (a tile of BLOCK_J blocks): the sum
    over compression blocks i (the tile's overlap range, block-causal) of overlap[i, j] * the sum over
    the group's heads h of 2^(s2 - lse2) (the compression softmax's probabilities). IDENTITY (block
    == stride == select): overlap is the identity and the compression tile is the selection tile
    (BLOCK_I == BLOCK_J); else an fp32 (IEEE) product with the overlap tile, from the geometry."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1) // NJ
    jt = tl.program_id(1) % NJ
    b = tl.program_id(2).to(tl.int64)
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = local < C
    t = (t0 + local).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    j = jt * BLOCK_J + tl.arange(0, BLOCK_J)
    j_lo = jt * BLOCK_J
    j_hi = tl.minimum(j_lo + BLOCK_J, Nsel)
    t_max = tl.minimum(t0 + tl.minimum((pid_m + 1) * BLOCK_M, C), S) - 1
    # the compression blocks that share a key with the tile, and are complete at t_max
    # (no division of negatives: compiled Triton truncates, the interpreter floors)
    i_lo = tl.where(j_lo * SELECT >= BLOCK, (tl.maximum(j_lo * SELECT - BLOCK, 0)) // STRIDE + 1, 0)
    i_hi = tl.minimum(Nc, (j_hi * SELECT + STRIDE - 1) // STRIDE)
    i_hi = tl.minimum(i_hi, tl.where(t_max >= BLOCK - 1, tl.maximum(t_max - BLOCK + 1, 0) // STRIDE + 1, 0))
    qs = 0
    if HAS_SEGMENTS:
        qs = 2 * tl.load(SEG + b * ssb + t * sss, mask=m_ok, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    for i0 in range(i_lo, i_hi, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        i_ok = i < i_hi
        vis = m_ok[:, None] & i_ok[None, :] & (i[None, :] * STRIDE + BLOCK - 1 <= t[:, None])
        if HAS_SEGMENTS:
            blk = tl.load(BLK_SEG + b * sbb + i * sbn, mask=i_ok, other=0)
            vis = vis & (blk[None, :] == qs[:, None])
        kcT = tl.trans(tl.load(KC + b * skb + g * skh + i[:, None] * sks + d[None, :] * skd,
                               mask=i_ok[:, None] & d_ok[None, :], other=0.0))
        psum = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
        for h in range(GROUP):
            hq = g * GROUP + h
            q = tl.load(Q + b * sqb + t[:, None] * sqs + hq * sqh + d[None, :] * sqd,
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            lse2 = tl.load(LSE + b * slb + hq * slh + t * sls, mask=m_ok, other=float("-inf")) * 1.4426950408889634
            seen = lse2 > float("-inf")
            s2 = tl.dot(q, kcT, input_precision=PRECISION) * score_mul
            psum += tl.where(vis & seen[:, None], tl.exp2(s2 - tl.where(seen, lse2, 0.0)[:, None]), 0.0)
        if IDENTITY:
            acc += psum
        else:
            ov = ((i[:, None] * STRIDE < (j[None, :] + 1) * SELECT)
                  & (i[:, None] * STRIDE + BLOCK > j[None, :] * SELECT)).to(tl.float32)
            acc = tl.dot(psum, ov, acc, input_precision="ieee")
    # the top-n's keys (`_top_n`): importance bits (order-preserving for floats >= 0; forced blocks
    # +inf), then the reversed index (equal importances: the lower index larger); -1 beyond t's frontier
    own = t // SELECT
    forced = (j[None, :] == 0) | (j[None, :] == own[:, None] - 1) | (j[None, :] == own[:, None])
    bits = tl.where(forced, float("inf"), acc).to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(j[None, :] > own[:, None], -1, (bits << 32) | (Nsel - 1 - j[None, :]).to(tl.int64))
    tl.store(KEYS + b * sib + local[:, None] * sis + g * sih + j[None, :] * sij, key,
             mask=m_ok[:, None] & (j < Nsel)[None, :])


def select_blocks(q, k_cmp, lse_cmp, *, block: int, stride: int, select_block: int, num_selected: int,
                  scale: float, segment_ids=None, config: NSABlockSizes = None):
    """int32 [B, S, Hkv, num_selected]: the importance of query_chunk queries at a time as top-n keys
    int64 [B, chunk, Hkv, Nsel] (`_importance_kernel`; never the [B, S, Hq, Nc] probabilities), and
    each chunk's top-n by one torch.topk (`_top_n`)."""
    config = config or default_nsa_block_sizes(q.shape[3], q.dtype, q.is_cuda and not INTERPRETED)
    B, S, Hq, D = q.shape
    Nc, Hkv = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    Nsel = spec.selection_count(S, select_block)
    out = torch.empty((B, S, Hkv, num_selected), dtype=torch.int32, device=q.device)
    identity = block == stride == select_block
    block_j = config.block_imp if identity else max(16, config.block_imp // 4)
    nj = triton.cdiv(Nsel, block_j)
    if segment_ids is None:
        seg = blk = torch.zeros(1, dtype=torch.int64, device=q.device)
        seg_strides = (0, 0, 0, 0)
    else:
        seg, blk = segment_ids, reference.compressed_segments(segment_ids, block, stride)
        seg_strides = (*seg.stride(), *blk.stride())
    with torch.no_grad(), device_ctx(q):
        for t0 in range(0, S, config.query_chunk):
            C = min(config.query_chunk, S - t0)
            keys = torch.empty((B, C, Hkv, Nsel), dtype=torch.int64, device=q.device)
            _importance_kernel[(triton.cdiv(C, config.block_imp), Hkv * nj, B)](
                q, k_cmp, lse_cmp, seg, blk, keys, t0, C, S, Nc, Nsel, nj, G, *q.stride(), *k_cmp.stride(),
                *lse_cmp.stride(), *seg_strides, *keys.stride(), scale * LOG2E, BLOCK=block, STRIDE=stride,
                SELECT=select_block, HEAD_DIM=D, BLOCK_M=config.block_imp,
                BLOCK_I=block_j if identity else config.block_imp, BLOCK_J=block_j, BLOCK_D=block_d(D),
                IDENTITY=identity, HAS_SEGMENTS=segment_ids is not None, PRECISION=precision(q.dtype),
                num_warps=config.num_warps_imp, num_stages=config.num_stages)
            out[:, t0:t0 + C] = _top_n(keys, num_selected)
    return out
