"""Dilated attention (LongNet, `dilated_attention`), both frameworks.

One shared test body (`test_against_golden` of tests/test_records.py) runs every implementation of
both frameworks (`parity.variants.dilated`'s record: JAX triton / mosaic / xla, torch triton / eager,
each where it serves the case here) on the record's awkward-shape grid against the float64 golden, with
the tolerance rule on out, lse, dq, dk, dv (`pytest tests/test_records.py -k dilated`). Here, on
every implementation too: rows kept by no branch, determinism; then the API of both frameworks
(errors, return forms, float64), and that one branch covering the sequence with rate 1 is
`flash_attention` (the engine path through an identity row map).

CPU CI runs the kernels through the Pallas and Triton interpreters at small, awkward shapes; tests
marked `gpu` run the compiled kernels at realistic shapes (make test-gpu)."""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_attn
import torch_ref
import variant_harness as harness
from parity import variants
from parity.tolerance import compare
from parity.variants import FRAMEWORKS
from parity.variants.dilated import _dl_case
from variant_harness import assert_rule, grid_params

RECORD = variants.BY_NAME["dilated"]


# ---------------------------------------------------------------------------------------------
# Every implementation of both frameworks
# ---------------------------------------------------------------------------------------------

KEPT_BY_NONE = [
    # one branch w=4, r=2: head h keeps the rows of parity h mod 2 (GQA: kv heads shared across parities)
    _dl_case("none_w4_r2_gqa_11", (2, 11, 4, 2, 16), (4,), (2,)),
    # S = 3 < r = 4: heads 0-2 keep one row each (one key: out = v), head 3 keeps none
    _dl_case("none_s3_r4_empty_head_fp16", (1, 3, 4, 1, 16), (8,), (4,), "float16", causal=True),
    # head groups: group 0 keeps rows 0, 2, 4 of each segment of 6, group 1 rows 1, 5 of each of 8
    _dl_case("none_head_groups_causal_fp16", (1, 20, 4, 2, 32), (6, 8), (2, 4), "float16", merge="head_groups",
             causal=True),
]


@pytest.mark.parametrize("framework, implementation, case", grid_params(RECORD, KEPT_BY_NONE))
def test_rows_kept_by_no_branch(framework, implementation, case):
    """Rows no branch keeps: out 0, lse -inf, zero dq, no NaN anywhere (with a random cotangent on
    lse, -inf there too), and the rule holds for the case."""
    fast, _, gold = assert_rule(RECORD, framework, implementation, case)
    empty = np.isneginf(gold["lse"]).transpose(0, 2, 1)  # [B, S, H]
    assert empty.any() and not empty.all()
    for name, x in fast.items():
        assert not np.isnan(x).any(), name
    assert (fast["out"][empty] == 0).all() and (fast["dq"][empty] == 0).all()
    lse = fast["lse"].transpose(0, 2, 1)
    assert np.isneginf(lse[empty]).all() and np.isfinite(lse[~empty]).all()
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(fast[name]).all(), name


DETERMINISM = [_dl_case("det_coprime_causal_gqa", (1, 30, 4, 2, 16), (5, 7), (2, 3), causal=True),
               _dl_case("det_head_groups_fp16", (1, 30, 4, 2, 16), (8, 64), (1, 4), "float16", merge="head_groups")]


@pytest.mark.parametrize("framework, implementation, case", grid_params(RECORD, DETERMINISM, include_reference=False))
def test_deterministic(framework, implementation, case):
    """Two runs of forward and backward are bitwise equal (the branches' dq, dk, dv add up in a
    fixed order; GQA groups summed in a fixed order; no atomics)."""
    inputs = RECORD.draw(case)
    first, second = (variants.results(RECORD, framework, implementation, case, case.dtype, inputs, harness.DEVICE)
                     for _ in range(2))
    for name, a, b in zip(RECORD.quantities, first, second):
        np.testing.assert_array_equal(a, b, err_msg=name)


# ---------------------------------------------------------------------------------------------
# One branch over the whole sequence with rate 1 is flash_attention
# ---------------------------------------------------------------------------------------------

