"""Triton tile toolkit shared by the variants' kernels (softmax and stick-breaking).

Device helpers: `load_2d` (a tile with compiled-in bounds checks) and the RoPE helpers: q / k
tiles loaded as their two rotated pair halves (`load_rotated`, `load_own`) and gradients rotated
back before the store (`store_unrotated`). Host helpers: `precision` (tl.dot input precision),
`rope_args` (the THETA / position pointers, strides and RoPE constexprs of a launch) and
`device_ctx`. `INTERPRETED` says whether the @triton.jit functions were built for the interpreter.

Importing this module imports triton: the interpreter (`TRITON_INTERPRET=1`) must be chosen in
the environment before that happens.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from attn_spec.tiles import MIN_BLOCK

# Whether the @triton.jit functions below (and the kernels built on them) were built for the
# interpreter (fixed at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

__all__ = ["INTERPRETED", "load_2d", "load_rotated", "load_own", "store_unrotated", "precision", "rope_args",
           "device_ctx", "block_d"]



def block_d(head_dim: int) -> int:
    """The head dim rounded up to a power of two (>= 16, the tl.dot minimum): the kernels' BLOCK_D."""
    return max(MIN_BLOCK, triton.next_power_of_2(head_dim))


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def load_2d(ptrs, r_ok, c_ok, CHECK_R: tl.constexpr, CHECK_C: tl.constexpr):
    """Load a 2-D tile; out-of-range rows/cols read 0. Checks compiled in only where needed."""
    if CHECK_R and CHECK_C:
        x = tl.load(ptrs, mask=r_ok[:, None] & c_ok[None, :], other=0.0)
    elif CHECK_R:
        x = tl.load(ptrs, mask=r_ok[:, None], other=0.0)
    elif CHECK_C:
        x = tl.load(ptrs, mask=c_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


# ----------------------------------------------------------------------------------------------
# RoPE helpers (ROPE=True only)
# ----------------------------------------------------------------------------------------------
# With RoPE every q / k tile is loaded as its two pair halves x_a, x_b (each [rows, BLOCK_H],
# BLOCK_H = D/2 padded to a power of two >= 16, masked on the real D/2 columns): for "half" the
# columns [0, D/2) and [D/2, D), for "interleaved" the even and odd columns (strided offsets 2j and
# 2j + 1). They are rotated in fp32 right after the load and rounded once to the input dtype (as
# the eager reference does), so scores are dot(q_a, k_a^T) + dot(q_b, k_b^T): no in-register
# shuffle. The dq / dk accumulators are kept as two halves (gradients w.r.t. the rotated q, k)
# and rotated back with R^T before the store.
@triton.jit
def _load_1d(ptrs, ok, CHECK: tl.constexpr):
    if CHECK:
        x = tl.load(ptrs, mask=ok, other=0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _pair_cols(offs_h, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Columns of the two members of pair j: (2j, 2j + 1) interleaved, (j, j + D/2) half."""
    if INTERLEAVED:
        col_a = 2 * offs_h
        col_b = col_a + 1
    else:
        col_a = offs_h
        col_b = offs_h + HALF
    return col_a, col_b


@triton.jit
def _load_positions(pos_base, rows, r_ok, s_pos, offs_h, CHECK_R: tl.constexpr, TRANS: tl.constexpr):
    """The positions of `rows` as fp32, loaded directly in the tile's shape [rows, BLOCK_H]
    ([BLOCK_H, rows] if TRANS): the pointers are broadcast along the pair axis.

    The dK/dV kernel uses this instead of a [rows] vector broadcast afterwards. In its loop the
    vector, whose layout is replicated across lanes, becomes lane-predicated cp.async copies in
    Triton 3.6's software pipeline, and ptxas (CUDA 12.8 as bundled with Triton 3.6, and 12.9;
    sm_90a) segfaulted on the 16-bit dK/dV kernel for every tile config tried. In the tile's shape
    nothing is replicated: it compiles, with fewer spills. The forward and dQ kernels keep the
    vector: they compile with it, and the tile would cost them pipelined shared memory (forward:
    up to 32 KB more)."""
    if TRANS:
        ptrs = pos_base + rows[None, :] * s_pos + 0 * offs_h[:, None]
        ok = r_ok[None, :]
    else:
        ptrs = pos_base + rows[:, None] * s_pos + 0 * offs_h[None, :]
        ok = r_ok[:, None]
    if CHECK_R:
        pos = tl.load(ptrs, mask=ok, other=0)
    else:
        pos = tl.load(ptrs)
    return pos.to(tl.float32)


@triton.jit
def _rope_cos_sin(pos, theta, TRANS: tl.constexpr, TILE_POS: tl.constexpr = False):
    """cos, sin of the angle pos * theta in fp32: [rows, BLOCK_H], or [BLOCK_H, rows] if TRANS.

    pos: fp32 positions [rows] (already in the tile's shape if TILE_POS); theta: the fp32 table
    base ** (-2j / D) [BLOCK_H] (0 on padding), so the fp32 angle is bit-identical to the eager
    reference's."""
    if TILE_POS:
        if TRANS:
            angle = theta[:, None] * pos
        else:
            angle = pos * theta[None, :]
    elif TRANS:
        angle = theta[:, None] * pos[None, :]
    else:
        angle = pos[:, None] * theta[None, :]
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def load_rotated(base, rows, r_ok, s_row, s_col, pos_base, s_pos, theta, offs_h, h_ok, HALF: tl.constexpr,
                 CHECK_R: tl.constexpr, CHECK_H: tl.constexpr, INTERLEAVED: tl.constexpr, TRANS: tl.constexpr,
                 TILE_POS: tl.constexpr = False):
    """Rows `rows` of a q or k tile, rotated by their positions: (x_a', x_b') in the input dtype,
    each [rows, BLOCK_H] ([BLOCK_H, rows] if TRANS). Padding rows / columns read 0 and stay 0.
    TILE_POS: load the positions in the tile's shape (`_load_positions`; the dK/dV kernel does)."""
    col_a, col_b = _pair_cols(offs_h, HALF, INTERLEAVED)
    if TILE_POS:
        pos = _load_positions(pos_base, rows, r_ok, s_pos, offs_h, CHECK_R, TRANS)
    else:
        pos = _load_1d(pos_base + rows * s_pos, r_ok, CHECK_R).to(tl.float32)
    if TRANS:
        x_a = load_2d(base + col_a[:, None] * s_col + rows[None, :] * s_row, h_ok, r_ok, CHECK_H, CHECK_R)
        x_b = load_2d(base + col_b[:, None] * s_col + rows[None, :] * s_row, h_ok, r_ok, CHECK_H, CHECK_R)
    else:
        x_a = load_2d(base + rows[:, None] * s_row + col_a[None, :] * s_col, r_ok, h_ok, CHECK_R, CHECK_H)
        x_b = load_2d(base + rows[:, None] * s_row + col_b[None, :] * s_col, r_ok, h_ok, CHECK_R, CHECK_H)
    c, s = _rope_cos_sin(pos, theta, TRANS, TILE_POS)
    f_a = x_a.to(tl.float32)
    f_b = x_b.to(tl.float32)
    r_a = (f_a * c - f_b * s).to(x_a.dtype)
    r_b = (f_a * s + f_b * c).to(x_a.dtype)
    return r_a, r_b


@triton.jit
def load_own(ptr, rows, r_ok, s_row, s_col, pos_ptr, s_pos, THETA, offs_d, d_ok, placeholder,
             HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, CHECK_D: tl.constexpr, ROPE: tl.constexpr,
             INTERLEAVED: tl.constexpr, TILE_POS: tl.constexpr = False):
    """A program's own block of q or k (rows `rows`) -> (x, x2, offs_h, h_ok, theta): with ROPE
    its pair parts rotated by their positions, each [rows, BLOCK_H], the pair columns and THETA's
    [BLOCK_H]; else the block [rows, BLOCK_D], with offs_d, d_ok and `placeholder` standing in for
    the unused rest (`load_rotated`, TILE_POS)."""
    if ROPE:  # (one return: triton matches the types of every return, constexpr branches too)
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = offs_h < HALF
        theta = tl.load(THETA + offs_h, mask=h_ok, other=0.0)
        x, x2 = load_rotated(ptr, rows, r_ok, s_row, s_col, pos_ptr, s_pos, theta, offs_h, h_ok, HALF, True,
                             BLOCK_H != HALF, INTERLEAVED, False, TILE_POS)
    else:
        x = load_2d(ptr + rows[:, None] * s_row + offs_d[None, :] * s_col, r_ok, d_ok, True, CHECK_D)
        x2 = x
        offs_h = offs_d
        h_ok = d_ok
        theta = placeholder
    return x, x2, offs_h, h_ok, theta


@triton.jit
def store_unrotated(base, rows, r_ok, s_row, s_col, g_a, g_b, pos_base, s_pos, theta, offs_h, h_ok,
                    HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Store the gradient w.r.t. the unrotated input from (g_a, g_b) [rows, BLOCK_H] (fp32, w.r.t.
    the rotated one): R^T, (g_a, g_b) -> (g_a cos + g_b sin, -g_a sin + g_b cos)."""
    col_a, col_b = _pair_cols(offs_h, HALF, INTERLEAVED)
    pos = tl.load(pos_base + rows * s_pos, mask=r_ok, other=0).to(tl.float32)
    c, s = _rope_cos_sin(pos, theta, False)
    d_a = g_a * c + g_b * s
    d_b = g_b * c - g_a * s
    mask = r_ok[:, None] & h_ok[None, :]
    tl.store(base + rows[:, None] * s_row + col_a[None, :] * s_col, d_a.to(base.dtype.element_ty), mask=mask)
    tl.store(base + rows[:, None] * s_row + col_b[None, :] * s_col, d_b.to(base.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------
def precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: follow torch's TF32 switch for fp32 (ieee unless allowed)."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


_THETA_CACHE: dict = {}


def _theta_table(head_dim: int, base: float, device) -> torch.Tensor:
    """The fp32 inverse frequencies [D/2], computed exactly as the eager reference does."""
    key = (head_dim, float(base), str(device))
    theta = _THETA_CACHE.get(key)
    if theta is None:
        from .rope import inverse_frequencies

        theta = inverse_frequencies(head_dim, base, torch.float32, device).contiguous()
        _THETA_CACHE[key] = theta
    return theta


def rope_args(rope, q_pos, kv_pos, q):
    """(THETA, QPOS, KPOS), their strides and the RoPE constexprs; q stands in (never read) without rope."""
    if rope is None:
        return (q, q, q), (0, 0, 0, 0), dict(BLOCK_H=16, ROPE=False, ROPE_INTERLEAVED=False)
    D = q.shape[3]
    theta = _theta_table(D, rope.base, q.device)
    block_h = max(16, triton.next_power_of_2(D // 2))
    return ((theta, q_pos, kv_pos), (q_pos.stride(0), q_pos.stride(1), kv_pos.stride(0), kv_pos.stride(1)),
            dict(BLOCK_H=block_h, ROPE=True, ROPE_INTERLEAVED=rope.style == "interleaved"))


def device_ctx(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
