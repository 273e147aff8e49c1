"""Stick-breaking attention (ExpoSB, `stick_breaking_attention`), both frameworks.

One shared test body (`test_against_golden`) runs every implementation of both frameworks
(`parity.variants.stick_breaking`'s record: JAX triton / mosaic / xla, torch triton / eager, each
where it serves the case here) on the record's awkward-shape grid against the float64 golden,
with the tolerance rule on out, rem, dq, dk, dv and d decay. Then what is one framework's own:
the JAX kernels' internals (spent-stick skipping, gradient units, tiles, the Mosaic forward's
lowering), the torch kernels' tiles, the definitions, input errors, planted garbage.

CPU CI runs the kernels through the Pallas and Triton interpreters at small, awkward shapes
(`slow`: the larger ones); tests marked `gpu` run the compiled kernels at realistic shapes."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_ref
from jax_attn import Rope, stick_breaking_attention
from jax_golden import NP_DTYPE
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare
from torch_golden import BF16, DEVICE, F16, F32, F64, _np_dtype, _to, randn_inputs
from torch_ref import UnknownImplementationError, stick_breaking_reference
from torch_ref import Rope as TorchRope
from torch_ref import stick_breaking_attention as torch_stick_breaking_attention


# ---------------------------------------------------------------------------------------------
# JAX only
# ---------------------------------------------------------------------------------------------

NAMES = ("out", "rem", "dq", "dk", "dv", "ddecay")


def _draw(seed, batch, seq_len, heads, kv_heads, head_dim, quiet=(), scale=1.0, loud=()):
    """q, k, v, dout, drem ~ N(0, 1). The rows `quiet` ((head, row) pairs) see logits of -5 (+ the
    decay's): their q is -5 / scale on the last feature, where every key is 1. The cotangents of
    the rows `loud` ((head, first row) pairs: that row and those after it) are times 2^13."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, seq_len, heads, head_dim), (batch, seq_len, kv_heads, head_dim),
              (batch, seq_len, kv_heads, head_dim), (batch, seq_len, heads, head_dim), (batch, heads, seq_len)]
    arrays = [rng.standard_normal(s) for s in shapes]
    for head, row in quiet:
        arrays[0][:, row, head] = np.eye(head_dim)[-1] * (-5.0 / scale)
        arrays[1][..., -1] = 1.0
    for head, row in loud:
        arrays[3][:, row:, head] *= 2.0 ** 13
        arrays[4][:, head, row:] *= 2.0 ** 13
    return arrays


def _jax_run(arrays, dtype, decay, implementation, **kw):
    """out, rem and the gradients of q, k, v, decay (cotangents dout and drem), float64 NumPy."""
    q, k, v, do, drem = arrays
    cast = lambda x: jnp.asarray(x, dtype)
    decay_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    f = lambda q, k, v, d: stick_breaking_attention(q, k, v, decay=d, return_remainder=True,
                                                    implementation=implementation, **kw)
    (out, rem), vjp = jax.vjp(f, cast(q), cast(k), cast(v), jnp.asarray(decay, decay_dtype))
    grads = vjp((cast(do), jnp.asarray(drem, rem.dtype)))
    return [np.asarray(x, np.float64) for x in (out, rem, *grads)]


def check(shape, dtype=jnp.float32, decay=0.0, seed=0, implementation="pallas_triton", held=NAMES, quiet=(),
          times=1.0, loud=(), **kw):
    """Every quantity finite; those in `held` within the tolerance rule of the float64 golden.
    `times` (a power of two): ours run on the cotangents times that, their gradients divided back.
    -> ours, the plain path's and the golden's results (out, rem, dq, dk, dv, d decay)."""
    arrays = _draw(seed, *shape, quiet=quiet, scale=kw.get("scale", 1.0), loud=loud)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        golden = _jax_run(arrays, jnp.float64, decay, "xla", **kw)
    with jax.default_matmul_precision("highest"):
        naive = _jax_run(arrays, dtype, decay, "xla", **kw)
        fast = _jax_run([*arrays[:3], arrays[3] * times, arrays[4] * times], dtype, decay, implementation, **kw)
    fast = fast[:2] + [x / times for x in fast[2:]]  # out and rem do not see the cotangents
    for name, f, n, g in zip(NAMES, fast, naive, golden):
        assert np.isfinite(f).all(), f"{name}: not finite"
        if name not in held:
            continue
        factor = FORWARD_FACTOR if name in ("out", "rem") else GRADIENT_FACTOR
        verdict = compare(f, n, g, NP_DTYPE[dtype], factor)
        assert verdict.ok, f"{name}: {verdict}"
    return fast, naive, golden


def _check_huge_logits(dtype, implementation):
    """Logits past fp16's range (scale 3000: |z| up to ~1e5 in base 2): the 16-bit terms of the
    in-tile softplus sums are capped (SP_CAP), not rounded to inf, whose products with the
    triangle's zeros were NaN in out and dq. The forward and dv hold the tolerance rule. Every
    row is saturated, so the true dq, dk and d decay are ~1e-31: ours are finite but not that
    small (log sigmoid(z) = z - softplus(z) errs by eps |z| on the query-major tiles, times the
    scale 3000), so they are only checked for finiteness."""
    check((1, 128, 2, 2, 64), dtype=dtype, decay=0.02, implementation=implementation, scale=3000.0,
          held=("out", "rem", "dv"))


def test_fp16_huge_logits():
    _check_huge_logits(jnp.float16, "pallas_triton")


def _check_huge_cotangents(shape, dtype, implementation="pallas_triton"):
    """dO and drem times 2^13 (fp16 loss scaling's range): dA = dO . v passed 65504, and the
    in-tile g sums, whose terms are fp16, were inf and dq, dk NaN, until the gradient units
    (`_gradient_unit`). The gradients scale with the cotangents: ours / 2^13 hold the golden's
    rule for the cotangents as drawn."""
    times = 2.0 ** 13
    _, _, golden = check(shape, dtype=dtype, decay=[0.0, 0.01, 0.05, 0.1], times=times,
                         implementation=implementation)
    assert max(np.abs(g).max() for g in golden[2:5]) * times > 2 ** 14, "the gradients should be large"


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_jax_huge_cotangents(dtype):
    _check_huge_cotangents((1, 80, 4, 2, 64), dtype)


