"""Absolute sinusoidal position encodings in torch, the twin of `jax_attn.nn.positions`.

The formula (PE[p, 2i] = sin(p / 10000 ** (2i / d)), PE[p, 2i + 1] = cos(...)) and the argument
checks are those of `attn_spec.positions`, evaluated here with torch ops on the positions' device,
in float32 or float64 (for float64 requests), then cast to the requested dtype.
"""
from __future__ import annotations

import torch

from attn_spec.positions import check_dim, check_length, sinusoidal_encoding


def sinusoidal_at(positions: torch.Tensor, dim: int, dtype=torch.float32) -> torch.Tensor:
    """The encoding of integer `positions` (a tensor of any shape [...]): [..., dim], on its device."""
    dim = check_dim(dim)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    pair_index = torch.arange(0, dim // 2, dtype=compute, device=positions.device)
    return sinusoidal_encoding(positions.to(compute), pair_index, torch).to(dtype)


def sinusoidal_positions(length: int, dim: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """The table PE [length, dim] for positions 0 .. length - 1."""
    return sinusoidal_at(torch.arange(check_length(length), device=device), dim, dtype)
