"""Shared torch test helpers: device, dtype aliases and the tolerance rule over out, lse, dq, dk, dv."""
from __future__ import annotations

import numpy as np
import torch

from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
NAMES = ("out", "lse", "dq", "dk", "dv")


def _np_dtype(dtype):
    if dtype == BF16:
        import ml_dtypes

        return ml_dtypes.bfloat16
    return {F16: np.float16, F32: np.float32}[dtype]


def _assert_rule(fast, naive, gold, dtype):
    failures = []
    for name in NAMES:
        factor = FORWARD_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR
        f, n, g = (r[name].detach().cpu().double().numpy() for r in (fast, naive, gold))
        verdict = compare(f, n, g, _np_dtype(dtype), factor)
        if not verdict.ok:
            failures.append(f"{name}: error {verdict.error:.3g} > allowed {verdict.allowed:.3g} {verdict.reason}")
    assert not failures, "; ".join(failures)
