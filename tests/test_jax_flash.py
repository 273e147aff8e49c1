"""jax_attn.flash_attention: the Pallas engine against the float64 golden (tolerance rule of
parity/tolerance.py), masks, fully masked rows, planted NaN/inf, determinism, input errors.

CPU CI runs the kernels through the Pallas interpreter at small, awkward shapes; tests marked
`gpu` run the compiled kernels at realistic shapes (make test-gpu on an H100/H200)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_attn
from jax_attn import flash_attention
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare
from jax_golden import NP_DTYPE, _golden, _inputs, _run, check_against_golden

# (batch, Sq, Sk, Hq, Hkv, D): the awkward lengths and head dims of CONVENTIONS.md.
SHAPES = [
    (1, 1, 19, 2, 2, 16),  # one query
    (2, 17, 17, 2, 1, 40),
    (1, 31, 47, 6, 2, 59),
    (1, 65, 129, 4, 1, 64),
    (1, 113, 203, 2, 2, 72),
    (1, 47, 31, 2, 2, 128),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_shapes_fp32(shape, causal):
    if causal and shape[1] == 1:  # causal single query = one visible key: test_single_visible_key
        shape = (shape[0], 2, *shape[2:])
    check_against_golden(shape, causal=causal)


def test_single_visible_key():
    """Rows with exactly one visible key: out = v exactly, dq = 0 mathematically. The golden and
    the autodiff reference give exact zeros there, so the rounding floor is 0 and the rule cannot
    judge dq; it is bounded here by the rounding of its two O(1) terms (dp and delta) instead."""
    rng = np.random.default_rng(11)
    q, k, v, do = _inputs(rng, 1, 9, 9, 2, 2, 16)
    out, lse, dq, dk, dv = _run(q, k, v, do, jnp.float32, "pallas_triton", window=(0, 0))
    np.testing.assert_array_equal(out, np.asarray(jnp.asarray(v, jnp.float32), np.float64))
    terms = np.abs(do).max() * np.abs(v).max() * q.shape[-1] * np.abs(k).max() * q.shape[-1] ** -0.5
    assert np.abs(dq).max() <= 4 * np.finfo(np.float32).eps * terms
    single = _run(q[:, :1], k, v, do[:, :1], jnp.float32, "pallas_triton", causal=True)
    np.testing.assert_array_equal(single[0][:, 0], np.asarray(jnp.asarray(v[:, 0], jnp.float32), np.float64))


@pytest.mark.parametrize("shape", [(1, 65, 129, 4, 1, 64), (2, 31, 47, 6, 2, 40)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp16(shape):
    check_against_golden(shape, dtype=jnp.float16, causal=True)


def _packed_ids(rng, batch, length, num_segments):
    cuts = np.sort(rng.choice(np.arange(1, length), size=num_segments - 1, replace=False))
    ids = np.zeros((batch, length), np.int32)
    for c in cuts:
        ids[:, c:] += 1
    return jnp.asarray(ids)


MASKS = {
    "window": dict(window=(9, 4)),
    "window_causal": dict(window=(20, 3), causal=True),
    "window_zero_left": dict(window=(0, 5)),
    "softcap": dict(softcap=3.0),
    "softcap_causal_window": dict(softcap=2.0, causal=True, window=(16, 0)),
    "scale": dict(scale=0.3, causal=True),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_masks(name):
    check_against_golden((1, 71, 71, 4, 2, 32), **MASKS[name])


@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids_packed(causal):
    ids = _packed_ids(np.random.default_rng(1), 2, 90, 4)
    check_against_golden((2, 90, 90, 4, 2, 32), causal=causal, segment_ids=ids, window=(40, 40))


def test_segment_ids_pair_unsorted():
    rng = np.random.default_rng(2)
    q_ids = jnp.asarray(rng.integers(0, 3, (1, 37)), jnp.int32)
    kv_ids = jnp.asarray(rng.integers(0, 3, (1, 70)), jnp.int32)
    check_against_golden((1, 37, 70, 2, 1, 16), segment_ids=(q_ids, kv_ids), softcap=4.0)


def test_fully_masked_rows_are_zero_without_nan():
    # Queries with id 7 find no key; window (2, 0) leaves rows i >= Sk + 2 without keys too.
    q_ids = jnp.asarray(np.r_[np.zeros(20), np.full(13, 7)][None], jnp.int32)
    kv_ids = jnp.zeros((1, 25), jnp.int32)
    fast, _ = check_against_golden((1, 33, 25, 2, 2, 32), segment_ids=(q_ids, kv_ids))
    out, lse, dq = fast[0], fast[1], fast[2]
    assert np.all(out[:, 20:] == 0) and np.all(lse[:, :, 20:] == -np.inf) and np.all(dq[:, 20:] == 0)
    fast, _ = check_against_golden((1, 50, 30, 2, 1, 16), window=(2, 0))
    out, lse, dq = fast[0], fast[1], fast[2]
    assert np.all(out[:, 32:] == 0) and np.all(lse[:, :, 32:] == -np.inf) and np.all(dq[:, 32:] == 0)
    assert not any(np.isnan(x).any() for x in fast)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_padding_poison_does_not_leak(dtype):
    """finfo.max in masked keys/values/queries and NaN in whole key blocks no query visits
    must not reach the real rows' outputs or gradients."""
    rng = np.random.default_rng(3)
    real_q, real_k, q_len, kv_len = 40, 50, 48, 128
    q, k, v, do = _inputs(rng, 1, q_len, kv_len, 2, 1, 32)
    big = float(np.finfo(NP_DTYPE[dtype]).max)
    q_ids = np.r_[np.zeros(20), np.ones(real_q - 20), np.full(q_len - real_q, -1)][None]
    kv_ids = np.r_[np.zeros(25), np.ones(real_k - 25), np.full(kv_len - real_k, -2)][None]
    q[:, real_q:], k[:, real_k:], v[:, real_k:] = big, big, big
    k[:, 64:], v[:, 64:] = np.nan, np.nan  # whole key blocks only padding queries would face
    ids = (jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32))
    clean = [x.copy() for x in (q, k, v)]
    for x, n in zip(clean, (real_q, real_k, real_k)):
        x[:, n:] = 0.0
    golden = _golden(*clean, do, segment_ids=ids)
    fast = _run(q, k, v, do, dtype, "pallas_triton", segment_ids=ids)
    naive = _run(*clean, do, dtype, "xla", segment_ids=ids)
    real = {"out": real_q, "lse": real_q, "dq": real_q, "dk": real_k, "dv": real_k}
    for (name, n), f, nv, g in zip(real.items(), fast, naive, golden):
        axis = 2 if name == "lse" else 1
        sl = lambda x: np.take(x, np.arange(n), axis=axis)
        factor = FORWARD_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR
        verdict = compare(sl(f), sl(nv), sl(g), NP_DTYPE[dtype], factor)
        assert verdict.ok, f"{name}: {verdict}"
    assert np.all(fast[0][:, real_q:] == 0)  # padding queries see no key


