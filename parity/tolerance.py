"""FlashAttention's tolerance rule, shared by the parity check and the tests.

A fast result passes when

    max|fast - golden| <= factor * max|naive - golden| + floor,
    floor = 2 * max|(golden + 0.3 - 0.3) - golden|   (computed in the compute dtype),

with factor 2 for forward outputs and 3 for gradients. `naive` is the plain reference run in the
compute dtype, `golden` the plain reference in float64. Infinities (lse of a row with no visible
key) must sit at the same places with the same sign; NaN never passes.
"""
from __future__ import annotations

import dataclasses

import numpy as np

FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 3.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    error: float  # max |fast - golden| over finite entries
    allowed: float  # factor * naive error + floor
    ok: bool
    reason: str = ""

    @property
    def ratio(self) -> float:
        return self.error / self.allowed if self.allowed > 0 else (0.0 if self.error == 0 else np.inf)


def _np64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def rounding_floor(golden, dtype) -> float:
    """2 * max|(golden + 0.3 - 0.3) - golden| evaluated in `dtype` (a NumPy/ml_dtypes dtype)."""
    g = _np64(golden)
    g = g[np.isfinite(g)]
    with np.errstate(over="ignore"):
        gd = g.astype(dtype)
    # entries past the dtype's range (loud gradients of 16-bit inputs, reported in fp32) have no
    # rounding there: left out, they would make the floor inf and the rule vacuous
    fits = np.isfinite(gd.astype(np.float64))
    g, gd = g[fits], gd[fits]
    if g.size == 0:
        return 0.0
    shifted = ((gd + np.asarray(0.3, dtype)).astype(dtype) - np.asarray(0.3, dtype)).astype(dtype)
    return 2.0 * float(np.max(np.abs(shifted.astype(np.float64) - g)))


def compare(fast, naive, golden, dtype, factor: float) -> Verdict:
    """Apply the rule; `dtype` is the compute dtype used for the rounding floor."""
    f, n, g = _np64(fast), _np64(naive), _np64(golden)
    if f.shape != g.shape:
        return Verdict(np.inf, 0.0, False, f"shape {f.shape} != golden {g.shape}")
    if np.isnan(f).any():
        return Verdict(np.inf, 0.0, False, "NaN in result")
    finite = np.isfinite(g)
    if not np.array_equal(np.isfinite(f), finite) or not np.array_equal(f[~finite], g[~finite]):
        return Verdict(np.inf, 0.0, False, "infinities differ from golden")
    if not finite.any():
        return Verdict(0.0, 0.0, True)
    err = float(np.max(np.abs(f[finite] - g[finite])))
    naive_finite = finite & np.isfinite(n)
    naive_err = float(np.max(np.abs(n[naive_finite] - g[naive_finite]))) if naive_finite.any() else 0.0
    allowed = factor * naive_err + rounding_floor(g, dtype)
    return Verdict(err, allowed, err <= allowed)
