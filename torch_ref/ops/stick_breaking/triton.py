"""Triton kernels for stick-breaking attention ("ExpoSB"): forward, dQ, dK/dV, their launchers and
the autograd Function `StickBreakingFn` that `torch_ref.api.stick_breaking_attention` calls.

Definition: see `torch_ref.ops.stick_breaking.reference` (with its options: ATTEND_CURRENT, keys
j <= i; segment ids, only keys of the row's id; OFF = Sk - Sq, i read as the query's key position
i + OFF). Causal; for key j < row i,
  z_ij = scale * q~_i . k~_j - lambda_h (i - j),  sp = softplus(z),  log beta = log sigmoid(z),
  log A_ij = log beta_ij - sum_{j<m<i} sp_im,  out_i = sum_j A_ij v_j,  rem_i = exp(-sum_j sp_ij).
Backward, with g_ij = A_ij (dO_i . v_j), sigma = sigmoid(z), P_ij = sum_{m<=j} g_im + drem_i rem_i:
  dz_ij = g_ij - sigma_ij P_ij,  dq = scale dz k~, dk = scale dz^T q~, dv = A^T dO,
  d lambda_h = -sum_{b,i,j} dz_ij (i - j).
All log-space math is fp32 (softplus via an accurate log1p: tl has none); A is rounded to v.dtype
for the A v product. 16-bit inputs (BASE2) keep every log-space quantity in base 2, exp2 / log2
compiled to single MUFU instructions (inline PTX), because the tiles are bound by transcendental
work; the interpreter stands in tl.exp2 / tl.log2. fp32 inputs keep the exact natural-log path.

The forward walks key blocks from the diagonal leftwards with the softplus sum to the right (the
in-tile strict suffix as cumsum(sp, reverse) - sp, not rowsum - cumsum, which loses accuracy at
the diagonal). The dQ kernel walks twice: right to left storing the softplus sum right of each key
block (Cb), then left to right with the g prefix sums (P summed from the left: from the right it
cancels), storing them at each block's left edge (Pb); the dK/dV kernel (per key block and kv head,
over the GQA group and the query tiles at and below the diagonal) reads Cb and Pb back, so both
backward kernels share `block_k_bwd`. No atomics: deterministic. Tiles strictly left of the diagonal
skip the element mask (with segment ids every tile takes theirs, and the walks start at the first
key a row of the tile sees). RoPE uses the shared helpers of `torch_ref.ops.common.triton_tiles`.
The options are constexprs and None-valued arguments: with none of them the kernels compile as
without them. Design and figures: docs/design/stick_breaking.md.

Importing this module imports triton: choose the interpreter (TRITON_INTERPRET=1) before that.
"""
from __future__ import annotations

import dataclasses
import types

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from attn_spec import visit
from attn_spec.tiles import check_launch_fields

from ..common.validation import segment_pair_for_kernel
from ..common.triton_tiles import (INTERPRETED, block_d, device_ctx, load_2d, load_own, load_rotated,
                                   precision, rope_args, store_unrotated)

__all__ = ["StickBreakingBlockSizes", "default_stick_breaking_block_sizes", "forward", "backward", "StickBreakingFn", "INTERPRETED"]


# ----------------------------------------------------------------------------------------------
# Block configuration
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StickBreakingBlockSizes:
    """Tile sizes and launch parameters (the field vocabulary of `BlockSizes`).

    forward: program = block_q query rows, walking key tiles of block_k (num_warps, num_stages).
    dQ:      program = block_q_dq query rows, walking key tiles of block_k_bwd.
    dK/dV:   program = block_k_bwd keys, looping over query tiles of block_q_dkv (all GQA heads).
    block_k_bwd is shared by the two backward kernels (launched with num_warps_bwd,
    num_stages_bwd): the boundary arrays are per key block. Any power-of-two sizes >= 16 work
    together (no divisibility between them is assumed). The head dim tile is not a field
    (`block_d`: the head dim rounded up to a power of two).
    """

    block_q: int = 64
    block_k: int = 32
    block_q_dq: int = 64
    block_k_bwd: int = 64
    block_q_dkv: int = 32
    num_warps: int = 4
    num_stages: int = 2
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2

    def __post_init__(self):
        check_launch_fields(self)


def default_stick_breaking_block_sizes(head_dim: int, dtype: torch.dtype, on_gpu: bool) -> StickBreakingBlockSizes:
    """16-bit tiles chosen by timing (docs/design/stick_breaking.md, 'Measurements'); fp32 tiles
    by register pressure only: these tiles hold more live fp32 [rows, keys] temporaries than the
    softmax kernels. The interpreter gets small tiles so that the CPU tests stay fast.
    """
    padded = block_d(head_dim)
    fields = ("block_q", "block_k", "num_warps", "num_stages", "block_k_bwd", "block_q_dq", "block_q_dkv",
              "num_warps_bwd", "num_stages_bwd")
    if not on_gpu:
        return StickBreakingBlockSizes(**dict(zip(fields, (16, 32, 4, 1, 32, 16, 16, 4, 1))))
    wide = dtype == torch.float32
    # (block_q, block_k, warps, stages), (block_k_bwd, block_q_dq, block_q_dkv, warps, stages)
    if padded <= 64:
        fwd = (64, 64, 4, 2) if not wide else (64, 32, 8, 2)
        bwd = (64, 64, 32, 4, 2) if not wide else (32, 32, 32, 8, 2)
    elif padded <= 128:
        fwd = (64, 32, 4, 3) if not wide else (32, 32, 8, 2)
        bwd = (64, 64, 32, 4, 2) if not wide else (32, 16, 16, 8, 2)
    else:  # 256
        fwd = (64, 32, 4, 2) if not wide else (16, 32, 8, 1)
        bwd = (32, 32, 32, 4, 2) if not wide else (16, 16, 16, 8, 1)
    return StickBreakingBlockSizes(**dict(zip(fields, (*fwd, *bwd))))


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------
_LOG2E = tl.constexpr(1.4426950408889634)
_PTX = tl.constexpr(not INTERPRETED)  # inline PTX runs only in compiled kernels


