"""Softmax attention (`flash_attention`, with and without fused RoPE), both frameworks.

One shared test body (`test_against_golden`) runs every implementation of both frameworks
(`parity.variants.softmax`'s record: JAX triton / mosaic / xla, torch triton / eager, each where
it serves the case here) on the record's awkward-shape grid against the float64 golden, with the
tolerance rule of parity/tolerance.py on out, lse, dq, dk, dv. Shared too: determinism and fully
masked rows. Then what is one framework's own: its input errors, planted garbage, implementation
rules, strides, dtypes.

CPU CI runs the kernels through the Pallas and Triton interpreters at small, awkward shapes
(`slow`: the larger ones, the slow tier); tests marked `gpu` run the compiled kernels at
realistic shapes (make test-gpu on an H100/H200)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_attn
import jax_golden as jg
import torch_ref
import variant_harness as harness
from jax_attn import flash_attention
from parity import variants
from parity.cases import case as make_case
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare
from torch_golden import BF16, DEVICE, F16, F32, F64, NAMES, Case, _assert_rule, _inputs, _kwargs, _run, _three, _to
from torch_ref import flash_attention as torch_flash_attention
from torch_ref import flash_attention_reference
from variant_harness import assert_rule, grid_params


RECORD = variants.BY_NAME["softmax"]


DETERMINISM = [make_case("det_causal_gqa", (1, 70, 70, 4, 2, 32), causal=True),
               make_case("det_pair_softcap_fp16", (2, 45, 77, 6, 2, 40), "float16", causal=True,
                         segments="pair_sorted", softcap=5.0, stat_grad=True)]


@pytest.mark.parametrize("framework, implementation, case", grid_params(RECORD, DETERMINISM, include_reference=False))
def test_deterministic(framework, implementation, case):
    """Two runs of forward and backward are bitwise equal (no atomics; fixed GQA sum order)."""
    inputs = RECORD.draw(case)
    first, second = (variants.results(RECORD, framework, implementation, case, case.dtype, inputs, harness.DEVICE)
                     for _ in range(2))
    for name, a, b in zip(RECORD.quantities, first, second):
        np.testing.assert_array_equal(a, b, err_msg=name)


FULLY_MASKED = [
    make_case("masked_pair_empty_tail_fp16", (2, 37, 29, 4, 2, 40), "float16", causal=True,
              segments="pair_empty_tail", stat_grad=True),
    make_case("masked_pair_with_empty_rows", (1, 33, 25, 2, 2, 32), segments="pair_with_empty_rows"),
    make_case("masked_window_rows_past_keys", (1, 50, 30, 2, 1, 16), window=(2, 0)),
    make_case("masked_rope_pair_empty_tail_fp16", (1, 40, 35, 4, 2, 40), "float16", rope=("half", 10000.0),
              segments="pair_empty_tail", positions="restart_per_segment", causal=True, stat_grad=True),
]


@pytest.mark.parametrize("framework, implementation, case", grid_params(RECORD, FULLY_MASKED))
def test_fully_masked_rows(framework, implementation, case):
    """Rows with no visible key (a segment id no key has; a window past the last key): out 0,
    lse -inf, zero dq, no NaN anywhere, and the rule holds for the case (with RoPE too)."""
    fast, _, gold = assert_rule(RECORD, framework, implementation, case)
    empty = np.isneginf(gold["lse"]).transpose(0, 2, 1)  # [B, Sq, Hq]
    assert empty.any() and not empty.all()
    for name, x in fast.items():
        assert not np.isnan(x).any(), name
    assert (fast["out"][empty] == 0).all() and (fast["dq"][empty] == 0).all()
    assert np.isneginf(fast["lse"].transpose(0, 2, 1)[empty]).all()
    assert np.isfinite(fast["lse"].transpose(0, 2, 1)[~empty]).all()


# ---------------------------------------------------------------------------------------------
# JAX only
# ---------------------------------------------------------------------------------------------

def test_single_visible_key():
    """Rows with exactly one visible key: out = v exactly, dq = 0 mathematically. The golden and
    the autodiff reference give exact zeros there, so the rounding floor is 0 and the rule cannot
    judge dq; it is bounded here by the rounding of its two O(1) terms (dp and delta) instead."""
    rng = np.random.default_rng(11)
    q, k, v, do = jg._inputs(rng, 1, 9, 9, 2, 2, 16)
    out, lse, dq, dk, dv = jg._run(q, k, v, do, jnp.float32, "pallas_triton", window=(0, 0))
    np.testing.assert_array_equal(out, np.asarray(jnp.asarray(v, jnp.float32), np.float64))
    terms = np.abs(do).max() * np.abs(v).max() * q.shape[-1] * np.abs(k).max() * q.shape[-1] ** -0.5
    assert np.abs(dq).max() <= 4 * np.finfo(np.float32).eps * terms
    single = jg._run(q[:, :1], k, v, do[:, :1], jnp.float32, "pallas_triton", causal=True)
    np.testing.assert_array_equal(single[0][:, 0], np.asarray(jnp.asarray(v[:, 0], jnp.float32), np.float64))


def _packed_ids(rng, batch, length, num_segments):
    cuts = np.sort(rng.choice(np.arange(1, length), size=num_segments - 1, replace=False))
    ids = np.zeros((batch, length), np.int32)
    for c in cuts:
        ids[:, c:] += 1
    return jnp.asarray(ids)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_padding_poison_does_not_leak(dtype):
    """finfo.max in masked keys/values/queries and NaN in whole key blocks no query visits
    must not reach the real rows' outputs or gradients."""
    rng = np.random.default_rng(3)
    real_q, real_k, q_len, kv_len = 40, 50, 48, 128
    q, k, v, do = jg._inputs(rng, 1, q_len, kv_len, 2, 1, 32)
    big = float(np.finfo(jg.NP_DTYPE[dtype]).max)
    q_ids = np.r_[np.zeros(20), np.ones(real_q - 20), np.full(q_len - real_q, -1)][None]
    kv_ids = np.r_[np.zeros(25), np.ones(real_k - 25), np.full(kv_len - real_k, -2)][None]
    q[:, real_q:], k[:, real_k:], v[:, real_k:] = big, big, big
    k[:, 64:], v[:, 64:] = np.nan, np.nan  # whole key blocks only padding queries would face
    ids = (jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32))
    clean = [x.copy() for x in (q, k, v)]
    for x, n in zip(clean, (real_q, real_k, real_k)):
        x[:, n:] = 0.0
    golden = jg._golden(*clean, do, segment_ids=ids)
    fast = jg._run(q, k, v, do, dtype, "pallas_triton", segment_ids=ids)
    naive = jg._run(*clean, do, dtype, "xla", segment_ids=ids)
    real = {"out": real_q, "lse": real_q, "dq": real_q, "dk": real_k, "dv": real_k}
    for (name, n), f, nv, g in zip(real.items(), fast, naive, golden):
        axis = 2 if name == "lse" else 1
        sl = lambda x: np.take(x, np.arange(n), axis=axis)
        factor = FORWARD_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR
        verdict = compare(sl(f), sl(nv), sl(g), jg.NP_DTYPE[dtype], factor)
        assert verdict.ok, f"{name}: {verdict}"
    assert np.all(fast[0][:, real_q:] == 0)  # padding queries see no key


