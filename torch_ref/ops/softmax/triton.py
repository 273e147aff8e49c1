"""Triton kernels for FlashAttention (forward, dK/dV, dQ) and their launch wrappers.

Read top to bottom: block configuration, the softmax device helpers, the forward kernel, the two
backward kernels, the host-side launchers, then the autograd Function `FlashAttentionFn` that
`torch_ref.api.flash_attention` calls. The helpers both variants share (tile loads, RoPE, launch
helpers) live in `torch_ref.ops.common.triton_tiles`.

Layout is BSHD everywhere: q/o/dq `[B, Sq, Hq, D]`, k/v/dk/dv `[B, Sk, Hkv, D]`; strides are
passed explicitly so any strided view works. Softmax statistics are fp32. Internally the kernels
work in base 2 (`exp2`, log2(e) folded into the score multiplier: s2 = s * log2 e).

Row statistics: the forward writes the public natural-log `lse` and, for the backward, the
base-2 row max `m2` and `inv_l = 1 / sum_j 2^(s2_ij - m2)` (all `[B, Hq, Sq]` fp32). The backward
recomputes P = 2^(s2 - m2) * inv_l: unlike 2^(s2 - lse2), it does not lose ulp(lse2) of absolute
accuracy in the exponent, which matters for fp32 gradients. Rows with no visible key store
m2 = +inf and inv_l = 0 (so P = 0), out 0 and lse = -inf.

Masking model: a key block is either *interior* (every key visible to every real query row of the
tile, ignoring segments) or *boundary*. Blocks that no row of the tile can see are never visited;
interior blocks skip the positional mask; boundary blocks (diagonal, window edges, the ragged end
of the sequence) apply it. Segment ids are data, so with segments every visited block is masked.

RoPE (constexpr ROPE, ROPE_INTERLEAVED; see "RoPE helpers" in `triton_tiles`): q and k tiles are rotated in
registers right after their load, in every kernel; v is not rotated. The RoPE branches are
compile-time: with ROPE=False they add only unused arguments.

Row map (constexprs RATE, HEADS, KV_HEADS, HEAD_BASE, FIXED_OFFSET; `attn_spec.dilation.RowMap`,
docs/design/dilated.md "The slot view"): dilated attention runs the kernels over a slot view
`x.reshape(B', rows, RATE * heads, D)`. Grid head h is global head g = HEAD_BASE + h with offset
o = g % RATE (or FIXED_OFFSET >= 0); it reads q / dO at head slot o * HEADS + g, k / v at slot
o * KV_HEADS + g // GROUP, segment-id row b * RATE + o, and writes out / lse / stats / dq compact at
head h. The identity (RATE 1, HEAD_BASE 0, the defaults) is ordinary attention: `_row_map` then
returns (h, h // GROUP, b), the very values the kernels used before the map existed, and nothing
else is emitted. With per-head offsets inside a GQA group (DKV_PER_QHEAD) the dK/dV kernel runs
one program per query head and writes dk, dv per query head; the caller sums each group.

Dropout (constexprs DROPOUT, the rate, and DROP_THRESHOLD; DROP_ROWS [B, Hq, Sq] and DROP_COLS [Sk],
the rows' and keys' hashes of `attn_spec.dropout`, built once per call by `hash_dropout` and padded
for mask-free loads; DROP_SCALE, 1 / (1 - rate) as a run-time scalar, see `triton_dropout.weight`):
each tile's mask is their product against the threshold, so the backward kernels regenerate the
forward's. The forward drops the probabilities after their sum l (the lse stays the softmax's) and
before the PV product, and scales its output rows once; dK/dV takes the kept probabilities, scaled,
for dV and drops and scales dP; dQ drops and scales dP; dS = P * (dP - delta) with delta_i = sum_d
dO_i O_i - dlse_i as without dropout. DROPOUT = 0 (the default) compiles none of it, and the tables are
then None (constexprs): the kernels are those without dropout.

Orderings (constexprs ORDERED, SCATTER; ORIG, its strides, Ssrc and BATCH_DIV;
docs/design/orderings.md): the tiles are those of an ordered sequence whose row t is token
ORIG[bs, t] of q, k, v (whole [B, Ssrc, H, D] arrays, batch row b // BATCH_DIV, global heads), so
every load gathers its rows through ORIG (clamped to Ssrc - 1: padding rows of a row map carry
positions past the end); the window compares ordered positions, causality the ORIG values.
SCATTER: out, lse, the statistics and dq, dk, dv live in the original order and are stored at
those rows (flash attention); else compact, in the ordered layout (a row map's branches). ORDERED
= False (the default) compiles none of it.

Importing this module imports triton: the interpreter (`TRITON_INTERPRET=1`) must be chosen in
the environment before that happens.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from attn_spec import dropout as plan
from attn_spec.dilation import RowMap
from attn_spec.tiles import BlockSizes

from ..common import triton_dropout as drop
from ..common.triton_tiles import (INTERPRETED, block_d, device_ctx, load_2d, load_own, load_rotated,
                                   precision, rope_args, store_unrotated)
from ..common.validation import MAX_HEAD_DIM
from ..common.visit import block_ranges

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # usable inside @triton.jit
# The dK/dV kernel recomputes P = 2^(s2 - m2) * inv_l with the forward's m2 and inv_l, which is
# exact only if its scores are the forward's bit for bit. Compiled, an fp32 tl.dot is a chain of
# FMAs over d for each element, the same for k @ q^T as for q @ k^T. The interpreter's tl.dot is
# np.matmul, i.e. the machine's BLAS, whose kernel and summation order depend on the operand shapes,
# layouts and the CPU: k @ q^T [BLOCK_N, BLOCK_M] does not round like the forward's q @ k^T
# [BLOCK_M, BLOCK_N] (docs/design/parity.md, 'Why fp32 pins exact matmuls').
# So the interpreted dK/dV kernel computes its scores as the forward does (same tiles, same
# layouts, same call) and transposes them; the compiled kernel keeps k @ q^T.
_FWD_SCORES = tl.constexpr(INTERPRETED)


# ----------------------------------------------------------------------------------------------
# Block configuration
# ----------------------------------------------------------------------------------------------
def default_block_sizes(head_dim: int, dtype: torch.dtype, on_gpu: bool) -> BlockSizes:
    """Heuristic on head dim and element size.

    GPU tiles (sized for Hopper, H100/H200: up to 227 KB of shared memory) shrink as the head dim
    (registers for the fp32 accumulators) and the element size (shared memory for the pipelined
    K/V or Q/dO tiles) grow.
    The interpreter gets small tiles so CPU tests stay fast while still exercising ragged edges.
    """
    padded = block_d(head_dim)
    if not on_gpu:
        return BlockSizes(block_q=16, block_k=32, num_warps=4, num_stages=1, block_q_dkv=16, block_k_dkv=32,
                          block_q_dq=16, block_k_dq=32, num_warps_bwd=4, num_stages_bwd=1)
    wide = dtype == torch.float32  # fp32 tiles take twice the shared memory
    # (block_q, block_k, warps, stages), (block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, warps, stages). The 16-bit
    # choices are the fastest of a tile sweep (bf16, B*H = 64, S = 4096, causal and not); fp32
    # ones are sized to fit shared memory.
    if padded <= 64:
        fwd = (128, 64, 4, 3) if not wide else (64, 64, 4, 2)
        bwd = (32, 128, 128, 32, 4, 3) if not wide else (32, 64, 64, 32, 4, 2)
    elif padded <= 128:
        fwd = (64, 64, 4, 3) if not wide else (64, 32, 4, 2)
        bwd = (32, 64, 64, 32, 4, 3) if not wide else (16, 64, 64, 16, 4, 2)
    else:  # 256
        fwd = (128, 64, 8, 2) if not wide else (32, 32, 4, 1)
        bwd = (32, 64, 64, 32, 8, 2) if not wide else (16, 32, 32, 16, 4, 1)
    fields = ("block_q", "block_k", "num_warps", "num_stages", "block_q_dkv", "block_k_dkv", "block_q_dq",
              "block_k_dq", "num_warps_bwd", "num_stages_bwd")
    return BlockSizes(**dict(zip(fields, (*fwd, *bwd))))


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    """fp32 tanh within ~2 ulp (no libdevice, so it also runs in the interpreter).

    |x| >= 0.55: 1 - 2 / (e^{2|x|} + 1) has no cancellation there (tanh > 0.5; |x| is clamped
    at 15, where this already rounds to 1, so exp2 never overflows). |x| < 0.55: odd Taylor series
    to x^15 (truncation < 1 ulp there).
    """
    a = tl.abs(x)
    big = 1.0 - 2.0 / (tl.exp2(tl.minimum(a, 15.0) * 2.8853900817779268) + 1.0)
    a2 = a * a
    p = -0.0014558343870513183
    p = p * a2 + 0.003592128036572481
    p = p * a2 - 0.008863235529902197
    p = p * a2 + 0.021869488536155203
    p = p * a2 - 0.05396825396825397
    p = p * a2 + 0.13333333333333333
    p = p * a2 - 0.3333333333333333
    small = a + a * a2 * p
    r = tl.where(a < 0.55, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def _scores(qk, score_mul, cap_mul, HAS_SOFTCAP: tl.constexpr):
    """Raw dot products -> base-2 scores s2 = log2(e) * s, plus t = tanh(.) for the softcap.

    No softcap: s2 = qk * (scale * log2 e).  Softcap c: t = tanh(qk * scale / c), s2 = t * c log2 e.
    """
    if HAS_SOFTCAP:
        t = _tanh(qk * score_mul)
        s2 = t * cap_mul
    else:
        t = qk  # unused
        s2 = qk * score_mul
    return s2, t


@triton.jit
def _alibi(s2, slope2, rows, cols, base):
    """s2 - slope2 |rows - cols| (log2 units; rows, cols broadcastable int positions). Both are
    taken relative to `base`, a position of the tile, and converted to float before the subtract:
    per element a float subtract instead of an integer abs and an int-to-float conversion (a
    quarter-rate instruction); exact while positions lie within 2^24 of the tile. Under an ordering
    rows and cols are the tokens' original positions, base 0."""
    return s2 - slope2 * tl.abs((rows - base).to(tl.float32) - (cols - base).to(tl.float32))