def _property_draws(count, seed=2024):
    """Seeded random configurations (B, S, H, Hkv, D, causal, merge, segment >= S, scale, dtype)."""
    rng = np.random.default_rng(seed)
    draws = []
    for i in range(count):
        s = int(rng.integers(1, 90))
        hkv = int(rng.choice([1, 2]))
        h = hkv * int(rng.choice([1, 2, 3]))
        d = int(rng.choice([16, 24, 32, 40, 64]))
        w = s + int(rng.integers(0, 2)) * int(rng.integers(1, 100))  # the sequence or past it
        merge = ("lse", "head_groups")[i // 2 % 2]
        draws.append(pytest.param(int(rng.integers(1, 3)), s, h, hkv, d, bool(i % 2), merge,
                                  w, float(rng.choice([0.1, 0.5, d ** -0.5])), ("float32", "float16")[i % 3 == 2],
                                  id=f"draw{i}"))
    return draws


def _run_pair(framework, implementation, dtype, arrays, causal, scale, dilated):
    """[out, lse, dq, dk, dv] (float64 NumPy) of `flash_attention`, or of `dilated_attention` with the
    keyword arguments `dilated`, through the framework's autodiff with the cotangents of `arrays`."""
    q, k, v, do, dlse = arrays
    extra = {} if dilated is None else dilated
    if framework == "jax":
        fn = jax_attn.flash_attention if dilated is None else jax_attn.dilated_attention
        cast = lambda x: jnp.asarray(x, variants.JAX_DTYPES[dtype])
        f = lambda q, k, v: fn(q, k, v, causal=causal, scale=scale, return_lse=True, implementation=implementation,
                               **extra)
        with variants.numerics("jax", dtype):
            outs, vjp = jax.vjp(jax.jit(f), cast(q), cast(k), cast(v))
            grads = vjp((cast(do), jnp.asarray(dlse, variants.JAX_DTYPES[variants.stat_dtype(dtype)])))
        return [variants.to_numpy(x) for x in (*outs, *grads)]
    fn = torch_ref.flash_attention if dilated is None else torch_ref.dilated_attention
    tdt = variants.TORCH_DTYPES[dtype]
    leaves = [torch.tensor(x, dtype=tdt, device=harness.DEVICE, requires_grad=True) for x in (q, k, v)]
    out, lse = fn(*leaves, causal=causal, scale=scale, return_lse=True, implementation=implementation, **extra)
    grads = torch.autograd.grad((out, lse), leaves, (torch.tensor(do, dtype=tdt, device=harness.DEVICE),
                                                     torch.tensor(dlse, dtype=lse.dtype, device=harness.DEVICE)))
    return [variants.to_numpy(x) for x in (out, lse, *grads)]


@pytest.mark.parametrize("framework, implementation", [("jax", "triton"), ("jax", "xla"), ("torch", "triton"),
                                                       ("torch", "eager")])
@pytest.mark.parametrize("batch, seq_len, heads, kv_heads, head_dim, causal, merge, segment, scale, dtype",
                         _property_draws(4))
def test_single_branch_is_flash_attention(framework, implementation, batch, seq_len, heads, kv_heads, head_dim,
                                          causal, merge, segment, scale, dtype):
    """segment_lengths=(w,), dilation_rates=(1,) with w >= S: one segment, every row kept, so
    dilated attention is `flash_attention` (causal and not, either merge: one branch, offset 0).
    Held to the tolerance rule with flash_attention as the naive run (the same implementation and
    dtype) and its plain reference in float64 as the golden: the dilated path (for "triton" the
    engine through an identity row map, the merge on one branch's statistics, the backward at the
    merged statistics) departs from flash_attention by no more than flash's own rounding."""
    rng = np.random.default_rng(seq_len * 131 + heads)
    arrays = [rng.standard_normal(s) for s in ((batch, seq_len, heads, head_dim), (batch, seq_len, kv_heads, head_dim),
                                               (batch, seq_len, kv_heads, head_dim), (batch, seq_len, heads, head_dim),
                                               (batch, heads, seq_len))]
    dilated = dict(segment_lengths=(segment,), dilation_rates=(1,), merge=merge)
    fast = _run_pair(framework, implementation, dtype, arrays, causal, scale, dilated)
    flash = _run_pair(framework, implementation, dtype, arrays, causal, scale, None)
    gold = _run_pair(framework, variants.REFERENCE[framework], "float64", arrays, causal, scale, None)
    for name, f, n, g in zip(RECORD.quantities, fast, flash, gold):
        verdict = compare(f, n, g, variants.NP_DTYPES[dtype], RECORD.factor(name))
        assert verdict.ok, f"{name}: {verdict}"


# ---------------------------------------------------------------------------------------------
# The API, both frameworks
# ---------------------------------------------------------------------------------------------

def _jax_zeros(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


def _torch_zeros(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, device=harness.DEVICE)


def _call(framework, q_shape, kv_shape, **kw):
    zeros = _jax_zeros if framework == "jax" else _torch_zeros
    fn = jax_attn.dilated_attention if framework == "jax" else torch_ref.dilated_attention
    kv = zeros(*kv_shape)
    return fn(zeros(*q_shape), kv, kv, **kw)


Q, KV = (1, 16, 4, 8), (1, 16, 2, 8)
OK = dict(segment_lengths=(8,), dilation_rates=(2,))
INVALID = [
    # (name, q shape, kv shape, kwargs, exception, message)
    ("q k lengths", Q, (1, 12, 2, 8), OK, ValueError, r"self-attention.*same .*length.*16.*12"),
    ("segment zero", Q, KV, dict(segment_lengths=(8, 0), dilation_rates=(1, 1)), ValueError,
     r"segment_lengths must hold positive ints, got \(8, 0\)"),
    ("segment float", Q, KV, dict(segment_lengths=(8.0,), dilation_rates=(1,)), ValueError,
     r"segment_lengths must hold positive ints"),
    ("segment int", Q, KV, dict(segment_lengths=8, dilation_rates=(1,)), ValueError,
     r"segment_lengths must be a sequence of positive ints, got 8"),
    ("segments empty", Q, KV, dict(segment_lengths=(), dilation_rates=()), ValueError,
     r"segment_lengths must not be empty"),
    ("rate negative", Q, KV, dict(segment_lengths=(8,), dilation_rates=(-2,)), ValueError,
     r"dilation_rates must hold positive ints, got \(-2,\)"),
    ("rate bool", Q, KV, dict(segment_lengths=(8,), dilation_rates=(True,)), ValueError,
     r"dilation_rates must hold positive ints"),
    ("rate past segment", Q, KV, dict(segment_lengths=(4, 8), dilation_rates=(5, 1)), ValueError,
     r"dilation_rates: rate 5 is larger than its segment length 4"),
    ("counts differ", Q, KV, dict(segment_lengths=(4, 8), dilation_rates=(1,)), ValueError,
     r"segment_lengths and dilation_rates must have the same count, got 2 and 1"),
    ("unknown merge", Q, KV, dict(merge="sum", **OK), ValueError,
     r"merge must be one of \('lse', 'head_groups'\), got 'sum'"),
    ("merge None", Q, KV, dict(merge=None, **OK), ValueError, r"merge must be one of"),
    ("head groups 4 heads 3 branches", Q, KV,
     dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), merge="head_groups"), ValueError,
     r"merge='head_groups' .*4 heads.*multiple of the branch count 3"),
    ("head groups fewer heads than branches", (1, 16, 2, 8), KV,
     dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), merge="head_groups"), ValueError,
     r"merge='head_groups' .*2 heads.*branch count 3"),
    ("scale", Q, KV, dict(scale=-1.0, **OK), ValueError, r"scale must be a positive finite number"),
    ("kv heads", Q, (1, 16, 3, 8), OK, ValueError, r"heads in k/v \(3\) must divide heads in q \(4\)"),
]