def test_lse_is_differentiable():
    """The lse output carries gradient: d lse_i / d s_ij = p_ij."""
    rng = np.random.default_rng(4)
    q, k, v, _ = jg._inputs(rng, 1, 40, 40, 2, 2, 16)
    dlse = jnp.asarray(rng.standard_normal((1, 2, 40)), jnp.float32)
    grads = {}
    for impl in ("pallas_triton", "xla"):
        with jax.default_matmul_precision("highest"):
            f = lambda q, k, v: flash_attention(q, k, v, causal=True, return_lse=True,
                                                implementation=impl)[1]
            _, vjp = jax.vjp(f, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
            grads[impl] = vjp(dlse)
    for a, b in zip(grads["pallas_triton"], grads["xla"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert min(np.abs(np.asarray(g)).max() for g in grads["xla"][:2]) > 0  # lse needs q, k, not v


def test_jit_and_default_implementation():
    rng = np.random.default_rng(6)
    q, k, v, _ = jg._inputs(rng, 1, 20, 20, 2, 2, 16)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    assert jax_attn.default_implementation() == "triton"  # CPU: Pallas interpreter
    out = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True))(q, k, v)
    ref = flash_attention(q, k, v, causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def _arr(*shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((_arr(2, 8, 4), _arr(2, 8, 4, 16), _arr(2, 8, 4, 16)), {}, ValueError, r"q must be 4-D"),
    ((_arr(2, 8, 4, 16), _arr(2, 8, 4, 16, dtype=jnp.float16), _arr(2, 8, 4, 16)), {}, TypeError,
     r"share a dtype"),
    ((_arr(2, 8, 4, 16, dtype=jnp.int32),) * 3, {}, TypeError, r"q.dtype=int32"),
    ((np.ones((2, 8, 4, 16)),) * 3, dict(implementation="pallas_triton"),
     NotImplementedError, r"float64 inputs are served by implementation='xla' only"),
    ((_arr(2, 8, 4, 16), _arr(2, 8, 4, 32), _arr(2, 8, 4, 32)), {}, ValueError, r"differ in head dim"),
    ((_arr(2, 8, 8, 16), _arr(2, 8, 3, 16), _arr(2, 8, 3, 16)), {}, ValueError,
     r"number of heads in k/v \(3\) must divide heads in q \(8\)"),
    ((_arr(1, 8, 2, 257), _arr(1, 8, 2, 257), _arr(1, 8, 2, 257)), {}, ValueError, r"head dim 257 exceeds"),
    ((_arr(2, 8, 4, 16), _arr(3, 8, 4, 16), _arr(3, 8, 4, 16)), {}, ValueError, r"batch sizes differ"),
    ((_arr(2, 8, 4, 16), _arr(2, 8, 4, 16), _arr(2, 9, 4, 16)), {}, ValueError, r"k and v must have the same shape"),
    ((_arr(2, 8, 4, 16),) * 3, dict(segment_ids=jnp.zeros((2, 9), jnp.int32)), ValueError,
     r"q segment_ids must have shape \(2, 8\)"),
    ((_arr(2, 8, 4, 16),) * 3, dict(segment_ids=jnp.zeros((2, 8))), TypeError, r"integer array"),
    ((_arr(2, 8, 4, 16), _arr(2, 6, 4, 16), _arr(2, 6, 4, 16)),
     dict(segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, r"single segment_ids array needs Sq == Sk"),
    ((_arr(2, 8, 4, 16),) * 3, dict(window=(-1, 2)), ValueError, r"window sizes must be >= 0"),
    ((_arr(2, 8, 4, 16),) * 3, dict(window=5), ValueError, r"window must be a pair"),
    ((_arr(2, 8, 4, 16),) * 3, dict(softcap=0.0), ValueError, r"softcap must be a positive"),
    ((_arr(2, 8, 4, 16),) * 3, dict(scale=float("nan")), ValueError, r"scale must be a positive"),
    ((_arr(2, 8, 4, 16),) * 3, dict(scale=jnp.float32(0.5)), TypeError, r"scale must be a Python number"),
    ((_arr(2, 8, 4, 16),) * 3, dict(implementation="cuda"), NotImplementedError,
     r"unknown implementation='cuda'"),
])
def test_bad_inputs(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attention(*args, **kwargs)


@pytest.mark.gpu
def test_gpu_segments_and_determinism():
    assert jax.default_backend() == "gpu"
    ids = _packed_ids(np.random.default_rng(8), 2, 2048, 5)
    jg.check_against_golden((2, 2048, 2048, 8, 2, 128), dtype=jnp.bfloat16, causal=True, segment_ids=ids)
    rng = np.random.default_rng(9)
    q, k, v, do = jg._inputs(rng, 2, 1024, 1024, 8, 2, 128)
    runs = [jg._run(q, k, v, do, jnp.bfloat16, "pallas_triton", causal=True) for _ in range(2)]
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# torch only
# ---------------------------------------------------------------------------------------------

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
    out2 = torch_flash_attention(q, k, v, implementation="eager")
    assert torch.equal(out, out2)


def test_lse_dtype_and_output_dtype():
    case = Case(1, 17, 17, 2, 2, 16, F16)
    q, k, v, _, _, _ = (_to(x, DEVICE) for x in _inputs(case))
    for impl in ("triton", "eager"):
        out, lse = torch_flash_attention(q, k, v, return_lse=True, implementation=impl)
        assert out.dtype == F16 and lse.dtype == F32 and lse.shape == (1, 2, 17)
        assert out.shape == q.shape


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
    assert torch.equal(torch_flash_attention(q, k, v, causal=True), torch_flash_attention(q, k, v, causal=True,
                                                                                  implementation=expected))


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    q, k, v = _small(device="cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(NotImplementedError, match="CUDA tensor or the Triton interpreter"):
        torch_flash_attention(q, k, v, implementation="triton")
    # None falls to eager by the documented rule (that is the rule, not a fallback)
    assert torch.equal(torch_flash_attention(q, k, v), torch_flash_attention(q, k, v, implementation="eager"))


def test_triton_float64_raises():
    q, k, v = _small(F64)
    with pytest.raises(NotImplementedError, match="float64"):
        torch_flash_attention(q, k, v, implementation="triton")


@pytest.mark.parametrize("impl", ["cuda", "Triton", "", 3])
def test_unknown_implementation(impl):
    q, k, v = _small()
    with pytest.raises(ValueError, match="unknown implementation=.*choose one of None, 'triton', 'eager'"):
        torch_flash_attention(q, k, v, implementation=impl)
    with pytest.raises(NotImplementedError, match="unknown implementation="):
        torch_flash_attention(q, k, v, implementation=impl)


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
        torch_flash_attention(q, k, v, implementation=impl, **kwargs)
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
    out = torch_flash_attention(q, kv, kv, implementation=impl)
    gold, _ = flash_attention_reference(q.double(), kv.double(), kv.double())
    assert out.shape == q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), gold, rtol=1e-4, atol=1e-5)
    q_ids = torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.int64, device=DEVICE)
    kv_ids = torch.tensor([[0, 1, 1, 1, 1, 1, 1]], dtype=torch.int16, device=DEVICE)
    out, lse = torch_flash_attention(q[..., :3], kv[..., :3], kv[..., :3], window=[0, 0], segment_ids=(q_ids, kv_ids),
                               softcap=1e-3, scale=1e-6, return_lse=True, implementation=impl)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def _require_gpu():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "gpu tests must run compiled kernels"


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


# ------------------------------------------------------------------------------------------------
# Position offsets (bottom-right alignment)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(6, 2)), dict(causal=True, window=(9, 0))],
                         ids=["causal", "window", "causal_window"])