@triton.jit
def _visible(qi, kj, Sq, Sk, qs, ks, left, right, POSITIONAL: tl.constexpr, IS_CAUSAL: tl.constexpr,
             HAS_WINDOW: tl.constexpr, HAS_SEGMENTS: tl.constexpr, qo=0, ko=0, ORDERED: tl.constexpr = False):
    """Visibility of key kj to query qi; the operands are pre-broadcast 2-D index tiles
    ([M, 1] x [1, N] or transposed), so the same helper serves both tile orientations.
    Rows/keys past the sequence ends are always invisible (keeps them out of row/col tests).
    ORDERED: qi, kj are ordered positions and qo, ko the original ones, which causality compares."""
    vis = (qi < Sq) & (kj < Sk)
    if POSITIONAL:
        if IS_CAUSAL and ORDERED:
            vis = vis & (ko <= qo)
        elif IS_CAUSAL:
            vis = vis & (kj <= qi)
        if HAS_WINDOW:
            vis = vis & (kj >= qi - left) & (kj <= qi + right)
    if HAS_SEGMENTS:
        vis = vis & (qs == ks)
    return vis


@triton.jit
def _row_map(h, b, GROUP, RATE: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_BASE: tl.constexpr,
             FIXED_OFFSET: tl.constexpr, ORDERED: tl.constexpr = False):
    """(q head slot, kv head slot, segment-id row) of grid head h in batch row b (see the module
    docstring). The identity map returns (h, h // GROUP, b) and emits nothing more. ORDERED: the
    rows are gathered from the unviewed arrays, so the heads are the global ones."""
    if ORDERED:
        g = HEAD_BASE + h
        if FIXED_OFFSET >= 0:
            o = FIXED_OFFSET
        else:
            o = g % RATE
        hq = g
        hk = g // GROUP
        bs = b * RATE + o
    elif RATE == 1 and HEAD_BASE == 0:
        hq = h
        hk = h // GROUP
        bs = b
    else:
        g = HEAD_BASE + h
        if FIXED_OFFSET >= 0:
            o = FIXED_OFFSET
        else:
            o = g % RATE
        hq = o * HEADS + g
        hk = o * KV_HEADS + g // GROUP
        bs = b * RATE + o
    return hq, hk, bs


@triton.jit
def _kv_row_map(hk, b, GROUP, RATE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_BASE: tl.constexpr,
                FIXED_OFFSET: tl.constexpr, ORDERED: tl.constexpr = False):
    """(kv head slot, segment-id row) of the dK/dV kernel's grid kv head hk when its whole GQA group
    shares one offset (the host checks that); the identity returns (hk, b). ORDERED: the global
    kv head (rows gathered from the unviewed arrays)."""
    if ORDERED:
        g0 = HEAD_BASE + hk * GROUP
        if FIXED_OFFSET >= 0:
            o = FIXED_OFFSET
        else:
            o = g0 % RATE
        hk_slot = HEAD_BASE // GROUP + hk
        bs = b * RATE + o
    elif RATE == 1 and HEAD_BASE == 0:
        hk_slot = hk
        bs = b
    else:
        g0 = HEAD_BASE + hk * GROUP  # the group's first global q head
        if FIXED_OFFSET >= 0:
            o = FIXED_OFFSET
        else:
            o = g0 % RATE
        hk_slot = o * KV_HEADS + HEAD_BASE // GROUP + hk
        bs = b * RATE + o
    return hk_slot, bs


@triton.jit
def _gathered(orig_base, sors, idx, ok, Ssrc, ORDERED: tl.constexpr):
    """(rows read, original positions) of ordered positions idx: the ORIG entries, clamped into the
    source's Ssrc rows; without an ordering (idx, idx)."""
    if ORDERED:
        o = tl.load(orig_base + idx * sors, mask=ok, other=0)
        return tl.minimum(o, Ssrc - 1), o
    else:
        return idx, idx


