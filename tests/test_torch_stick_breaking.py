"""Tests of stick-breaking attention ("ExpoSB") in torch_ref: the Triton kernels (forward, dQ, dK/dV)
and the eager reference against a float64 golden.

Every parity case produces three results: the eager reference in float64 (golden), the eager
reference in the compute dtype (naive) and the Triton kernels (fast), and applies the
FlashAttention rule of parity/tolerance.py to out, rem, dq, dk, dv and, where the decay is a
tensor that requires grad, d decay (factor 2 forward, 3 gradients). Without CUDA the kernels run
through the Triton interpreter (fp32 / fp16 only: the interpreter computes bf16 dots wrongly);
the `gpu` tests (bf16 and fp16, realistic shapes) need a GPU.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import torch_ref  # noqa: E402
from torch_ref import Rope, UnknownImplementationError, stick_breaking_attention, stick_breaking_reference  # noqa: E402
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare  # noqa: E402

from torch_golden import BF16, DEVICE, F16, F32, F64, _np_dtype  # noqa: E402

FORWARD_NAMES = ("out", "rem")


# ----------------------------------------------------------------------------------------------
# Case description, inputs, the three runs, the rule
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SBCase:
    B: int
    S: int
    Hq: int
    Hkv: int
    D: int
    dtype: torch.dtype
    # None: no decay; a float: decay=that float; "scalar": a 0-d tensor 0.07 (requires grad);
    # "heads": a tensor [Hq] of distinct values >= 0 (requires grad)
    decay: object = None
    rope: str | None = None  # None | "interleaved" | "half"
    pos: str | None = None  # with rope: None (arange) | "tensor" (one [B, S]) | "pair" ((q_pos, kv_pos))
    rem_grad: bool = False  # also put a random cotangent on rem
    scale: float | None = None

    def __str__(self):
        parts = [f"B{self.B}", f"S{self.S}", f"H{self.Hq}/{self.Hkv}", f"D{self.D}",
                 str(self.dtype).replace("torch.", "")]
        for flag in ("decay", "rope", "pos", "rem_grad", "scale"):
            val = getattr(self, flag)
            if val not in (None, False):
                parts.append(flag if val is True else f"{flag}={val}")
        return "-".join(parts)


def _decay_values(case: SBCase):
    """The decay as given to every run: None / float, or a float32 tensor (the runs make their own
    leaf from it: float64 for the golden, float32 otherwise)."""
    if case.decay is None:
        return 0.0
    if case.decay == "scalar":
        return torch.tensor(0.07)
    if case.decay == "heads":
        return torch.linspace(0.0, 0.3, case.Hq)  # head 0: no decay
    return float(case.decay)


def _positions(case: SBCase, gen: torch.Generator):
    if case.pos is None:
        return None
    if case.pos == "tensor":  # packed-like: restarting at 0 halfway
        pos = torch.arange(case.S).repeat(case.B, 1)
        pos[:, case.S // 2:] -= case.S // 2
        return pos
    if case.pos == "pair":  # unsorted positions, different for q and k
        return (torch.randint(0, 2000, (case.B, case.S), generator=gen),
                torch.randint(0, 2000, (case.B, case.S), generator=gen, dtype=torch.int64).to(torch.int32))
    raise AssertionError(case.pos)


def _inputs(case: SBCase, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(case.B, case.S, case.Hq, case.D, generator=gen)
    k = torch.randn(case.B, case.S, case.Hkv, case.D, generator=gen)
    v = torch.randn(case.B, case.S, case.Hkv, case.D, generator=gen)
    do = torch.randn(case.B, case.S, case.Hq, case.D, generator=gen)
    drem = torch.randn(case.B, case.Hq, case.S, generator=gen) if case.rem_grad else None
    return q, k, v, do, drem, _positions(case, gen)


def _to(x, device):
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(t.to(device) for t in x)
    return x.to(device)


def _kwargs(case: SBCase, positions):
    rope = None if case.rope is None else Rope(style=case.rope)
    return dict(rope=rope, positions=positions, scale=case.scale)


def _run(impl, dtype, q, k, v, do, drem, decay, kw):
    """Forward and backward (random cotangents) of one implementation in `dtype`."""
    qq, kk, vv = (x.to(dtype).detach().requires_grad_() for x in (q, k, v))
    leaves = [qq, kk, vv]
    if isinstance(decay, torch.Tensor):
        decay = decay.to(device=q.device, dtype=F64 if dtype == F64 else F32).detach().requires_grad_()
        leaves.append(decay)
    out, rem = stick_breaking_attention(qq, kk, vv, decay=decay, return_remainder=True, implementation=impl, **kw)
    outputs, cotangents = [out], [do.to(dtype)]
    if drem is not None:
        outputs.append(rem)
        cotangents.append(drem.to(rem.dtype))
    grads = torch.autograd.grad(outputs, leaves, cotangents)
    res = dict(out=out.detach(), rem=rem.detach(), dq=grads[0], dk=grads[1], dv=grads[2])
    if len(grads) == 4:
        assert grads[3].shape == decay.shape and grads[3].dtype == decay.dtype
        res["ddecay"] = grads[3]
    return res


def _three(case: SBCase, device=DEVICE, seed=0):
    q, k, v, do, drem, positions = (_to(x, device) for x in _inputs(case, seed))
    decay = _decay_values(case)
    kw = _kwargs(case, positions)
    gold = _run("eager", F64, q, k, v, do, drem, decay, kw)
    naive = _run("eager", case.dtype, q, k, v, do, drem, decay, kw)
    fast = _run("triton", case.dtype, q, k, v, do, drem, decay, kw)
    return fast, naive, gold


def _assert_rule(fast, naive, gold, dtype):
    assert fast.keys() == gold.keys() == naive.keys()
    failures = []
    for name in gold:
        factor = FORWARD_FACTOR if name in FORWARD_NAMES else GRADIENT_FACTOR
        f, n, g = (r[name].detach().cpu().double().numpy() for r in (fast, naive, gold))
        verdict = compare(f, n, g, _np_dtype(dtype), factor)
        if not verdict.ok:
            failures.append(f"{name}: error {verdict.error:.3g} > allowed {verdict.allowed:.3g} {verdict.reason}")
    assert not failures, "; ".join(failures)


# ----------------------------------------------------------------------------------------------
# Parity grid: ragged lengths (S = 1, 17, 31, 33, 45, 64, 100 against tiles of 16 / 32), GQA / MQA,
# head dims 16 / 32 / 48 / 64 / 80, decay none / float / 0-d tensor / per head, RoPE both styles
# with default, single and pair positions, cotangents on rem; fp32 and fp16
# ----------------------------------------------------------------------------------------------
CASES = [
    SBCase(1, 1, 2, 1, 16, F32, rem_grad=True),  # a single token: no key at all
    SBCase(2, 1, 4, 2, 32, F16, decay="heads", rem_grad=True),
    SBCase(1, 17, 2, 2, 16, F16, rem_grad=True),
    SBCase(2, 17, 4, 2, 32, F32, decay=0.1),  # GQA
    SBCase(1, 100, 4, 1, 64, F16, decay="heads", rem_grad=True),  # MQA
    SBCase(1, 100, 2, 2, 48, F32, rope="interleaved"),  # padded head dim and half
    SBCase(1, 45, 4, 2, 80, F16, decay="scalar", rope="half", pos="tensor"),
    SBCase(2, 33, 2, 1, 64, F32, decay="heads", rope="half", pos="pair", rem_grad=True),
    SBCase(1, 64, 2, 2, 32, F16, decay=0.5, scale=0.3),  # S a multiple of every tile
    SBCase(1, 31, 4, 4, 16, F32, decay="heads", rope="interleaved", pos="tensor", rem_grad=True),
    SBCase(1, 100, 2, 1, 32, F32, decay="scalar", rem_grad=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parity(case):
    _assert_rule(*_three(case), case.dtype)


@pytest.mark.parametrize("impl", ["eager", "triton"])
def test_huge_cotangents(impl):
    """fp16 cotangents times 2^13 (loss scaling's range): the results divided back hold the rule
    against the golden and the naive run on the cotangents as drawn. The eager path's A v product
    took its cotangent dO . v in fp16, past 65504 (dq, dk not finite), until it ran in fp32."""
    case = SBCase(1, 64, 4, 2, 64, F16, decay="heads", rem_grad=True)
    times = 2.0 ** 13
    q, k, v, do, drem, positions = (_to(x, DEVICE) for x in _inputs(case))
    decay, kw = _decay_values(case), _kwargs(case, positions)
    gold = _run("eager", F64, q, k, v, do, drem, decay, kw)
    naive = _run("eager", F16, q, k, v, do, drem, decay, kw)
    loud = _run(impl, F16, q, k, v, do * times, drem * times, decay, kw)
    loud = {name: x if name in FORWARD_NAMES else x.double() / times for name, x in loud.items()}
    assert max(gold[n].abs().max().item() for n in ("dq", "dk", "dv")) * times > 2 ** 14, "gradients should be large"
    _assert_rule(loud, naive, gold, F16)


CONFIGS = [  # (block_m, block_n, bwd_block_n, dq_block_m, dkdv_block_m): tiles wider / narrower than each other
    (32, 16, 16, 32, 32),
    (16, 16, 16, 16, 16),
    (16, 64, 64, 16, 32),
]


@pytest.mark.parametrize("tiles", CONFIGS, ids=lambda t: "x".join(map(str, t)))
def test_parity_other_tiles(tiles, monkeypatch):
    """The block-range logic for other tile shapes (a diagonal that crosses several key blocks or
    several query tiles, ragged ends at different offsets)."""
    from torch_ref.ops.stick_breaking import triton as sbt

    def config(head_dim, dtype, on_gpu):
        bm, bn, bwd_n, dq_m, dkdv_m = tiles
        return sbt.StickBreakingConfig(max(16, 1 << (head_dim - 1).bit_length()), bm, bn, 4, 1, bwd_n, dq_m, dkdv_m,
                                       4, 1)

    monkeypatch.setattr(sbt, "default_config", config)
    case = SBCase(1, 77, 4, 2, 32, F32, decay="heads", rope="half", rem_grad=True)
    _assert_rule(*_three(case), case.dtype)


def test_first_row_and_last_key():
    """Row 0 has no key: out 0, rem 1, zero dq; key S - 1 is seen by no row: zero dk, dv; no NaN."""
    case = SBCase(2, 37, 4, 2, 16, F16, decay="heads", rope="interleaved", rem_grad=True)
    fast, naive, gold = _three(case)
    _assert_rule(fast, naive, gold, case.dtype)
    for res in (fast, naive, gold):
        for name, x in res.items():
            assert not torch.isnan(x).any(), name
        assert (res["out"][:, 0] == 0).all()
        assert (res["rem"][:, :, 0] == 1).all()
        assert (res["dq"][:, 0] == 0).all()
        assert (res["dk"][:, -1] == 0).all() and (res["dv"][:, -1] == 0).all()
        assert (res["rem"] > 0).all() and (res["rem"] <= 1).all()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter's numpy on planted
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / NaN, masked after
@pytest.mark.parametrize("impl", ["triton", "eager"])
def test_unseen_entries_hold_garbage(impl):
    """NaN / inf in q of row 0 and in k, v of key S - 1 (which no score uses) must not reach any
    output or gradient: the results equal the run with those entries zeroed, bit for bit."""
    B, S, Hq, Hkv, D = 1, 40, 2, 1, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(B, S, h, D, generator=gen) for h in (Hq, Hkv, Hkv, Hq))
    drem = torch.randn(B, Hq, S, generator=gen)
    decay = torch.tensor([0.0, 0.2])
    clean = [x.clone() for x in (q, k, v)]
    clean[0][:, 0] = 0
    clean[1][:, -1] = 0
    clean[2][:, -1] = 0
    planted = [x.clone() for x in clean]
    planted[0][:, 0, :, 0] = float("nan")
    planted[0][:, 0, :, 1] = float("inf")
    planted[1][:, -1, :, 0] = float("nan")
    planted[2][:, -1, :, 1] = float("nan")
    planted[2][:, -1, :, 2] = float("-inf")
    kw = dict(rope=Rope(style="half"))
    a = _run(impl, F32, *_to(tuple(clean), DEVICE), do.to(DEVICE), drem.to(DEVICE), decay, kw)
    b = _run(impl, F32, *_to(tuple(planted), DEVICE), do.to(DEVICE), drem.to(DEVICE), decay, kw)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_determinism_and_equivalent_arguments():
    """Two runs are bitwise equal (GQA: dK/dV sums the group's heads in a fixed order; no atomics).
    Equivalent spellings give bitwise equal results: positions None == arange; decay 0.0 == zeros
    [Hq]; a float decay == a 0-d tensor == a tensor [Hq] of that value."""
    case = SBCase(1, 40, 4, 2, 16, F32, rope="half", rem_grad=True)
    q, k, v, do, drem, _ = (_to(x, DEVICE) for x in _inputs(case, seed=5))
    rope = Rope(style="half")
    lam = torch.tensor([0.05, 0.0, 0.2, 0.1])
    first = _run("triton", F32, q, k, v, do, drem, lam, dict(rope=rope))
    second = _run("triton", F32, q, k, v, do, drem, lam, dict(rope=rope))
    for name in first:
        assert torch.equal(first[name], second[name]), name

    pos = torch.arange(case.S, device=DEVICE).expand(case.B, case.S)
    a = _run("triton", F32, q, k, v, do, drem, 0.0, dict(rope=rope))
    b = _run("triton", F32, q, k, v, do, drem, 0.0, dict(rope=rope, positions=pos))
    c = _run("triton", F32, q, k, v, do, drem, torch.zeros(case.Hq), dict(rope=rope))
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert torch.equal(a[name], c[name]), name
    x = _run("triton", F32, q, k, v, do, drem, 0.125, {})
    y = _run("triton", F32, q, k, v, do, drem, torch.tensor(0.125), {})
    z = _run("triton", F32, q, k, v, do, drem, torch.full((case.Hq,), 0.125), {})
    for name in x:
        assert torch.equal(x[name], y[name]), name
        assert torch.equal(x[name], z[name]), name
    # the scalar's gradient is the sum of the per-head ones
    torch.testing.assert_close(y["ddecay"], z["ddecay"].sum(), rtol=1e-6, atol=1e-6)


def test_decay_gradient_finite_differences():
    """d decay of the float64 reference against central differences (per-head tensor), and the
    kernels' d decay within the rule against it (the parity cases check it too)."""
    gen = torch.Generator().manual_seed(7)
    B, S, Hq, Hkv, D = 1, 12, 2, 1, 8
    q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=F64) for h in (Hq, Hkv, Hkv))
    lam = torch.tensor([0.1, 0.4], dtype=F64, requires_grad=True)
    w = torch.randn(B, S, Hq, D, generator=gen, dtype=F64)
    wr = torch.randn(B, Hq, S, generator=gen, dtype=F64)

    def loss(d):
        out, rem = stick_breaking_reference(q, k, v, decay=d)
        return (out * w).sum() + (rem * wr).sum()

    (grad,) = torch.autograd.grad(loss(lam), lam)
    eps = 1e-6
    for h in range(Hq):
        e = torch.zeros(Hq, dtype=F64)
        e[h] = eps
        fd = (loss(lam.detach() + e) - loss(lam.detach() - e)) / (2 * eps)
        assert abs(fd.item() - grad[h].item()) < 1e-6 * max(1.0, abs(fd.item()))