def test_lse_is_differentiable():
    """The lse output carries gradient: d lse_i / d s_ij = p_ij."""
    rng = np.random.default_rng(4)
    q, k, v, _ = _inputs(rng, 1, 40, 40, 2, 2, 16)
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


def test_deterministic_bitwise():
    rng = np.random.default_rng(5)
    q, k, v, do = _inputs(rng, 1, 70, 70, 4, 2, 32)
    runs = [_run(q, k, v, do, jnp.float32, "pallas_triton", causal=True) for _ in range(2)]
    for a, b in zip(*runs):
        assert np.array_equal(a, b, equal_nan=False)


def test_jit_and_default_implementation():
    rng = np.random.default_rng(6)
    q, k, v, _ = _inputs(rng, 1, 20, 20, 2, 2, 16)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    assert jax_attn.default_implementation() == "pallas_triton"  # CPU: Pallas interpreter
    out = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True))(q, k, v)
    ref = flash_attention(q, k, v, causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Bad inputs: each error names the argument; the boundary case passes.
# ---------------------------------------------------------------------------------------------

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


def test_boundary_inputs_pass():
    # head dim 256, GQA ratio 8, a zero window side, a pair of ids with Sq != Sk: all valid.
    check_against_golden((1, 20, 24, 8, 1, 256), window=(0, 3),
                         segment_ids=(jnp.zeros((1, 20), jnp.int32), jnp.zeros((1, 24), jnp.int32)))


# ---------------------------------------------------------------------------------------------
# Compiled kernels on an NVIDIA GPU (make test-gpu).
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    ((2, 1024, 1024, 8, 8, 128), jnp.bfloat16, dict(causal=True)),
    ((2, 1024, 1024, 8, 8, 128), jnp.float16, {}),
    ((1, 2000, 3001, 8, 2, 64), jnp.bfloat16, dict(window=(256, 64))),
    ((2, 777, 777, 6, 2, 72), jnp.bfloat16, dict(causal=True, softcap=20.0)),
    ((1, 1537, 1537, 4, 1, 256), jnp.bfloat16, dict(causal=True)),
    ((1, 513, 513, 4, 4, 40), jnp.float32, dict(causal=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype, kw", GPU_CASES, ids=lambda x: str(x))
def test_gpu_compiled(shape, dtype, kw):
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    check_against_golden(shape, dtype=dtype, **kw)


@pytest.mark.gpu
def test_gpu_segments_and_determinism():
    assert jax.default_backend() == "gpu"
    ids = _packed_ids(np.random.default_rng(8), 2, 2048, 5)
    check_against_golden((2, 2048, 2048, 8, 2, 128), dtype=jnp.bfloat16, causal=True, segment_ids=ids)
    rng = np.random.default_rng(9)
    q, k, v, do = _inputs(rng, 2, 1024, 1024, 8, 2, 128)
    runs = [_run(q, k, v, do, jnp.bfloat16, "pallas_triton", causal=True) for _ in range(2)]
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