@pytest.mark.parametrize("name, q_shape, kv_shape, kwargs, exc, match", INVALID, ids=[c[0] for c in INVALID])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_invalid_arguments(framework, name, q_shape, kv_shape, kwargs, exc, match):
    """Errors name the argument and the value, in both frameworks, for every implementation."""
    for implementation in variants.implementations(RECORD, framework):
        with pytest.raises(exc, match=match):
            _call(framework, q_shape, kv_shape, implementation=implementation, **kwargs)


@pytest.mark.parametrize("implementation", ["mosaic", "mosaic_gpu"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_jax_mosaic_refused_where_it_cannot_serve(dtype, implementation):
    """An explicit implementation="mosaic" (the Hopper kernels: 16-bit, head dims 33 to 128, sm90) that
    cannot serve the call is refused with the reason, never a silent fallback: float32 everywhere,
    16-bit off Hopper (CPU: the Pallas interpreter has no Mosaic GPU)."""
    probe = _dl_case("probe", (1, 16, 4, 2, 64), (8,), (2,), dtype)
    reason = variants.unsupported_reason(RECORD, "jax", "mosaic", probe)
    if reason is None:
        pytest.skip("the Mosaic kernels serve this call here (Hopper)")
    q = jnp.zeros((1, 16, 4, 64), variants.JAX_DTYPES[dtype])
    kv = jnp.zeros((1, 16, 2, 64), variants.JAX_DTYPES[dtype])
    with pytest.raises(NotImplementedError, match=r"implementation='mosaic' cannot serve this call: "
                                                  + re.escape(reason)):
        jax_attn.dilated_attention(q, kv, kv, implementation=implementation, **OK)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("implementation", ["cuda", "TRITON", ""])
def test_unknown_implementation(framework, implementation):
    """A name the framework does not know is refused (NotImplementedError and ValueError), naming
    the ones there are; torch_ref has no "mosaic"."""
    names = ", ".join(map(repr, variants.implementations(RECORD, framework)))
    for name in (implementation, *(("mosaic",) if framework == "torch" else ())):
        with pytest.raises(NotImplementedError, match=rf"unknown implementation='{name}'; choose one of None, {names}"):
            _call(framework, Q, KV, implementation=name, **OK)
        with pytest.raises(ValueError):
            _call(framework, Q, KV, implementation=name, **OK)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_config_errors(framework):
    """config= is the engine's tiles (a BlockSizes) for "triton": wrong type, bad values, or a config
    for the plain reference are refused, naming config / the field."""
    block_sizes = jax_attn.BlockSizes if framework == "jax" else torch_ref.BlockSizes
    reference = variants.REFERENCE[framework]
    with pytest.raises(TypeError, match=r"config must be a .*BlockSizes for implementation='triton', got int"):
        _call(framework, Q, KV, implementation="triton", config=3, **OK)
    with pytest.raises(ValueError, match=r"block_q=3 must be a power of two"):
        _call(framework, Q, KV, implementation="triton", config=block_sizes(block_q=3), **OK)
    with pytest.raises(TypeError, match=rf"implementation='{reference}' takes no tile config"):
        _call(framework, Q, KV, implementation=reference, config=block_sizes(), **OK)


def _jax_run(implementation, dtype, arrays, return_lse=True, **kw):
    q, k, v = (jnp.asarray(x, dtype) for x in arrays[:3])
    return jax_attn.dilated_attention(q, k, v, return_lse=return_lse, implementation=implementation, **kw)


def _torch_run(implementation, dtype, arrays, return_lse=True, **kw):
    q, k, v = (torch.tensor(x, dtype=dtype, device=harness.DEVICE) for x in arrays[:3])
    return torch_ref.dilated_attention(q, k, v, return_lse=return_lse, implementation=implementation, **kw)


def _arrays(batch=2, seq_len=21, heads=4, kv_heads=2, head_dim=16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in ((batch, seq_len, heads, head_dim), (batch, seq_len, kv_heads, head_dim),
                                             (batch, seq_len, kv_heads, head_dim))]


CFG = dict(segment_lengths=(5, 8), dilation_rates=(1, 2), causal=True)


@pytest.mark.parametrize("dtype, merge", [("float32", "lse"), ("float16", "head_groups"), ("bfloat16", "lse")])
def test_return_forms(dtype, merge):
    """out [B, S, H, D] in q's dtype; lse [B, H, S] float32; return_lse=False returns out alone,
    the same array (checked in float32). Every implementation of both frameworks that runs the
    dtype here."""
    arrays = _arrays()
    probe = _dl_case("probe", (2, 21, 4, 2, 16), CFG["segment_lengths"], CFG["dilation_rates"], dtype)
    ran = 0
    for framework in FRAMEWORKS:
        for implementation in variants.implementations(RECORD, framework):
            if variants.unsupported_reason(RECORD, framework, implementation, probe, harness.DEVICE):
                continue
            run = _jax_run if framework == "jax" else _torch_run
            dt = (variants.JAX_DTYPES if framework == "jax" else variants.TORCH_DTYPES)[dtype]
            out, lse = run(implementation, dt, arrays, merge=merge, **CFG)
            assert tuple(out.shape) == (2, 21, 4, 16) and tuple(lse.shape) == (2, 4, 21)
            assert out.dtype == dt and lse.dtype == (jnp.float32 if framework == "jax" else torch.float32)
            if dtype == "float32":
                alone = run(implementation, dt, arrays, False, merge=merge, **CFG)
                assert isinstance(alone, jax.Array if framework == "jax" else torch.Tensor)
                np.testing.assert_array_equal(variants.to_numpy(alone), variants.to_numpy(out))
            ran += 1
    assert ran >= 3


@pytest.mark.parametrize("merge", ["lse", "head_groups"])
def test_float64_through_the_references(merge):
    """float64 runs through "xla" (under jax.enable_x64) and "eager": out and lse in float64, the
    two frameworks equal to 1e-12; "triton" refuses float64, saying which implementation serves it."""
    arrays = _arrays(seed=3)
    with jax.enable_x64(True):
        out, lse = _jax_run("xla", jnp.float64, arrays, merge=merge, **CFG)
        assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
        with pytest.raises(NotImplementedError, match=r"implementation='triton' cannot serve .*float64.*'xla'"):
            _jax_run("triton", jnp.float64, arrays, merge=merge, **CFG)
    t_out, t_lse = _torch_run("eager", torch.float64, arrays, merge=merge, **CFG)
    assert t_out.dtype == torch.float64 and t_lse.dtype == torch.float64
    with pytest.raises(NotImplementedError, match=r"implementation='triton' cannot serve this call: .*float64"):
        _torch_run("triton", torch.float64, arrays, merge=merge, **CFG)
    np.testing.assert_allclose(np.asarray(out), variants.to_numpy(t_out), rtol=0, atol=1e-12)
    lse, t_lse = np.asarray(lse), variants.to_numpy(t_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(t_lse))
    finite = np.isfinite(lse)
    np.testing.assert_allclose(lse[finite], t_lse[finite], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Compiled kernels at realistic shapes (make test-gpu)
# ---------------------------------------------------------------------------------------------

def _require_gpu(framework):
    if framework == "jax":
        assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    else:
        assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
        assert os.environ.get("TRITON_INTERPRET", "0") != "1", "gpu tests must run compiled kernels"


GPU_CASES = [
    _dl_case("gpu_bf16_lse_causal_s1000_gqa", (2, 1000, 8, 4, 64), (128, 256, 512), (1, 2, 4), "bfloat16",
             merge="lse", causal=True, gpu=True),
    # four branches: head_groups splits the 8 heads in pairs
    _dl_case("gpu_bf16_head_groups_causal_s1000_gqa", (2, 1000, 8, 4, 64), (128, 256, 512, 1000), (1, 2, 4, 8),
             "bfloat16", merge="head_groups", causal=True, gpu=True),
    # rates 2 and 8 with offsets h mod r: rows of odd offset in their segments kept by no branch for some heads
    _dl_case("gpu_bf16_rows_kept_by_none", (2, 1000, 8, 4, 64), (4, 256), (2, 8), "bfloat16", gpu=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("framework, implementation, case", grid_params(RECORD, GPU_CASES, include_reference=False))
def test_gpu_against_golden_and_deterministic(framework, implementation, case):
    """bf16 B=2, S=1000, H=8, Hkv=4, D=64, both merges: the rule against the float64 golden on
    out, lse, dq, dk, dv; no NaN; a second run bitwise equal."""
    _require_gpu(framework)
    fast, _, _ = assert_rule(RECORD, framework, implementation, case)
    for name, x in fast.items():
        assert not np.isnan(x).any(), name
    again = variants.results(RECORD, framework, implementation, case, case.dtype, RECORD.draw(case), harness.DEVICE)
    for name, a in zip(RECORD.quantities, again):
        np.testing.assert_array_equal(a, fast[name], err_msg=name)