def test_reference_definition():
    """The eager reference against the product formula written out (float64): A_ij = beta_ij *
    prod_{j<m<i} (1 - beta_im), rem_i = 1 - sum_j A_ij; with RoPE positions and per-head decay."""
    gen = torch.Generator().manual_seed(1)
    B, S, Hq, Hkv, D = 2, 7, 4, 2, 6
    q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=F64) for h in (Hq, Hkv, Hkv))
    lam = torch.tensor([0.0, 0.1, 0.5, 1.0], dtype=F64)
    pos = torch.randint(0, 30, (B, S), generator=gen)
    rope = Rope(style="half")
    out, rem = stick_breaking_reference(q, k, v, decay=lam, rope=rope, positions=pos, scale=0.7)
    qr, kr = torch_ref.apply_rope(q, pos, rope), torch_ref.apply_rope(k, pos, rope)
    want = torch.zeros_like(out)
    want_rem = torch.ones_like(rem)
    for b in range(B):
        for h in range(Hq):
            for i in range(S):
                beta = [torch.sigmoid(0.7 * qr[b, i, h] @ kr[b, j, h // 2] - lam[h] * (i - j)) for j in range(i)]
                for j in range(i):
                    a = beta[j] * torch.prod(torch.stack([1 - beta[m] for m in range(j + 1, i)] + [beta[j] * 0 + 1]))
                    want[b, i, h] += a * v[b, j, h // 2]
                    want_rem[b, h, i] -= a
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rem, want_rem, rtol=1e-12, atol=1e-12)
    assert rem.dtype == F64


def test_defaults_and_return_forms():
    """return_remainder=False returns out alone; rem is float32 [B, Hq, S] for 16-bit inputs; the
    default scale is D ** -0.5; implementation=None picks the kernels where Triton runs."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 9, h, 16, generator=gen).to(DEVICE, F16) for h in (2, 1, 1))
    out = stick_breaking_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == F16
    out2, rem = stick_breaking_attention(q, k, v, return_remainder=True, implementation="triton")
    assert torch.equal(out, out2) and rem.shape == (1, 2, 9) and rem.dtype == F32
    out3, rem3 = stick_breaking_attention(q, k, v, scale=0.25, return_remainder=True, implementation="triton")
    assert torch.equal(out3, out2) and torch.equal(rem3, rem)
    gold, gold_rem = stick_breaking_reference(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), gold, rtol=0, atol=3e-3)
    torch.testing.assert_close(rem.double(), gold_rem, rtol=0, atol=1e-5)
    # empty batch: no launch, shapes kept
    e = torch.zeros(0, 9, 2, 16, device=DEVICE, dtype=F16)
    ekv = torch.zeros(0, 9, 1, 16, device=DEVICE, dtype=F16)
    out_e, rem_e = stick_breaking_attention(e, ekv, ekv, return_remainder=True, implementation="triton")
    assert out_e.shape == e.shape and rem_e.shape == (0, 2, 9)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _t(*shape, dtype=F32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def _i(*shape, dtype=torch.int32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


Q, KV = (1, 8, 4, 16), (1, 8, 2, 16)
INVALID = [
    # (name, (q, k, v) shapes / tensors, kwargs, exception, message)
    ("q 3-D", ((8, 4, 16), KV, KV), {}, ValueError, r"q must be 4-D \[B, S, H, D\], got shape \[8, 4, 16\]"),
    ("k 5-D", (Q, (1, 1, 8, 2, 16), KV), {}, ValueError, r"k must be 4-D"),
    ("q not a tensor", (np.zeros(Q, np.float32), KV, KV), {}, TypeError, r"q must be a torch.Tensor, got ndarray"),
    ("dtype mismatch", (Q, (KV, F16), KV), {}, TypeError,
     r"q, k, v dtypes must match, got q torch.float32, k torch.float16"),
    ("int dtype", ((Q, torch.int32), (KV, torch.int32), (KV, torch.int32)), {}, TypeError, r"q dtype must be float16"),
    ("Sq != Sk", (Q, (1, 9, 2, 16), (1, 9, 2, 16)), {}, ValueError,
     r"q and k/v need the same sequence length, got Sq=8 .*, Sk=9"),
    ("heads", (Q, (1, 8, 3, 16), (1, 8, 3, 16)), {}, ValueError,
     r"number of heads in k/v \(3\) must divide heads in q \(4\)"),
    ("k v shapes", (Q, KV, (1, 8, 1, 16)), {}, ValueError, r"k and v shapes must match"),
    ("head dim", ((1, 8, 4, 300), (1, 8, 2, 300), (1, 8, 2, 300)), {}, ValueError,
     r"head dim must be in 1..256, got 300"),
    ("scale", (Q, KV, KV), dict(scale=-1.0), ValueError, r"scale must be a positive finite number, got -1.0"),
    ("decay negative", (Q, KV, KV), dict(decay=-0.1), ValueError, r"decay must be finite and >= 0, got decay=-0.1"),
    ("decay nan", (Q, KV, KV), dict(decay=float("nan")), ValueError, r"decay must be finite and >= 0"),
    ("decay tensor negative", (Q, KV, KV), dict(decay=torch.tensor([0.1, -0.2, 0.0, 0.0], device=DEVICE)), ValueError,
     r"decay must be finite and >= 0, got decay=\[0.1.*-0.2"),
    ("decay tensor inf", (Q, KV, KV), dict(decay=torch.tensor(float("inf"), device=DEVICE)), ValueError,
     r"decay must be finite and >= 0"),
    ("decay shape", (Q, KV, KV), dict(decay=_t(3)), ValueError,
     r"decay must be a scalar or have shape \[Hq\] = \[4\], got \[3\]"),
    ("decay shape 2-D", (Q, KV, KV), dict(decay=_t(1, 4)), ValueError,
     r"decay must be a scalar or have shape \[Hq\] = \[4\], got \[1, 4\]"),
    ("decay int tensor", (Q, KV, KV), dict(decay=_i(4)), TypeError,
     r"decay must have a floating dtype, got decay.dtype=torch.int32"),
    ("decay str", (Q, KV, KV), dict(decay="0.1"), TypeError,
     r"decay must be a float >= 0 or a floating torch.Tensor.*got str"),
    ("decay bool", (Q, KV, KV), dict(decay=True), TypeError, r"decay must be a float >= 0 .*got bool"),
    ("decay list", (Q, KV, KV), dict(decay=[0.1] * 4), TypeError, r"decay must be a float >= 0 .*got list"),
    ("rope str", (Q, KV, KV), dict(rope="half"), TypeError, r"rope must be a torch_ref.Rope or None, got str"),
    ("rope odd D", ((1, 8, 4, 15), (1, 8, 2, 15), (1, 8, 2, 15)), dict(rope=Rope()), ValueError,
     r"head dim must be even for RoPE, got D=15"),
    ("positions no rope", (Q, KV, KV), dict(positions=_i(1, 8)), ValueError, r"positions given without rope"),
    ("positions float", (Q, KV, KV), dict(rope=Rope(), positions=_t(1, 8)), TypeError,
     r"positions must have an integer dtype, got torch.float32"),
    ("positions shape", (Q, KV, KV), dict(rope=Rope(), positions=_i(1, 7)), ValueError,
     r"positions must have shape \[B, S\] = \[1, 8\], got \[1, 7\]"),
    ("positions triple", (Q, KV, KV), dict(rope=Rope(), positions=(_i(1, 8),) * 3), ValueError,
     r"positions must be one \[B, S\] tensor or a pair"),
    ("causal", (Q, KV, KV), dict(causal=True), TypeError, r"unexpected keyword argument 'causal'"),
    ("window", (Q, KV, KV), dict(window=(4, 0)), TypeError, r"unexpected keyword argument 'window'"),
]


def _make(spec):
    if isinstance(spec, (torch.Tensor, np.ndarray)):
        return spec
    if isinstance(spec[0], tuple):
        return _t(*spec[0], dtype=spec[1])
    return _t(*spec)


@pytest.mark.parametrize("name,shapes,kwargs,exc,match", INVALID, ids=[c[0] for c in INVALID])
@pytest.mark.parametrize("impl", ["triton", "eager"])
def test_invalid_arguments(name, shapes, kwargs, exc, match, impl):
    q, k, v = (_make(s) for s in shapes)
    with pytest.raises(exc, match=match):
        stick_breaking_attention(q, k, v, implementation=impl, **kwargs)
    if impl == "eager":
        with pytest.raises(exc, match=match):
            stick_breaking_reference(q, k, v, **kwargs)


@pytest.mark.parametrize("impl", ["cuda", "xla", "TRITON", ""])
def test_unknown_implementation(impl):
    x = _t(*Q)
    kv = _t(*KV)
    with pytest.raises(UnknownImplementationError, match=r"implementation must be None, 'triton' or 'eager'"):
        stick_breaking_attention(x, kv, kv, implementation=impl)
    with pytest.raises(ValueError):
        stick_breaking_attention(x, kv, kv, implementation=impl)
    with pytest.raises(NotImplementedError):
        stick_breaking_attention(x, kv, kv, implementation=impl)


def test_triton_refuses_float64():
    x = _t(*Q, dtype=F64)
    kv = _t(*KV, dtype=F64)
    with pytest.raises(NotImplementedError, match=r"implementation='triton' does not support float64"):
        stick_breaking_attention(x, kv, kv, implementation="triton")
    out = stick_breaking_attention(x, kv, kv, implementation="eager")  # the golden path
    assert out.dtype == F64


def test_accepted_edges():
    """Accepted: decay 0, a decay tensor in float16 / float64, int16 / int64 positions, D = 2 with
    rope, a pair of positions; results match the float64 reference."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 11, 2, 2, generator=gen).to(DEVICE)
    kv = torch.randn(1, 11, 1, 2, generator=gen).to(DEVICE)
    pos = torch.randint(-5, 40, (1, 11), generator=gen, dtype=torch.int16).to(DEVICE)
    for decay in (0.0, 0, torch.tensor([0.0, 0.5], dtype=F16, device=DEVICE),
                  torch.tensor(0.25, dtype=F64, device=DEVICE)):
        for positions in (pos, (pos, pos.to(torch.int64)), None):
            kw = dict(decay=decay, rope=Rope(style="half"), positions=positions)
            out, rem = stick_breaking_attention(q, kv, kv, implementation="triton", return_remainder=True, **kw)
            gold, gold_rem = stick_breaking_reference(q.double(), kv.double(), kv.double(), **kw)
            torch.testing.assert_close(out.double(), gold, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(rem.double(), gold_rem, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# GPU: compiled kernels at realistic shapes, bf16 and fp16 (run with -m gpu; they fail without a GPU)
# ----------------------------------------------------------------------------------------------
def _require_gpu():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "gpu tests must run compiled kernels"


GPU_CASES = [
    SBCase(2, 1024, 8, 2, 128, BF16, decay="heads", rope="half", rem_grad=True),
    SBCase(2, 1024, 8, 8, 64, F16, rope="interleaved"),
    SBCase(1, 2048, 8, 2, 64, BF16, decay=0.01, rope="interleaved", pos="tensor"),
    SBCase(1, 2048, 4, 1, 128, F16, decay="scalar", rem_grad=True),
    SBCase(1, 1000, 4, 2, 96, BF16, decay="heads", rope="half", pos="pair", rem_grad=True),  # ragged, padded D
    SBCase(1, 1024, 4, 2, 64, F32, decay="heads", rope="half", rem_grad=True),  # IEEE fp32 dots
    SBCase(1, 1024, 4, 2, 256, BF16, decay="heads", rope="interleaved", rem_grad=True),  # the largest tiles' spills
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_parity(case):
    _require_gpu()
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32: exact dots on both sides (kernels: "ieee")
    try:
        _assert_rule(*_three(case, "cuda"), case.dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
def test_gpu_determinism():
    _require_gpu()
    case = SBCase(2, 2048, 8, 2, 128, BF16, decay="heads", rope="half", rem_grad=True)
    q, k, v, do, drem, _ = (_to(x, "cuda") for x in _inputs(case, seed=1))
    kw = dict(rope=Rope(style="half"))
    first = _run("triton", BF16, q, k, v, do, drem, _decay_values(case), kw)
    second = _run("triton", BF16, q, k, v, do, drem, _decay_values(case), kw)
    for name in first:
        assert torch.equal(first[name], second[name]), name
        assert torch.isfinite(first[name]).all(), name