@triton.jit
def _approx(x, INSTRUCTION: tl.constexpr):
    """One MUFU instruction per element ("ex2" or "lg2", .approx.ftz.f32; ftz is harmless for A,
    sigma, rem): tl.log2 lowers to libdevice's exact log2f, about 30 ALU instructions (tl.exp2
    to ex2 in Triton 3.6, pinned here all the same)."""
    return tl.inline_asm_elementwise(INSTRUCTION + ".approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _exp(x, BASE2: tl.constexpr):
    """exp in the kernel's log units: 2^x for 16-bit inputs (BASE2), e^x for fp32."""
    if BASE2:
        if _PTX:
            y = _approx(x, "ex2")
        else:
            y = tl.exp2(x)
    else:
        y = _exp_exact(x)
    return y


@triton.jit
def _exp_exact(x):
    """e^x for the fp32 path: libdevice's expf in compiled kernels (Triton lowers tl.exp on fp32 to
    ex2.approx of x * log2(e), whose error grows with |x|; JAX's Pallas Triton lowering calls
    expf), tl.exp in the interpreter."""
    if _PTX:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _log_exact(x):
    """log for the fp32 path: libdevice's logf in compiled kernels, tl.log in the interpreter."""
    if _PTX:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _log2(x):
    """log2 for the BASE2 path (the exact path uses `_log1p`)."""
    if _PTX:
        y = _approx(x, "lg2")
    else:
        y = tl.log2(x)
    return y


@triton.jit
def _log1p(e):
    """log(1 + e) for e >= 0 without losing e where 1 + e rounds (Goldberg's correction:
    log(u) * e / (u - 1) with u = fl(1 + e), and e itself where u == 1)."""
    u = 1.0 + e
    tiny = u == 1.0
    return tl.where(tiny, e, _log_exact(u) * (e / tl.where(tiny, 1.0, u - 1.0)))


@triton.jit
def _softplus_logsigmoid(z, BASE2: tl.constexpr):
    """(softplus(z), log sigmoid(z)) in fp32 and the kernel's log units, stable for any z:
    t = log1p(exp(-|z|)) in (0, ln 2] (BASE2: z and the results in log2 units, t = log2(1 + 2^-|z|)
    in (0, 1], where 1 + x rounding away a tiny x costs <= 2^-24 absolute: no log1p correction),
    softplus = max(z, 0) + t, log sigmoid = min(z, 0) - t."""
    if BASE2:
        t = _log2(1.0 + _exp(-tl.abs(z), BASE2))
    else:
        t = _log1p(_exp_exact(-tl.abs(z)))
    return tl.maximum(z, 0.0) + t, tl.minimum(z, 0.0) - t


@triton.jit
def _logits(qk, scale, lam, rows, cols, HAS_DECAY: tl.constexpr, BASE2: tl.constexpr):
    """z = scale * q.k - lambda * (i - j), times log2(e) when BASE2; rows, cols are pre-broadcast
    index tiles."""
    if BASE2:
        scale = scale * _LOG2E
    z = qk * scale
    if HAS_DECAY:
        if BASE2:
            lam = lam * _LOG2E
        z = z - lam * (rows - cols).to(tl.float32)
    return z


@triton.jit
def _positions(rows, m0, m_last, S, OFF, ATTEND_CURRENT: tl.constexpr):
    """(the rows' key positions, the first row's, the end of the keys the tile's rows see (keys
    j < end), the number of keys) of a query tile: row i sits at i + OFF (OFF None: at i) and sees
    the keys j < i + OFF (j <= i + OFF with ATTEND_CURRENT)."""
    pos = rows
    m0_pos = m0
    k_end = m_last
    SK = S
    if OFF is not None:
        pos = rows + OFF
        m0_pos = m0 + OFF
        k_end = m_last + OFF
        SK = S + OFF
    if ATTEND_CURRENT:
        m0_pos = m0_pos + 1
        k_end = k_end + 1
    return pos, m0_pos, k_end, SK


@triton.jit
def _segment_rows(SEG_Q, SEG_K, FIRST, b, rows, m_ok, S, SK, n_left, BLOCK_N: tl.constexpr):
    """With segment ids: (the rows' ids [BLOCK_M, 1], the base of this batch row's key ids, the
    first key block left of the diagonal's to walk (the first one a row of the tile sees, at
    most n_left), the number of them up to n_left). (Without: None, None, 0, n_left.)"""
    qs = tl.load(SEG_Q + b * S + rows, mask=m_ok, other=0)[:, None]
    ks_base = SEG_K + b * SK
    lo = tl.minimum(tl.min(tl.load(FIRST + b * S + rows, mask=m_ok, other=SK), axis=0) // BLOCK_N, n_left)
    return qs, ks_base, lo, n_left - lo


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _visible(cols, rows, qs, ks, DIAG: tl.constexpr, ATTEND_CURRENT: tl.constexpr, HAS_SEGMENTS: tl.constexpr):
    """The element mask of a tile from pre-broadcast index tiles (rows: the queries' key
    positions) and segment ids (the same orientation): causal (j < i, j <= i with
    ATTEND_CURRENT) where DIAG, the ids' equality with HAS_SEGMENTS; None where neither applies."""
    valid = None
    if DIAG:
        if ATTEND_CURRENT:
            valid = cols <= rows
        else:
            valid = cols < rows
        if HAS_SEGMENTS:
            valid = valid & (qs == ks)
    elif HAS_SEGMENTS:
        valid = qs == ks
    return valid


@triton.jit
def _fwd_inner(acc, c, q, q2, k_base, v_base, kp_base, sks, skd, svs, svd, skp_s, theta, lam, rows, m_last,
               offs_n, offs_d, offs_h, d_ok, h_ok, S, scale, blk_top, n_blk,
               BLOCK_N: tl.constexpr, HALF: tl.constexpr, CHECK_D: tl.constexpr, CHECK_H: tl.constexpr,
               DIAG: tl.constexpr, HAS_DECAY: tl.constexpr, ROPE: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
               PRECISION: tl.constexpr, BASE2: tl.constexpr, qs=None, ks_base=None,
               ATTEND_CURRENT: tl.constexpr = False, HAS_SEGMENTS: tl.constexpr = False):
    """Key blocks blk_top - 1 down to blk_top - n_blk. DIAG: tiles that need the element mask j < i
    (and bounds checks on the keys); otherwise every key of the tile precedes every row. rows:
    the queries' key positions; S: the number of keys; keys >= m_last are seen by no row of the
    tile. With HAS_SEGMENTS every tile takes the segment ids' mask (qs [BLOCK_M] of the rows, the
    keys' from ks_base)."""
    MASKED: tl.constexpr = DIAG or HAS_SEGMENTS
    for t in range(0, n_blk):
        blk = blk_top - 1 - t
        cols = blk * BLOCK_N + offs_n
        n_ok = cols < S
        if ROPE:
            kT, kT2 = load_rotated(k_base, cols, n_ok, sks, skd, kp_base, skp_s, theta, offs_h, h_ok, HALF,
                                   DIAG, CHECK_H, ROPE_INTERLEAVED, True)
            qk = tl.dot(q, kT, input_precision=PRECISION)
            qk = tl.dot(q2, kT2, qk, input_precision=PRECISION)
        else:
            kT = load_2d(k_base + offs_d[:, None] * skd + cols[None, :] * sks, d_ok, n_ok, CHECK_D, DIAG)
            qk = tl.dot(q, kT, input_precision=PRECISION)
        v = load_2d(v_base + cols[:, None] * svs + offs_d[None, :] * svd, n_ok, d_ok, DIAG, CHECK_D)
        z = _logits(qk, scale, lam, rows[:, None], cols[None, :], HAS_DECAY, BASE2)
        sp, log_beta = _softplus_logsigmoid(z, BASE2)
        if MASKED:
            ks = None
            if HAS_SEGMENTS:
                ks = tl.load(ks_base + cols, mask=n_ok, other=0)[None, :]
            valid = _visible(cols[None, :], rows[:, None], qs, ks, DIAG, ATTEND_CURRENT, HAS_SEGMENTS)
            sp = tl.where(valid, sp, 0.0)
        rs = tl.sum(sp, axis=1)
        suffix = tl.cumsum(sp, axis=1, reverse=True) - sp  # sum_{j<m<i} within the tile
        a = _exp(log_beta - c[:, None] - suffix, BASE2)
        if MASKED:
            a = tl.where(valid, a, 0.0)
        if DIAG:
            v = tl.where((cols < m_last)[:, None], v, 0.0)  # keys no row of the tile sees: keep 0 * NaN out
        acc = tl.dot(a.to(v.dtype), v, acc, input_precision=PRECISION)
        c = c + rs
    return acc, c


@triton.jit
def _sb_fwd_kernel(Q, K, V, O, REM, DECAY, THETA, QPOS, KPOS,
                   sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sob, sos, soh, sod,
                   sqpb, sqps, skpb, skps,
                   Hq, GROUP, S, scale,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_H: tl.constexpr, HAS_DECAY: tl.constexpr, ROPE: tl.constexpr,
                   ROPE_INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, OFF=None, SEG_Q=None, SEG_K=None,
                   FIRST=None, ATTEND_CURRENT: tl.constexpr = False, HAS_SEGMENTS: tl.constexpr = False):
    """grid (cdiv(S, BLOCK_M), Hq, B). Writes O [B, S, Hq, D] and REM [B, Hq, S] fp32 (S: the
    queries). OFF: Sk - S (None: Sk == S), query i at key position i + OFF. With HAS_SEGMENTS:
    SEG_Q [B, S], SEG_K [B, Sk] the ids, FIRST [B, S] the first key each row sees (contiguous)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = (h // GROUP).to(tl.int64)
    CHECK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    BASE2: tl.constexpr = Q.dtype.element_ty != tl.float32  # 16-bit inputs: log2 units (module doc)
    HALF: tl.constexpr = HEAD_DIM // 2
    CHECK_H: tl.constexpr = BLOCK_H != HALF

    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = rows < S
    d_ok = offs_d < HEAD_DIM

    q, q2, offs_h, h_ok, theta = load_own(Q + b * sqb + h * sqh, rows, m_ok, sqs, sqd, QPOS + b * sqpb, sqps, THETA,
                                          offs_d, d_ok, scale, HEAD_DIM, BLOCK_H, CHECK_D, ROPE, ROPE_INTERLEAVED)
    kp_base = KPOS
    if ROPE:
        kp_base = KPOS + b * skpb
    lam = 0.0
    if HAS_DECAY:
        lam = tl.load(DECAY + h)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    c = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Keys j < i <= m_last: blocks [0, n_hi). Blocks [0, n_left) lie strictly left of row m0.
    m_last = tl.minimum(m0 + BLOCK_M, S) - 1
    pos, m0_pos, k_end, SK = _positions(rows, m0, m_last, S, OFF, ATTEND_CURRENT)
    n_hi = tl.cdiv(k_end, BLOCK_N)
    n_left = tl.minimum(m0_pos // BLOCK_N, n_hi)
    qs = None
    ks_base = None
    n_mid = n_left
    if HAS_SEGMENTS:
        qs, ks_base, _, n_mid = _segment_rows(SEG_Q, SEG_K, FIRST, b, rows, m_ok, S, SK, n_left, BLOCK_N)
    acc, c = _fwd_inner(acc, c, q, q2, k_base, v_base, kp_base, sks, skd, svs, svd, skps, theta, lam, pos, k_end,
                        offs_n, offs_d, offs_h, d_ok, h_ok, SK, scale, n_hi, n_hi - n_left, BLOCK_N, HALF, CHECK_D,
                        CHECK_H, True, HAS_DECAY, ROPE, ROPE_INTERLEAVED, PRECISION, BASE2, qs, ks_base,
                        ATTEND_CURRENT, HAS_SEGMENTS)
    acc, c = _fwd_inner(acc, c, q, q2, k_base, v_base, kp_base, sks, skd, svs, svd, skps, theta, lam, pos, k_end,
                        offs_n, offs_d, offs_h, d_ok, h_ok, SK, scale, n_left, n_mid, BLOCK_N, HALF, CHECK_D,
                        CHECK_H, False, HAS_DECAY, ROPE, ROPE_INTERLEAVED, PRECISION, BASE2, qs, ks_base,
                        ATTEND_CURRENT, HAS_SEGMENTS)

    tl.store(O + b * sob + h * soh + rows[:, None] * sos + offs_d[None, :] * sod, acc.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(REM + (b * Hq + h) * S + rows, _exp(-c, BASE2), mask=m_ok)


# ----------------------------------------------------------------------------------------------
# Backward: dQ (one program per query tile, head, batch row); writes the boundary sums
# ----------------------------------------------------------------------------------------------
@triton.jit
def _dq_prepass(c, q, q2, k_base, kp_base, cb_base, sks, skd, skp_s, theta, lam, rows, m_ok, offs_n, offs_d, offs_h,
                d_ok, h_ok, S, s64, scale, blk_top, n_blk,
                BLOCK_N: tl.constexpr, HALF: tl.constexpr, CHECK_D: tl.constexpr, CHECK_H: tl.constexpr,
                DIAG: tl.constexpr, HAS_DECAY: tl.constexpr, ROPE: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
                PRECISION: tl.constexpr, BASE2: tl.constexpr, pos, qs=None, ks_base=None,
                ATTEND_CURRENT: tl.constexpr = False, HAS_SEGMENTS: tl.constexpr = False):
    """Pass 1, key blocks blk_top - 1 down to blk_top - n_blk (as the forward walks): store the sum
    of softplus over the keys right of each block, CB[blk, rows] = c, then add the block. pos:
    the rows' key positions; S: the number of keys; masks as `_fwd_inner`."""
    for t in range(0, n_blk):
        blk = blk_top - 1 - t
        cols = blk * BLOCK_N + offs_n
        n_ok = cols < S
        if ROPE:
            kT, kT2 = load_rotated(k_base, cols, n_ok, sks, skd, kp_base, skp_s, theta, offs_h, h_ok, HALF,
                                   DIAG, CHECK_H, ROPE_INTERLEAVED, True)
            qk = tl.dot(q, kT, input_precision=PRECISION)
            qk = tl.dot(q2, kT2, qk, input_precision=PRECISION)
        else:
            kT = load_2d(k_base + offs_d[:, None] * skd + cols[None, :] * sks, d_ok, n_ok, CHECK_D, DIAG)
            qk = tl.dot(q, kT, input_precision=PRECISION)
        z = _logits(qk, scale, lam, pos[:, None], cols[None, :], HAS_DECAY, BASE2)
        sp, _ = _softplus_logsigmoid(z, BASE2)
        if HAS_SEGMENTS or (DIAG and ATTEND_CURRENT):
            ks = None
            if HAS_SEGMENTS:
                ks = tl.load(ks_base + cols, mask=n_ok, other=0)[None, :]
            sp = tl.where(_visible(cols[None, :], pos[:, None], qs, ks, DIAG, ATTEND_CURRENT, HAS_SEGMENTS), sp, 0.0)
        elif DIAG:
            sp = tl.where(cols[None, :] < pos[:, None], sp, 0.0)
        tl.store(cb_base + blk * s64 + rows, c, mask=m_ok)
        c = c + tl.sum(sp, axis=1)
    return c


@triton.jit
def _dq_inner(dq, dq2, ddec, p_run, q, q2, do, k_base, v_base, kp_base, cb_base, pb_base, sks, skd, svs, svd, skp_s,
              theta, lam, rows, m_ok, m_last, offs_n, offs_d, offs_h, d_ok, h_ok, S, s64, scale, blk_lo, blk_hi,
              BLOCK_N: tl.constexpr, HALF: tl.constexpr, CHECK_D: tl.constexpr, CHECK_H: tl.constexpr,
              DIAG: tl.constexpr, HAS_DECAY: tl.constexpr, DECAY_GRAD: tl.constexpr, ROPE: tl.constexpr,
              ROPE_INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, BASE2: tl.constexpr, pos, qs=None, ks_base=None,
              ATTEND_CURRENT: tl.constexpr = False, HAS_SEGMENTS: tl.constexpr = False):
    """Pass 2, key blocks blk_lo .. blk_hi - 1 left to right. p_run: the prefix sum of g over the
    keys left of the block plus drem * rem (stored as PB[blk, rows] for the dK/dV kernel).
    With ROPE, (q, q2) and (dq, dq2) are the pair halves (rotated q; gradient w.r.t. it).
    pos, S, m_last and the masks as `_fwd_inner`."""
    MASKED: tl.constexpr = DIAG or HAS_SEGMENTS
    for blk in range(blk_lo, blk_hi):
        cols = blk * BLOCK_N + offs_n
        n_ok = cols < S
        if ROPE:
            kT, kT2 = load_rotated(k_base, cols, n_ok, sks, skd, kp_base, skp_s, theta, offs_h, h_ok, HALF,
                                   DIAG, CHECK_H, ROPE_INTERLEAVED, True)
            qk = tl.dot(q, kT, input_precision=PRECISION)
            qk = tl.dot(q2, kT2, qk, input_precision=PRECISION)
        else:
            kT = load_2d(k_base + offs_d[:, None] * skd + cols[None, :] * sks, d_ok, n_ok, CHECK_D, DIAG)
            qk = tl.dot(q, kT, input_precision=PRECISION)
        vT = load_2d(v_base + offs_d[:, None] * svd + cols[None, :] * svs, d_ok, n_ok, CHECK_D, DIAG)
        c = tl.load(cb_base + blk * s64 + rows, mask=m_ok, other=0.0)
        z = _logits(qk, scale, lam, pos[:, None], cols[None, :], HAS_DECAY, BASE2)
        sp, log_beta = _softplus_logsigmoid(z, BASE2)
        if MASKED:
            ks = None
            if HAS_SEGMENTS:
                ks = tl.load(ks_base + cols, mask=n_ok, other=0)[None, :]
            valid = _visible(cols[None, :], pos[:, None], qs, ks, DIAG, ATTEND_CURRENT, HAS_SEGMENTS)
            sp = tl.where(valid, sp, 0.0)
        suffix = tl.cumsum(sp, axis=1, reverse=True) - sp
        a = _exp(log_beta - c[:, None] - suffix, BASE2)
        da = tl.dot(do, vT, input_precision=PRECISION)  # dO_i . v_j
        g = a * da
        if MASKED:
            g = tl.where(valid, g, 0.0)
        prefix = p_run[:, None] + tl.cumsum(g, axis=1)  # sum_{m <= j} g_im + drem_i rem_i
        dz = g - _exp(log_beta, BASE2) * prefix
        if MASKED:
            dz = tl.where(valid, dz, 0.0)
        if DIAG:
            col_ok = cols < m_last  # keys no row of the tile sees: keep 0 * NaN out of dQ
            kT = tl.where(col_ok[None, :], kT, 0.0)
            if ROPE:
                kT2 = tl.where(col_ok[None, :], kT2, 0.0)
        tl.store(pb_base + blk * s64 + rows, p_run, mask=m_ok)
        dq = tl.dot(dz.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)
        if ROPE:
            dq2 = tl.dot(dz.to(kT.dtype), tl.trans(kT2), dq2, input_precision=PRECISION)
        if DECAY_GRAD:
            ddec += tl.sum(dz * (cols[None, :] - pos[:, None]).to(tl.float32), axis=1)  # dz/dlambda = -(i - j)
        p_run = p_run + tl.sum(g, axis=1)
    return dq, dq2, ddec, p_run


@triton.jit
def _sb_bwd_dq_kernel(Q, K, V, DO, P0, DQ, DDEC, CB, PB, DECAY, THETA, QPOS, KPOS,
                      sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                      sdob, sdos, sdoh, sdod, sdqb, sdqs, sdqh, sdqd, sqpb, sqps, skpb, skps,
                      Hq, GROUP, S, NKB, scale,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_H: tl.constexpr, HAS_DECAY: tl.constexpr, DECAY_GRAD: tl.constexpr,
                      HAS_P0: tl.constexpr, ROPE: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
                      PRECISION: tl.constexpr, OFF=None, SEG_Q=None, SEG_K=None, FIRST=None,
                      ATTEND_CURRENT: tl.constexpr = False, HAS_SEGMENTS: tl.constexpr = False):
    """grid (cdiv(S, BLOCK_M), Hq, B). Writes DQ, DDEC [B, Hq, S] (if DECAY_GRAD) and the boundary
    sums CB, PB [B, Hq, NKB, S] of every key block the tile visits. P0 [B, Hq, S]: drem * rem.
    S: the queries; OFF, SEG_Q, SEG_K, FIRST: as `_sb_fwd_kernel`."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = (h // GROUP).to(tl.int64)
    CHECK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    BASE2: tl.constexpr = Q.dtype.element_ty != tl.float32  # 16-bit inputs: log2 units (module doc)
    HALF: tl.constexpr = HEAD_DIM // 2
    CHECK_H: tl.constexpr = BLOCK_H != HALF

    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = rows < S
    d_ok = offs_d < HEAD_DIM

    q, q2, offs_h, h_ok, theta = load_own(Q + b * sqb + h * sqh, rows, m_ok, sqs, sqd, QPOS + b * sqpb, sqps, THETA,
                                          offs_d, d_ok, scale, HEAD_DIM, BLOCK_H, CHECK_D, ROPE, ROPE_INTERLEAVED)
    if ROPE:
        kp_base = KPOS + b * skpb
        dq = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        dq2 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    else:
        kp_base = KPOS
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq2 = dq  # unused placeholder
    do = load_2d(DO + b * sdob + h * sdoh + rows[:, None] * sdos + offs_d[None, :] * sdod, m_ok, d_ok, True, CHECK_D)
    bh = b * Hq + h
    lam = 0.0
    if HAS_DECAY:
        lam = tl.load(DECAY + h)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    cb_base = CB + bh * NKB * S
    pb_base = PB + bh * NKB * S
    s64 = b * 0 + S  # int64: the key block offsets blk * S into CB, PB

    m_last = tl.minimum(m0 + BLOCK_M, S) - 1
    pos, m0_pos, k_end, SK = _positions(rows, m0, m_last, S, OFF, ATTEND_CURRENT)
    n_hi = tl.cdiv(k_end, BLOCK_N)  # key blocks [0, n_hi) hold keys j < i for some row of the tile
    n_left = tl.minimum(m0_pos // BLOCK_N, n_hi)  # [0, n_left): every key before every row
    qs = None
    ks_base = None
    n_mid = n_left
    if HAS_SEGMENTS:
        qs, ks_base, lo, n_mid = _segment_rows(SEG_Q, SEG_K, FIRST, b, rows, m_ok, S, SK, n_left, BLOCK_N)
    # Pass 1 (right to left): softplus sums right of each key block -> CB.
    c = tl.zeros([BLOCK_M], dtype=tl.float32)
    c = _dq_prepass(c, q, q2, k_base, kp_base, cb_base, sks, skd, skps, theta, lam, rows, m_ok, offs_n, offs_d,
                    offs_h, d_ok, h_ok, SK, s64, scale, n_hi, n_hi - n_left, BLOCK_N, HALF, CHECK_D, CHECK_H, True,
                    HAS_DECAY, ROPE, ROPE_INTERLEAVED, PRECISION, BASE2, pos, qs, ks_base, ATTEND_CURRENT, HAS_SEGMENTS)
    c = _dq_prepass(c, q, q2, k_base, kp_base, cb_base, sks, skd, skps, theta, lam, rows, m_ok, offs_n, offs_d,
                    offs_h, d_ok, h_ok, SK, s64, scale, n_left, n_mid, BLOCK_N, HALF, CHECK_D, CHECK_H, False,
                    HAS_DECAY, ROPE, ROPE_INTERLEAVED, PRECISION, BASE2, pos, qs, ks_base, ATTEND_CURRENT, HAS_SEGMENTS)
    tl.debug_barrier()  # pass 2 reads CB rows that other threads of the program wrote
    # Pass 2 (left to right): gradients, with the prefix sums of g running from the left.
    if HAS_P0:
        p_run = tl.load(P0 + bh * S + rows, mask=m_ok, other=0.0)
    else:
        p_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    ddec = tl.zeros([BLOCK_M], dtype=tl.float32)
    dq, dq2, ddec, p_run = _dq_inner(dq, dq2, ddec, p_run, q, q2, do, k_base, v_base, kp_base, cb_base, pb_base, sks,
                                     skd, svs, svd, skps, theta, lam, rows, m_ok, k_end, offs_n, offs_d, offs_h, d_ok,
                                     h_ok, SK, s64, scale, lo if HAS_SEGMENTS else 0, n_left, BLOCK_N, HALF, CHECK_D,
                                     CHECK_H, False, HAS_DECAY, DECAY_GRAD, ROPE, ROPE_INTERLEAVED, PRECISION, BASE2,
                                     pos, qs, ks_base, ATTEND_CURRENT, HAS_SEGMENTS)
    dq, dq2, ddec, p_run = _dq_inner(dq, dq2, ddec, p_run, q, q2, do, k_base, v_base, kp_base, cb_base, pb_base, sks,
                                     skd, svs, svd, skps, theta, lam, rows, m_ok, k_end, offs_n, offs_d, offs_h, d_ok,
                                     h_ok, SK, s64, scale, n_left, n_hi, BLOCK_N, HALF, CHECK_D, CHECK_H, True,
                                     HAS_DECAY, DECAY_GRAD, ROPE, ROPE_INTERLEAVED, PRECISION, BASE2, pos, qs,
                                     ks_base, ATTEND_CURRENT, HAS_SEGMENTS)
    if ROPE:
        store_unrotated(DQ + b * sdqb + h * sdqh, rows, m_ok, sdqs, sdqd, dq * scale, dq2 * scale,
                        QPOS + b * sqpb, sqps, theta, offs_h, h_ok, HALF, ROPE_INTERLEAVED)
    else:
        dq = dq * scale
        tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqs + offs_d[None, :] * sdqd,
                 dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    if DECAY_GRAD:
        tl.store(DDEC + bh * S + rows, ddec, mask=m_ok)


# ----------------------------------------------------------------------------------------------
# Backward: dK/dV (one program per key block and kv head; loops over the GQA group's q heads)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _dkdv_inner(dk, dk2, dv, k, k2, v, q_base, do_base, cb_base, pb_base, qp_base, sqs, sqd, sdos, sdod, sqp_s,
                theta, lam, n0, cols, offs_m, offs_d, offs_h, d_ok, h_ok, S, scale, blk_lo, blk_hi,
                BLOCK_M: tl.constexpr, HALF: tl.constexpr, CHECK_D: tl.constexpr, CHECK_H: tl.constexpr,
                MASKED: tl.constexpr, HAS_DECAY: tl.constexpr, ROPE: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
                PRECISION: tl.constexpr, BASE2: tl.constexpr, n0_seen, OFF=None, qs_base=None, ks=None,
                ATTEND_CURRENT: tl.constexpr = False, HAS_SEGMENTS: tl.constexpr = False):
    """Query tiles blk_lo .. blk_hi - 1. Tiles are transposed ([keys, rows]) so that dK, dV
    accumulate as [BLOCK_N, D]; the sums along the keys run over axis 0. MASKED: the element mask
    j < i and the bounds checks on the rows (diagonal tiles, the ragged end); otherwise every row
    of the tile is in range and follows every key of the block. With ROPE, (k, k2) and (dk, dk2)
    are the pair halves. S: the queries; row r sits at key position r + OFF (OFF None: r) and
    sees a key of the block iff r > n0_seen. With HAS_SEGMENTS every tile takes the segment ids'
    mask (the rows' from qs_base, ks [BLOCK_N, 1] the block's)."""
    SEG_MASK: tl.constexpr = MASKED or HAS_SEGMENTS
    for blk in range(blk_lo, blk_hi):
        rows = blk * BLOCK_M + offs_m
        pos = rows
        if OFF is not None:
            pos = rows + OFF
        m_ok = rows < S
        if ROPE:
            qT, qT2 = load_rotated(q_base, rows, m_ok, sqs, sqd, qp_base, sqp_s, theta, offs_h, h_ok, HALF,
                                   MASKED, CHECK_H, ROPE_INTERLEAVED, True)
            qk = tl.dot(k, qT, input_precision=PRECISION)
            qk = tl.dot(k2, qT2, qk, input_precision=PRECISION)
        else:
            qT = load_2d(q_base + offs_d[:, None] * sqd + rows[None, :] * sqs, d_ok, m_ok, CHECK_D, MASKED)
            qk = tl.dot(k, qT, input_precision=PRECISION)
        do = load_2d(do_base + rows[:, None] * sdos + offs_d[None, :] * sdod, m_ok, d_ok, MASKED, CHECK_D)
        if MASKED:
            seen = m_ok & (rows > n0_seen)  # rows with a key in this block: the dQ kernel wrote their sums
            c = tl.load(cb_base + rows, mask=seen, other=0.0)
            p0 = tl.load(pb_base + rows, mask=seen, other=0.0)
        else:
            c = tl.load(cb_base + rows)
            p0 = tl.load(pb_base + rows)
        zT = _logits(qk, scale, lam, pos[None, :], cols[:, None], HAS_DECAY, BASE2)
        spT, log_betaT = _softplus_logsigmoid(zT, BASE2)
        if SEG_MASK:
            qs = None
            if HAS_SEGMENTS:
                qs = tl.load(qs_base + rows, mask=m_ok, other=0)[None, :]
            if ATTEND_CURRENT or HAS_SEGMENTS:
                validT = _visible(cols[:, None], pos[None, :], qs, ks, MASKED, ATTEND_CURRENT, HAS_SEGMENTS)
                if MASKED:
                    validT = validT & m_ok[None, :]
            else:
                validT = (cols[:, None] < pos[None, :]) & m_ok[None, :]
            spT = tl.where(validT, spT, 0.0)
        suffixT = tl.cumsum(spT, axis=0, reverse=True) - spT
        aT = _exp(log_betaT - c[None, :] - suffixT, BASE2)
        if SEG_MASK:
            aT = tl.where(validT, aT, 0.0)
        daT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        gT = aT * daT
        if SEG_MASK:
            gT = tl.where(validT, gT, 0.0)
        dv = tl.dot(aT.to(do.dtype), do, dv, input_precision=PRECISION)  # A is dead after this
        prefixT = p0[None, :] + tl.cumsum(gT, axis=0)
        dzT = gT - _exp(log_betaT, BASE2) * prefixT
        q = tl.trans(qT)
        if ROPE:
            q2 = tl.trans(qT2)
        if SEG_MASK:
            dzT = tl.where(validT, dzT, 0.0)
        if MASKED:
            q = tl.where(seen[:, None], q, 0.0)  # rows with no key here (row 0): keep 0 * NaN out of dK
            if ROPE:
                q2 = tl.where(seen[:, None], q2, 0.0)
        dk = tl.dot(dzT.to(q.dtype), q, dk, input_precision=PRECISION)
        if ROPE:
            dk2 = tl.dot(dzT.to(q.dtype), q2, dk2, input_precision=PRECISION)
    return dk, dk2, dv


@triton.jit
def _sb_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, CB, PB, DECAY, THETA, QPOS, KPOS,
                        sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                        sdob, sdos, sdoh, sdod, sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd,
                        sqpb, sqps, skpb, skps,
                        Hq, GROUP, S, NKB, scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DECAY: tl.constexpr, ROPE: tl.constexpr,
                        ROPE_INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, OFF=None, SEG_Q=None, SEG_K=None,
                        Q_END=None, ATTEND_CURRENT: tl.constexpr = False, HAS_SEGMENTS: tl.constexpr = False):
    """grid (cdiv(Sk, BLOCK_N), Hkv, B). dK, dV of one key block summed over the GQA group in a
    fixed order (deterministic, no atomics). BLOCK_N must be the dQ kernel's key block. S: the
    queries; OFF, SEG_Q, SEG_K: as `_sb_fwd_kernel`; Q_END [B, NKB] int32 (segment ids): per key
    block the end of the query tiles a row of which may see it."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    CHECK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    BASE2: tl.constexpr = Q.dtype.element_ty != tl.float32  # 16-bit inputs: log2 units (module doc)
    HALF: tl.constexpr = HEAD_DIM // 2
    CHECK_H: tl.constexpr = BLOCK_H != HALF

    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    # a row r sees the keys j < r + shift (shift = OFF + ATTEND_CURRENT): n0_seen = n0 - shift
    SK = S
    n0_seen = n0
    if OFF is not None:
        SK = S + OFF
        n0_seen = n0 - OFF
    if ATTEND_CURRENT:
        n0_seen = n0_seen - 1
    n_ok = cols < SK
    d_ok = offs_d < HEAD_DIM

    k, k2, offs_h, h_ok, theta = load_own(K + b * skb + hk * skh, cols, n_ok, sks, skd, KPOS + b * skpb, skps, THETA,
                                          offs_d, d_ok, scale, HEAD_DIM, BLOCK_H, CHECK_D, ROPE, ROPE_INTERLEAVED)
    if ROPE:
        qp_base = QPOS + b * sqpb
        dk = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
        dk2 = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    else:
        qp_base = QPOS
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dk2 = dk  # unused placeholder
    v = load_2d(V + b * svb + hk * svh + cols[:, None] * svs + offs_d[None, :] * svd, n_ok, d_ok, True, CHECK_D)
    # key S - 1 is seen by no row (with ATTEND_CURRENT every key is seen): keep whatever it holds
    # out of the products
    if ATTEND_CURRENT:
        seen_k = cols < SK
    else:
        seen_k = cols < SK - 1
    k = tl.where(seen_k[:, None], k, 0.0)
    if ROPE:
        k2 = tl.where(seen_k[:, None], k2, 0.0)
    v = tl.where(seen_k[:, None], v, 0.0)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query tiles with a row i > n0: [q_lo, q_hi). From q_int on, every row is >= n0 + BLOCK_N (after
    # every column of the block, padding included); [q_int, q_full) are full tiles (no checks).
    q_hi = tl.cdiv(S, BLOCK_M)
    ks = None
    if HAS_SEGMENTS:  # no tile from Q_END on has a row of this block's ids
        q_hi = tl.minimum(q_hi, tl.load(Q_END + b * NKB + pid_n))
        ks = tl.load(SEG_K + b * SK + cols, mask=n_ok, other=0)[:, None]
    if OFF is not None or ATTEND_CURRENT:
        q_lo = tl.minimum(tl.maximum(n0_seen + 1, 0) // BLOCK_M, q_hi)
        q_int = tl.maximum(tl.minimum(tl.cdiv(tl.maximum(n0_seen + BLOCK_N, 0), BLOCK_M), q_hi), q_lo)
    else:
        q_lo = tl.minimum((n0 + 1) // BLOCK_M, q_hi)
        q_int = tl.maximum(tl.minimum(tl.cdiv(n0 + BLOCK_N, BLOCK_M), q_hi), q_lo)
    q_full = tl.maximum(tl.minimum(S // BLOCK_M, q_hi), q_int)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * Hq + h
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        cb_base = CB + (bh * NKB + pid_n) * S
        pb_base = PB + (bh * NKB + pid_n) * S
        qs_base = None
        if HAS_SEGMENTS:
            qs_base = SEG_Q + b * S
        lam = 0.0
        if HAS_DECAY:
            lam = tl.load(DECAY + h)
        dk, dk2, dv = _dkdv_inner(dk, dk2, dv, k, k2, v, q_base, do_base, cb_base, pb_base, qp_base, sqs, sqd, sdos,
                                  sdod, sqps, theta, lam, n0, cols, offs_m, offs_d, offs_h, d_ok, h_ok, S, scale,
                                  q_lo, q_int, BLOCK_M, HALF, CHECK_D, CHECK_H, True, HAS_DECAY, ROPE,
                                  ROPE_INTERLEAVED, PRECISION, BASE2, n0_seen, OFF, qs_base, ks, ATTEND_CURRENT,
                                  HAS_SEGMENTS)
        dk, dk2, dv = _dkdv_inner(dk, dk2, dv, k, k2, v, q_base, do_base, cb_base, pb_base, qp_base, sqs, sqd, sdos,
                                  sdod, sqps, theta, lam, n0, cols, offs_m, offs_d, offs_h, d_ok, h_ok, S, scale,
                                  q_int, q_full, BLOCK_M, HALF, CHECK_D, CHECK_H, False, HAS_DECAY, ROPE,
                                  ROPE_INTERLEAVED, PRECISION, BASE2, n0_seen, OFF, qs_base, ks, ATTEND_CURRENT,
                                  HAS_SEGMENTS)
        dk, dk2, dv = _dkdv_inner(dk, dk2, dv, k, k2, v, q_base, do_base, cb_base, pb_base, qp_base, sqs, sqd, sdos,
                                  sdod, sqps, theta, lam, n0, cols, offs_m, offs_d, offs_h, d_ok, h_ok, S, scale,
                                  q_full, q_hi, BLOCK_M, HALF, CHECK_D, CHECK_H, True, HAS_DECAY, ROPE,
                                  ROPE_INTERLEAVED, PRECISION, BASE2, n0_seen, OFF, qs_base, ks, ATTEND_CURRENT,
                                  HAS_SEGMENTS)

    mask = n_ok[:, None] & d_ok[None, :]
    if ROPE:
        store_unrotated(DK + b * sdkb + hk * sdkh, cols, n_ok, sdks, sdkd, dk * scale, dk2 * scale,
                        KPOS + b * skpb, skps, theta, offs_h, h_ok, HALF, ROPE_INTERLEAVED)
    else:
        dk = dk * scale
        tl.store(DK + b * sdkb + hk * sdkh + cols[:, None] * sdks + offs_d[None, :] * sdkd,
                 dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + b * sdvb + hk * sdvh + cols[:, None] * sdvs + offs_d[None, :] * sdvd,
             dv.to(DV.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch wrappers
# ----------------------------------------------------------------------------------------------
def _config(q: torch.Tensor, config):
    return config or default_stick_breaking_block_sizes(q.shape[3], q.dtype, q.is_cuda and not INTERPRETED)


def _decay_args(decay, q):
    """(DECAY pointer, HAS_DECAY): decay is None or a contiguous fp32 [Hq] tensor."""
    if decay is None:
        return q, False  # never read
    return decay, True


def _option_args(q, k, attend_current: bool, q_ids, kv_ids):
    """The launch arguments of the options (none when all are off, which compiles the kernels as
    without them): OFF = Sk - Sq where the lengths differ, ATTEND_CURRENT, and with segment ids
    SEG_Q [B, Sq], SEG_K [B, Sk] (one integer dtype, contiguous), FIRST [B, Sq] int32 (the first
    key each row sees, `attn_spec.visit.first_visible_keys`) and HAS_SEGMENTS."""
    args = {}
    if k.shape[1] != q.shape[1]:
        args["OFF"] = k.shape[1] - q.shape[1]
    if attend_current:
        args["ATTEND_CURRENT"] = True
    if q_ids is not None:
        q_ids, kv_ids = (x.contiguous() for x in segment_pair_for_kernel(q_ids, kv_ids))
        first = visit.first_visible_keys(q_ids, kv_ids, _TORCH_SEGMENT_OPS).to(torch.int32).contiguous()
        args.update(SEG_Q=q_ids, SEG_K=kv_ids, FIRST=first, HAS_SEGMENTS=True)
    return args


_TORCH_SEGMENT_OPS = types.SimpleNamespace(
    argsort=lambda x: torch.argsort(x, dim=-1, stable=True), take=lambda x, i: torch.gather(x, -1, i),
    searchsorted_left=lambda a, v: torch.searchsorted(a, v), where=torch.where,
    minimum=lambda x, n: torch.clamp(x, max=n))


def _query_tile_ends(first, block_q: int, block_k: int, num_k_blocks: int):
    """Per key block of block_k keys, the end of the query tiles of block_q rows a row of which may
    see it ([B, key blocks] int32): a tile's rows see no key left of its rows' least first visible
    key (`first` [B, Sq]), so a key block is seen by no tile past the last one whose least first
    key block is at most its own."""
    B, Sq = first.shape
    tiles = triton.cdiv(Sq, block_q)
    padded = torch.full((B, tiles * block_q), num_k_blocks * block_k, dtype=torch.int64, device=first.device)
    padded[:, :Sq] = first
    least = (padded.reshape(B, tiles, block_q).amin(dim=2) // block_k).clamp(max=num_k_blocks)  # [B, tiles]
    ends = torch.zeros((B, num_k_blocks + 1), dtype=torch.int64, device=first.device)
    tile_ends = torch.arange(1, tiles + 1, device=first.device).expand(B, tiles).contiguous()
    ends.scatter_reduce_(1, least, tile_ends, reduce="amax")
    return ends.cummax(dim=1).values[:, :num_k_blocks].to(torch.int32).contiguous()


def forward(q, k, v, *, scale: float, decay=None, rope=None, q_pos=None, kv_pos=None,
            config: StickBreakingBlockSizes | None = None, attend_current: bool = False, q_ids=None, kv_ids=None):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (Sq <= Sk: query i at key position i + Sk - Sq) ->
    (out [B, Sq, Hq, D] in q.dtype, rem [B, Hq, Sq] fp32).

    decay: None or a contiguous fp32 tensor [Hq] (lambda per head). rope: a `torch_ref.Rope` or
    None; with it q_pos [B, Sq], kv_pos [B, Sk] are the integer positions. attend_current: keys
    j <= i. q_ids [B, Sq], kv_ids [B, Sk]: segment ids or None. Inputs are assumed validated (see
    torch_ref.ops.common.validation).
    """
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    cfg = _config(q, config)
    out = torch.empty((B, S, Hq, D), dtype=q.dtype, device=q.device)
    rem = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, rem.fill_(1.0)
    decay_ptr, has_decay = _decay_args(decay, q)
    rope_ptrs, rope_strides, rope_flags = rope_args(rope, q_pos, kv_pos, q)
    options = _option_args(q, k, attend_current, q_ids, kv_ids)
    grid = (triton.cdiv(S, cfg.block_q), Hq, B)
    with device_ctx(q):
        _sb_fwd_kernel[grid](
            q, k, v, out, rem, decay_ptr, *rope_ptrs,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *rope_strides,
            Hq, Hq // Hkv, S, scale,
            HEAD_DIM=D, BLOCK_M=cfg.block_q, BLOCK_N=cfg.block_k, BLOCK_D=block_d(D), HAS_DECAY=has_decay,
            PRECISION=precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **rope_flags, **options)
    return out, rem


def backward(do, q, k, v, rem, *, scale: float, drem=None, decay=None, decay_grad: bool = False, rope=None,
             q_pos=None, kv_pos=None, config: StickBreakingBlockSizes | None = None, attend_current: bool = False,
             q_ids=None, kv_ids=None):
    """Gradients (dq, dk, dv, ddecay_rows) from dO [B, Sq, Hq, D], the forward's rem and optionally
    the cotangent drem [B, Hq, Sq] of rem (the forward's out is not needed); the options as `forward`.

    ddecay_rows [B, Hq, S] fp32 (None unless decay_grad): row i's share of d lambda_h; the
    gradient of lambda is its sum over b and i (and over the heads for a scalar lambda).
    """
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    cfg = _config(q, config)
    Sk = k.shape[1]
    dq = torch.empty((B, S, Hq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Sk, Hkv, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, Sk, Hkv, D), dtype=v.dtype, device=v.device)
    ddec = torch.zeros((B, Hq, S), dtype=torch.float32, device=q.device) if decay_grad else None
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), ddec
    # the prefix sums of g start at drem_i * rem_i (d rem_i / d z_ij = -rem_i sigma_ij)
    p0 = None if drem is None else (drem.float() * rem).contiguous()
    nkb = triton.cdiv(Sk, cfg.block_k_bwd)
    options = _option_args(q, k, attend_current, q_ids, kv_ids)
    # Running sums at the key-block boundaries, written by the dQ kernel, read by the dK/dV kernel
    # (only entries the dQ kernel wrote are read: empty is enough; with segment ids a dK/dV tile
    # also reads rows whose dQ tile started right of the block, masked: zeros keep them finite).
    new = torch.zeros if q_ids is not None else torch.empty
    cb = new((B, Hq, nkb, S), dtype=torch.float32, device=q.device)
    pb = new((B, Hq, nkb, S), dtype=torch.float32, device=q.device)
    decay_ptr, has_decay = _decay_args(decay, q)
    rope_ptrs, rope_strides, rope_flags = rope_args(rope, q_pos, kv_pos, q)
    dkdv_options = {name: x for name, x in options.items() if name != "FIRST"}
    if q_ids is not None:
        dkdv_options["Q_END"] = _query_tile_ends(options["FIRST"], cfg.block_q_dkv, cfg.block_k_bwd, nkb)
    common = dict(HEAD_DIM=D, BLOCK_N=cfg.block_k_bwd, BLOCK_D=block_d(D), HAS_DECAY=has_decay,
                  PRECISION=precision(q.dtype), num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd,
                  **rope_flags)
    with device_ctx(q):
        _sb_bwd_dq_kernel[(triton.cdiv(S, cfg.block_q_dq), Hq, B)](
            q, k, v, do, rem if p0 is None else p0, dq, ddec if decay_grad else rem, cb, pb, decay_ptr,
            *rope_ptrs, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *rope_strides,
            Hq, Hq // Hkv, S, nkb, scale, BLOCK_M=cfg.block_q_dq, DECAY_GRAD=bool(decay_grad),
            HAS_P0=p0 is not None, **common, **options)
        _sb_bwd_dkdv_kernel[(nkb, Hkv, B)](
            q, k, v, do, dk, dv, cb, pb, decay_ptr, *rope_ptrs,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *rope_strides,
            Hq, Hq // Hkv, S, nkb, scale, BLOCK_M=cfg.block_q_dkv, **common, **dkdv_options)
    return dq, dk, dv, ddec


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------
class StickBreakingFn(torch.autograd.Function):
    """Triton forward + backward. Outputs (out, rem), both differentiable. Gradients for q, k, v
    and the decay tensor (when one is given: `decay_t`, its own shape and dtype)."""

    @staticmethod
    def forward(ctx, q, k, v, decay_t, decay_value, scale, rope, q_pos, kv_pos, config=None, attend_current=False,
                q_ids=None, kv_ids=None):
        Hq = q.shape[2]
        if decay_t is not None:
            lam = decay_t.detach().to(torch.float32).reshape(-1).expand(Hq).contiguous()
        elif decay_value != 0.0:
            lam = torch.full((Hq,), decay_value, dtype=torch.float32, device=q.device)
        else:
            lam = None
        options = dict(attend_current=attend_current, q_ids=q_ids, kv_ids=kv_ids)
        out, rem = forward(q, k, v, scale=scale, decay=lam, rope=rope, q_pos=q_pos, kv_pos=kv_pos, config=config,
                           **options)
        ctx.save_for_backward(q, k, v, rem, lam, q_pos, kv_pos)
        ctx.opts = dict(scale=scale, rope=rope, config=config, **options)
        ctx.decay_meta = None if decay_t is None else (tuple(decay_t.shape), decay_t.dtype)
        ctx.set_materialize_grads(False)
        return out, rem

    @staticmethod
    def backward(ctx, dout, drem):
        q, k, v, rem, lam, q_pos, kv_pos = ctx.saved_tensors
        want_decay = ctx.decay_meta is not None and ctx.needs_input_grad[3]
        if dout is None and drem is None:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            ddecay_rows = torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device) if want_decay else None
        else:
            if dout is None:
                dout = torch.zeros_like(q)
            dq, dk, dv, ddecay_rows = backward(dout, q, k, v, rem, drem=drem, decay=lam, decay_grad=want_decay,
                                               q_pos=q_pos, kv_pos=kv_pos, **ctx.opts)
        ddecay = None
        if want_decay:
            shape, dtype = ctx.decay_meta
            per_head = ddecay_rows.to(torch.float64).sum(dim=(0, 2))  # [Hq]
            ddecay = (per_head.sum() if shape == () else per_head).to(dtype).reshape(shape)
        return dq, dk, dv, ddecay, None, None, None, None, None, None, None, None, None
