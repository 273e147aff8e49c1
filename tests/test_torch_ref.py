"""Tests of torch_ref: Triton kernels and the eager path against a float64 golden.

Without CUDA the kernels run through the Triton interpreter, which must be chosen before triton
is imported (hence the environment line right after importing torch). The interpreter computes
bf16 dots wrongly, so bf16 is only tested by the `gpu` tests (deselected on CPU: -m "not gpu").

Every parity case produces three results: the eager reference in float64 (golden), the eager
reference in the compute dtype (naive) and the Triton kernels (fast), and applies the
FlashAttention rule of parity/tolerance.py to out, lse, dq, dk and dv.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402

import torch_ref  # noqa: E402
from torch_ref import flash_attention, flash_attention_reference  # noqa: E402

from torch_golden import BF16, DEVICE, F16, F32, F64, NAMES, _assert_rule  # noqa: E402,F401


# ----------------------------------------------------------------------------------------------
# Case description, inputs, the three runs, the rule
# ----------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------
# Parity grid (awkward lengths and head dims, GQA/MQA, every feature and some combinations)
# ----------------------------------------------------------------------------------------------
# Rows with exactly one visible key (the (1, 1) and window=(0, 0) cases) have d out / d s = 0:
# with a cotangent on `out` alone the golden dq, dk are identically 0, the rule's floor is 0, and
# the kernel's dS = P (dP - delta) is the rounding difference of two summation orders of dO . v
# (FlashAttention's delta = rowsum(dO * O) trick), which no floor admits. Those cases therefore also
# put a cotangent on lse (golden dS = P dlse, non-zero) and run in float16: in float32 the naive
# eager reference cancels exactly there (its P = 1 makes dP - sum P dP = 0 bit for bit), so its
# error, hence the allowance, is far below the kernel's ~1 ulp of |dP| (the limit of the delta
# trick, not a bug; see the report).
CASES = [
    Case(1, 1, 1, 1, 1, 16, F16, lse_grad=True),
    Case(2, 1, 1, 4, 1, 64, F16, causal=True, lse_grad=True),  # MQA, single token
    Case(1, 17, 17, 2, 2, 16, F32, causal=True),
    Case(2, 17, 17, 6, 2, 72, F16, seg="single"),
    Case(1, 31, 47, 6, 2, 40, F32, causal=True),  # GQA, Sq < Sk
    Case(1, 31, 47, 4, 1, 59, F16, window=(5, 9)),  # MQA, odd head dim
    Case(1, 47, 31, 2, 1, 64, F32, causal=True, lse_grad=True),  # Sq > Sk
    Case(1, 65, 129, 2, 2, 59, F32, causal=True, window=(20, 0)),
    Case(1, 65, 129, 6, 2, 128, F16, softcap=4.0, amp=2.0),
    Case(1, 113, 203, 4, 1, 64, F16, causal=True, seg="pair"),
    Case(1, 113, 203, 2, 2, 40, F16, window=(0, 0), lse_grad=True),  # one key per row
    Case(2, 65, 65, 4, 2, 72, F32, causal=True, window=(7, 3), seg="single", softcap=2.5, scale=0.3, amp=2.0),
    Case(1, 47, 17, 2, 2, 16, F16, window=(0, 0), lse_grad=True),  # rows 17.. see nothing
    Case(1, 31, 31, 2, 1, 256, F16, causal=True),  # widest head dim
    Case(1, 17, 31, 2, 2, 1, F32, softcap=1.0, amp=3.0),  # narrowest head dim
    Case(1, 40, 40, 4, 2, 128, F32, causal=True, seg="pair_empty", lse_grad=True),
    Case(1, 65, 129, 2, 1, 72, F16, window=(30, 50), seg="pair", softcap=3.0, amp=2.0),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parity(case):
    _assert_rule(*_three(case), case.dtype)


def test_fully_masked_rows():
    """Queries whose segment has no key: out 0, lse -inf, zero gradients, no NaN anywhere."""
    case = Case(2, 37, 29, 4, 2, 40, F16, causal=True, seg="pair_empty", lse_grad=True)
    fast, naive, gold = _three(case)
    _assert_rule(fast, naive, gold, case.dtype)
    _, _, _, _, _, (q_ids, kv_ids) = _inputs(case)
    empty = (q_ids[:, :, None] != kv_ids[:, None, :]).all(-1).to(DEVICE)  # [B, Sq]
    assert empty.any() and not empty.all()
    for res in (fast, naive):
        for name in NAMES:
            assert not torch.isnan(res[name]).any(), name
        assert (res["out"][empty] == 0).all()
        assert (res["dq"][empty] == 0).all()
        lse = res["lse"].transpose(1, 2)  # [B, Sq, Hq]
        assert torch.isneginf(lse[empty]).all()
        assert torch.isfinite(lse[~empty]).all()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter's numpy on planted
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / NaN, masked after
def test_masked_keys_hold_garbage():
    """NaN / inf / finfo.max at keys, values (and queries) that are masked for every query must
    not reach any other output or gradient: results equal the run with those entries zeroed."""
    B, Sq, Sk, Hq, Hkv, D = 2, 37, 45, 4, 2, 40
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(B, s, h, D, generator=gen) for s, h in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv), (Sq, Hq)))
    dl = torch.randn(B, Hq, Sq, generator=gen)
    # Padding: the last 7 kv positions have id 9 (no query has it); the last 4 queries id 8 (no key).
    q_ids = torch.sort(torch.randint(0, 2, (B, Sq), generator=gen), dim=1).values
    kv_ids = torch.sort(torch.randint(0, 2, (B, Sk), generator=gen), dim=1).values
    q_ids[:, -4:] = 8
    kv_ids[:, -7:] = 9
    for dtype in (F32, F16):
        big = torch.finfo(dtype).max
        planted = [x.to(dtype).clone() for x in (q, k, v)]
        planted[1][:, -7:, :, 0] = float("nan")
        planted[1][:, -7:, :, 1] = big
        planted[2][:, -7:, :, 0] = float("inf")
        planted[2][:, -7:, :, 1:] = float("nan")
        planted[2][:, -2:] = big
        planted[0][:, -4:, :, :3] = float("nan")
        clean = [x.to(dtype).clone() for x in (q, k, v)]
        for x in clean[1:]:
            x[:, -7:] = 0
        clean[0][:, -4:] = 0
        kw = dict(causal=True, segment_ids=(q_ids.to(DEVICE), kv_ids.to(DEVICE)))
        for impl in ("triton", "eager"):
            a = _run(impl, dtype, *_to(tuple(planted), DEVICE), do.to(DEVICE), dl.to(DEVICE), kw)
            b = _run(impl, dtype, *_to(tuple(clean), DEVICE), do.to(DEVICE), dl.to(DEVICE), kw)
            for name in NAMES:
                assert not torch.isnan(a[name]).any(), (impl, dtype, name)
                assert torch.equal(a[name], b[name]), (impl, dtype, name)
            assert (a["dk"][:, -7:] == 0).all() and (a["dv"][:, -7:] == 0).all()
            assert (a["dq"][:, -4:] == 0).all()


def test_causal_keys_past_last_query_hold_nan():
    """Top-left causal with Sk > Sq: keys j >= Sq are seen by no query; NaN there stays there."""
    case = Case(1, 23, 70, 2, 1, 16, F32, causal=True)
    q, k, v, do, _, _ = (_to(x, DEVICE) for x in _inputs(case))
    k2, v2 = k.clone(), v.clone()
    k2[:, 23:] = float("nan")
    v2[:, 23:] = float("nan")
    for impl in ("triton", "eager"):
        a = _run(impl, F32, q, k2, v2, do, None, dict(causal=True))
        b = _run(impl, F32, q, k, v, do, None, dict(causal=True))
        for name in NAMES:
            assert torch.equal(a[name], b[name]), (impl, name)
        assert (a["dk"][:, 23:] == 0).all() and (a["dv"][:, 23:] == 0).all()


def test_deterministic():
    """Two runs of forward and backward are bitwise equal (no atomics; fixed GQA sum order)."""
    case = Case(2, 45, 77, 6, 2, 40, F16, causal=True, seg="pair", softcap=5.0, lse_grad=True)
    q, k, v, do, dl, seg = (_to(x, DEVICE) for x in _inputs(case))
    first = _run("triton", case.dtype, q, k, v, do, dl, _kwargs(case, seg))
    second = _run("triton", case.dtype, q, k, v, do, dl, _kwargs(case, seg))
    for name in NAMES:
        assert torch.equal(first[name], second[name]), name


def test_strided_inputs():
    """Non-contiguous q (from BHSD), k/v slices of one packed tensor, strided cotangent: the
    kernels take strides, so results equal the contiguous run bitwise."""
    B, Sq, Sk, Hq, Hkv, D = 2, 33, 41, 4, 2, 24
    gen = torch.Generator().manual_seed(5)
    q_bhsd = torch.randn(B, Hq, Sq, D, generator=gen).to(DEVICE)
    kv = torch.randn(B, Sk, 2 * Hkv, D + 8, generator=gen).to(DEVICE)
    do_big = torch.randn(B, Sq, Hq, 2 * D, generator=gen).to(DEVICE)
    q = q_bhsd.transpose(1, 2)
    k, v = kv[:, :, :Hkv, 3:3 + D], kv[:, :, Hkv:, :D]
    do = do_big[..., ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or do.is_contiguous())
    kw = dict(causal=True, window=(9, 4))
    a = _run("triton", F32, q, k, v, do, None, kw)
    b = _run("triton", F32, q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(), None, kw)
    for name in NAMES:
        assert torch.equal(a[name], b[name]), name


def test_reference_float64_and_defaults():
    """flash_attention_reference returns (out, lse), runs in float64 and uses scale D ** -0.5;
    its lse is the plain log-sum-exp and its out the softmax-weighted sum."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 9, 3, 5, generator=gen, dtype=F64) for _ in range(3))
    out, lse = flash_attention_reference(q, k, v)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 5 ** -0.5
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v), rtol=1e-12, atol=1e-12)
    assert out.dtype == F64 and lse.dtype == F64
    out2 = flash_attention(q, k, v, implementation="eager")
    assert torch.equal(out, out2)


