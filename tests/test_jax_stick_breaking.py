"""Stick-breaking attention (ExpoSB) in JAX: the Pallas kernels against the float64 golden under the
tolerance rule (out, rem, dq, dk, dv, d decay), the definition itself, edge rows and bad inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_attn import Rope, stick_breaking_attention
from jax_golden import NP_DTYPE
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare

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


def _run(arrays, dtype, decay, implementation, **kw):
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
        golden = _run(arrays, jnp.float64, decay, "xla", **kw)
    with jax.default_matmul_precision("highest"):
        naive = _run(arrays, dtype, decay, "xla", **kw)
        fast = _run([*arrays[:3], arrays[3] * times, arrays[4] * times], dtype, decay, implementation, **kw)
    fast = fast[:2] + [x / times for x in fast[2:]]  # out and rem do not see the cotangents
    for name, f, n, g in zip(NAMES, fast, naive, golden):
        assert np.isfinite(f).all(), f"{name}: not finite"
        if name not in held:
            continue
        factor = FORWARD_FACTOR if name in ("out", "rem") else GRADIENT_FACTOR
        verdict = compare(f, n, g, NP_DTYPE[dtype], factor)
        assert verdict.ok, f"{name}: {verdict}"
    return fast, naive, golden


@pytest.mark.parametrize("shape, decay", [
    ((1, 37, 2, 2, 32), 0.0),                     # ragged: 3 tiles of 16, last partial
    ((2, 50, 4, 2, 32), [0.0, 0.05, 0.2, 1.0]),   # GQA, per-head decay
    ((1, 33, 4, 1, 48), 0.1),                     # MQA, scalar decay, D padded to 64
    ((1, 1, 2, 2, 16), 0.0),                      # one token: no keys at all
    ((1, 17, 1, 1, 80), 0.3),
], ids=["ragged", "gqa_per_head_decay", "mqa_scalar_decay_d48", "single_token", "d80"])
def test_against_golden(shape, decay):
    check(shape, decay=decay)


@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_rope_against_golden(style):
    check((1, 40, 4, 2, 32), decay=[0.0, 0.1, 0.0, 0.4], rope=Rope(base=500.0, style=style))


def test_rope_packed_positions():
    pos = jnp.asarray(np.concatenate([np.arange(20), np.arange(25)])[None], jnp.int32)
    check((1, 45, 2, 2, 32), decay=0.05, rope=Rope(), positions=pos)


def test_fp16():
    check((1, 64, 2, 2, 64), dtype=jnp.float16, decay=0.02)


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
def test_huge_cotangents(dtype):
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
    from jax_attn.ops.stick_breaking.triton import default_stick_breaking_blocks, stick_breaking_pallas

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
        blocks = default_stick_breaking_blocks(shape[-1], interpret, dtype)
        st = _Static(spec, blocks, interpret, jnp.dtype(dtype), mosaic=forward == "mosaic_gpu")
        _, (*_, spent, _v_max) = _stick_breaking_fwd(st, q, k, v, decay, None)  # (the residuals)
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
        per_head = _run(arrays, jnp.float32, [0.1] * 4, "pallas_triton")[-1]
        scalar = _run(arrays, jnp.float32, 0.1, "pallas_triton")[-1]
    assert scalar.shape == ()
    np.testing.assert_allclose(scalar, per_head.sum(), rtol=1e-5)


def test_deterministic():
    arrays = _draw(5, 1, 48, 4, 2, 32)
    first = _run(arrays, jnp.float32, 0.1, "pallas_triton")
    second = _run(arrays, jnp.float32, 0.1, "pallas_triton")
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
], ids=["negative_decay", "decay_shape", "decay_int", "decay_str", "rope_type", "positions_without_rope",
        "scale", "scale_array", "implementation", "non_causal"])
def test_bad_inputs(kw, error, match):
    x = jnp.ones((1, 8, 4, 16), jnp.float32)
    with pytest.raises(error, match=match):
        stick_breaking_attention(x, x, x, **kw)


def test_bad_shapes():
    x = jnp.ones((1, 8, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match="same length"):
        stick_breaking_attention(x, jnp.ones((1, 9, 4, 16)), jnp.ones((1, 9, 4, 16)))
    with pytest.raises(ValueError, match="must divide"):
        stick_breaking_attention(x, jnp.ones((1, 8, 3, 16)), jnp.ones((1, 8, 3, 16)))
    with pytest.raises(ValueError, match="head dim must be even for RoPE"):
        y = jnp.ones((1, 8, 2, 15))
        stick_breaking_attention(y, y, y, rope=Rope())
    with pytest.raises(ValueError, match="unknown rope style"):
        Rope(style="neox")


def test_bad_blocks():
    from jax_attn import StickBreakingBlocks
    with pytest.raises(ValueError, match=r"StickBreakingBlocks.block_k=48 must be a power of two"):
        StickBreakingBlocks(64, 48)
    with pytest.raises(ValueError, match=r"StickBreakingBlocks.num_stages_dkdv=0 must be >= 1"):
        StickBreakingBlocks(num_stages_dkdv=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape, kw", [
    ((2, 1024, 8, 2, 128), dict(decay=0.01)),
    ((1, 2048, 4, 4, 64), dict(rope=Rope(style="half"))),
    ((1, 1024, 8, 2, 128), dict(rope=Rope(style="interleaved"), decay=0.01)),  # k_rot published per kv head
], ids=["gqa_d128", "rope_d64", "rope_gqa_d128"])
def test_gpu(dtype, shape, kw):
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    check(shape, dtype=dtype, **kw)


@pytest.mark.parametrize("head_dim, group", [(128, 2), (64, 1)])
def test_mosaic_forward_lowers_for_cuda(head_dim, group):
    """No interpreter runs Mosaic GPU kernels: the forward and its gradient (the Triton backward
    reading the Mosaic forward's sums) are lowered for CUDA, which traces both kernels."""
    from jax_attn.ops.common.spec import AttentionSpec
    from jax_attn.ops.stick_breaking.triton import _stick_breaking, _Static, default_stick_breaking_blocks

    spec = AttentionSpec(scale=head_dim ** -0.5, causal=True)
    st = _Static(spec, default_stick_breaking_blocks(head_dim, False, jnp.bfloat16), False, jnp.dtype(jnp.bfloat16),
                 mosaic=True)
    q = jax.ShapeDtypeStruct((2, 256, 2 * group, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, head_dim), jnp.bfloat16)
    decay = jax.ShapeDtypeStruct((2 * group,), jnp.float32)
    loss = lambda *a: sum(x.astype(jnp.float32).sum() for x in _stick_breaking(st, *a, None))
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, kv, kv, decay).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text and "stick_breaking_bwd_dkdv" in text