@triton.jit
def _visited(RANGES, block):
    """(lo, plain_lo, plain_hi, hi) of `block` in the visit plan (`attn_spec.visit.block_table`)."""
    row = RANGES + block * 4
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, q2, qs, k_base, v_base, ks_base, kp_base, sks, skd, svs, svd, sks_s, skp_s,
               theta, offs_m, offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right, score_mul, cap_mul, slope2, aoff,
               drop_rows, DROP_COLS, blk_lo, blk_hi, ko_base, sors, Ssrc, qo,
               BLOCK_N: tl.constexpr, HALF: tl.constexpr, CHECK_D: tl.constexpr, CHECK_H: tl.constexpr,
               POSITIONAL: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_SEGMENTS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ROPE: tl.constexpr,
               ROPE_INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr,
               DROPOUT: tl.constexpr, DROP_THRESHOLD: tl.constexpr, ORDERED: tl.constexpr):
    """With ROPE, q and q2 are the rotated pair halves of the query tile; otherwise q is the tile.
    With DROPOUT, drop_rows are the query rows' dropout bits ([BLOCK_M, 1]). ORDERED: key rows
    gathered through ORIG (ko_base), qo the query rows' original positions ([BLOCK_M, 1])."""
    for blk in range(blk_lo, blk_hi):
        cols = blk * BLOCK_N + offs_n
        n_ok = cols < Sk
        krow, ko = _gathered(ko_base, sors, cols, n_ok, Ssrc, ORDERED)
        # Interior blocks lie inside [0, Sk): no bounds check on their loads.
        if ROPE:
            kT, kT2 = load_rotated(k_base, cols, n_ok, sks, skd, kp_base, skp_s, theta, offs_h, h_ok, HALF,
                                   POSITIONAL, CHECK_H, ROPE_INTERLEAVED, True)
            qk = tl.dot(q, kT, input_precision=PRECISION)
            qk = tl.dot(q2, kT2, qk, input_precision=PRECISION)
        else:
            kT = load_2d(k_base + offs_d[:, None] * skd + krow[None, :] * sks, d_ok, n_ok, CHECK_D, POSITIONAL)
            qk = tl.dot(q, kT, input_precision=PRECISION)
        s2, t = _scores(qk, score_mul, cap_mul, HAS_SOFTCAP)
        if HAS_ALIBI and ORDERED:  # the tokens' original distance
            s2 = _alibi(s2, slope2, qo, ko[None, :], 0)
        elif HAS_ALIBI:  # -slope |i + offset - j|, in log2 units
            s2 = _alibi(s2, slope2, offs_m[:, None] + aoff, cols[None, :], blk * BLOCK_N)
        v = load_2d(v_base + krow[:, None] * svs + offs_d[None, :] * svd, n_ok, d_ok, POSITIONAL, CHECK_D)
        if POSITIONAL or HAS_SEGMENTS:
            ks = 0
            if HAS_SEGMENTS:
                ks = tl.load(ks_base + cols * sks_s, mask=n_ok, other=0)[None, :]
            vis = _visible(offs_m[:, None], cols[None, :], Sq, Sk, qs, ks, left, right, POSITIONAL,
                           IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, qo, ko[None, :], ORDERED)
            s2 = tl.where(vis, s2, float("-inf"))
            # A key no row of the tile sees must not reach the PV product: 0 * NaN = NaN.
            col_ok = tl.max(vis.to(tl.int32), axis=0) > 0
            v = tl.where(col_ok[:, None], v, 0.0)
        m_new = tl.maximum(m_i, tl.max(s2, axis=1))
        # Rows with nothing visible so far keep m = -inf; shift by a safe 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s2 - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DROPOUT > 0:  # l is the softmax's sum; dropout acts on the probabilities after it
            p = drop.kept_only(p, drop.keep(drop_rows, drop.bits(DROP_COLS, cols)[None, :], DROP_THRESHOLD))
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, M2, INV_L, QSEG, KSEG, THETA, QPOS, KPOS, RANGES, ALIBI,
                sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sob, sos, soh, sod,
                sqsb, sqss, sksb, skss, sqpb, sqps, skpb, skps,
                Hq, GROUP, Sq, Sk, score_mul, cap_mul, left, right, aoff, DROP_ROWS, DROP_COLS, DROP_SCALE,
                ORIG, sorb, sors, Ssrc, BATCH_DIV,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_H: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_SEGMENTS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ROPE: tl.constexpr,
                ROPE_INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr,
                RATE: tl.constexpr = 1, HEADS: tl.constexpr = 1, KV_HEADS: tl.constexpr = 1,
                HEAD_BASE: tl.constexpr = 0, FIXED_OFFSET: tl.constexpr = -1, DROPOUT: tl.constexpr = 0.0,
                DROP_THRESHOLD: tl.constexpr = 0, ORDERED: tl.constexpr = False, SCATTER: tl.constexpr = False):
    """grid (cdiv(Sq, BLOCK_M), Hq, B). Writes O [B, Sq, Hq, D]; LSE, M2, INV_L [B, Hq, Sq].
    With ROPE: THETA [D/2] fp32, QPOS [B, Sq], KPOS [B, Sk] integer positions. With a row map, Hq
    is the grid's head count and Q, K, V are slot views (the module docstring). ORDERED / SCATTER:
    rows gathered through ORIG (the module docstring)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hq, hk, bs = _row_map(h, b, GROUP, RATE, HEADS, KV_HEADS, HEAD_BASE, FIXED_OFFSET, ORDERED)
    bsrc = b  # the batch row of q, k, v
    if ORDERED:
        bsrc = b // BATCH_DIV
    hk = hk.to(tl.int64)
    slope2 = 0.0  # ALiBi slope of this head, times log2(e)
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + h)
    CHECK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    HALF: tl.constexpr = HEAD_DIM // 2
    CHECK_H: tl.constexpr = BLOCK_H != HALF

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Sq
    d_ok = offs_d < HEAD_DIM
    orig_base = ORIG + bs * sorb
    qrow, qo = _gathered(orig_base, sors, offs_m, m_ok, Ssrc, ORDERED)

    q, q2, offs_h, h_ok, theta = load_own(Q + bsrc * sqb + hq * sqh, qrow, m_ok, sqs, sqd, QPOS + b * sqpb, sqps,
                                          THETA, offs_d, d_ok, score_mul, HEAD_DIM, BLOCK_H, CHECK_D, ROPE,
                                          ROPE_INTERLEAVED)
    kp_base = KPOS
    if ROPE:
        kp_base = KPOS + b * skpb
    qs = 0
    if HAS_SEGMENTS:
        qs = tl.load(QSEG + bs * sqsb + offs_m * sqss, mask=m_ok, other=0)[:, None]
    k_base = K + bsrc * skb + hk * skh
    v_base = V + bsrc * svb + hk * svh
    ks_base = KSEG + bs * sksb

    drop_rows = None  # the query rows' dropout bits
    if DROPOUT > 0:
        drop_rows = drop.bits(DROP_ROWS + (b * Hq + h) * Sq, offs_m)[:, None]

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    b_lo, f_lo, f_hi, b_hi = _visited(RANGES, pid_m)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q2, qs, k_base, v_base, ks_base, kp_base, sks, skd, svs, svd, skss,
                               skps, theta, offs_m, offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right,
                               score_mul, cap_mul, slope2, aoff, drop_rows, DROP_COLS, b_lo, f_lo, orig_base, sors, Ssrc,
                               qo[:, None], BLOCK_N, HALF, CHECK_D,
                               CHECK_H, True, IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, HAS_SOFTCAP, ROPE,
                               ROPE_INTERLEAVED, PRECISION, HAS_ALIBI, DROPOUT, DROP_THRESHOLD, ORDERED)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q2, qs, k_base, v_base, ks_base, kp_base, sks, skd, svs, svd, skss,
                               skps, theta, offs_m, offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right,
                               score_mul, cap_mul, slope2, aoff, drop_rows, DROP_COLS, f_lo, f_hi, orig_base, sors, Ssrc,
                               qo[:, None], BLOCK_N, HALF, CHECK_D,
                               CHECK_H, False, IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, HAS_SOFTCAP, ROPE,
                               ROPE_INTERLEAVED, PRECISION, HAS_ALIBI, DROPOUT, DROP_THRESHOLD, ORDERED)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q2, qs, k_base, v_base, ks_base, kp_base, sks, skd, svs, svd, skss,
                               skps, theta, offs_m, offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right,
                               score_mul, cap_mul, slope2, aoff, drop_rows, DROP_COLS, f_hi, b_hi, orig_base, sors, Ssrc,
                               qo[:, None], BLOCK_N, HALF, CHECK_D,
                               CHECK_H, True, IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, HAS_SOFTCAP, ROPE,
                               ROPE_INTERLEAVED, PRECISION, HAS_ALIBI, DROPOUT, DROP_THRESHOLD, ORDERED)

    # A row that saw no key has l = 0 and acc = 0: out 0, lse -inf, m2 = +inf, inv_l = 0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    inv_l = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), l_safe)  # correctly rounded, once a row
    if DROPOUT > 0:  # the kept probabilities' 1 / (1 - rate), once a row
        out = acc * (inv_l * DROP_SCALE)[:, None]
    else:
        out = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    orow = offs_m  # the rows out and the statistics are stored at
    if SCATTER:
        orow = qrow
    o_ptrs = O + b * sob + h * soh + orow[:, None] * sos + offs_d[None, :] * sod
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    row = (b * Hq + h) * Sq + orow
    tl.store(LSE + row, lse, mask=m_ok)
    tl.store(M2 + row, tl.where(empty, float("inf"), m_i), mask=m_ok)
    tl.store(INV_L + row, tl.where(empty, 0.0, inv_l), mask=m_ok)


# ----------------------------------------------------------------------------------------------
# Backward: dK/dV (one program per key tile and kv head, looping over its GQA group's q heads)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _dkdv_inner(dk, dk2, dv, k, k2, kT, kT2, v, ks, q_base, do_base, m2_base, inv_l_base, delta_base, qs_base,
                qp_base, sqs, sqd, sdos, sdod, sqss, sqps, theta, offs_m, offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk,
                left, right, score_mul, cap_mul, slope2, aoff, drop_rows, drop_cols, drop_scale, blk_lo, blk_hi,
                qo_base, sors, Ssrc, ko,
                BLOCK_M: tl.constexpr, HALF: tl.constexpr, CHECK_D: tl.constexpr, CHECK_H: tl.constexpr,
                POSITIONAL: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_SEGMENTS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ROPE: tl.constexpr,
                ROPE_INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr,
                DROPOUT: tl.constexpr, DROP_THRESHOLD: tl.constexpr, ORDERED: tl.constexpr,
                SCATTER: tl.constexpr):
    # Tiles are transposed ([keys, queries]) so dK, dV accumulate as [BLOCK_N, D] without trans.
    # With ROPE, (k, k2) and (dk, dk2) are the pair halves (rotated k; gradient w.r.t. it).
    # (kT, kT2): the key tile as the forward loads it, used only if _FWD_SCORES (interpreter).
    # With DROPOUT: drop_rows, the head's row bits (a pointer); drop_cols, the keys' bits ([BLOCK_N, 1]).
    # ORDERED: query rows gathered through ORIG (qo_base); ko: the key rows' original positions
    # ([BLOCK_N, 1]); SCATTER: the row statistics in the original order.
    for blk in range(blk_lo, blk_hi):
        rows = blk * BLOCK_M + offs_m
        m_ok = rows < Sq
        qrow, qo = _gathered(qo_base, sors, rows, m_ok, Ssrc, ORDERED)
        srow = rows
        if SCATTER:
            srow = qrow
        if _FWD_SCORES:  # the forward's scores bit for bit (see _FWD_SCORES), transposed
            if ROPE:
                qr, qr2 = load_rotated(q_base, rows, m_ok, sqs, sqd, qp_base, sqps, theta, offs_h, h_ok, HALF,
                                       POSITIONAL, CHECK_H, ROPE_INTERLEAVED, False)
                qk = tl.dot(qr, kT, input_precision=PRECISION)
                qk = tl.trans(tl.dot(qr2, kT2, qk, input_precision=PRECISION))
                qT = tl.trans(qr)
                qT2 = tl.trans(qr2)
            else:
                qr = load_2d(q_base + qrow[:, None] * sqs + offs_d[None, :] * sqd, m_ok, d_ok, POSITIONAL, CHECK_D)
                qk = tl.trans(tl.dot(qr, kT, input_precision=PRECISION))
                qT = tl.trans(qr)
        elif ROPE:
            qT, qT2 = load_rotated(q_base, rows, m_ok, sqs, sqd, qp_base, sqps, theta, offs_h, h_ok, HALF,
                                   POSITIONAL, CHECK_H, ROPE_INTERLEAVED, True, True)
            qk = tl.dot(k, qT, input_precision=PRECISION)
            qk = tl.dot(k2, qT2, qk, input_precision=PRECISION)
        else:
            qT = load_2d(q_base + offs_d[:, None] * sqd + qrow[None, :] * sqs, d_ok, m_ok, CHECK_D, POSITIONAL)
            qk = tl.dot(k, qT, input_precision=PRECISION)
        s2T, tT = _scores(qk, score_mul, cap_mul, HAS_SOFTCAP)
        if HAS_ALIBI and ORDERED:
            s2T = _alibi(s2T, slope2, qo[None, :], ko, 0)
        elif HAS_ALIBI:
            s2T = _alibi(s2T, slope2, rows[None, :] + aoff, offs_n[:, None], blk * BLOCK_M)
        if POSITIONAL:
            m2 = tl.load(m2_base + srow, mask=m_ok, other=float("inf"))
            inv_l = tl.load(inv_l_base + srow, mask=m_ok, other=0.0)
            delta = tl.load(delta_base + srow, mask=m_ok, other=0.0)
        else:
            m2 = tl.load(m2_base + srow)
            inv_l = tl.load(inv_l_base + srow)
            delta = tl.load(delta_base + srow)
        # Rows that saw no key have m2 = +inf, inv_l = 0: p = 0.
        pT = tl.exp2(s2T - m2[None, :]) * inv_l[None, :]
        do = load_2d(do_base + qrow[:, None] * sdos + offs_d[None, :] * sdod, m_ok, d_ok, POSITIONAL, CHECK_D)
        q = tl.trans(qT)
        if ROPE:
            q2 = tl.trans(qT2)
        if POSITIONAL or HAS_SEGMENTS:
            qs = 0
            if HAS_SEGMENTS:
                qs = tl.load(qs_base + rows * sqss, mask=m_ok, other=0)[None, :]
            visT = _visible(rows[None, :], offs_n[:, None], Sq, Sk, qs, ks, left, right, POSITIONAL,
                            IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, qo[None, :], ko, ORDERED)
            pT = tl.where(visT, pT, 0.0)
            # Queries that see no key of this tile must not reach dK through 0 * NaN.
            row_ok = tl.max(visT.to(tl.int32), axis=0) > 0
            q = tl.where(row_ok[:, None], q, 0.0)
            if ROPE:
                q2 = tl.where(row_ok[:, None], q2, 0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if DROPOUT > 0:  # dV takes the kept probabilities, dP the mask
            keptT = drop.keep(drop.bits(drop_rows, rows)[None, :], drop_cols, DROP_THRESHOLD)
            wT = drop.weight(keptT, drop_scale)
            dv = tl.dot((pT * wT).to(do.dtype), do, dv, input_precision=PRECISION)
            dsT = pT * (dpT * wT - delta[None, :])
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
            dsT = pT * (dpT - delta[None, :])
        if HAS_SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)
        if POSITIONAL or HAS_SEGMENTS:
            dsT = tl.where(visT, dsT, 0.0)  # dpT is NaN where a masked value is NaN
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
        if ROPE:
            dk2 = tl.dot(dsT.to(q.dtype), q2, dk2, input_precision=PRECISION)
    return dk, dk2, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, M2, INV_L, DELTA, DK, DV, QSEG, KSEG, THETA, QPOS, KPOS, RANGES, ALIBI,
                     sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                     sdob, sdos, sdoh, sdod, sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd,
                     sqsb, sqss, sksb, skss, sqpb, sqps, skpb, skps,
                     Hq, GROUP, Sq, Sk, score_mul, cap_mul, sm_scale, left, right, aoff, DROP_ROWS, DROP_COLS, DROP_SCALE,
                     ORIG, sorb, sors, Ssrc, BATCH_DIV,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_H: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     HAS_SEGMENTS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ROPE: tl.constexpr,
                     ROPE_INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr,
                     RATE: tl.constexpr = 1, HEADS: tl.constexpr = 1, KV_HEADS: tl.constexpr = 1,
                     HEAD_BASE: tl.constexpr = 0, FIXED_OFFSET: tl.constexpr = -1,
                     DKV_PER_QHEAD: tl.constexpr = False, DROPOUT: tl.constexpr = 0.0,
                     DROP_THRESHOLD: tl.constexpr = 0, ORDERED: tl.constexpr = False,
                     SCATTER: tl.constexpr = False):
    """grid (cdiv(Sk, BLOCK_N), Hkv, B). dK, dV of one key tile summed over the GQA group
    in registers, in a fixed order: deterministic, no atomics. With ROPE the group's q heads are
    rotated by the q positions of the batch row, and dK is rotated back (R^T) before the store.
    With a row map: grid (cdiv(Sk, BLOCK_N), grid kv heads, B), DK / DV compact per grid kv head;
    DKV_PER_QHEAD: grid (cdiv(Sk, BLOCK_N), grid q heads, B), one q head per program, DK / DV
    compact per q head (its kv head read through the map)."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if DKV_PER_QHEAD:
        hq0 = tl.program_id(1)
        _, hk_slot, bs = _row_map(hq0, b, GROUP, RATE, HEADS, KV_HEADS, HEAD_BASE, FIXED_OFFSET, ORDERED)
        hk_slot = hk_slot.to(tl.int64)
        n_heads = 1
    else:
        hk_slot, bs = _kv_row_map(hk, b, GROUP, RATE, KV_HEADS, HEAD_BASE, FIXED_OFFSET, ORDERED)
        n_heads = GROUP
    bsrc = b  # the batch row of q, k, v, dO
    if ORDERED:
        bsrc = b // BATCH_DIV
    CHECK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    HALF: tl.constexpr = HEAD_DIM // 2
    CHECK_H: tl.constexpr = BLOCK_H != HALF

    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < Sk
    d_ok = offs_d < HEAD_DIM
    orig_base = ORIG + bs * sorb
    krow, ko = _gathered(orig_base, sors, offs_n, n_ok, Ssrc, ORDERED)

    k, k2, offs_h, h_ok, theta = load_own(K + bsrc * skb + hk_slot * skh, krow, n_ok, sks, skd, KPOS + b * skpb,
                                          skps, THETA, offs_d, d_ok, score_mul, HEAD_DIM, BLOCK_H, CHECK_D, ROPE,
                                          ROPE_INTERLEAVED, True)
    qp_base = QPOS
    if ROPE:
        qp_base = QPOS + b * sqpb
    v = load_2d(V + bsrc * svb + hk_slot * svh + krow[:, None] * svs + offs_d[None, :] * svd, n_ok, d_ok, True,
                CHECK_D)
    ks = 0
    if HAS_SEGMENTS:
        ks = tl.load(KSEG + bs * sksb + offs_n * skss, mask=n_ok, other=0)[:, None]
    qs_base = QSEG + bs * sqsb
    kT = k  # placeholders unless _FWD_SCORES
    kT2 = k2
    if _FWD_SCORES:  # the key tile as _fwd_inner loads it
        if ROPE:
            kT, kT2 = load_rotated(K + b * skb + hk_slot * skh, offs_n, n_ok, sks, skd, KPOS + b * skpb, skps, theta,
                                   offs_h, h_ok, HALF, True, CHECK_H, ROPE_INTERLEAVED, True)
        else:
            kT = load_2d(K + bsrc * skb + hk_slot * skh + offs_d[:, None] * skd + krow[None, :] * sks, d_ok, n_ok,
                         CHECK_D, True)
            kT2 = kT

    if ROPE:
        dk = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
        dk2 = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    else:
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dk2 = dk  # unused placeholder
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    drop_cols = None  # the keys' dropout bits
    if DROPOUT > 0:
        drop_cols = drop.bits(DROP_COLS, offs_n)[:, None]
    b_lo, f_lo, f_hi, b_hi = _visited(RANGES, pid_n)
    for g in range(n_heads):
        if DKV_PER_QHEAD:
            h = hq0 + g
        else:
            h = hk * GROUP + g
        hq, _hk, _bs = _row_map(h, b, GROUP, RATE, HEADS, KV_HEADS, HEAD_BASE, FIXED_OFFSET, ORDERED)
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(ALIBI + h)
        drop_rows = DROP_ROWS  # query head h's rows of dropout bits
        if DROPOUT > 0:
            drop_rows = DROP_ROWS + (b * Hq + h) * Sq
        q_base = Q + bsrc * sqb + hq * sqh
        do_base = DO + bsrc * sdob + hq * sdoh
        m2_base = M2 + (b * Hq + h) * Sq
        inv_l_base = INV_L + (b * Hq + h) * Sq
        delta_base = DELTA + (b * Hq + h) * Sq
        dk, dk2, dv = _dkdv_inner(dk, dk2, dv, k, k2, kT, kT2, v, ks, q_base, do_base, m2_base, inv_l_base,
                                  delta_base, qs_base, qp_base, sqs, sqd, sdos, sdod, sqss, sqps, theta, offs_m,
                                  offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right, score_mul, cap_mul, slope2,
                                  aoff, drop_rows, drop_cols, DROP_SCALE, b_lo, f_lo, orig_base, sors, Ssrc, ko[:, None], BLOCK_M,
                                  HALF, CHECK_D, CHECK_H, True,
                                  IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, HAS_SOFTCAP, ROPE, ROPE_INTERLEAVED, PRECISION,
                                  HAS_ALIBI, DROPOUT, DROP_THRESHOLD, ORDERED, SCATTER)
        dk, dk2, dv = _dkdv_inner(dk, dk2, dv, k, k2, kT, kT2, v, ks, q_base, do_base, m2_base, inv_l_base,
                                  delta_base, qs_base, qp_base, sqs, sqd, sdos, sdod, sqss, sqps, theta, offs_m,
                                  offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right, score_mul, cap_mul, slope2,
                                  aoff, drop_rows, drop_cols, DROP_SCALE, f_lo, f_hi, orig_base, sors, Ssrc, ko[:, None], BLOCK_M,
                                  HALF, CHECK_D, CHECK_H, False,
                                  IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, HAS_SOFTCAP, ROPE, ROPE_INTERLEAVED, PRECISION,
                                  HAS_ALIBI, DROPOUT, DROP_THRESHOLD, ORDERED, SCATTER)
        dk, dk2, dv = _dkdv_inner(dk, dk2, dv, k, k2, kT, kT2, v, ks, q_base, do_base, m2_base, inv_l_base,
                                  delta_base, qs_base, qp_base, sqs, sqd, sdos, sdod, sqss, sqps, theta, offs_m,
                                  offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right, score_mul, cap_mul, slope2,
                                  aoff, drop_rows, drop_cols, DROP_SCALE, f_hi, b_hi, orig_base, sors, Ssrc, ko[:, None], BLOCK_M,
                                  HALF, CHECK_D, CHECK_H, True,
                                  IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, HAS_SOFTCAP, ROPE, ROPE_INTERLEAVED, PRECISION,
                                  HAS_ALIBI, DROPOUT, DROP_THRESHOLD, ORDERED, SCATTER)

    if ROPE:
        # ds/dk' = scale * q' (the softcap factor is already in ds); dk = R^T dk'
        store_unrotated(DK + b * sdkb + hk * sdkh, offs_n, n_ok, sdks, sdkd, dk * sm_scale, dk2 * sm_scale,
                        KPOS + b * skpb, skps, theta, offs_h, h_ok, HALF, ROPE_INTERLEAVED)
        tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvs + offs_d[None, :] * sdvd,
                 dv.to(DV.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])
    else:
        dk = dk * sm_scale  # ds/dk = scale * q (the softcap factor is already in ds)
        mask = n_ok[:, None] & d_ok[None, :]
        orow = offs_n  # SCATTER: back to the keys' original rows
        if SCATTER:
            orow = krow
        tl.store(DK + b * sdkb + hk * sdkh + orow[:, None] * sdks + offs_d[None, :] * sdkd,
                 dk.to(DK.dtype.element_ty), mask=mask)
        tl.store(DV + b * sdvb + hk * sdvh + orow[:, None] * sdvs + offs_d[None, :] * sdvd,
                 dv.to(DV.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Backward: dQ (one program per query tile and q head)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _dq_inner(dq, dq2, q, q2, do, m2, inv_l, delta, qs, k_base, v_base, ks_base, kp_base, sks, skd, svs, svd,
              sks_s, skp_s, theta, offs_m, offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right, score_mul,
              cap_mul, slope2, aoff, drop_rows, DROP_COLS, drop_scale, blk_lo, blk_hi, ko_base, sors, Ssrc, qo,
              BLOCK_N: tl.constexpr, HALF: tl.constexpr, CHECK_D: tl.constexpr, CHECK_H: tl.constexpr,
              POSITIONAL: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_SEGMENTS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ROPE: tl.constexpr,
              ROPE_INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr,
              DROPOUT: tl.constexpr, DROP_THRESHOLD: tl.constexpr, ORDERED: tl.constexpr):
    """With ROPE, (q, q2) and (dq, dq2) are the pair halves (rotated q; gradient w.r.t. it). With
    DROPOUT, drop_rows are the query rows' dropout bits ([BLOCK_M, 1]). ORDERED: key rows gathered
    through ORIG (ko_base), qo the query rows' original positions ([BLOCK_M, 1])."""
    for blk in range(blk_lo, blk_hi):
        cols = blk * BLOCK_N + offs_n
        n_ok = cols < Sk
        krow, ko = _gathered(ko_base, sors, cols, n_ok, Ssrc, ORDERED)
        if ROPE:
            kT, kT2 = load_rotated(k_base, cols, n_ok, sks, skd, kp_base, skp_s, theta, offs_h, h_ok, HALF,
                                   POSITIONAL, CHECK_H, ROPE_INTERLEAVED, True)
        else:
            kT = load_2d(k_base + offs_d[:, None] * skd + krow[None, :] * sks, d_ok, n_ok, CHECK_D, POSITIONAL)
        vT = load_2d(v_base + offs_d[:, None] * svd + krow[None, :] * svs, d_ok, n_ok, CHECK_D, POSITIONAL)
        qk = tl.dot(q, kT, input_precision=PRECISION)
        if ROPE:
            qk = tl.dot(q2, kT2, qk, input_precision=PRECISION)
        s2, t = _scores(qk, score_mul, cap_mul, HAS_SOFTCAP)
        if HAS_ALIBI and ORDERED:
            s2 = _alibi(s2, slope2, qo, ko[None, :], 0)
        elif HAS_ALIBI:
            s2 = _alibi(s2, slope2, offs_m[:, None] + aoff, cols[None, :], blk * BLOCK_N)
        p = tl.exp2(s2 - m2[:, None]) * inv_l[:, None]
        dp = tl.dot(do, vT, input_precision=PRECISION)
        if DROPOUT > 0:
            kept = drop.keep(drop_rows, drop.bits(DROP_COLS, cols)[None, :], DROP_THRESHOLD)
            ds = p * (dp * drop.weight(kept, drop_scale) - delta[:, None])
        else:
            ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        if POSITIONAL or HAS_SEGMENTS:
            ks = 0
            if HAS_SEGMENTS:
                ks = tl.load(ks_base + cols * sks_s, mask=n_ok, other=0)[None, :]
            vis = _visible(offs_m[:, None], cols[None, :], Sq, Sk, qs, ks, left, right, POSITIONAL,
                           IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, qo, ko[None, :], ORDERED)
            ds = tl.where(vis, ds, 0.0)
            col_ok = tl.max(vis.to(tl.int32), axis=0) > 0
            kT = tl.where(col_ok[None, :], kT, 0.0)  # keep 0 * NaN out of dQ
            if ROPE:
                kT2 = tl.where(col_ok[None, :], kT2, 0.0)
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)
        if ROPE:
            dq2 = tl.dot(ds.to(kT.dtype), tl.trans(kT2), dq2, input_precision=PRECISION)
    return dq, dq2


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, M2, INV_L, DELTA, DQ, QSEG, KSEG, THETA, QPOS, KPOS, RANGES, ALIBI,
                   sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                   sdob, sdos, sdoh, sdod, sdqb, sdqs, sdqh, sdqd,
                   sqsb, sqss, sksb, skss, sqpb, sqps, skpb, skps,
                   Hq, GROUP, Sq, Sk, score_mul, cap_mul, sm_scale, left, right, aoff, DROP_ROWS, DROP_COLS, DROP_SCALE,
                   ORIG, sorb, sors, Ssrc, BATCH_DIV,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_H: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_SEGMENTS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ROPE: tl.constexpr,
                   ROPE_INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   RATE: tl.constexpr = 1, HEADS: tl.constexpr = 1, KV_HEADS: tl.constexpr = 1,
                   HEAD_BASE: tl.constexpr = 0, FIXED_OFFSET: tl.constexpr = -1, DROPOUT: tl.constexpr = 0.0,
                   DROP_THRESHOLD: tl.constexpr = 0, ORDERED: tl.constexpr = False, SCATTER: tl.constexpr = False):
    """grid (cdiv(Sq, BLOCK_M), Hq, B). With ROPE, dQ is rotated back (R^T) before the store. With a
    row map, Hq is the grid's head count, Q, K, V, DO are slot views and DQ is compact. ORDERED /
    SCATTER: rows gathered through ORIG (the module docstring)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hq, hk, bs = _row_map(h, b, GROUP, RATE, HEADS, KV_HEADS, HEAD_BASE, FIXED_OFFSET, ORDERED)
    bsrc = b  # the batch row of q, k, v, dO
    if ORDERED:
        bsrc = b // BATCH_DIV
    hk = hk.to(tl.int64)
    slope2 = 0.0  # ALiBi slope of this head, times log2(e)
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + h)
    CHECK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    HALF: tl.constexpr = HEAD_DIM // 2
    CHECK_H: tl.constexpr = BLOCK_H != HALF

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Sq
    d_ok = offs_d < HEAD_DIM
    orig_base = ORIG + bs * sorb
    qrow, qo = _gathered(orig_base, sors, offs_m, m_ok, Ssrc, ORDERED)
    orow = offs_m  # the rows of the statistics and of dq
    if SCATTER:
        orow = qrow

    q, q2, offs_h, h_ok, theta = load_own(Q + bsrc * sqb + hq * sqh, qrow, m_ok, sqs, sqd, QPOS + b * sqpb, sqps,
                                          THETA, offs_d, d_ok, score_mul, HEAD_DIM, BLOCK_H, CHECK_D, ROPE,
                                          ROPE_INTERLEAVED)
    kp_base = KPOS
    if ROPE:
        kp_base = KPOS + b * skpb
    do = load_2d(DO + bsrc * sdob + hq * sdoh + qrow[:, None] * sdos + offs_d[None, :] * sdod, m_ok, d_ok, True,
                 CHECK_D)
    row = (b * Hq + h) * Sq + orow
    m2 = tl.load(M2 + row, mask=m_ok, other=float("inf"))  # empty rows: m2 = +inf, inv_l = 0: p = 0
    inv_l = tl.load(INV_L + row, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + row, mask=m_ok, other=0.0)
    qs = 0
    if HAS_SEGMENTS:
        qs = tl.load(QSEG + bs * sqsb + offs_m * sqss, mask=m_ok, other=0)[:, None]
    k_base = K + bsrc * skb + hk * skh
    v_base = V + bsrc * svb + hk * svh
    ks_base = KSEG + bs * sksb

    drop_rows = None  # the query rows' dropout bits
    if DROPOUT > 0:
        drop_rows = drop.bits(DROP_ROWS + (b * Hq + h) * Sq, offs_m)[:, None]

    if ROPE:
        dq = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        dq2 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    else:
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq2 = dq  # unused placeholder
    b_lo, f_lo, f_hi, b_hi = _visited(RANGES, pid_m)
    dq, dq2 = _dq_inner(dq, dq2, q, q2, do, m2, inv_l, delta, qs, k_base, v_base, ks_base, kp_base, sks, skd, svs,
                        svd, skss, skps, theta, offs_m, offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right,
                        score_mul, cap_mul, slope2, aoff, drop_rows, DROP_COLS, DROP_SCALE, b_lo, f_lo, orig_base, sors, Ssrc, qo[:, None],
                        BLOCK_N, HALF, CHECK_D, CHECK_H,
                        True, IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, HAS_SOFTCAP, ROPE, ROPE_INTERLEAVED, PRECISION,
                        HAS_ALIBI, DROPOUT, DROP_THRESHOLD, ORDERED)
    dq, dq2 = _dq_inner(dq, dq2, q, q2, do, m2, inv_l, delta, qs, k_base, v_base, ks_base, kp_base, sks, skd, svs,
                        svd, skss, skps, theta, offs_m, offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right,
                        score_mul, cap_mul, slope2, aoff, drop_rows, DROP_COLS, DROP_SCALE, f_lo, f_hi, orig_base, sors, Ssrc, qo[:, None],
                        BLOCK_N, HALF, CHECK_D, CHECK_H,
                        False, IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, HAS_SOFTCAP, ROPE, ROPE_INTERLEAVED, PRECISION,
                        HAS_ALIBI, DROPOUT, DROP_THRESHOLD, ORDERED)
    dq, dq2 = _dq_inner(dq, dq2, q, q2, do, m2, inv_l, delta, qs, k_base, v_base, ks_base, kp_base, sks, skd, svs,
                        svd, skss, skps, theta, offs_m, offs_n, offs_d, offs_h, d_ok, h_ok, Sq, Sk, left, right,
                        score_mul, cap_mul, slope2, aoff, drop_rows, DROP_COLS, DROP_SCALE, f_hi, b_hi, orig_base, sors, Ssrc, qo[:, None],
                        BLOCK_N, HALF, CHECK_D, CHECK_H,
                        True, IS_CAUSAL, HAS_WINDOW, HAS_SEGMENTS, HAS_SOFTCAP, ROPE, ROPE_INTERLEAVED, PRECISION,
                        HAS_ALIBI, DROPOUT, DROP_THRESHOLD, ORDERED)
    if ROPE:
        store_unrotated(DQ + b * sdqb + h * sdqh, offs_m, m_ok, sdqs, sdqd, dq * sm_scale, dq2 * sm_scale,
                        QPOS + b * sqpb, sqps, theta, offs_h, h_ok, HALF, ROPE_INTERLEAVED)
    else:
        dq = dq * sm_scale
        tl.store(DQ + b * sdqb + h * sdqh + orow[:, None] * sdqs + offs_d[None, :] * sdqd,
                 dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Launch wrappers
# ----------------------------------------------------------------------------------------------
def _score_constants(scale: float, softcap: float | None) -> tuple[float, float]:
    if softcap is None:
        return scale * LOG2E, 1.0
    return scale / softcap, softcap * LOG2E


def _segment_args(q_ids, kv_ids, q):
    """Segment tensors and their strides; dummies (never read) when there are none."""
    if q_ids is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
        return dummy, dummy, (0, 0, 0, 0)
    return q_ids, kv_ids, (q_ids.stride(0), q_ids.stride(1), kv_ids.stride(0), kv_ids.stride(1))


def _alibi_args(alibi, q):
    """(slopes times log2(e) [Hq] fp32, offset) for the kernels; a dummy (never read) without ALiBi."""
    if alibi is None:
        return torch.zeros(1, dtype=torch.float32, device=q.device), 0
    slopes, offset = alibi
    return (slopes.to(q.device, torch.float32) * LOG2E).contiguous(), int(offset)


def map_constexprs(row_map: RowMap) -> dict:
    """The kernels' row-map constexprs of `row_map`."""
    return dict(RATE=row_map.rate, HEADS=row_map.heads, KV_HEADS=row_map.kv_heads, HEAD_BASE=row_map.head_base,
                FIXED_OFFSET=-1 if row_map.offset is None else row_map.offset)