def test_lse_dtype_and_output_dtype():
    case = Case(1, 17, 17, 2, 2, 16, F16)
    q, k, v, _, _, _ = (_to(x, DEVICE) for x in _inputs(case))
    for impl in ("triton", "eager"):
        out, lse = flash_attention(q, k, v, return_lse=True, implementation=impl)
        assert out.dtype == F16 and lse.dtype == F32 and lse.shape == (1, 2, 17)
        assert out.shape == q.shape


# ----------------------------------------------------------------------------------------------
# implementation=None and explicit implementations
# ----------------------------------------------------------------------------------------------
def _small(dtype=F32, device=DEVICE):
    gen = torch.Generator().manual_seed(11)
    return tuple(torch.randn(1, 9, 2, 8, generator=gen).to(dtype).to(device) for _ in range(3))


def test_implementation_none_rule(monkeypatch):
    q_cpu = torch.zeros(1, 2, 1, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert torch_ref.resolve_implementation(q_cpu) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert torch_ref.resolve_implementation(q_cpu) == "eager"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert torch_ref.resolve_implementation(q_cpu) == "eager"
    assert torch_ref.resolve_implementation(q_cpu, "triton") == "triton"
    assert torch_ref.resolve_implementation(q_cpu, "eager") == "eager"


def test_implementation_none_runs_the_resolved_one():
    q, k, v = _small()
    expected = "triton" if (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") else "eager"
    assert torch_ref.resolve_implementation(q) == expected
    assert torch.equal(flash_attention(q, k, v, causal=True), flash_attention(q, k, v, causal=True,
                                                                                  implementation=expected))


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    q, k, v = _small(device="cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(NotImplementedError, match="CUDA tensor or the Triton interpreter"):
        flash_attention(q, k, v, implementation="triton")
    # None falls to eager by the documented rule (that is the rule, not a fallback)
    assert torch.equal(flash_attention(q, k, v), flash_attention(q, k, v, implementation="eager"))


def test_triton_float64_raises():
    q, k, v = _small(F64)
    with pytest.raises(NotImplementedError, match="float64"):
        flash_attention(q, k, v, implementation="triton")


@pytest.mark.parametrize("impl", ["cuda", "Triton", "", 3])
def test_unknown_implementation(impl):
    q, k, v = _small()
    with pytest.raises(ValueError, match="implementation must be None, 'triton' or 'eager'"):
        flash_attention(q, k, v, implementation=impl)
    with pytest.raises(NotImplementedError, match="implementation must be"):
        flash_attention(q, k, v, implementation=impl)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _t(*shape, dtype=F32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


Q, KV = (1, 8, 4, 16), (1, 8, 2, 16)
INVALID = [
    # (q, k, v, kwargs, exception, message)
    ("q 3-D", lambda: (_t(1, 8, 16), _t(*KV), _t(*KV)), {}, ValueError, r"q must be 4-D .* \[1, 8, 16\]"),
    ("k 5-D", lambda: (_t(*Q), _t(1, 1, 8, 2, 16), _t(*KV)), {}, ValueError, r"k must be 4-D"),
    ("int dtype", lambda: (_t(*Q, dtype=torch.int32), _t(*KV, dtype=torch.int32), _t(*KV, dtype=torch.int32)), {}, TypeError,
     r"q dtype must be .* got torch.int32"),
    ("dtype mix", lambda: (_t(*Q), _t(*KV, dtype=F16), _t(*KV)), {}, TypeError,
     r"dtypes must match, got q torch.float32, k torch.float16"),
    ("batch", lambda: (_t(*Q), _t(2, 8, 2, 16), _t(2, 8, 2, 16)), {}, ValueError, r"batch mismatch: q has batch 1, k/v have 2"),
    ("head dim", lambda: (_t(*Q), _t(1, 8, 2, 32), _t(1, 8, 2, 32)), {}, ValueError,
     r"head-dim mismatch: q has head dim 16, k/v have 32"),
    ("k/v shapes", lambda: (_t(*Q), _t(*KV), _t(1, 9, 2, 16)), {}, ValueError, r"k and v shapes must match"),
    ("heads", lambda: (_t(1, 8, 8, 16), _t(1, 8, 3, 16), _t(1, 8, 3, 16)), {}, ValueError,
     r"number of heads in k/v \(3\) must divide heads in q \(8\)"),
    ("D 257", lambda: (_t(1, 8, 2, 257), _t(1, 8, 2, 257), _t(1, 8, 2, 257)), {}, ValueError,
     r"head dim must be in 1..256, got 257"),
    ("seg float", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(segment_ids=_t(1, 8)), TypeError,
     r"segment_ids must have an integer dtype, got torch.float32"),
    ("seg bool", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(segment_ids=_t(1, 8, dtype=torch.bool)), TypeError,
     r"segment_ids must have an integer dtype"),
    ("seg shape", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(segment_ids=_t(1, 7, dtype=torch.int32)), ValueError,
     r"segment_ids must have shape \[B, S\] = \[1, 8\], got \[1, 7\]"),
    ("seg single cross", lambda: (_t(*Q), _t(1, 9, 2, 16), _t(1, 9, 2, 16)),
     dict(segment_ids=_t(1, 8, dtype=torch.int32)), ValueError, r"single segment_ids tensor needs Sq == Sk.*Sq=8, Sk=9"),
    ("seg pair kv shape", lambda: (_t(*Q), _t(1, 9, 2, 16), _t(1, 9, 2, 16)),
     dict(segment_ids=(_t(1, 8, dtype=torch.int32), _t(1, 8, dtype=torch.int32))), ValueError,
     r"segment_ids\[1\] \(kv_ids\) must have shape \[B, S\] = \[1, 9\], got \[1, 8\]"),
    ("seg triple", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(segment_ids=(_t(1, 8, dtype=torch.int32),) * 3),
     ValueError, r"segment_ids must be one \[B, S\] tensor or a pair"),
    ("window 1", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(window=(3,)), ValueError,
     r"window must be a pair \(left, right\) of non-negative ints, got \(3,\)"),
    ("window neg", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(window=(-1, 2)), ValueError,
     r"window must be a pair .* got \(-1, 2\)"),
    ("window float", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(window=(1.5, 2)), ValueError,
     r"window must be a pair .* got \(1.5, 2\)"),
    ("window int", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(window=4), ValueError, r"window must be a pair .* got 4"),
    ("softcap 0", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(softcap=0.0), ValueError,
     r"softcap must be a positive finite number or None, got 0.0"),
    ("softcap neg", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(softcap=-2.0), ValueError, r"softcap .* got -2.0"),
    ("softcap inf", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(softcap=float("inf")), ValueError, r"softcap .* got inf"),
    ("causal int", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(causal=1), TypeError, r"causal must be a bool, got 1"),
    ("scale 0", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(scale=0.0), ValueError,
     r"scale must be a positive finite number, got 0.0"),
    ("scale neg", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(scale=-1.0), ValueError, r"scale .* got -1.0"),
    ("scale nan", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(scale=float("nan")), ValueError, r"scale .* got nan"),
    ("scale str", lambda: (_t(*Q), _t(*KV), _t(*KV)), dict(scale="0.5"), ValueError, r"scale .* got '0.5'"),
]


@pytest.mark.parametrize("name,make,kwargs,exc,match", INVALID, ids=[c[0] for c in INVALID])
@pytest.mark.parametrize("impl", ["triton", "eager"])
def test_invalid_arguments(name, make, kwargs, exc, match, impl):
    q, k, v = make()
    with pytest.raises(exc, match=match):
        flash_attention(q, k, v, implementation=impl, **kwargs)
    if impl == "eager":
        with pytest.raises(exc, match=match):
            flash_attention_reference(q, k, v, **kwargs)


@pytest.mark.parametrize("impl", ["triton", "eager"])
def test_boundary_arguments_pass(impl):
    """The edge of each accepted range works: D = 256 (257 raises), window (0, 0), a pair of
    segment ids with different lengths and dtypes, Hkv dividing Hq, tiny positive softcap/scale."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 5, 4, 256, generator=gen).to(DEVICE)
    kv = torch.randn(1, 7, 2, 256, generator=gen).to(DEVICE)
    out = flash_attention(q, kv, kv, implementation=impl)
    gold, _ = flash_attention_reference(q.double(), kv.double(), kv.double())
    assert out.shape == q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), gold, rtol=1e-4, atol=1e-5)
    q_ids = torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.int64, device=DEVICE)
    kv_ids = torch.tensor([[0, 1, 1, 1, 1, 1, 1]], dtype=torch.int16, device=DEVICE)
    out, lse = flash_attention(q[..., :3], kv[..., :3], kv[..., :3], window=[0, 0], segment_ids=(q_ids, kv_ids),
                               softcap=1e-3, scale=1e-6, return_lse=True, implementation=impl)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ----------------------------------------------------------------------------------------------
# GPU: compiled kernels at realistic shapes (run with -m gpu; they fail without a GPU)
# ----------------------------------------------------------------------------------------------
def _require_gpu():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "gpu tests must run compiled kernels"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["MHA", "GQA"])
def test_gpu_realistic(dtype, causal, heads):
    _require_gpu()
    case = Case(2, 1024, 1024, heads[0], heads[1], 128, dtype, causal=causal)
    _assert_rule(*_three(case, "cuda"), dtype)


GPU_FEATURE_CASES = [
    Case(1, 300, 517, 4, 2, d, dt, causal=True, window=(200, 0), seg="pair", softcap=8.0, amp=2.0, lse_grad=True)
    for d in (16, 72, 128, 256) for dt in (F16, BF16, F32)
] + [Case(2, 777, 777, 4, 1, d, dt, seg="single", window=(100, 300)) for d in (64, 96) for dt in (BF16, F32)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_FEATURE_CASES, ids=str)
def test_gpu_features(case):
    """Every GPU tile configuration (head dims 16..256, each dtype) with all features on."""
    _require_gpu()
    _assert_rule(*_three(case, "cuda"), case.dtype)


@pytest.mark.gpu
def test_gpu_fp32_follows_torch_tf32_switch():
    """fp32 dots are IEEE under torch's default (allow_tf32=False; held to the rule) and TF32 once
    torch.backends.cuda.matmul.allow_tf32 is True (visibly less accurate: 10 mantissa bits)."""
    _require_gpu()
    case = Case(1, 512, 512, 4, 4, 64, F32, causal=True)
    q, k, v, do, dl, seg = (_to(x, "cuda") for x in _inputs(case))
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        fast_tf32 = _run("triton", F32, q, k, v, do, dl, _kwargs(case, seg))
        torch.backends.cuda.matmul.allow_tf32 = False
        fast_ieee, naive, gold = _three(case, "cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    _assert_rule(fast_ieee, naive, gold, F32)
    err_tf32, err_ieee = ((r["out"].double() - gold["out"]).abs().max().item() for r in (fast_tf32, fast_ieee))
    assert err_tf32 > 10 * err_ieee, (err_tf32, err_ieee)


@pytest.mark.gpu
def test_gpu_deterministic_and_rule():
    _require_gpu()
    case = Case(2, 1024, 1024, 8, 2, 128, BF16, causal=True, seg="single", lse_grad=True)
    q, k, v, do, dl, seg = (_to(x, "cuda") for x in _inputs(case))
    runs = [_run("triton", BF16, q, k, v, do, dl, _kwargs(case, seg)) for _ in range(2)]
    for name in NAMES:
        assert torch.equal(runs[0][name], runs[1][name]), name
    assert torch_ref.resolve_implementation(q) == "triton"
