"""Attention dropout in Triton: the hash of `attn_spec.dropout` on tl.uint32 values. `tables` hashes
a call's query rows (per batch and head) and key rows once, in one small kernel; the softmax
kernels (forward, dK/dV, dQ) load those bits like the row statistics and take one product and one
compare per element, so the backward regenerates the forward's mask.

Every value is tl.uint32: products and sums wrap, and `>>` on an unsigned value is a logical shift.
The constants are cast to tl.uint32 explicitly (a Python int above 2^31 - 1 would otherwise be
typed by its value). The seed words enter the tables kernel as two int64 scalars (`seed_args`:
each word plus 2^32, so that Triton types them int64 whatever the seed, compiles one kernel for
every seed, and does not specialise on their value); `stream` keeps their low 32 bits. The tables
are int32 tensors holding the uint32 bits (torch has no general uint32 arithmetic).

Importing this module imports triton (see `triton_tiles`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_spec import dropout as plan

MIX1 = tl.constexpr(plan.MIX1)
MIX2 = tl.constexpr(plan.MIX2)
GOLDEN = tl.constexpr(plan.GOLDEN)

# the tables kernel's seed parameters, not specialised on their values (`triton.jit(do_not_specialize=...)`)
SEED_ARGS = ("seed0", "seed1")
TABLE_BLOCK = 1024

__all__ = ["SEED_ARGS", "seed_args", "constexprs", "tables", "padded", "mix", "stream", "row_bits", "col_bits", "bits", "keep",
           "kept_only", "weight"]


def seed_args(seed: tuple[int, int]) -> tuple[int, int]:
    """The tables kernel's (seed0, seed1) scalars of the seed words."""
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
    return mix(stream_ ^ rows.to(tl.uint32)) | tl.cast(1, tl.uint32)


@triton.jit
def col_bits(cols):
    return mix(cols.to(tl.uint32) + tl.cast(GOLDEN, tl.uint32)) | tl.cast(1, tl.uint32)


@triton.jit(do_not_specialize=SEED_ARGS)
def _tables_kernel(ROWS, COLS, seed0, seed1, Sq, Sk, BLOCK: tl.constexpr):
    """grid (cdiv(max(Sq, Sk), BLOCK), B * H): ROWS [B * H, Sq] the rows' bits of stream bh, COLS
    [Sk] the keys' bits (written by the programs of bh = 0)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bh = tl.program_id(1).to(tl.int64)
    rows = row_bits(stream(seed0, seed1, bh), offs)
    tl.store(ROWS + bh * Sq + offs, rows.to(tl.int32, bitcast=True), mask=offs < Sq)
    if bh == 0:
        tl.store(COLS + offs, col_bits(offs).to(tl.int32, bitcast=True), mask=offs < Sk)


def tables(seed: tuple[int, int], streams: int, q_len: int, kv_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows int32 [streams, q_len], cols int32 [kv_len]): the uint32 bits of stream bh = b * H + h's
    query rows and of the key rows, for the kernels' `bits`."""
    rows = torch.empty((streams, q_len), dtype=torch.int32, device=device)
    cols = torch.empty((kv_len,), dtype=torch.int32, device=device)
    _tables_kernel[(triton.cdiv(max(q_len, kv_len), TABLE_BLOCK), streams)](
        rows, cols, *seed_args(seed), q_len, kv_len, BLOCK=TABLE_BLOCK)
    return rows, cols


def padded(tables: tuple[torch.Tensor, torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables flat with `pad` entries more (any values: the rows and keys past the sequence
    ends are invisible), so that the kernels load a block at any offset below the length without a
    mask (a masked load of the keys' bits in the tiles' loop costs a predicate per element)."""
    rows, cols = tables
    return (torch.nn.functional.pad(rows.reshape(-1), (0, pad)), torch.nn.functional.pad(cols, (0, pad)))


@triton.jit
def bits(table, offs):
    """A table's uint32 bits at offs (`padded`: a block past the length reads the pad)."""
    return tl.load(table + offs).to(tl.uint32, bitcast=True)


@triton.jit
def keep(row, col, DROP_THRESHOLD: tl.constexpr):
    """row and column bits broadcast against each other -> True where kept (`plan.keep`)."""
    return row * col >= tl.cast(DROP_THRESHOLD, tl.uint32)


@triton.jit
def kept_only(x, kept):
    """x where kept, else 0 (the forward applies 1 / (1 - rate) once a row, to the output)."""
    return tl.where(kept, x, 0.0)


@triton.jit
def weight(kept, scale):
    """1 / (1 - rate) where kept, else 0: the backward's factor of a kept probability and of dP.
    scale is that factor as a run-time scalar: with it a constant, the compiler turns p * weight
    into a select on the 16-bit values after their conversion (two extra instructions per element)
    or keeps a p * 0 beside it."""
    return tl.where(kept, scale, 0.0)