def dkv_per_query_head(row_map: RowMap | None, grid_heads: int) -> bool:
    """Whether `backward` writes dk, dv per query head (the caller sums each GQA group): when the
    heads of a GQA group read different offsets (per-head offsets, rate > 1), or when the grid's
    heads do not cover whole groups (head groups of a size or start not a multiple of the group)."""
    if row_map is None:
        return False
    group = row_map.heads // row_map.kv_heads
    if group == 1:
        return False
    if row_map.rate > 1 and row_map.offset is None:
        return True
    return row_map.head_base % group != 0 or grid_heads % group != 0


def _map_launch(row_map: RowMap | None, grid_heads: int | None, Hq: int, Hkv: int):
    """(grid heads, GQA group, row-map constexprs) of a launch; none for the identity."""
    if row_map is None:
        return Hq, Hq // Hkv, {}
    return grid_heads, row_map.heads // row_map.kv_heads, map_constexprs(row_map)


@functools.lru_cache(maxsize=256)
def _ordered_ranges(causal: bool, window, q_len: int, kv_len: int, block_q: int, block_k: int, *, key_major: bool,
                    device: torch.device) -> torch.Tensor:
    """The visit plan of an ordered sequence: the window's tiles (causality on original positions
    bounds no tile), every one masked when causal (cached: do not modify)."""
    table = block_ranges(False, window, q_len, kv_len, block_q, block_k, key_major=key_major, device=device)
    if causal:
        table = torch.cat([table[:, :1], table[:, 3:].expand(-1, 3)], dim=1).contiguous()
    return table