@pytest.mark.parametrize("dtype, kw, match", [
    (jnp.bfloat16, dict(rope=Rope()), "does not serve RoPE"),
    (jnp.float32, {}, "float16 or bfloat16"),
    (jnp.bfloat16, {}, "need a Hopper"),
], ids=["rope", "fp32", "device"])
def test_mosaic_refuses_what_it_does_not_serve(dtype, kw, match):
    x = jnp.ones((1, 8, 4, 64), dtype)
    with pytest.raises(NotImplementedError, match=match):
        stick_breaking_attention(x, x, x, implementation="mosaic_gpu", **kw)


def test_default_is_the_triton_forward_on_hopper_too(monkeypatch):
    """implementation=None picks "pallas_triton" on an sm90 GPU too, where "mosaic_gpu" would serve
    the call: the Mosaic forward walks every tile, the Triton one skips the spent sticks'."""
    import jax_attn
    from jax_attn import registry
    from jax_attn.ops.softmax import mosaic as mosaic_gpu
    from jax_attn.ops.stick_breaking import mosaic as stick_breaking_mosaic
    from jax_attn.ops.common.spec import AttentionSpec

    hopper = jax_attn.DeviceInfo("gpu", "NVIDIA H100 (pretended)", (9, 0), None, 132)
    monkeypatch.setattr(mosaic_gpu, "device_info", lambda: hopper)
    called = []
    for name in registry.STICK_BREAKING:
        fake = lambda q, k, v, decay, spec, pos, name=name: (called.append(name), (q, None))[1]
        monkeypatch.setitem(registry.STICK_BREAKING, name, fake)
    x = jnp.ones((1, 8, 4, 64), jnp.bfloat16)
    assert stick_breaking_mosaic.unsupported_reason(AttentionSpec(scale=1.0, causal=True), 64, x.dtype) is None
    stick_breaking_attention(x, x, x)
    assert called == ["pallas_triton"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape, kw", [
    ((2, 1024, 8, 2, 128), dict(decay=0.01)),
    ((1, 1000, 4, 1, 64), dict(decay=[0.0, 0.05, 0.2, 1.0])),  # ragged (padded to 1024), MQA, per-head decay
    ((1, 300, 2, 2, 48), dict(decay=0.1)),                      # D padded to 64, 3 query tiles
    ((1, 4096, 2, 2, 128), dict(decay=0.0)),                    # long rows: sums over 4095 keys
    ((1, 1024, 4, 2, 64), dict(decay=0.0, scale=0.5)),          # sharp: logits ~ N(0, 4^2), sp up to ~30
], ids=["gqa_d128", "ragged_mqa_d64", "d48", "long_no_decay", "sharp_logits"])
def test_gpu_mosaic_forward(dtype, shape, kw):
    """implementation="mosaic_gpu": the forward on the Hopper kernel (its in-tile sums of fp16
    terms), the backward on the Triton engine's kernels reading its key-block sums."""
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    kw = dict(kw, decay=np.asarray(kw["decay"]))
    check(shape, dtype=dtype, implementation="mosaic_gpu", **kw)


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
    from jax_attn.ops.stick_breaking.triton import StickBreakingBlocks, stick_breaking_pallas

    q, k, v, _, _ = _draw(seed, *shape)
    spec = AttentionSpec(scale=shape[-1] ** -0.5, causal=True, rope=rope, precision=jax.lax.Precision.HIGHEST)
    run = lambda dt, f: np.asarray(f(*(jnp.asarray(x, dt) for x in (q, k, v)),
                                     jnp.asarray(decay, dt if dt == jnp.float64 else jnp.float32), spec)[0],
                                   np.float64)
    with jax.enable_x64(True):
        golden = run(jnp.float64, stick_breaking_reference)
    naive = run(jnp.float32, stick_breaking_reference)
    tiles = StickBreakingBlocks(*blocks, 4, 1)
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
