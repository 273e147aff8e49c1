"""Padding to tile multiples and power-of-two head dims (any shape runs on one kernel family)."""
from __future__ import annotations

import jax.numpy as jnp

from jax_attn.ops.common.spec import AttentionSpec


def pad_axis(x, axis, size, mode="constant"):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, mode=mode)


def pad_head_dim(x, spec: AttentionSpec, head_pad: int, rotated: bool):
    """Zero-pad the head dim; with RoPE style "half" each half is padded on its own, so that
    pairs (i, i + D/2) stay pairs (i, i + head_pad/2)."""
    if rotated and spec.rope is not None and spec.rope.style == "half" and x.shape[-1] != head_pad:
        halves = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
        return pad_axis(halves, halves.ndim - 1, head_pad // 2).reshape(*x.shape[:-1], head_pad)
    return pad_axis(x, x.ndim - 1, head_pad)