def _ranges(causal, window, gather, q_len, kv_len, block_q, block_k, *, key_major, device):
    plan = block_ranges if gather is None else _ordered_ranges
    return plan(causal, window, q_len, kv_len, block_q, block_k, key_major=key_major, device=device)


def _gather_args(gather, q):
    """(ORIG, its strides, Ssrc, BATCH_DIV) and constexprs of a launch; gather = (orig [R, L] int32,
    scatter, batch_div) or None (dummies, never read)."""
    if gather is None:
        return (torch.zeros(1, dtype=torch.int32, device=q.device), 0, 0, 1, 1), {}
    orig, scatter, batch_div = gather
    return (orig, orig.stride(0), orig.stride(1), q.shape[1], batch_div), dict(ORDERED=True, SCATTER=bool(scatter))


def _flags(causal, window, q_ids, softcap):
    return dict(IS_CAUSAL=bool(causal), HAS_WINDOW=window is not None, HAS_SEGMENTS=q_ids is not None,
                HAS_SOFTCAP=softcap is not None)


def hash_dropout(dropout, q, k, order=None):
    """dropout (rate, (s0, s1)) or None -> (rate, (rows, cols)) or None: the call's row and key bits
    (`triton_dropout.tables`), hashed once for its forward and backward kernels. order: an
    ordering's permutation [S] (flash attention's gathered rows): row t takes token order[t]'s
    bits, so that the mask is the unordered call's."""
    if dropout is None:
        return None
    rate, seed = dropout
    rows, cols = drop.tables(seed, q.shape[0] * q.shape[2], q.shape[1], k.shape[1], q.device)
    if order is not None:
        order = order.to(torch.int64)
        rows, cols = rows.index_select(1, order).contiguous(), cols.index_select(0, order).contiguous()
    return rate, (rows, cols)


