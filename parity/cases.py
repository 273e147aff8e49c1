"""The parity case registry: what is compared, variant by variant.

A case names its variant, its shape (B, Sq, Sk, Hq, Hkv, D), its compute dtype and the keyword
arguments of the call. Inputs are drawn from the case's seed in NumPy, once, and handed to both
frameworks. `gpu=True` cases (fp16/bf16 and long sequences) run only where a GPU is present;
`quick=True` cases form the `--quick` subset.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    variant: str
    shape: tuple[int, int, int, int, int, int]  # B, Sq, Sk, Hq, Hkv, D
    dtype: str  # "float32" | "float16" | "bfloat16"
    kwargs: tuple[tuple[str, Any], ...] = ()
    segments: str | None = None  # None | "packed" | "pair_with_empty_rows"
    seed: int = 0
    gpu: bool = False
    quick: bool = False

    def call_kwargs(self) -> dict:
        return dict(self.kwargs)

    def draw(self):
        """Seeded inputs: q, k, v, cotangent do (float64 NumPy) and segment ids (int32 or None)."""
        rng = np.random.default_rng(self.seed)
        b, sq, sk, hq, hkv, d = self.shape
        q = rng.standard_normal((b, sq, hq, d))
        k = rng.standard_normal((b, sk, hkv, d))
        v = rng.standard_normal((b, sk, hkv, d))
        do = rng.standard_normal((b, sq, hq, d))
        return q, k, v, do, self._segment_ids(rng)

    def _segment_ids(self, rng):
        b, sq, sk = self.shape[:3]
        if self.segments is None:
            return None
        if self.segments == "packed":  # sorted ids, as in packed sequences; self-attention
            cuts = np.sort(rng.choice(np.arange(1, sq), size=3, replace=False))
            ids = (np.arange(sq)[None, :] >= cuts[:, None]).sum(0)
            return np.broadcast_to(ids, (b, sq)).astype(np.int32).copy()
        if self.segments == "pair_with_empty_rows":  # unsorted ids; id 9 has no keys at all
            q_ids = rng.integers(0, 3, (b, sq)).astype(np.int32)
            q_ids[:, sq // 2: sq // 2 + 5] = 9
            return q_ids, rng.integers(0, 3, (b, sk)).astype(np.int32)
        raise ValueError(f"unknown segments={self.segments!r}")


def _case(name, shape, dtype="float32", segments=None, gpu=False, quick=False, **kwargs):
    return Case(name, "standard", shape, dtype, tuple(sorted(kwargs.items())), segments,
                seed=zlib.crc32(name.encode()), gpu=gpu, quick=quick)


CASES: list[Case] = [
    # CPU and GPU (fp32 with exact matmuls on both sides).
    _case("dense", (2, 64, 64, 4, 4, 32), quick=True),
    _case("causal_gqa", (1, 77, 77, 6, 2, 40), causal=True, quick=True),
    _case("cross_window_mqa", (1, 47, 95, 4, 1, 64), window=(16, 8)),
    _case("packed_segments_causal", (2, 80, 80, 4, 2, 32), segments="packed", causal=True),
    _case("softcap_cross", (1, 50, 70, 2, 2, 16), softcap=5.0, scale=0.2),
    _case("empty_rows", (1, 40, 56, 2, 1, 16), segments="pair_with_empty_rows", quick=True),
    _case("fp16_causal", (1, 64, 64, 2, 2, 64), dtype="float16", causal=True),
    # GPU only: half precision (the Triton interpreter computes bf16 dots wrongly), long sequences.
    _case("bf16_causal_1k_gqa", (2, 1024, 1024, 8, 2, 128), "bfloat16", causal=True, gpu=True),
    _case("bf16_dense_4k", (1, 4096, 4096, 4, 4, 128), "bfloat16", gpu=True),
    _case("bf16_causal_4k", (1, 4096, 4096, 4, 4, 128), "bfloat16", causal=True, gpu=True),
    _case("fp16_window_4k_d64", (1, 4096, 4096, 8, 2, 64), "float16", window=(512, 128), gpu=True),
    _case("bf16_packed_2k", (2, 2048, 2048, 4, 4, 128), "bfloat16", segments="packed",
          causal=True, gpu=True),
    _case("fp16_softcap_cross_d96", (1, 1000, 3000, 4, 1, 96), "float16", softcap=30.0, gpu=True),
    _case("bf16_empty_rows_d256", (1, 700, 900, 4, 2, 256), "bfloat16",
          segments="pair_with_empty_rows", gpu=True),
    _case("fp32_causal_2k", (1, 2048, 2048, 4, 2, 128), causal=True, gpu=True),
]
