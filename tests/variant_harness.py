"""The shared test body's machinery: every implementation of both frameworks on a record's grid.

`grid_params(record)` -> pytest params (framework, implementation, case) for every grid case and
every implementation that serves it here (from the registries: `parity.variants.implementations`
and `unsupported_reason`; e.g. the Mosaic kernels only on Hopper, for what they serve), marked
`gpu` (realistic shapes, compiled kernels) or `slow` (the slow CPU tier) from the case.
`assert_rule(record, framework, implementation, case)` runs the three results of the tolerance rule (docs/design/parity.md)
(the framework's plain reference in float64, the same in the compute dtype, the implementation)
and applies the tolerance rule to every quantity of the record.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from parity import variants
from parity.variants import FRAMEWORKS, REFERENCE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _marks(case):
    return [m for flag, m in ((case.gpu, pytest.mark.gpu), (case.slow, pytest.mark.slow)) if flag]


def grid_params(record, cases=None, include_reference=True):
    """(framework, implementation, case) params over `cases` (default: the record's grid)."""
    params = []
    for case in record.grid if cases is None else cases:
        device = DEVICE if case.gpu else "cpu"
        for framework in FRAMEWORKS:
            for impl in variants.implementations(record, framework):
                if impl == REFERENCE[framework] and not include_reference:
                    continue
                if variants.unsupported_reason(record, framework, impl, case, device) is not None:
                    continue
                params.append(pytest.param(framework, impl, case, marks=_marks(case),
                                           id=f"{framework}-{impl}-{case.name}"))
    return params


@functools.lru_cache(maxsize=None)
def inputs(record_name, case):
    return variants.BY_NAME[record_name].draw(case)


@functools.lru_cache(maxsize=64)
def results(record_name, framework, implementation, case, dtype):
    """The quantities of one run (cached: the golden and the naive run serve every implementation)."""
    record = variants.BY_NAME[record_name]
    device = DEVICE if case.gpu else "cpu"
    return variants.results(record, framework, implementation, case, dtype, inputs(record_name, case), device)


def three(record, framework, implementation, case):
    """(fast, naive, golden) of `implementation` on `case`."""
    gold = results(record.name, framework, REFERENCE[framework], case, "float64")
    naive = results(record.name, framework, REFERENCE[framework], case, case.dtype)
    fast = results(record.name, framework, implementation, case, case.dtype)
    return fast, naive, gold


def assert_rule(record, framework, implementation, case):
    """The tolerance rule on every quantity; returns (fast, naive, golden) as dicts by quantity."""
    fast, naive, gold = three(record, framework, implementation, case)
    failed = {name: v for name, v in variants.verdicts(record, fast, naive, gold, case.dtype, case).items()
              if not v.ok}
    assert not failed, "; ".join(f"{n}: error {v.error:.3g} > allowed {v.allowed:.3g} {v.reason}"
                                 for n, v in failed.items())
    as_dict = lambda xs: dict(zip(record.quantities_of(case), xs))
    return as_dict(fast), as_dict(naive), as_dict(gold)


def cpu_grid(record):
    """The record's grid cases that run on the CPU, as pytest params named by case."""
    return [pytest.param(c, id=c.name) for c in record.grid if not c.gpu]


def assert_goldens_agree(record, case):
    """The two frameworks' plain references in float64 agree to 1e-10 (the golden is one)."""
    gold_jax, gold_torch = (results(record.name, fw, REFERENCE[fw], case, "float64") for fw in FRAMEWORKS)
    for name, a, b in zip(record.quantities_of(case), gold_jax, gold_torch, strict=True):
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=name)
        finite = np.isfinite(a)
        np.testing.assert_array_equal(a[~finite], b[~finite], err_msg=name)
        np.testing.assert_allclose(a[finite], b[finite], rtol=0, atol=1e-10, err_msg=name)