def _dropout_args(dropout, row_map, cfg: BlockSizes):
    """((DROP_ROWS, DROP_COLS, DROP_SCALE), constexprs) of a launch: dropout = `hash_dropout`'s or
    None; the tables padded by the launch's largest block."""
    if dropout is None:
        return (None, None, None), {}
    if row_map is not None:
        raise NotImplementedError("dropout with a row map (dilated attention) is not implemented")
    rate, tables = dropout
    pad = max(getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name.startswith("block_"))
    return (*drop.padded(tables, pad), plan.scale(rate)), drop.constexprs(rate)


def forward(q, k, v, *, causal: bool, scale: float, q_ids=None, kv_ids=None, window=None, softcap=None,
            rope=None, q_pos=None, kv_pos=None, config: BlockSizes | None = None, alibi=None,
            row_map: RowMap | None = None, grid_heads: int | None = None, out_dtype: torch.dtype | None = None,
            dropout=None, gather=None):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, Hq, D] in q.dtype, lse, stats).

    lse [B, Hq, Sq] fp32 natural log (-inf for rows with no visible key); stats = (m2, inv_l), each
    [B, Hq, Sq] fp32, is what `backward` needs. rope: a `torch_ref.Rope` or None; with it, q_pos
    [B, Sq] and kv_pos [B, Sk] are the integer positions (q and k are rotated inside the kernel).
    alibi: (slopes [Hq] fp32, offset) or None: scores get -slope_h |i + offset - j|.
    row_map: an `attn_spec.dilation.RowMap` (with `grid_heads`, the heads it runs) or None: q, k, v
    are then slot views `[B', L, rate * heads, D]` (and q_ids / kv_ids `[B' * rate, L]`), and out,
    lse, stats come compact, `[B', L, grid_heads, D]` / `[B', grid_heads, L]` (no RoPE, ALiBi,
    window or softcap with it). out_dtype: out's dtype (default q.dtype). dropout: (rate, (rows,
    cols)), the bits `hash_dropout` makes of a seed, or None; no row map with it.
    gather: an ordering's rows, (orig int32 [R, L], scatter, batch_div) or None: the tiles are those
    of an ordered sequence of L rows whose row t is row orig[bs, t] of q, k, v (whole arrays
    [B, S, H, D], batch row b // batch_div; bs as the segment-id row). scatter: out, lse, stats in
    the original order (B, S as q's); else compact [B * batch_div, L, ...] (with a row map).
    No RoPE with it; ALiBi's distance is then the tokens' original one (offset 0), dropout's bits
    the tokens' (`hash_dropout`'s order).
    Inputs are assumed validated (see torch_ref.ops.common.validation).
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if gather is not None:
        B, Sq, Sk = B * gather[2], gather[0].shape[1], gather[0].shape[1]
    Hq, group, map_kw = _map_launch(row_map, grid_heads, Hq, Hkv)
    cfg = config or default_block_sizes(D, q.dtype, q.is_cuda and not INTERPRETED)
    out = torch.empty((B, Sq, Hq, D), dtype=out_dtype or q.dtype, device=q.device)
    lse, m2, inv_l = (torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device) for _ in range(3))
    if out.numel() == 0:
        return out, lse.fill_(float("-inf")), (m2.fill_(float("inf")), inv_l.zero_())
    qseg, kseg, seg_strides = _segment_args(q_ids, kv_ids, q)
    rope_ptrs, rope_strides, rope_flags = rope_args(rope, q_pos, kv_pos, q)
    score_mul, cap_mul = _score_constants(scale, softcap)
    left, right = window if window is not None else (0, 0)
    alibi_args = _alibi_args(alibi, q)
    if gather is not None and alibi_args[1]:
        raise NotImplementedError("ALiBi with an ordering takes the original distance: no offset")
    drop_tables, drop_kw = _dropout_args(dropout, row_map, cfg)
    gather_args, gather_kw = _gather_args(gather, q)
    grid = (triton.cdiv(Sq, cfg.block_q), Hq, B)
    with device_ctx(q):
        _fwd_kernel[grid](
            q, k, v, out, lse, m2, inv_l, qseg, kseg, *rope_ptrs,
            _ranges(causal, window, gather, Sq, Sk, cfg.block_q, cfg.block_k, key_major=False, device=q.device),
            alibi_args[0], *q.stride(), *k.stride(), *v.stride(), *out.stride(), *seg_strides, *rope_strides,
            Hq, group, Sq, Sk, score_mul, cap_mul, left, right, *alibi_args[1:], *drop_tables, *gather_args,
            HEAD_DIM=D, BLOCK_M=cfg.block_q, BLOCK_N=cfg.block_k, BLOCK_D=block_d(D),
            PRECISION=precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **_flags(causal, window, q_ids, softcap), **rope_flags, HAS_ALIBI=alibi is not None, **map_kw,
            **drop_kw, **gather_kw)
    return out, lse, (m2, inv_l)


