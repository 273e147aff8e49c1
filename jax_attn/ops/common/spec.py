"""What an attention call computes, independent of the backend that computes it.

`AttentionSpec` is the static description (hashable, a `custom_vjp` non-diff argument) shared by
the plain reference and the Pallas engine. `visible` is the one element-mask definition both use.
`visit.py` turns it into "which key blocks each query block visits" (the visit plan).
"""
from __future__ import annotations

import dataclasses
import math

import jax

from attn_spec.rope import Rope
from attn_spec.tiles import pow2_at_least

LOG2E = math.log2(math.e)  # the kernels exponentiate in base 2


def padded_head_dim(spec: "AttentionSpec", head_dim: int) -> int:
    """The head dim every engine pads to: a power of two; with RoPE twice one, so that the pairs'
    first and second columns each fill a power of two (style "half" pads them apart)."""
    return pow2_at_least(head_dim) if spec.rope is None else 2 * pow2_at_least(head_dim // 2)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static part of an attention call.

    window_left / window_right: query i sees keys i - left .. i + right (None = unbounded).
    causal: query i sees keys j <= i (top-left aligned).
    offset: q_offset - kv_offset, the absolute position of query row 0 minus that of key row 0:
      causality and windows compare absolute positions, i + offset against j (Sk - Sq:
      bottom-right aligned, as FlashAttention).
    alibi: scores get -slope_h * |i + offset - j| (ALiBi, per-head slopes given at run time).
    dropout: the rate of attention dropout (probabilities zeroed after the softmax, the rest
      scaled by 1 / (1 - rate); the bits of `attn_spec.dropout`, seeded at run time).
    ordered: the rows are positions of an ordered sequence (a space-filling-curve ordering,
      `attn_spec.orderings`) and each carries its original position: windows compare the ordered
      positions, causality the original ones (`visible`'s q_orig, kv_orig). The kernels gather
      the rows through those positions.
    """

    scale: float
    causal: bool = False
    window_left: int | None = None
    window_right: int | None = None
    softcap: float | None = None
    has_segments: bool = False
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    rope: Rope | None = None  # rotate q and k by their positions (fused in the kernels)
    offset: int = 0
    alibi: bool = False
    dropout: float = 0.0
    ordered: bool = False  # rows read through an ordering (orig positions given): causality compares those

    @property
    def has_position_mask(self) -> bool:
        return self.causal or self.window_left is not None or self.window_right is not None


def visible(spec: AttentionSpec, rows, cols, kv_len: int, q_seg=None, kv_seg=None, q_orig=None, kv_orig=None):
    """Element mask: True where query position `rows` may attend key position `cols`.

    `rows`, `cols` (and the segment ids, aligned with them) broadcast against each other, so one
    definition serves the reference ([Sq, Sk]) and every kernel tile orientation. With
    spec.ordered, q_orig / kv_orig are the rows' original positions (aligned likewise): causality
    compares them, the window the ordered positions `rows`, `cols`.
    """
    mask = cols < kv_len
    if spec.offset:  # absolute positions: query row i sits at key position i + offset
        rows = rows + spec.offset
    if spec.causal and spec.ordered:
        mask &= kv_orig <= q_orig
    elif spec.causal:
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


