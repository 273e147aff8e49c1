"""Rotary position embedding (RoPE): the config both frameworks take.

theta_i = base ** (-2 i / D), i in [0, D/2). A token at position p rotates each pair of features
by the angle p * theta_i:
  style="interleaved": pairs (2i, 2i + 1)   (the original project; GPT-J)
  style="half":        pairs (i, i + D/2)   (LLaMA, GPT-NeoX)
  (x_a, x_b) -> (x_a cos - x_b sin, x_a sin + x_b cos).
"""
from __future__ import annotations

import dataclasses

ROPE_STYLES = ("interleaved", "half")


@dataclasses.dataclass(frozen=True)
class Rope:
    base: float = 10000.0
    style: str = "interleaved"

    def __post_init__(self):
        if self.style not in ROPE_STYLES:
            raise ValueError(f"unknown rope style={self.style!r}; choose one of {ROPE_STYLES}")
        if not (isinstance(self.base, (int, float)) and self.base > 1.0):
            raise ValueError(f"rope base must be a number > 1, got base={self.base!r}")