def backward(do, q, k, v, out, stats, *, causal: bool, scale: float, q_ids=None, kv_ids=None, window=None,
             softcap=None, rope=None, q_pos=None, kv_pos=None, dlse=None, config: BlockSizes | None = None,
             alibi=None, delta=None, row_map: RowMap | None = None, grid_heads: int | None = None,
             grad_dtype: torch.dtype | None = None, dropout=None, gather=None):
    """Gradients (dq, dk, dv) shaped like q, k, v, from dO [B, Sq, Hq, D], the forward's `out`
    and `stats`, and optionally the cotangent of the natural lse `dlse [B, Hq, Sq]`.

    With P = softmax, dS = P * (dP - delta) where delta_i = sum_d dO_i O_i; a cotangent on
    lse_i adds P_ij * dlse_i to dS_ij, i.e. it is folded in as delta_i -= dlse_i. With rope, the
    kernels accumulate dq', dk' w.r.t. the rotated q, k and store dq = R^T dq', dk = R^T dk'.

    delta: the rows' delta `[B, Hq, Sq]` fp32, given instead of computing it from do, out and dlse
    (out is then not read). row_map / grid_heads: as in `forward`; q, k, v and do are slot views,
    stats and delta compact `[B', grid_heads, L]`, and the gradients come compact: dq
    `[B', L, grid_heads, D]`, dk / dv `[B', L, grid_heads // group, D]`, or `[B', L, grid_heads, D]`
    per query head when `dkv_per_query_head(row_map, grid_heads)` (the caller sums each GQA group).
    grad_dtype: the gradients' dtype (default the inputs'). dropout: the forward's (the same bits
    regenerate its mask); delta is unchanged by it (sum_j P~_ij dP_ij = dO_i . O_i).
    gather: as in `forward` (q, k, v, do whole; with scatter the statistics, delta and the
    gradients in the original order, else compact).
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if gather is not None:
        B, Sq, Sk = B * gather[2], gather[0].shape[1], gather[0].shape[1]
    Hq, group, map_kw = _map_launch(row_map, grid_heads, Hq, Hkv)
    per_qhead = dkv_per_query_head(row_map, Hq)
    if row_map is not None:  # the dK/dV grid's heads
        Hkv = Hq if per_qhead else Hq // group
    cfg = config or default_block_sizes(D, q.dtype, q.is_cuda and not INTERPRETED)
    dq = torch.empty((B, Sq, Hq, D), dtype=grad_dtype or q.dtype, device=q.device)
    dk = torch.zeros((B, Sk, Hkv, D), dtype=grad_dtype or k.dtype, device=k.device)
    dv = torch.zeros((B, Sk, Hkv, D), dtype=grad_dtype or v.dtype, device=v.device)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk, dv
    if delta is None:
        # delta [B, Hq, Sq] fp32 (preprocess; a plain torch reduction)
        delta = (do.float() * out.float()).sum(-1).transpose(1, 2)
        if dlse is not None:
            delta = delta - dlse.float()
    delta = delta.contiguous()
    qseg, kseg, seg_strides = _segment_args(q_ids, kv_ids, q)
    rope_ptrs, rope_strides, rope_flags = rope_args(rope, q_pos, kv_pos, q)
    score_mul, cap_mul = _score_constants(scale, softcap)
    left, right = window if window is not None else (0, 0)
    drop_tables, drop_kw = _dropout_args(dropout, row_map, cfg)
    gather_args, gather_kw = _gather_args(gather, q)
    common = dict(HEAD_DIM=D, BLOCK_D=block_d(D), PRECISION=precision(q.dtype), num_warps=cfg.num_warps_bwd,
                  num_stages=cfg.num_stages_bwd, **_flags(causal, window, q_ids, softcap), **rope_flags,
                  HAS_ALIBI=alibi is not None, **drop_kw, **gather_kw)
    alibi_args = _alibi_args(alibi, q)
    scalars = (Hq, group, Sq, Sk, score_mul, cap_mul, scale, left, right, *alibi_args[1:], *drop_tables, *gather_args)
    dkv_kw = dict(map_kw, DKV_PER_QHEAD=True) if per_qhead else map_kw
    with device_ctx(q):
        _bwd_dkdv_kernel[(triton.cdiv(Sk, cfg.block_k_dkv), Hkv, B)](
            q, k, v, do, *stats, delta, dk, dv, qseg, kseg, *rope_ptrs,
            _ranges(causal, window, gather, Sq, Sk, cfg.block_q_dkv, cfg.block_k_dkv, key_major=True, device=q.device),
            alibi_args[0], *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *seg_strides,
            *rope_strides, *scalars, BLOCK_M=cfg.block_q_dkv, BLOCK_N=cfg.block_k_dkv, **common, **dkv_kw)
        _bwd_dq_kernel[(triton.cdiv(Sq, cfg.block_q_dq), Hq, B)](
            q, k, v, do, *stats, delta, dq, qseg, kseg, *rope_ptrs,
            _ranges(causal, window, gather, Sq, Sk, cfg.block_q_dq, cfg.block_k_dq, key_major=False, device=q.device),
            alibi_args[0], *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *seg_strides,
            *rope_strides, *scalars, BLOCK_M=cfg.block_q_dq, BLOCK_N=cfg.block_k_dq, **common, **map_kw)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------
class FlashAttentionFn(torch.autograd.Function):
    """Triton forward + backward. Outputs (out, lse); both are differentiable: a cotangent on lse
    enters the backward as delta_i -= dlse_i (d lse_i / d s_ij = P_ij)."""

    @staticmethod
    def forward(ctx, q, k, v, q_ids, kv_ids, causal, scale, window, softcap, rope, q_pos, kv_pos, config=None,
                alibi=None, dropout=None, gather=None):
        # dropout: (rate, (s0, s1)) or None; an ordering's rows (the same for every batch row) take their tokens' bits
        dropout = hash_dropout(dropout, q, k, None if gather is None else gather[0][0])
        out, lse, stats = forward(q, k, v, causal=causal, scale=scale, q_ids=q_ids, kv_ids=kv_ids,
                                  window=window, softcap=softcap, rope=rope, q_pos=q_pos, kv_pos=kv_pos,
                                  config=config, alibi=alibi, dropout=dropout, gather=gather)
        ctx.save_for_backward(q, k, v, out, *stats, q_ids, kv_ids, q_pos, kv_pos)
        ctx.opts = dict(causal=causal, scale=scale, window=window, softcap=softcap, rope=rope, config=config,
                        alibi=alibi, dropout=dropout, gather=gather)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, m2, inv_l, q_ids, kv_ids, q_pos, kv_pos = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward(dout, q, k, v, out, (m2, inv_l), q_ids=q_ids, kv_ids=kv_ids, dlse=dlse,
                              q_pos=q_pos, kv_pos=kv_pos, **ctx.opts)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, None


__all__ = ["BlockSizes", "default_block_sizes", "block_d", "forward", "backward", "FlashAttentionFn", "hash_dropout",
           "INTERPRETED", "MAX_HEAD_DIM", "map_constexprs", "dkv_per_query_head"]
