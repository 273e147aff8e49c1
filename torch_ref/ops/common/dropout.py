"""Attention dropout in torch: the hash of `attn_spec.dropout` on torch tensors (the eager
reference's [B, H, Sq, Sk] mask) and the seed of a call.

torch has no wrapping uint32 arithmetic on every device, so the values are uint32 held in int64
tensors: `_U32` wraps one and masks every sum and product to 32 bits (products are split in 16-bit
halves, so no intermediate leaves int64's positive range). The hash itself is `attn_spec.dropout`'s,
evaluated through `_ops(device)`, the namespace of operations it takes; the Triton kernels evaluate
the same hash with tl.uint32 (`triton_dropout`). This module does not import triton.
"""
from __future__ import annotations

import types

import torch

from attn_spec import dropout as plan

MASK32 = 0xFFFFFFFF

__all__ = ["keep_mask", "draw_seed", "seed_words"]

seed_words = plan.seed_words


class _U32:
    """uint32 values in an int64 tensor, with the ^, | and the wrapping +, * of uint32."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __xor__(self, other: "_U32") -> "_U32":
        return _U32(self.t ^ other.t)

    def __or__(self, other: "_U32") -> "_U32":
        return _U32(self.t | other.t)

    def __add__(self, other: "_U32") -> "_U32":
        return _U32((self.t + other.t) & MASK32)

    def __mul__(self, other: "_U32") -> "_U32":
        # a * b mod 2^32 = a * b_lo + ((a * b_hi) mod 2^16) * 2^16, every term below 2^48
        lo, hi = other.t & 0xFFFF, other.t >> 16
        return _U32((self.t * lo + (((self.t * hi) & 0xFFFF) << 16)) & MASK32)


def _ops(device) -> types.SimpleNamespace:
    def u32(x):
        if isinstance(x, _U32):
            return x
        return _U32(torch.as_tensor(x, dtype=torch.int64, device=device) & MASK32)

    return types.SimpleNamespace(u32=u32, shr=lambda x, n: _U32(x.t >> n), ge=lambda x, t: x.t >= t)


def keep_mask(seed: tuple[int, int], batch: int, num_heads: int, q_len: int, kv_len: int, rate: float,
              device=None) -> torch.Tensor:
    """[B, H, Sq, Sk] bool, True where kept: element (b, h, i, j) of `attn_spec.dropout` with seed
    words (s0, s1) (`seed_words`)."""
    ops = _ops(device)
    arange = lambda n: torch.arange(n, dtype=torch.int64, device=device)
    b, h = arange(batch)[:, None, None, None], arange(num_heads)[None, :, None, None]
    stream = plan.stream(ops.u32(seed[0]), ops.u32(seed[1]), b, h, num_heads, ops)
    row = plan.row_bits(stream, arange(q_len)[None, None, :, None], ops)
    return plan.keep(row, plan.col_bits(arange(kv_len)[None, None, None, :], ops), rate, ops)


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A seed in [0, 2^64) from two 32-bit words of `torch.randint` (torch's default CPU generator,
    or `generator`, on its device)."""
    device = "cpu" if generator is None else generator.device
    hi, lo = torch.randint(0, 2 ** 32, (2,), dtype=torch.int64, generator=generator, device=device).tolist()
    return (hi << 32) | lo
