"""The shared test body of every variant (tokamax's shared test base): every implementation of both
frameworks on the variant record's grid, against its framework's float64 golden, and the two
frameworks' goldens against each other. The variants' own tests are in tests/test_<variant>.py."""
from __future__ import annotations

import pytest

import variant_harness as harness
from parity import variants


@pytest.mark.parametrize("record, framework, implementation, case", [
    pytest.param(record, *p.values, marks=p.marks, id=f"{record.name}-{p.id}")
    for record in variants.RECORDS for p in harness.grid_params(record)])
def test_against_golden(record, framework, implementation, case):
    """Every quantity of the record within the tolerance rule of the framework's float64 golden."""
    harness.assert_rule(record, framework, implementation, case)


@pytest.mark.slow
@pytest.mark.parametrize("record, case", [
    pytest.param(record, *p.values, id=f"{record.name}-{p.id}") for record in variants.RECORDS
    for p in harness.cpu_grid(record)])
def test_goldens_agree(record, case):
    harness.assert_goldens_agree(record, case)
