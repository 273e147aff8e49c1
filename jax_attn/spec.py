"""What an attention call computes, independent of the backend that computes it.

`AttentionSpec` is the static description (hashable, a `custom_vjp` non-diff argument) shared by
the plain reference and the Pallas engine. `visible` is the one element-mask definition both use.
`block_ranges` turns the spec into "which key blocks each query block visits" (and the transpose),
the parameter through which the engine skips fully masked tiles.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.rope import Rope

LOG2E = math.log2(math.e)  # the kernels exponentiate in base 2
# Stick-breaking: its 16-bit in-tile softplus suffix terms (base 2) are capped here before the fp16
# rounding (fp16 overflows at 65504); one such term makes every A left of it 2^-256, zero in fp32.
SP_CAP = 256.0
# Stick-breaking: a row whose softplus sum right of a key block reaches SPENT (base 2) has spent its
# stick there: every A left of it is 2^-SPENT or less, exactly 0 in fp32 (2^-150 rounds to 0), so
# the kernels skip those tiles and the results stay bit-equal. On the GPU A is ex2.approx.ftz,
# which flushes results below 2^-126 to 0: there SPENT_FTZ suffices (2 below, for the
# approximation's error).
SPENT = 152.0
SPENT_FTZ = 128.0


def pow2_at_least(n: int, minimum: int = 16) -> int:
    """The power of two >= n and >= minimum: tile sides and padded head dims (16 = the smallest
    side a matrix-unit dot takes)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def padded_head_dim(spec: "AttentionSpec", head_dim: int) -> int:
    """The head dim every engine pads to: a power of two; with RoPE twice one, so that the pairs'
    first and second columns each fill a power of two (style "half" pads them apart)."""
    return pow2_at_least(head_dim) if spec.rope is None else 2 * pow2_at_least(head_dim // 2)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static part of an attention call.

    window_left / window_right: query i sees keys i - left .. i + right (None = unbounded).
    causal: query i sees keys j <= i (top-left aligned).
    """

    scale: float
    causal: bool = False
    window_left: int | None = None
    window_right: int | None = None
    softcap: float | None = None
    has_segments: bool = False
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    rope: Rope | None = None  # rotate q and k by their positions (fused in the kernels)

    @property
    def right_reach(self) -> int | None:
        """How far to the right of the diagonal a query may look (None = unbounded)."""
        reach = self.window_right
        if self.causal:
            reach = 0 if reach is None else min(reach, 0)
        return reach

    @property
    def has_position_mask(self) -> bool:
        return self.causal or self.window_left is not None or self.window_right is not None


def visible(spec: AttentionSpec, rows, cols, kv_len: int, q_seg=None, kv_seg=None):
    """Element mask: True where query position `rows` may attend key position `cols`.

    `rows`, `cols` (and the segment ids, aligned with them) broadcast against each other, so one
    definition serves the reference ([Sq, Sk]) and every kernel tile orientation.
    """
    mask = cols < kv_len
    if spec.causal:
        mask &= cols <= rows
    if spec.window_left is not None:
        mask &= cols >= rows - spec.window_left
    if spec.window_right is not None:
        mask &= cols <= rows + spec.window_right
    if spec.has_segments:
        mask &= q_seg == kv_seg
    return mask


# --------------------------------------------------------------------------------------------
# Block ranges: the visited tiles. For every query block the visible key blocks form one
# interval [lo, hi), and inside it the blocks that need no element mask form [full_lo, full_hi).
# Causality and windows are static (NumPy at trace time, cached); segment ids narrow [lo, hi)
# at run time (jnp, a few hundred elements). The transpose (query blocks per key block) drives
# the dK/dV kernel.
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _static_block_masks(spec: AttentionSpec, q_len, kv_len, block_q, block_k, nq, nk):
    """(any, all) visibility per (query block, key block), from causality, window and kv_len."""
    r0 = np.arange(nq)[:, None] * block_q  # first row of each query block
    r1_real = np.minimum(r0 + block_q, q_len) - 1  # last real row ("any" ignores padding rows)
    r1_pad = r0 + block_q - 1  # last row incl. padding ("all" must hold for padding rows too)
    c0 = np.arange(nk)[None, :] * block_k
    c1 = c0 + block_k - 1
    big = 1 << 40
    left = big if spec.window_left is None else spec.window_left
    right = big if spec.right_reach is None else spec.right_reach
    # Row r sees the interval [r - left, r + right]; both ends grow with r, so a block of rows
    # sees the union [r0 - left, r1 + right] and sees every key of [c0, c1] iff
    # r1 - left <= c0 and c1 <= r0 + right.
    any_ = (c0 <= r1_real + right) & (c1 >= r0 - left) & (c0 < kv_len) & (r0 < q_len)
    all_ = (c0 >= r1_pad - left) & (c1 <= r0 + right) & (c1 < kv_len)
    return any_, all_ & any_


def _ranges_from_masks(any_, all_):
    """Per row of the block matrices: (lo, full_lo, full_hi, hi) int32, jnp or np alike."""
    xp = jnp if isinstance(any_, jax.Array) or isinstance(all_, jax.Array) else np
    n = any_.shape[-1]
    idx = xp.arange(n)
    lo = xp.min(xp.where(any_, idx, n), axis=-1)
    hi = xp.max(xp.where(any_, idx + 1, 0), axis=-1)
    hi = xp.maximum(hi, lo)  # an empty row gives lo = hi = n
    full_lo = xp.min(xp.where(all_, idx, n), axis=-1)
    full_hi = xp.max(xp.where(all_, idx + 1, 0), axis=-1)
    full_lo = xp.clip(full_lo, lo, hi)
    full_hi = xp.clip(full_hi, full_lo, hi)
    return xp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(xp.int32)


def block_ranges(spec: AttentionSpec, q_len, kv_len, block_q, block_k, nq, nk,
                 q_seg=None, kv_seg=None, *, key_major: bool):
    """Visited block ranges, int32 [B or 1, n_outer, 4] = (lo, full_lo, full_hi, hi).

    key_major=False: for each query block, the key blocks it visits (forward, dQ).
    key_major=True: for each key block, the query blocks that visit it (dK/dV).
    Segment ids ([B, nq*block_q], [B, nk*block_k], padded) narrow the ranges where the id
    intervals of two blocks do not overlap; with segments no block counts as mask-free.
    """
    any_, all_ = _static_block_masks(spec, q_len, kv_len, block_q, block_k, nq, nk)
    if key_major:
        any_, all_ = any_.T, all_.T
    if not spec.has_segments:
        return jnp.asarray(_ranges_from_masks(any_, all_))[None]
    qb = q_seg.reshape(q_seg.shape[0], nq, block_q)
    kb = kv_seg.reshape(kv_seg.shape[0], nk, block_k)
    qmin, qmax = qb.min(-1), qb.max(-1)
    kmin, kmax = kb.min(-1), kb.max(-1)
    overlap = (qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])
    if key_major:
        overlap = overlap.transpose(0, 2, 1)
    seg_any = overlap & jnp.asarray(any_)[None]
    return _ranges_from_masks(seg_any, jnp.zeros_like(seg_any))
