"""The compensated fp32 sums of the backward passes (`jax_attn.ops.common.summation`)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_attn.ops.common import summation


def _cancelling(seed, shape):
    """fp32 terms of spread magnitudes whose sum is far smaller than their absolute sum."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 8, shape)).astype(np.float32)
    return np.concatenate([x, -x[..., ::-1] * np.float32(1 + 2 ** -20)], axis=-1)


@pytest.mark.parametrize("length", [1, 5, 16, 37, 200])
def test_sum_is_within_one_ulp_of_the_exact_sum(length):
    x = _cancelling(length, (4, length))
    exact = x.astype(np.float64).sum(-1)
    got = np.asarray(jax.jit(summation.sum_compensated)(x), np.float64)
    assert np.all(np.abs(got - exact) <= np.spacing(np.abs(exact).astype(np.float32))), (got, exact)


@pytest.mark.parametrize("length", [3, 32, 128])
def test_dot_is_within_one_ulp_of_the_exact_dot(length):
    x, y = _cancelling(length, (4, length)), _cancelling(length + 1, (4, length))
    exact = (x.astype(np.float64) * y).sum(-1)
    got = np.asarray(jax.jit(summation.dot_compensated)(x, y), np.float64)
    assert np.all(np.abs(got - exact) <= np.spacing(np.abs(exact).astype(np.float32))), (got, exact)
