"""Attention dropout in Triton: the hash of `attn_spec.dropout` on tl.uint32 values, evaluated
per tile by the softmax kernels (forward, dK/dV, dQ), so the backward regenerates the forward's mask.

Every value is tl.uint32: products and sums wrap, and `>>` on an unsigned value is a logical shift.
The constants are cast to tl.uint32 explicitly (a Python int above 2^31 - 1 would otherwise be
typed by its value). The seed words enter a kernel as two int64 scalars (`seed_args`: each word
plus 2^32, so that Triton types them int64 whatever the seed, compiles one kernel for every seed,
and does not specialise on their value); `stream` keeps their low 32 bits.

Importing this module imports triton (see `triton_tiles`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from attn_spec import dropout as plan

MIX1 = tl.constexpr(plan.MIX1)
MIX2 = tl.constexpr(plan.MIX2)
GOLDEN = tl.constexpr(plan.GOLDEN)

# the kernels' seed parameters, not specialised on their values (`triton.jit(do_not_specialize=...)`)
SEED_ARGS = ("seed0", "seed1")

__all__ = ["SEED_ARGS", "seed_args", "constexprs", "mix", "stream", "row_bits", "col_bits", "keep", "dropped"]


def seed_args(seed: tuple[int, int] | None) -> tuple:
    """The kernels' (seed0, seed1) scalars: None (a constexpr: nothing emitted) without dropout."""
    if seed is None:
        return None, None
    return seed[0] + 2 ** 32, seed[1] + 2 ** 32


def constexprs(rate: float) -> dict:
    """The kernels' dropout constexprs: DROPOUT (the rate; 0 compiles the dropout out) and
    DROP_THRESHOLD (`attn_spec.dropout.threshold`)."""
    return dict(DROPOUT=float(rate), DROP_THRESHOLD=plan.threshold(rate))


@triton.jit
def mix(x):
    """MurmurHash3's fmix32 on tl.uint32 values."""
    x = x ^ (x >> 16)
    x = x * tl.cast(MIX1, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.cast(MIX2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def stream(seed0, seed1, bh):
    """The (batch, query head) stream: seed words as `seed_args` passes them, bh = b * H + h."""
    return mix(seed0.to(tl.uint32) ^ mix(seed1.to(tl.uint32) ^ bh.to(tl.uint32)))


@triton.jit
def row_bits(stream_, rows):
    return mix(stream_ ^ rows.to(tl.uint32))


@triton.jit
def col_bits(cols):
    return mix(cols.to(tl.uint32) + tl.cast(GOLDEN, tl.uint32))


@triton.jit
def keep(row, col, DROP_THRESHOLD: tl.constexpr):
    """row and column bits broadcast against each other -> True where kept (`plan.scramble`)."""
    x = row ^ col
    x = (x ^ (x >> 16)) * tl.cast(MIX1, tl.uint32)
    return (x >> 1).to(tl.int32) >= DROP_THRESHOLD


@triton.jit
def kept_only(x, kept):
    """x where kept, else 0 (the 1 / (1 - rate) applied once to the row's sum instead)."""
    return tl.where(kept, x, 0.0)


@triton.jit
def dropped(x, kept, DROPOUT: tl.constexpr):
    """x scaled by 1 / (1 - rate) where kept, else 0."""
    return tl.where(kept, x * (1.0 / (1.0 - DROPOUT)), 0.0)