def test_xla_huge_cotangents():
    """The plain-jnp path on the same fp16 cotangents: its A v product's cotangent dO . v passed
    65504 in fp16 (dq, dk not finite) until it took that product in fp32."""
    _check_huge_cotangents((1, 80, 4, 2, 64), jnp.float16, "xla")


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["pallas_triton", "mosaic_gpu"])  # max |v|: its forward's, XLA's
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_gpu_huge_cotangents(dtype, implementation):
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    _check_huge_cotangents((1, 1024, 4, 2, 128), dtype, implementation)


def _check_mixed_cotangents(shape, dtype):
    """Cotangents of very different sizes under one kv head (GQA: heads 0 and 1 share it): head 1's
    rows and head 0's second half times 2^13. The dQ programs of head 0's first half then run at
    unit 1, the others and the kv head's dK/dV programs at a smaller one (`_gradient_unit`), and
    the g sums pass between them scaled back. Held against the golden on the same cotangents, and
    head 0's first half's dq on its own, which the loud rows' errors would hide."""
    half = shape[1] // 2
    fast, naive, golden = check(shape, dtype=dtype, decay=[0.0, 0.01, 0.05, 0.1], loud=((0, half), (1, 0)))
    assert np.abs(golden[2][0, half:, 0]).max() > 2 ** 14, "the loud rows' gradients should be large"
    first_half = lambda x: x[0, :half, 0]  # head 0's rows at unit 1
    verdict = compare(*(first_half(x[2]) for x in (fast, naive, golden)), NP_DTYPE[dtype], GRADIENT_FACTOR)
    assert verdict.ok, f"dq of head 0's first half: {verdict}"


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_mixed_cotangents(dtype):
    _check_mixed_cotangents((1, 96, 4, 2, 64), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_gpu_mixed_cotangents(dtype):
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    _check_mixed_cotangents((1, 1024, 4, 2, 128), dtype)


def _check_skipping(shape, dtype, decay, scale, quiet, rope=None, forward="pallas_triton"):
    """The kernels skip the tiles of spent sticks (`_Static.spent`): out, rem and every gradient
    equal the dense walk's bit for bit, and hold the rule of the golden. The `quiet` rows (logits
    -5, in heads of decay 0) never spend their sticks (a key's softplus is 0.0067 nats) and their
    far keys' A stay ~1e-3, so a tile of theirs left out shows in dk and dv. Without RoPE (S a
    tile multiple, D a power of two) returns the forward's spent key blocks per row [Hq, S] and
    how many steps each dK/dV program walked from its list (`_spent_bounds`) [Hkv, key blocks]."""
    from jax_attn.ops.common.spec import AttentionSpec
    from jax_attn.ops.stick_breaking.triton import _spent_bounds, _Static, _stick_breaking_fwd
    from jax_attn.ops.stick_breaking.triton import default_stick_breaking_block_sizes, stick_breaking_pallas

    check(shape, dtype=dtype, decay=decay, scale=scale, rope=rope, implementation=forward, quiet=quiet)
    q, k, v, do, drem = (jnp.asarray(x, dtype) for x in _draw(0, *shape, quiet=quiet, scale=scale))
    decay = jnp.asarray(decay, jnp.float32)
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    spec = AttentionSpec(scale=scale, causal=True, rope=rope, precision=precision)

    def run(skip):
        f = lambda *a: stick_breaking_pallas(*a, spec, forward=forward, skip_spent=skip)
        outs, vjp = jax.vjp(f, q, k, v, decay)
        return [*outs, *vjp((do, drem.astype(jnp.float32)))]

    for name, skipped, dense in zip(NAMES, run(True), run(False)):
        np.testing.assert_array_equal(skipped, dense, err_msg=name)
    if rope is None:
        interpret = jax.default_backend() == "cpu"
        blocks = default_stick_breaking_block_sizes(shape[-1], interpret, dtype)
        st = _Static(spec, blocks, interpret, jnp.dtype(dtype), mosaic=forward == "mosaic_gpu")
        _, (*_, spent, _v_max, _seg) = _stick_breaking_fwd(st, q, k, v, decay, None)  # (the residuals)
        group = shape[2] // shape[3]
        _, bounds, _ = _spent_bounds(spent, blocks.block_q, blocks.block_q_dkv, group, blocks.block_k)
        return np.asarray(spent)[0], np.asarray(bounds)[0, :, 1, :shape[1] // blocks.block_k]


@pytest.mark.parametrize("dtype, rope", [(jnp.float32, None), (jnp.float16, Rope(base=500.0, style="half"))],
                         ids=["fp32", "fp16_rope"])
def test_spent_sticks_are_skipped_exactly(dtype, rope):
    """Logits ~ N(0, 5.7^2) (scale 1): a key's softplus is ~2.3 nats, so a row's stick is spent
    after ~50 keys (A < 2^-152, zero in fp32) and the kernels skip the tiles left of that."""
    found = _check_skipping((1, 208, 4, 2, 32), dtype, [0.0, 0.01, 0.0, 0.1], 1.0, [(0, 150), (0, 200)], rope)
    if rope is None:  # tiles were skipped: heads 0-2 spend from row ~80 on (blocks of 16 keys);
        # head 3's decay (0.1) keeps far keys' softplus tiny, and the quiet rows 150 and 200 of head 0
        spent, listed = found
        assert (spent[:3, 96:] > 0).mean() > 0.95 and spent[:3, -1].min() >= 6, spent
        assert spent[0, [150, 200]].max() == 0, spent
        # the first key blocks' dK/dV programs walked (at least) the quiet rows' steps from their lists
        assert listed[:, :2].min() >= 2, listed


def test_spent_bounds_walk_exactly_the_needed_steps():
    """`_spent_bounds` against a plain enumeration: each dK/dV program walks, past the diagonal's
    steps, exactly the steps (query block, group head) with a row not spent at its key block,
    each once and in order; each dQ block starts at its rows' first needed key block."""
    from jax_attn.ops.stick_breaking.triton import _spent_bounds

    batch, heads, group, seq, bq, bq_dkv, bk = 2, 4, 2, 512, 64, 32, 64
    rng = np.random.default_rng(0)
    rows = np.arange(seq)
    reach = rng.integers(100, 300, (batch, heads, seq))  # a row spends its stick this far left
    spent = np.maximum(rows - reach, 0) // bk
    spent[rng.random(spent.shape) < 0.03] = 0  # rows that never spend theirs
    first, bounds, extras = (np.asarray(x) for x in _spent_bounds(jnp.asarray(spent, jnp.int32), bq, bq_dkv, group, bk))
    num_q, num_k = seq // bq_dkv, seq // bk
    np.testing.assert_array_equal(first[..., :seq // bq], spent.reshape(batch, heads, -1, bq).min(axis=3))
    needs = spent.reshape(batch, heads // group, group, num_q, bq_dkv).min(axis=4).swapaxes(2, 3)
    needs = needs.reshape(batch, heads // group, num_q * group)
    listed_somewhere = 0
    for b, h, j in np.ndindex(batch, heads // group, num_k):
        full = min((j * bk + bk - 1) // bq_dkv + 1, num_q) * group
        near, count = bounds[b, h, :, j]
        walked = [*range(full, near), *extras[b, h, j, :count]]
        expected = [s for s in range(full, num_q * group) if needs[b, h, s] <= j]
        assert walked == expected, (b, h, j)
        listed_somewhere += count > 0
    assert listed_somewhere >= 4, listed_somewhere  # lists were used (7 of the 32 programs), not only contiguous walks


@pytest.mark.gpu
@pytest.mark.parametrize("forward", ["pallas_triton", "mosaic_gpu"])
def test_gpu_spent_sticks_are_skipped_exactly(forward):
    """bf16, logits ~ N(0, 1), decay 0 or 0.01: rows spend their sticks (A < 2^-128, which
    ex2.approx.ftz flushes to 0) some 150 to 300 keys left of them, so most tiles are skipped;
    bit-equal to the dense walk (both forwards; the backward is the Triton kernels')."""
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    quiet = [(0, 1500), (0, 2000), (2, 1800)]
    spent, listed = _check_skipping((1, 2048, 4, 2, 128), jnp.bfloat16, [0.0, 0.01, 0.0, 0.01], 128 ** -0.5,
                                    quiet, forward=forward)
    assert (spent[:, 512:] > 0).mean() > 0.95 and spent[:, -1].min() >= 20, spent  # of 32 blocks of 64 keys
    assert spent[0, [1500, 2000]].max() == 0 and spent[2, 1800] == 0, spent
    assert listed[:, :16].min() >= 1, listed  # the quiet rows' steps, from the dK/dV walks' lists


def test_definition_and_edge_rows():
    """Against a direct product-of-sticks loop; row 0 gets out 0, rem 1, no NaN anywhere."""
    q, k, v, _, _ = _draw(3, 1, 9, 1, 1, 16)
    lam, scale = 0.2, 0.25
    with jax.default_matmul_precision("highest"):
        out, rem = stick_breaking_attention(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                            jnp.asarray(v, jnp.float32), scale=scale, decay=lam,
                                            return_remainder=True)
    q, k, v = q[0, :, 0], k[0, :, 0], v[0, :, 0]
    for i in range(9):
        beta = [1 / (1 + np.exp(-(scale * q[i] @ k[j] - lam * (i - j)))) for j in range(i)]
        weights = [beta[j] * np.prod([1 - beta[m] for m in range(j + 1, i)]) for j in range(i)]
        expected = sum((w * v[j] for j, w in enumerate(weights)), np.zeros(16))
        np.testing.assert_allclose(np.asarray(out)[0, i, 0], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(rem[0, 0, i]), 1 - sum(weights), rtol=1e-5, atol=1e-6)
    assert float(rem[0, 0, 0]) == 1.0 and not np.any(np.asarray(out)[0, 0])


def test_scalar_decay_gradient_is_the_sum_over_heads():
    arrays = _draw(4, 1, 24, 4, 2, 16)
    with jax.default_matmul_precision("highest"):
        per_head = _jax_run(arrays, jnp.float32, [0.1] * 4, "pallas_triton")[-1]
        scalar = _jax_run(arrays, jnp.float32, 0.1, "pallas_triton")[-1]
    assert scalar.shape == ()
    # one compensated sum over every head's rows (~1 ulp), against the per-head ones (~1 ulp each)
    bound = 2 * np.spacing(np.float32(abs(scalar))) + 2 * np.spacing(np.abs(per_head).astype(np.float32)).sum()
    assert abs(scalar - per_head.sum()) <= bound, (scalar, per_head)


def test_jax_deterministic():
    arrays = _draw(5, 1, 48, 4, 2, 32)
    first = _jax_run(arrays, jnp.float32, 0.1, "pallas_triton")
    second = _jax_run(arrays, jnp.float32, 0.1, "pallas_triton")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_jit_with_learnable_decay():
    q = jnp.ones((1, 20, 2, 16), jnp.float32)
    loss = lambda d: stick_breaking_attention(q, q, q, decay=d).sum()
    grad = jax.jit(jax.grad(loss))(jnp.asarray([0.1, 0.2]))
    assert grad.shape == (2,) and np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("kw, error, match", [
    (dict(decay=-0.1), ValueError, "decay must be finite and >= 0"),
    (dict(decay=np.zeros(3, np.float32)), ValueError, r"decay must be a scalar or have shape \[Hq\]"),
    (dict(decay=np.zeros(4, np.int32)), TypeError, "decay must have a floating dtype"),
    (dict(decay="0.1"), TypeError, "decay must be a float"),
    (dict(rope="interleaved"), TypeError, "rope must be a jax_attn.Rope"),
    (dict(positions=np.zeros((1, 8), np.int32)), ValueError, "positions are given but rope is None"),
    (dict(scale=0.0), ValueError, "scale must be a positive"),
    (dict(scale=jnp.float32(0.5)), TypeError, "scale must be a Python number"),
    (dict(implementation="cudnn"), NotImplementedError, "unknown implementation"),
    (dict(causal=False), TypeError, "causal"),
    (dict(attend_current=1), TypeError, "attend_current must be a bool, got attend_current=1"),
    (dict(segment_ids=np.zeros((1, 8), np.float32)), TypeError, "q segment_ids must be an integer array"),
    (dict(segment_ids=np.zeros((1, 7), np.int32)), ValueError, r"q segment_ids must have shape \(1, 8\)"),
    (dict(segment_ids=(np.zeros((1, 8), np.int32),)), ValueError, "segment_ids as a pair"),
], ids=["negative_decay", "decay_shape", "decay_int", "decay_str", "rope_type", "positions_without_rope",
        "scale", "scale_array", "implementation", "non_causal", "attend_current_int", "segment_ids_float",
        "segment_ids_shape", "segment_ids_single_item"])
def test_jax_bad_inputs(kw, error, match):
    x = jnp.ones((1, 8, 4, 16), jnp.float32)
    with pytest.raises(error, match=match):
        stick_breaking_attention(x, x, x, **kw)


def test_bad_shapes():
    x = jnp.ones((1, 8, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"last Sq positions of the keys: Sq <= Sk needed, got q.shape=\(1, 9"):
        stick_breaking_attention(jnp.ones((1, 9, 4, 16)), x, x)
    assert stick_breaking_attention(x[:, :7], x, x, implementation="xla").shape == (1, 7, 4, 16)  # Sq < Sk: served
    with pytest.raises(ValueError, match="a single segment_ids array needs Sq == Sk"):
        stick_breaking_attention(x[:, :7], x, x, segment_ids=np.zeros((1, 7), np.int32))
    with pytest.raises(ValueError, match="a single positions array needs Sq == Sk"):
        stick_breaking_attention(x[:, :7], x, x, rope=Rope(), positions=np.zeros((1, 7), np.int32))
    with pytest.raises(ValueError, match="must divide"):
        stick_breaking_attention(x, jnp.ones((1, 8, 3, 16)), jnp.ones((1, 8, 3, 16)))
    with pytest.raises(ValueError, match="head dim must be even for RoPE"):
        y = jnp.ones((1, 8, 2, 15))
        stick_breaking_attention(y, y, y, rope=Rope())
    with pytest.raises(ValueError, match="unknown rope style"):
        Rope(style="neox")


def test_bad_blocks():
    from jax_attn import StickBreakingBlockSizes
    with pytest.raises(ValueError, match=r"StickBreakingBlockSizes.block_k=48 must be a power of two"):
        StickBreakingBlockSizes(64, 48)
    with pytest.raises(ValueError, match=r"StickBreakingBlockSizes.num_stages_dkv=0 must be >= 1"):
        StickBreakingBlockSizes(num_stages_dkv=0)


@pytest.mark.parametrize("head_dim, group, attend_current", [(128, 2, False), (64, 1, False), (64, 2, True)])
def test_mosaic_forward_lowers_for_cuda(head_dim, group, attend_current):
    """No interpreter runs Mosaic GPU kernels: the forward and its gradient (the Triton backward
    reading the Mosaic forward's sums) are lowered for CUDA, which traces both kernels."""
    from jax_attn.ops.common.spec import AttentionSpec
    from jax_attn.ops.stick_breaking.triton import _stick_breaking, _Static, default_stick_breaking_block_sizes

    spec = AttentionSpec(scale=head_dim ** -0.5, causal=True)
    st = _Static(spec, default_stick_breaking_block_sizes(head_dim, False, jnp.bfloat16), False, jnp.dtype(jnp.bfloat16),
                 mosaic=True, attend_current=attend_current)
    q = jax.ShapeDtypeStruct((2, 256, 2 * group, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, head_dim), jnp.bfloat16)
    decay = jax.ShapeDtypeStruct((2 * group,), jnp.float32)
    loss = lambda *a: sum(x.astype(jnp.float32).sum() for x in _stick_breaking(st, *a, None))
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, kv, kv, decay).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text and "stick_breaking_bwd_dkdv" in text


def test_options_lower_for_cuda():
    """The compiled Triton path, which the interpreter does not take: forward, dQ and dK/dV with
    segment ids, Sq < Sk and attend_current lower to Triton for CUDA (bf16; fp16 and fp32 lower
    alike, checked when they were built)."""
    from jax_attn.ops.common.spec import AttentionSpec
    from jax_attn.ops.stick_breaking.triton import stick_breaking_pallas

    spec = AttentionSpec(scale=0.2, causal=True, has_segments=True, offset=223)
    q, kv = (jax.ShapeDtypeStruct((2, n, h, 64), jnp.bfloat16) for n, h in ((77, 4), (300, 2)))
    ids = (jax.ShapeDtypeStruct((2, 77), jnp.int32), jax.ShapeDtypeStruct((2, 300), jnp.int32))

    def loss(q, k, v, decay, q_ids, kv_ids):
        out, rem = stick_breaking_pallas(q, k, v, decay, spec, q_ids=q_ids, kv_ids=kv_ids, attend_current=True,
                                         interpret=False)
        return out.astype(jnp.float32).sum() + rem.sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    text = grad.trace(q, kv, kv, jax.ShapeDtypeStruct((4,), jnp.float32), *ids).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3  # forward, dQ, dK/dV


@pytest.mark.parametrize("dtype, kw, match", [
    (jnp.bfloat16, dict(rope=Rope()), "does not serve RoPE"),
    (jnp.float32, {}, "float16 or bfloat16"),
    (jnp.bfloat16, {}, "need a Hopper"),
    (jnp.bfloat16, dict(segment_ids=np.zeros((1, 8), np.int32)), "does not serve segment ids"),
    (jnp.bfloat16, dict(q_len=5), "needs Sq == Sk"),
], ids=["rope", "fp32", "device", "segments", "sq_lt_sk"])
def test_mosaic_refuses_what_it_does_not_serve(dtype, kw, match):
    x = jnp.ones((1, 8, 4, 64), dtype)
    q = x[:, :kw.pop("q_len", 8)]
    with pytest.raises(NotImplementedError, match=match):
        stick_breaking_attention(q, x, x, implementation="mosaic_gpu", **kw)


def test_default_is_the_triton_forward_on_hopper_too(monkeypatch):
    """implementation=None picks "triton" on an sm90 GPU too, where "mosaic" would serve
    the call: the Mosaic forward walks every tile, the Triton one skips the spent sticks'."""
    import dataclasses

    import jax_attn
    from jax_attn import registry
    from jax_attn.ops.softmax import mosaic as mosaic_gpu
    from jax_attn.ops.stick_breaking import mosaic as stick_breaking_mosaic
    from jax_attn.ops.common.spec import AttentionSpec

    hopper = jax_attn.DeviceInfo("gpu", "NVIDIA H100 (pretended)", (9, 0), None, 132)
    monkeypatch.setattr(mosaic_gpu, "device_info", lambda: hopper)
    called = []
    for name, entry in registry.REGISTRY["stick_breaking"].items():
        fake = lambda q, k, v, decay, spec, name=name, **kw: (called.append(name), (q, None))[1]
        monkeypatch.setitem(registry.REGISTRY["stick_breaking"], name, dataclasses.replace(entry, fn=fake))
    x = jnp.ones((1, 8, 4, 64), jnp.bfloat16)
    assert stick_breaking_mosaic.unsupported_reason(AttentionSpec(scale=1.0, causal=True), 64, x.dtype) is None
    stick_breaking_attention(x, x, x)
    assert called == ["triton"]


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["pallas_triton", "mosaic_gpu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_gpu_huge_logits(dtype, implementation):
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    _check_huge_logits(dtype, implementation)


def _forward_at_tiles(seed, shape, decay, blocks, rope=None):
    """The Pallas forward (interpreter) at the given tiles against the golden, fp32."""
    from jax_attn import stick_breaking_reference
    from jax_attn.ops.common.spec import AttentionSpec
    from jax_attn.ops.stick_breaking.triton import StickBreakingBlockSizes, stick_breaking_pallas

    q, k, v, _, _ = _draw(seed, *shape)
    spec = AttentionSpec(scale=shape[-1] ** -0.5, causal=True, rope=rope, precision=jax.lax.Precision.HIGHEST)
    run = lambda dt, f: np.asarray(f(*(jnp.asarray(x, dt) for x in (q, k, v)),
                                     jnp.asarray(decay, dt if dt == jnp.float64 else jnp.float32), spec)[0],
                                   np.float64)
    with jax.enable_x64(True):
        golden = run(jnp.float64, stick_breaking_reference)
    naive = run(jnp.float32, stick_breaking_reference)
    tiles = StickBreakingBlockSizes(*blocks, 4, 1)
    fast = run(jnp.float32, lambda *a: stick_breaking_pallas(*a, blocks=tiles, interpret=True))
    return compare(fast, naive, golden, np.float32, FORWARD_FACTOR)


def test_fp32_forward_at_gpu_tiles():
    """64-key tiles (the GPU's): the in-tile suffix sum must not cost fp32 digits (rowsum - cumsum
    did: 20x the reference's error here)."""
    verdict = _forward_at_tiles(6, (1, 256, 2, 2, 32), np.array([0.0, 0.01]), (64, 64, 64))
    assert verdict.ok, verdict


@pytest.mark.parametrize("blocks", [(32, 16, 16), (16, 32, 16)], ids=["bq32_bk16", "bq16_bk32"])
def test_rope_shared_key_blocks_at_other_tiles(blocks):
    """With RoPE the forward reads key blocks rotated by the programs whose diagonal holds them:
    every block left of a program's diagonal must have been published, whatever the tiles."""
    verdict = _forward_at_tiles(3, (1, 70, 4, 2, 32), np.array([0.0, 0.1, 0.0, 0.3]), blocks,
                                rope=Rope(base=500.0, style="half"))
    assert verdict.ok, verdict


# ---------------------------------------------------------------------------------------------
# torch only
# ---------------------------------------------------------------------------------------------

FORWARD_NAMES = ("out", "rem")


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
    q, k, v, do, drem = randn_inputs(gen, (case.B, case.S, case.Hq, case.D), (case.B, case.S, case.Hkv, case.D),
                                     (case.B, case.Hq, case.S), case.rem_grad)
    return q, k, v, do, drem, _positions(case, gen)


def _kwargs(case: SBCase, positions):
    rope = None if case.rope is None else TorchRope(style=case.rope)
    return dict(rope=rope, positions=positions, scale=case.scale)


def _run(impl, dtype, q, k, v, do, drem, decay, kw):
    """Forward and backward (random cotangents) of one implementation in `dtype`."""
    qq, kk, vv = (x.to(dtype).detach().requires_grad_() for x in (q, k, v))
    leaves = [qq, kk, vv]
    if isinstance(decay, torch.Tensor):
        decay = decay.to(device=q.device, dtype=F64 if dtype == F64 else F32).detach().requires_grad_()
        leaves.append(decay)
    out, rem = torch_stick_breaking_attention(qq, kk, vv, decay=decay, return_remainder=True, implementation=impl, **kw)
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


@pytest.mark.parametrize("impl", ["eager", "triton"])
def test_torch_huge_cotangents(impl):
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


CONFIGS = [  # (block_q, block_k, block_k_bwd, block_q_dq, block_q_dkv): tiles wider / narrower than each other
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
        bq, bk, bk_bwd, bq_dq, bq_dkv = tiles
        return sbt.StickBreakingBlockSizes(block_q=bq, block_k=bk, block_k_bwd=bk_bwd, block_q_dq=bq_dq,
                                           block_q_dkv=bq_dkv, num_warps=4, num_stages=1, num_warps_bwd=4,
                                           num_stages_bwd=1)

    monkeypatch.setattr(sbt, "default_stick_breaking_block_sizes", config)
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
    kw = dict(rope=TorchRope(style="half"))
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
    rope = TorchRope(style="half")
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
    rope = TorchRope(style="half")
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
    out = torch_stick_breaking_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == F16
    out2, rem = torch_stick_breaking_attention(q, k, v, return_remainder=True, implementation="triton")
    assert torch.equal(out, out2) and rem.shape == (1, 2, 9) and rem.dtype == F32
    out3, rem3 = torch_stick_breaking_attention(q, k, v, scale=0.25, return_remainder=True, implementation="triton")
    assert torch.equal(out3, out2) and torch.equal(rem3, rem)
    gold, gold_rem = stick_breaking_reference(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), gold, rtol=0, atol=3e-3)
    torch.testing.assert_close(rem.double(), gold_rem, rtol=0, atol=1e-5)
    # empty batch: no launch, shapes kept
    e = torch.zeros(0, 9, 2, 16, device=DEVICE, dtype=F16)
    ekv = torch.zeros(0, 9, 1, 16, device=DEVICE, dtype=F16)
    out_e, rem_e = torch_stick_breaking_attention(e, ekv, ekv, return_remainder=True, implementation="triton")
    assert out_e.shape == e.shape and rem_e.shape == (0, 2, 9)


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
    ("Sq > Sk", ((1, 9, 4, 16), KV, KV), {}, ValueError,
     r"the queries at the last Sq positions of the keys: Sq <= Sk needed, got Sq=9 .*, Sk=8"),
    ("attend_current int", (Q, KV, KV), dict(attend_current=1), TypeError,
     r"attend_current must be a bool, got attend_current=1"),
    ("segment_ids float", (Q, KV, KV), dict(segment_ids=_t(1, 8)), TypeError,
     r"segment_ids must have an integer dtype, got torch.float32"),
    ("segment_ids shape", (Q, KV, KV), dict(segment_ids=_i(1, 7)), ValueError,
     r"segment_ids must have shape \[B, S\] = \[1, 8\], got \[1, 7\]"),
    ("segment_ids single, Sq < Sk", ((1, 5, 4, 16), KV, KV), dict(segment_ids=_i(1, 5)), ValueError,
     r"a single segment_ids tensor needs Sq == Sk"),
    ("segment_ids pair shape", ((1, 5, 4, 16), KV, KV), dict(segment_ids=(_i(1, 5), _i(1, 5))), ValueError,
     r"segment_ids\[1\] \(kv_ids\) must have shape \[B, S\] = \[1, 8\], got \[1, 5\]"),
    ("positions single, Sq < Sk", ((1, 5, 4, 16), KV, KV), dict(rope=TorchRope(), positions=_i(1, 5)), ValueError,
     r"a single positions tensor needs Sq == Sk"),
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
    ("rope odd D", ((1, 8, 4, 15), (1, 8, 2, 15), (1, 8, 2, 15)), dict(rope=TorchRope()), ValueError,
     r"head dim must be even for RoPE, got D=15"),
    ("positions no rope", (Q, KV, KV), dict(positions=_i(1, 8)), ValueError, r"positions given without rope"),
    ("positions float", (Q, KV, KV), dict(rope=TorchRope(), positions=_t(1, 8)), TypeError,
     r"positions must have an integer dtype, got torch.float32"),
    ("positions shape", (Q, KV, KV), dict(rope=TorchRope(), positions=_i(1, 7)), ValueError,
     r"positions must have shape \[B, S\] = \[1, 8\], got \[1, 7\]"),
    ("positions triple", (Q, KV, KV), dict(rope=TorchRope(), positions=(_i(1, 8),) * 3), ValueError,
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
        torch_stick_breaking_attention(q, k, v, implementation=impl, **kwargs)
    if impl == "eager":
        with pytest.raises(exc, match=match):
            stick_breaking_reference(q, k, v, **kwargs)


@pytest.mark.parametrize("impl", ["cuda", "xla", "TRITON", ""])
def test_unknown_implementation(impl):
    x = _t(*Q)
    kv = _t(*KV)
    with pytest.raises(UnknownImplementationError, match=r"unknown implementation=.*choose one of None, 'triton', 'eager'"):
        torch_stick_breaking_attention(x, kv, kv, implementation=impl)
    with pytest.raises(ValueError):
        torch_stick_breaking_attention(x, kv, kv, implementation=impl)
    with pytest.raises(NotImplementedError):
        torch_stick_breaking_attention(x, kv, kv, implementation=impl)


def test_triton_refuses_float64():
    x = _t(*Q, dtype=F64)
    kv = _t(*KV, dtype=F64)
    with pytest.raises(NotImplementedError, match=r"implementation='triton' cannot serve this call: .*not float64"):
        torch_stick_breaking_attention(x, kv, kv, implementation="triton")
    out = torch_stick_breaking_attention(x, kv, kv, implementation="eager")  # the golden path
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
            kw = dict(decay=decay, rope=TorchRope(style="half"), positions=positions)
            out, rem = torch_stick_breaking_attention(q, kv, kv, implementation="triton", return_remainder=True, **kw)
            gold, gold_rem = stick_breaking_reference(q.double(), kv.double(), kv.double(), **kw)
            torch.testing.assert_close(out.double(), gold, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(rem.double(), gold_rem, rtol=1e-5, atol=1e-6)


def _require_gpu():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "gpu tests must run compiled kernels"


@pytest.mark.gpu
def test_gpu_determinism():
    _require_gpu()
    case = SBCase(2, 2048, 8, 2, 128, BF16, decay="heads", rope="half", rem_grad=True)
    q, k, v, do, drem, _ = (_to(x, "cuda") for x in _inputs(case, seed=1))
    kw = dict(rope=TorchRope(style="half"))
    first = _run("triton", BF16, q, k, v, do, drem, _decay_values(case), kw)
    second = _run("triton", BF16, q, k, v, do, drem, _decay_values(case), kw)
    for name in first:
        assert torch.equal(first[name], second[name]), name
        assert torch.isfinite(first[name]).all(), name


def test_jax_position_pairs_rotate_before_the_kernels():
    """A (q_pos, kv_pos) pair (and Sq < Sk with RoPE): the kernels' in-kernel rotation reads one
    table for q and k rows, so q and k are rotated by XLA first; the result is "xla"'s, and the keys'
    own positions count."""
    import jax_attn

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 24, 2, 16)), jnp.float32) for _ in range(3))
    pair = (jnp.asarray(rng.integers(0, 50, (1, 24)), jnp.int32), jnp.arange(24, dtype=jnp.int32)[None])
    with jax.default_matmul_precision("highest"):
        run = lambda impl, positions: np.asarray(jax_attn.stick_breaking_attention(
            q, k, v, rope=jax_attn.Rope(), positions=positions, implementation=impl))
        kernels, plain = run("triton", pair), run("xla", pair)
    np.testing.assert_allclose(kernels, plain, rtol=1e-4, atol=1e-5)
    assert not np.allclose(plain, run("xla", pair[0]))  # the keys' own positions count


# ---------------------------------------------------------------------------------------------
# attend_current, segment ids, Sq < Sk: both frameworks
# ---------------------------------------------------------------------------------------------


def _options_by_loops(q, k, v, scale, lam, q_ids, kv_ids, attend_current):
    """out, rem of one head by the product of sticks, written out (float64): query i sits at key
    position i + Sk - Sq and sees the keys of its id up to it (strictly or not)."""
    q_len, kv_len = len(q), len(k)
    out, rem = np.zeros_like(q), np.ones(q_len)
    for i in range(q_len):
        p = i + kv_len - q_len
        seen = [j for j in range(kv_len) if (j <= p if attend_current else j < p) and q_ids[i] == kv_ids[j]]
        beta = {j: 1 / (1 + np.exp(-(scale * q[i] @ k[j] - lam * (p - j)))) for j in seen}
        for j in seen:
            a = beta[j] * np.prod([1 - beta[m] for m in seen if m > j])
            out[i] += a * v[j]
            rem[i] -= a
    return out, rem


@pytest.mark.parametrize("attend_current", [False, True])
def test_options_against_the_product_of_sticks(attend_current):
    """attend_current, unsorted segment pairs and Sq < Sk in every implementation of both frameworks
    against the definition written out; query ids no key has (3) give rows with out 0, rem 1 and
    zero dq, never NaN."""
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal(s) for s in ((1, 9, 2, 16), (1, 21, 1, 16), (1, 21, 1, 16), (1, 9, 2, 16)))
    q_ids, kv_ids = rng.integers(0, 3, (1, 9)), rng.integers(0, 3, (1, 21))
    q_ids[0, [2, 6]] = 3
    scale, lam = 0.3, 0.2
    want = [_options_by_loops(q[0, :, h], k[0, :, 0], v[0, :, 0], scale, lam, q_ids[0], kv_ids[0], attend_current)
            for h in range(2)]
    want_out, want_rem = np.stack([w[0] for w in want], axis=1), np.stack([w[1] for w in want])
    kw = dict(scale=scale, decay=lam, attend_current=attend_current, return_remainder=True)
    results = {}
    with jax.default_matmul_precision("highest"):
        for impl in ("xla", "triton"):
            ids = (jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32))
            f = lambda q: stick_breaking_attention(q, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                                                   segment_ids=ids, implementation=impl, **kw)
            (out, rem), vjp = jax.vjp(f, jnp.asarray(q, jnp.float32))
            results[f"jax-{impl}"] = out, rem, vjp((jnp.asarray(do, jnp.float32), jnp.zeros_like(rem)))[0]
    for impl in ("eager", "triton"):
        tq = torch.tensor(q, dtype=F32, device=DEVICE, requires_grad=True)
        tk, tv = (torch.tensor(x, dtype=F32, device=DEVICE) for x in (k, v))
        ids = tuple(torch.tensor(x, device=DEVICE) for x in (q_ids, kv_ids))
        out, rem = torch_stick_breaking_attention(tq, tk, tv, segment_ids=ids, implementation=impl, **kw)
        (dq,) = torch.autograd.grad(out, tq, torch.tensor(do, dtype=F32, device=DEVICE))
        results[f"torch-{impl}"] = out.detach().cpu(), rem.detach().cpu(), dq.cpu()
    for name, (out, rem, dq) in results.items():
        out, rem, dq = (np.asarray(x, np.float64) for x in (out, rem, dq))
        np.testing.assert_allclose(out[0], want_out, rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(rem[0], want_rem, rtol=1e-4, atol=1e-5, err_msg=name)
        assert np.isfinite(dq).all(), name
        assert (out[0, [2, 6]] == 0).all() and (rem[0, :, [2, 6]] == 1).all() and (dq[0, [2, 6]] == 0).all(), name


def test_attend_current_first_row():
    """With attend_current row 0 sees key 0 alone: out = sigmoid(z_00) v_0, rem = 1 - sigmoid(z_00)."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 5, 1, 16)) for _ in range(3))
    beta = 1 / (1 + np.exp(-0.25 * q[0, 0, 0] @ k[0, 0, 0]))
    jout, jrem = stick_breaking_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), scale=0.25,
                                          attend_current=True, return_remainder=True, implementation="xla")
    tout, trem = torch_stick_breaking_attention(*(torch.tensor(x, dtype=F32) for x in (q, k, v)), scale=0.25,
                                                attend_current=True, return_remainder=True, implementation="eager")
    for out, rem in ((jout, jrem), (tout, trem)):
        np.testing.assert_allclose(np.asarray(out)[0, 0, 0], beta * v[0, 0, 0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(rem[0, 0, 0]), 1 - beta, rtol=1e-5)


def test_first_visible_keys_and_query_tile_ends():
    """The per-row first visible key (`attn_spec.visit.first_visible_keys`, jnp and torch) and the
    torch dK/dV kernel's per-key-block end of the query tiles, against plain enumeration, for
    sorted and unsorted ids and ids no key has."""
    from jax_attn.ops.common.visit import first_visible_keys
    from torch_ref.ops.stick_breaking.triton import _TORCH_SEGMENT_OPS, _query_tile_ends
    from attn_spec import visit

    rng = np.random.default_rng(3)
    for q_ids, kv_ids in ((rng.integers(0, 5, (2, 40)), rng.integers(0, 4, (2, 70))),
                          (np.sort(rng.integers(0, 3, (2, 50))), np.sort(rng.integers(0, 3, (2, 50))))):
        want = np.array([[next((j for j in range(kv_ids.shape[1]) if kv_ids[b, j] == x), kv_ids.shape[1])
                          for x in q_ids[b]] for b in range(2)])
        np.testing.assert_array_equal(first_visible_keys(jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32)),
                                      want)
        first = visit.first_visible_keys(torch.tensor(q_ids), torch.tensor(kv_ids), _TORCH_SEGMENT_OPS)
        np.testing.assert_array_equal(first.numpy(), want)
        block_q, block_k = 16, 32
        num_k_blocks = -(-kv_ids.shape[1] // block_k)
        ends = _query_tile_ends(first, block_q, block_k, num_k_blocks).numpy()
        for b, j in np.ndindex(2, num_k_blocks):
            tiles = [t for t in range(-(-q_ids.shape[1] // block_q))
                     if (want[b, t * block_q:(t + 1) * block_q] // block_k).min() <= j]
            assert ends[b, j] == (max(tiles) + 1 if tiles else 0), (b, j)


def test_skipping_with_options_is_exact():
    """Spent sticks skipped with segment ids, Sq < Sk and attend_current: bit-equal to the walk
    that skips none (`skip_spent=False`), within the rule of the golden, and tiles were skipped."""
    from jax_attn.ops.common.spec import AttentionSpec
    from jax_attn.ops.stick_breaking.triton import stick_breaking_pallas

    rng = np.random.default_rng(4)
    q_len, kv_len = 120, 200
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                   for s in ((1, q_len, 4, 32), (1, kv_len, 2, 32), (1, kv_len, 2, 32), (1, q_len, 4, 32)))
    drem = jnp.asarray(rng.standard_normal((1, 4, q_len)), jnp.float32)
    kv_ids = np.repeat(np.arange(3), [90, 60, 50])[None]
    ids = (jnp.asarray(kv_ids[:, kv_len - q_len:]), jnp.asarray(kv_ids))
    decay = jnp.asarray([0.0, 0.01, 0.0, 0.1], jnp.float32)
    spec = AttentionSpec(scale=1.0, causal=True, has_segments=True, offset=kv_len - q_len,
                         precision=jax.lax.Precision.HIGHEST)

    def run(skip):
        f = lambda *a: stick_breaking_pallas(*a, spec, q_ids=ids[0], kv_ids=ids[1], attend_current=True,
                                             skip_spent=skip)
        (out, rem), vjp = jax.vjp(f, q, k, v, decay)
        return [out, rem, *vjp((do, drem))]

    skipped, dense = run(True), run(False)
    for name, a, b in zip(NAMES, skipped, dense):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert float(skipped[1].min()) == 0.0  # sticks were spent (rem exactly 0): their tiles were skipped
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        golden = stick_breaking_attention(*(x.astype(jnp.float64) for x in (q, k, v)), decay=decay.astype(jnp.float64),
                                          scale=1.0, segment_ids=ids, attend_current=True, implementation="xla")
    naive = stick_breaking_attention(q, k, v, decay=decay, scale=1.0, segment_ids=ids, attend_current=True,
                                     implementation="xla")
    verdict = compare(*(np.asarray(x, np.float64) for x in (skipped[0], naive, golden)), np.float32, FORWARD_FACTOR)
    assert verdict.ok, verdict


def _varlen_inputs(seed, cu_q, cu_k):
    rng = np.random.default_rng(seed)
    total_q, total_k = cu_q[-1], cu_k[-1]
    return [rng.standard_normal(s) for s in ((total_q, 4, 16), (total_k, 2, 16), (total_k, 2, 16))]


@pytest.mark.parametrize("cu_q, cu_k", [((0, 5, 12, 20), None), ((0, 5, 11, 19), (0, 9, 15, 30))],
                         ids=["same_lengths", "longer_keys"])
def test_varlen_is_every_sequence_alone(cu_q, cu_k):
    """`stick_breaking_attention_varlen` (both frameworks): out, rem and the gradients equal those
    of each sequence's own call (its queries the last of its keys; torch's plain path), on the
    packing (segment ids) and through the aligned layout; on the packing the JAX kernels' within
    tolerance of the plain path's (one positions array for q and k: rotated in the kernels)."""
    import jax_attn

    q, k, v = _varlen_inputs(5, cu_q, cu_k or cu_q)
    kw = dict(decay=0.1, attend_current=True, return_remainder=True)
    seqs = list(zip(cu_q[:-1], cu_q[1:], (cu_k or cu_q)[:-1], (cu_k or cu_q)[1:]))
    tq, tk, tv = (torch.tensor(x, dtype=F32, device=DEVICE, requires_grad=True) for x in (q, k, v))
    alone = []  # (out, rem, dq, dk, dv) of each sequence's own call, gradients of out.sum()
    for q0, q1, k0, k1 in seqs:
        o, r = torch_stick_breaking_attention(tq[q0:q1][None], tk[k0:k1][None], tv[k0:k1][None],
                                              rope=TorchRope(style="half"), implementation="eager", **kw)
        g = torch.autograd.grad(o.sum(), (tq, tk, tv))
        alone.append((o[0], r[0], g[0][q0:q1], g[1][k0:k1], g[2][k0:k1]))

    def check(out, rem, grads, name):
        for (q0, q1, k0, k1), want in zip(seqs, alone):
            got = (out[q0:q1], rem[:, q0:q1], grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1])
            for quantity, a, b in zip(("out", "rem", "dq", "dk", "dv"), got, want):
                np.testing.assert_allclose(np.asarray(a), b.detach().cpu().numpy(), rtol=1e-4, atol=1e-5,
                                           err_msg=f"{name} {quantity}")

    out, rem = torch_ref.stick_breaking_attention_varlen(
        tq, tk, tv, torch.tensor(cu_q, device=DEVICE), None if cu_k is None else torch.tensor(cu_k, device=DEVICE),
        rope=TorchRope(style="half"), implementation="triton", **kw)
    check(out.detach().cpu(), rem.detach().cpu(), [g.cpu() for g in torch.autograd.grad(out.sum(), (tq, tk, tv))],
          "torch")
    with jax.default_matmul_precision("highest"):
        cu = (jnp.asarray(cu_q, jnp.int32), None if cu_k is None else jnp.asarray(cu_k, jnp.int32))
        whole = lambda impl: jax.jit(lambda q, k, v: jax_attn.stick_breaking_attention_varlen(
            q, k, v, *cu, rope=jax_attn.Rope(style="half"), implementation=impl, **kw))
        jq, jk, jv = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
        (out, rem), vjp = jax.vjp(whole("xla"), jq, jk, jv)
        check(out, rem, vjp((jnp.ones_like(out), jnp.zeros_like(rem))), "jax")
        if cu_k is None:
            for a, b in zip(whole("triton")(jq, jk, jv), (out, rem)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_varlen_bad_arguments(framework):
    import jax_attn

    q, k, v = _varlen_inputs(6, (0, 4, 8), (0, 4, 8))
    if framework == "jax":
        f, cast = jax_attn.stick_breaking_attention_varlen, lambda x: jnp.asarray(x, jnp.float32)
        cu, bad_cu, ids = jnp.asarray([0, 4, 8]), jnp.asarray([0.0, 4.0, 8.0]), jnp.asarray([0, 4, 7])
    else:
        f, cast = torch_ref.stick_breaking_attention_varlen, lambda x: torch.tensor(x, dtype=F32)
        cu, bad_cu, ids = torch.tensor([0, 4, 8]), torch.tensor([0.0, 4.0, 8.0]), torch.tensor([0, 4, 7])
    q, k, v = (cast(x) for x in (q, k, v))
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer"):
        f(q, k, v, bad_cu)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must rise from 0 to the packed length 8"):
        f(q, k, v, ids)
    with pytest.raises(ValueError, match=r"q must be (a )?3-D"):
        f(q[None], k, v, cu)
    with pytest.raises(TypeError, match="attend_current must be a bool"):
        f(q, k, v, cu, attend_current="yes")
    assert f(q, k, v, cu).shape == q.shape
