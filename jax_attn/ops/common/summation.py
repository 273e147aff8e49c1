"""fp32 sums and dot products nearly correctly rounded, in a fixed order on every backend.

Where a backward's reductions cancel heavily (stick-breaking's decay gradient over a head's rows,
dilated attention's delta = rowsum(dO * O) over short segments), the order of a plain fp32
reduction shows in the result, and XLA's order differs between backends and CPU instruction sets
(XLA:CPU merges reductions under jit and sums windows of terms sequentially;
docs/design/stick_breaking.md, 'Log space'). These helpers use elementwise ops only (which XLA
does not reassociate): Knuth's TwoSum for every add and Dekker's TwoProduct for every product,
the rounding errors carried in a second fp32 word."""
from __future__ import annotations

import jax.numpy as jnp

from attn_spec.tiles import pow2_at_least
from jax_attn.ops.common import padding


def sum_compensated(x):
    """Sum over the last axis of fp32 x, erring ~1 ulp of the sum: pairwise halving with TwoSum."""
    n = pow2_at_least(x.shape[-1])
    hi = padding.pad_axis(x, x.ndim - 1, n)
    lo = jnp.zeros_like(hi)
    while n > 1:
        n //= 2
        a, b = hi[..., :n], hi[..., n:]
        hi = a + b
        b_virtual = hi - a
        err = (a - (hi - b_virtual)) + (b - b_virtual)  # exactly a + b - hi
        lo = lo[..., :n] + lo[..., n:] + err
    return (hi + lo)[..., 0]


def _split(a):
    """Veltkamp's split of fp32 a into hi + lo, 12 significant bits each: their products are exact."""
    c = a * 4097.0  # 2^12 + 1
    hi = c - (c - a)
    return hi, a - hi


def dot_compensated(x, y):
    """sum(x * y) over the last axis of fp32 x, y, erring ~1/2 ulp of the result: the products and
    their rounding errors (TwoProduct) in one compensated sum. 16-bit values upcast have exact
    fp32 products: their error terms are 0."""
    p = x * y
    x_hi, x_lo = _split(x)
    y_hi, y_lo = _split(y)
    err = ((x_hi * y_hi - p) + x_hi * y_lo + x_lo * y_hi) + x_lo * y_lo  # exactly x * y - p
    return sum_compensated(jnp.concatenate([p, err], axis=-1))
