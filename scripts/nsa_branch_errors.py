"""An NSA parity case split by branch: the case's inputs with the gates 0.9 on one branch and 1e-3 on
the other two, checked under the parity rule like `python -m parity.check --cases NAME`, so that an
error can be traced to the compression, selection or sliding-window branch.

  PYTHONPATH=. python scripts/nsa_branch_errors.py [CASE] [cpu|cuda]   (default nsa_random_gqa16_s77, cuda)

Prints one line per (gates, implementation, quantity): the error, the allowed error, their ratio.
"""
import dataclasses
import sys

import numpy as np

import parity.check as check  # sets the check's XLA flags and TF32 switches first
from parity import variants
from parity.variants import nsa

BRANCHES = (("all", None), ("cmp", 0), ("sel", 1), ("win", 2))


def main(name: str = "nsa_random_gqa16_s77", device: str = "cuda") -> None:
    cases = {c.name: c for c in nsa.NSA.cases if dict(c.kwargs)["op"] == "nsa"}
    if name not in cases:
        raise SystemExit(f"{name!r} is not an NSA case with gates: one of {sorted(cases)}")
    case = cases[name]
    for label, branch in BRANCHES:
        def draw(c, branch=branch):
            inputs = nsa.draw(c)
            if branch is None:
                return inputs
            gates = np.full_like(inputs.gates, 1e-3)
            gates[..., branch] = 0.9
            return inputs._replace(gates=gates)
        variants.BY_NAME["nsa"] = dataclasses.replace(nsa.NSA, draw=draw)
        for r in check.check_case(case, device):
            if r["quantity"] in ("out", "dq", "dk", "dv"):
                print(f"{label:4s} {r['impl']:14s} {r['quantity']:3s} err {r['error']:.3e} "
                      f"allowed {r['allowed']:.3e} ratio {r['ratio']:.3f}", flush=True)
    variants.BY_NAME["nsa"] = nsa.NSA


if __name__ == "__main__":
    main(*sys.argv[1:])