@pytest.mark.parametrize("lengths", [(5, 40), (1, 17), (33, 70)], ids=lambda s: "x".join(map(str, s)))
def test_bottom_right_is_queries_at_the_end(kw, lengths):
    """q_offset = Sk - Sq (FlashAttention's alignment) equals, by construction, the last Sq rows of
    the same call on Sk queries (the first Sk - Sq of them zeros): forward and gradients, both
    frameworks, every implementation."""
    sq, sk = lengths
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal(s) for s in ((2, sq, 4, 16), (2, sk, 2, 16), (2, sk, 2, 16), (2, sq, 4, 16)))
    padded = np.concatenate([np.zeros((2, sk - sq, 4, 16)), q], 1)
    with jax.enable_x64(True):
        def loss(q, k, v, **extra):
            out = flash_attention(q, k, v, implementation="xla", **kw, **extra)
            return jnp.sum(out[:, -sq:] * do)
        want = jax.grad(lambda qp, k, v: loss(qp, k, v), argnums=(0, 1, 2))(padded, k, v)
        want_out = flash_attention(padded, k, v, implementation="xla", **kw)[:, -sq:]
    for impl in ("xla", "triton"):
        with jax.default_matmul_precision("highest"):
            f = lambda q, k, v: flash_attention(q, k, v, q_offset=sk - sq, implementation=impl, **kw)
            out, vjp = jax.vjp(f, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
            grads = vjp(jnp.asarray(do, jnp.float32))
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-5, err_msg=impl)
        for got, ref in zip(grads, (want[0][:, -sq:], want[1], want[2])):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=5e-5, err_msg=impl)
    for impl in ("eager", "triton"):
        t = [torch.tensor(x, dtype=F32, device=DEVICE, requires_grad=True) for x in (q, k, v)]
        out = torch_flash_attention(*t, q_offset=sk - sq, implementation=impl, **kw)
        grads = torch.autograd.grad(out, t, torch.tensor(do, dtype=F32, device=DEVICE))
        np.testing.assert_allclose(out.detach().cpu().numpy(), np.asarray(want_out), atol=2e-5, err_msg=impl)
        for got, ref in zip(grads, (want[0][:, -sq:], want[1], want[2])):
            np.testing.assert_allclose(got.cpu().numpy(), np.asarray(ref), atol=5e-5, err_msg=impl)


