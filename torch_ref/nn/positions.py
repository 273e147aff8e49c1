"""Absolute sinusoidal position encodings, the PyTorch twin of `jax_attn.positions`.

    PE[p, 2i]     = sin(p / 10000 ** (2i / d))
    PE[p, 2i + 1] = cos(p / 10000 ** (2i / d)),      i in [0, d/2), d = the model dimension.

Computed in float32 or wider (float64 for float64 requests), then cast to the requested dtype.
"""
from __future__ import annotations

import torch

BASE = 10000.0


def _check_dim(dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(f"sinusoidal positions need a positive even dim, got dim={dim!r}")
    return dim


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def sinusoidal_at(positions: torch.Tensor, dim: int, dtype=torch.float32) -> torch.Tensor:
    """The encoding of integer `positions` (a tensor of any shape [...]): [..., dim], on its device."""
    dim = _check_dim(dim)
    compute = _compute_dtype(dtype)
    inv_freq = BASE ** (-torch.arange(0, dim // 2, dtype=compute, device=positions.device) * 2 / dim)
    angle = positions.to(compute)[..., None] * inv_freq
    pe = torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1)  # [..., d/2, 2]: (sin, cos) pairs
    return pe.reshape(*angle.shape[:-1], dim).to(dtype)


def sinusoidal_positions(length: int, dim: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """The table PE [length, dim] for positions 0 .. length - 1."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative int, got length={length!r}")
    return sinusoidal_at(torch.arange(length, device=device), dim, dtype)
