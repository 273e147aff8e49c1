"""Shared torch test helpers: device, dtype aliases, the tolerance rule over out, lse, dq, dk, dv, and the
softmax case description of the torch-specific tests (`Case`, `_inputs`, `_run`, `_three`)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from torch_ref import flash_attention

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


# The softmax case description of the torch-specific tests (the shared grid is parity.variants').
@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    Sq: int
    Sk: int
    Hq: int
    Hkv: int
    D: int
    dtype: torch.dtype
    causal: bool = False
    window: tuple | None = None
    seg: str | None = None  # None | "single" | "pair" | "pair_empty" (a q segment with no keys)
    softcap: float | None = None
    scale: float | None = None
    amp: float = 1.0  # input magnitude (large values drive the softcap's tanh into saturation)
    lse_grad: bool = False  # also put a random cotangent on lse

    def __str__(self):
        parts = [f"B{self.B}", f"{self.Sq}x{self.Sk}", f"H{self.Hq}/{self.Hkv}", f"D{self.D}",
                 str(self.dtype).replace("torch.", "")]
        for flag in ("causal", "window", "seg", "softcap", "scale", "lse_grad"):
            val = getattr(self, flag)
            if val not in (None, False):
                parts.append(flag if val is True else f"{flag}={val}")
        return "-".join(parts)


def _segment_ids(case: Case, gen: torch.Generator):
    """Sorted (packed-sequence-like) ids. "pair_empty": the last q rows get id 2, absent in kv."""
    if case.seg is None:
        return None
    if case.seg == "single":
        return torch.sort(torch.randint(0, 3, (case.B, case.Sq), generator=gen), dim=1).values
    q_ids = torch.sort(torch.randint(0, 3, (case.B, case.Sq), generator=gen), dim=1).values
    kv_ids = torch.sort(torch.randint(0, 3, (case.B, case.Sk), generator=gen), dim=1).values
    if case.seg == "pair_empty":
        kv_ids = kv_ids.clamp(max=1)
        q_ids[:, -5:] = 2
    return q_ids, kv_ids.to(torch.int32)


def _inputs(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * case.amp).to(case.dtype)

    q = rnd(case.B, case.Sq, case.Hq, case.D)
    k = rnd(case.B, case.Sk, case.Hkv, case.D)
    v = rnd(case.B, case.Sk, case.Hkv, case.D)
    do = torch.randn(case.B, case.Sq, case.Hq, case.D, generator=gen).to(case.dtype)
    dl = torch.randn(case.B, case.Hq, case.Sq, generator=gen) if case.lse_grad else None
    seg = _segment_ids(case, gen)
    return q, k, v, do, dl, seg


def randn_inputs(gen, q_shape, kv_shape, stat_shape, stat_grad: bool):
    """q, k, v, dO ~ N(0, 1) in that order from `gen`, and the row statistic's cotangent (or None)."""
    q, k, v, do = (torch.randn(*s, generator=gen) for s in (q_shape, kv_shape, kv_shape, q_shape))
    return q, k, v, do, torch.randn(*stat_shape, generator=gen) if stat_grad else None


def _to(x, device):
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(t.to(device) for t in x)
    return x.to(device)


def _kwargs(case: Case, seg):
    return dict(causal=case.causal, window=case.window, segment_ids=seg, softcap=case.softcap, scale=case.scale)


def _run(impl, dtype, q, k, v, do, dl, kw):
    """Forward and backward (random cotangents, not .sum()) of one implementation in `dtype`."""
    qq, kk, vv = (x.to(dtype).detach().requires_grad_() for x in (q, k, v))
    out, lse = flash_attention(qq, kk, vv, return_lse=True, implementation=impl, **kw)
    outputs, cotangents = [out], [do.to(dtype)]
    if dl is not None:
        outputs.append(lse)
        cotangents.append(dl.to(lse.dtype))
    dq, dk, dv = torch.autograd.grad(outputs, (qq, kk, vv), cotangents)
    return dict(out=out.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv)


def _three(case: Case, device=DEVICE, seed=0):
    q, k, v, do, dl, seg = (_to(x, device) for x in _inputs(case, seed))
    kw = _kwargs(case, seg)
    gold = _run("eager", F64, q, k, v, do, dl, kw)
    naive = _run("eager", case.dtype, q, k, v, do, dl, kw)
    fast = _run("triton", case.dtype, q, k, v, do, dl, kw)
    return fast, naive, gold