@pytest.mark.parametrize("bad", [-1, 2.0, True, None])
def test_offsets_are_ints(bad):
    x = jnp.zeros((1, 4, 2, 16), jnp.float32)
    t = torch.zeros(1, 4, 2, 16)
    for name in ("q_offset", "kv_offset"):
        with pytest.raises(ValueError, match=name):
            flash_attention(x, x, x, causal=True, **{name: bad})
        with pytest.raises(ValueError, match=name):
            torch_flash_attention(t, t, t, causal=True, **{name: bad})
    assert flash_attention(x, x, x, causal=True, q_offset=0, kv_offset=0).shape == x.shape  # the boundary


def test_mosaic_refuses_offsets():
    spec = jax_attn.AttentionSpec(scale=1.0, causal=True, offset=3)
    reason = jax_attn.ops.softmax.mosaic.unsupported_reason(spec, 64, jnp.bfloat16)
    assert reason is not None and "q_offset != kv_offset" in reason


@pytest.mark.parametrize("bad, error, match", [
    ((0.5, 0.25), TypeError, "alibi_slopes must be a float"),
    (np.ones(3, np.float32), ValueError, r"alibi_slopes must have shape \[Hq\] = \(2,\)"),
    (np.array([0.5, np.inf], np.float32), ValueError, "alibi_slopes must be finite"),
    (np.ones(2, np.int32), TypeError, "alibi_slopes must be a float")])
def test_alibi_slopes_are_checked(bad, error, match):
    x = jnp.zeros((1, 4, 2, 16), jnp.float32)
    with pytest.raises(error, match=match):
        flash_attention(x, x, x, alibi_slopes=bad)
    t = torch.zeros(1, 4, 2, 16)
    with pytest.raises(error, match=match):
        torch_flash_attention(t, t, t, alibi_slopes=bad if not isinstance(bad, np.ndarray) else torch.from_numpy(bad))
    assert flash_attention(x, x, x, alibi_slopes=np.zeros(2, np.float32)).shape == x.shape  # the boundary


def test_mosaic_refuses_alibi():
    spec = jax_attn.AttentionSpec(scale=1.0, causal=True, alibi=True)
    reason = jax_attn.ops.softmax.mosaic.unsupported_reason(spec, 64, jnp.bfloat16)
    assert reason is not None and "ALiBi" in reason
