"""Absolute sinusoidal position encodings (Vaswani et al. 2017), defined once for both frameworks.

    PE[p, 2i]     = sin(p / 10000 ** (2i / d))
    PE[p, 2i + 1] = cos(p / 10000 ** (2i / d)),      i in [0, d/2), d = the model dimension.

`sinusoidal_encoding` writes the formula once over an array namespace `xp` (it needs `xp.sin`,
`xp.cos` and `xp.stack`, and the arrays' own `*`, `/`, `**`, `[..., None]` and `reshape`):
`jax_attn.nn.positions` evaluates it with `jax.numpy`, `torch_ref.nn.positions` with `torch`, and
NumPy with float64 inputs gives a golden table. Each framework chooses the compute dtype (float32,
or float64 for float64 requests) and the device, and casts the result. Imports neither jax nor torch.
"""
from __future__ import annotations

BASE = 10000.0


def check_dim(dim) -> int:
    """The encoding width: a positive even int."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(f"sinusoidal positions need a positive even dim, got dim={dim!r}")
    return dim


def check_length(length) -> int:
    """The table length: a non-negative int."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative int, got length={length!r}")
    return length


def sinusoidal_encoding(positions, pair_index, xp):
    """PE at `positions` [...]: [..., d], with d = 2 * len(pair_index).

    positions: the token positions, already in the compute dtype; pair_index: arange(d/2) in the
    same dtype, on the same device; xp: the namespace of their framework (jax.numpy, torch, numpy).
    """
    dim = 2 * pair_index.shape[0]
    inv_freq = BASE ** (-pair_index * 2 / dim)  # 10000 ** (-2i / d)
    angle = positions[..., None] * inv_freq.reshape((1,) * positions.ndim + (-1,))  # ranks spelled out
    pe = xp.stack([xp.sin(angle), xp.cos(angle)], -1)  # [..., d/2, 2]: (sin, cos) pairs
    return pe.reshape(*angle.shape[:-1], dim)
