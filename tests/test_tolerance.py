"""The tolerance rule itself (parity/tolerance.py), on hand-made arrays."""
from __future__ import annotations

import numpy as np

from parity.tolerance import compare, rounding_floor

GOLDEN = np.array([1.0, -2.5, 1000.0])


def test_rule_bounds_the_error_by_the_naive_error():
    naive = GOLDEN + np.array([0.0, 0.0, 1.0])  # naive error 1
    assert compare(GOLDEN + 2.0, naive, GOLDEN, np.float32, 3.0).ok  # 2 <= 3 * 1 + floor
    assert not compare(GOLDEN + 4.0, naive, GOLDEN, np.float32, 3.0).ok


def test_nan_never_passes_and_infinities_must_match():
    golden = np.array([1.0, -np.inf])
    assert not compare(np.array([np.nan, -np.inf]), golden, golden, np.float16, 3.0).ok
    assert not compare(np.array([1.0, 0.0]), golden, golden, np.float16, 3.0).ok
    assert compare(golden, golden, golden, np.float16, 3.0).ok


def test_floor_ignores_entries_past_the_dtype_range():
    """A golden past fp16's range (the loud gradients of fp16 inputs, d decay reported in fp32) once
    made the floor inf, and so every error allowed."""
    golden = np.array([1.0, 76815.0])
    floor = rounding_floor(golden, np.float16)
    assert np.isfinite(floor) and floor == rounding_floor(golden[:1], np.float16)
    assert not compare(golden + np.array([0.0, 200.0]), golden, golden, np.float16, 3.0).ok
