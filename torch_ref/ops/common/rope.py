"""Rotary position embedding (RoPE) for the PyTorch backend: the plain rotation.

The config `Rope` (and `ROPE_STYLES`) is the framework-free one of `attn_spec.rope`, shared with
`jax_attn`, and re-exported here. theta_i = base ** (-2 i / D), i in [0, D/2). A token at
position p rotates each pair of features by the angle p * theta_i:
  style="interleaved": pairs (2i, 2i + 1)   (the original project; GPT-J)
  style="half":        pairs (i, i + D/2)   (LLaMA, GPT-NeoX)
  (x_a, x_b) -> (x_a cos - x_b sin, x_a sin + x_b cos).
`apply_rope` is the eager reference (rotate, then attend); the Triton kernels rotate q and k
after load (`torch_ref.ops.common.triton_tiles`), with the angle computed exactly as here
(float32 theta table, float32 position times theta) so that their rotation matches the eager one
in the compute dtype.
"""
from __future__ import annotations

import torch

from attn_spec.rope import ROPE_STYLES, Rope


def split_pairs(x: torch.Tensor, style: str):
    """[..., D] -> (x_a, x_b), each [..., D/2]: the two members of every rotated pair."""
    if style == "interleaved":
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def merge_pairs(x_a: torch.Tensor, x_b: torch.Tensor, style: str) -> torch.Tensor:
    """Inverse of `split_pairs`."""
    if style == "interleaved":
        return torch.stack([x_a, x_b], dim=-1).reshape(*x_a.shape[:-1], 2 * x_a.shape[-1])
    return torch.cat([x_a, x_b], dim=-1)


def inverse_frequencies(head_dim: int, base: float, dtype=torch.float32, device=None) -> torch.Tensor:
    """theta_i = base ** (-2 i / D), [D/2] (the kernels read this float32 table)."""
    return base ** (-torch.arange(0, head_dim // 2, dtype=dtype, device=device) * 2 / head_dim)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate x [B, S, H, D] by integer positions [B, S]; computed in float32 (float64 for float64
    inputs), returned in x.dtype. Differentiable by autograd (the backward applies R^T)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    theta = inverse_frequencies(x.shape[-1], rope.base, compute, x.device)
    angle = positions.to(compute)[:, :, None, None] * theta
    cos, sin = torch.cos(angle), torch.sin(angle)
    x_a, x_b = split_pairs(x.to(compute), rope.style)
    out = merge_pairs(x_a * cos - x_b * sin, x_a * sin + x_b * cos, rope.style)
    return out.to(x.dtype)


__all__ = ["Rope", "ROPE_STYLES", "apply_rope", "inverse_frequencies", "split_pairs", "merge_pairs"]
