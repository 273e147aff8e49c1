"""The parity case registry: what is compared, variant by variant.

A case names its variant ("standard" and "rope": `flash_attention`; "stick_breaking":
`stick_breaking_attention`, Sq == Sk), its shape (B, Sq, Sk, Hq, Hkv, D), its compute dtype and
the keyword arguments of the call. Inputs are drawn from the case's seed in NumPy, once, and handed to both
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
    rope: tuple[str, float] | None = None  # (style, base): fused RoPE, built per framework
    positions: str | None = None  # None (arange) | "restart_per_segment" | "pair_random"
    seed: int = 0
    gpu: bool = False
    quick: bool = False

    @property
    def quantities(self) -> tuple[str, ...]:
        if self.variant == "stick_breaking":
            return ("out", "rem", "dq", "dk", "dv", "ddecay")
        return ("out", "lse", "dq", "dk", "dv")

    @property
    def decay(self):
        """Stick-breaking decay: a float or a per-head tuple."""
        return dict(self.kwargs).get("decay", 0.0)

    def call_kwargs(self) -> dict:
        return {k: v for k, v in self.kwargs if k != "decay"}

    def draw(self):
        """Seeded inputs: q, k, v, cotangent do (float64 NumPy), cotangent of the row statistic
        (zero for lse, random for the stick-breaking remainder), segment ids and positions."""
        rng = np.random.default_rng(self.seed)
        b, sq, sk, hq, hkv, d = self.shape
        q = rng.standard_normal((b, sq, hq, d))
        k = rng.standard_normal((b, sk, hkv, d))
        v = rng.standard_normal((b, sk, hkv, d))
        do = rng.standard_normal((b, sq, hq, d))
        seg = self._segment_ids(rng)
        pos = self._positions(rng, seg)
        dstat = rng.standard_normal((b, hq, sq)) if self.variant == "stick_breaking" else np.zeros((b, hq, sq))
        return q, k, v, do, dstat, seg, pos

    def _positions(self, rng, seg):
        b, sq, sk = self.shape[:3]
        if self.positions is None:
            return None
        if self.positions == "restart_per_segment":  # packed sequences: 0, 1, ... per segment
            seg = _packed(rng, b, sq) if seg is None else seg
            starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1, axis=1) != 0,
                                                    np.arange(sq)[None, :], 0), axis=1)
            return (np.arange(sq)[None, :] - starts).astype(np.int32)
        if self.positions == "pair_random":
            return (rng.integers(0, 4096, (b, sq)).astype(np.int32),
                    rng.integers(0, 4096, (b, sk)).astype(np.int32))
        raise ValueError(f"unknown positions={self.positions!r}")

    def _segment_ids(self, rng):
        b, sq, sk = self.shape[:3]
        if self.segments is None:
            return None
        if self.segments == "packed":
            return _packed(rng, b, sq)
        if self.segments == "pair_with_empty_rows":  # unsorted ids; id 9 has no keys at all
            q_ids = rng.integers(0, 3, (b, sq)).astype(np.int32)
            q_ids[:, sq // 2: sq // 2 + 5] = 9
            return q_ids, rng.integers(0, 3, (b, sk)).astype(np.int32)
        raise ValueError(f"unknown segments={self.segments!r}")


def _packed(rng, batch, seq_len):
    """Sorted ids of 4 packed sequences, the same in every batch row."""
    cuts = np.sort(rng.choice(np.arange(1, seq_len), size=3, replace=False))
    ids = (np.arange(seq_len)[None, :] >= cuts[:, None]).sum(0)
    return np.broadcast_to(ids, (batch, seq_len)).astype(np.int32).copy()


def _case(name, shape, dtype="float32", segments=None, gpu=False, quick=False, variant="standard",
          rope=None, positions=None, **kwargs):
    return Case(name, variant, shape, dtype, tuple(sorted(kwargs.items())), segments, rope,
                positions, seed=zlib.crc32(name.encode()), gpu=gpu, quick=quick)


def _rope_case(name, shape, style, dtype="float32", **kwargs):
    return _case(name, shape, dtype, variant="rope", rope=(style, kwargs.pop("base", 10000.0)), **kwargs)


def _sb_case(name, shape, dtype="float32", rope=None, **kwargs):
    """Stick-breaking: shape (B, S, Hq, Hkv, D); rope (style, base) or None."""
    b, s, hq, hkv, d = shape
    return _case(name, (b, s, s, hq, hkv, d), dtype, variant="stick_breaking", rope=rope, **kwargs)


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
    # Fused RoPE (q, k rotated inside the kernels), both pairings.
    _rope_case("rope_interleaved_causal_gqa", (1, 64, 64, 6, 2, 32), "interleaved", causal=True,
               quick=True),
    _rope_case("rope_half_packed", (2, 72, 72, 4, 2, 40), "half", segments="packed",
               positions="restart_per_segment", causal=True),
    _rope_case("rope_half_cross_pair", (1, 40, 56, 2, 1, 64), "half", positions="pair_random",
               base=500.0, window=(20, 20)),
    _rope_case("rope_interleaved_fp16", (1, 64, 64, 2, 2, 64), "interleaved", dtype="float16"),
    _rope_case("rope_half_bf16_2k", (2, 2048, 2048, 8, 2, 128), "half", dtype="bfloat16",
               causal=True, gpu=True),
    _rope_case("rope_interleaved_bf16_4k_packed", (1, 4096, 4096, 4, 4, 128), "interleaved",
               dtype="bfloat16", segments="packed", positions="restart_per_segment", causal=True,
               gpu=True),
    # Stick-breaking (ExpoSB): strictly causal; out, rem, dq, dk, dv and d decay, with a cotangent on rem.
    _sb_case("sb_gqa", (1, 77, 4, 2, 32), quick=True),
    _sb_case("sb_decay_per_head_d48", (2, 64, 4, 4, 48), decay=(0.0, 0.02, 0.1, 0.5)),
    _sb_case("sb_rope_interleaved_mqa", (1, 70, 6, 1, 32), rope=("interleaved", 10000.0), decay=0.05),
    _sb_case("sb_rope_half_packed_positions", (2, 72, 4, 2, 40), rope=("half", 500.0),
             positions="restart_per_segment", decay=0.01),
    _sb_case("sb_fp16", (1, 64, 2, 2, 64), "float16", decay=0.01),
    _sb_case("sb_bf16_2k_gqa", (2, 2048, 8, 2, 128), "bfloat16", gpu=True),
    _sb_case("sb_bf16_4k_rope_decay", (1, 4096, 4, 4, 128), "bfloat16", rope=("half", 10000.0),
             decay=(0.0, 0.001, 0.01, 0.1), gpu=True),
    _sb_case("sb_fp16_1k_d64", (2, 1000, 8, 8, 64), "float16", decay=0.01, gpu=True),
    _sb_case("sb_fp32_1k", (1, 1024, 4, 2, 128), gpu=True),
]
