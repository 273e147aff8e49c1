"""Attention dropout in both frameworks: one counter-based hash (`attn_spec.dropout`), one mask.

(a) the mask of a seed is the same in NumPy, jnp, torch (eager) and Triton (a kernel through
    `torch_ref.ops.common.triton_dropout`), and every implementation applies it: q = k = 0 makes
    the softmax uniform, a one-hot v reads the forward's mask out of `out` and a one-hot dO the
    dK/dV kernel's out of `dv` (per query head of a GQA group);
(b) the drop fraction matches the rate, and masks of neighbouring rows, columns, heads, batches
    and seeds, and 2x2 groups of elements, are independent (within a few sigma); the kernels'
    row and column tables hold NumPy's bits;
(c) every implementation of both frameworks within the tolerance rule of the float64 golden that
    replays the same mask (out, lse, dq, dk, dv);
(d) the two frameworks' float64 references agree for one seed (jax.random.key(s) and
    dropout_seed=s), varlen included;
(e) determinism: a seed gives the same bits twice, different seeds differ; torch's default seed
    follows torch's generator;
(f) argument errors, and the Mosaic kernels refuse dropout.
A `gpu` case (bf16, 2 x 1024 x 8 x 64, rate 0.1) runs the compiled kernels against the golden.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import jax_attn
import torch_ref
import variant_harness as harness
from attn_spec import dropout as plan
from attn_spec.dilation import RowMap
from jax_attn.ops.common import dropout as jax_dropout
from parity import variants
from parity.cases import case as make_case
from torch_ref.ops.common import dropout as torch_dropout
from torch_ref.ops.common import triton_dropout

RECORD = variants.BY_NAME["softmax"]
DEVICE = harness.DEVICE
SEEDS = (0, 1, 0xDEADBEEF, 2 ** 32 + 7, 2 ** 63 + 11, 2 ** 64 - 1)
SHAPES = ((1, 1, 1, 1), (2, 3, 17, 33), (1, 4, 40, 70))


def jax_key(seed: int):
    """The JAX key of torch's int seed (its two words, exact for every seed)."""
    return jax.random.wrap_key_data(jnp.asarray(plan.seed_words(seed), jnp.uint32))


# ---------------------------------------------------------------------------------------------
# (a) one mask
# ---------------------------------------------------------------------------------------------
@triton.jit
def _mask_kernel(OUT, seed0, seed1, H, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DROP_THRESHOLD: tl.constexpr):
    """OUT [B, H, Sq, Sk] int8: the keep mask, tile by tile as the attention kernels hash it."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = triton_dropout.row_bits(triton_dropout.stream(seed0, seed1, b * H + h), rows)
    for n0 in range(0, Sk, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kept = triton_dropout.keep(row[:, None], triton_dropout.col_bits(cols)[None, :], DROP_THRESHOLD)
        ptrs = OUT + ((b * H + h) * Sq + rows[:, None]) * Sk + cols[None, :]
        tl.store(ptrs, kept.to(tl.int8), mask=(rows[:, None] < Sq) & (cols[None, :] < Sk))


def triton_mask(seed, batch, heads, q_len, kv_len, rate):
    out = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.int8, device=DEVICE)
    _mask_kernel[(triton.cdiv(q_len, 16), heads, batch)](
        out, *triton_dropout.seed_args(plan.seed_words(seed)), heads, q_len, kv_len, BLOCK_M=16, BLOCK_N=32,
        DROP_THRESHOLD=plan.threshold(rate))
    return out.bool().cpu().numpy()


@pytest.mark.parametrize("seed", SEEDS, ids=hex)
@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_masks_identical(seed, rate):
    """NumPy, jnp, torch (int64 held uint32) and Triton (tl.uint32) give one mask."""
    words = plan.seed_words(seed)
    for shape in SHAPES:
        expected = plan.keep_mask(words, *shape, rate)
        np.testing.assert_array_equal(
            np.asarray(jax_dropout.keep_mask(jnp.asarray(words, jnp.uint32), *shape, rate)), expected)
        np.testing.assert_array_equal(torch_dropout.keep_mask(words, *shape, rate).numpy(), expected)
        np.testing.assert_array_equal(triton_mask(seed, *shape, rate), expected)


@pytest.mark.parametrize("seed", SEEDS[:3], ids=hex)
def test_tables(seed):
    """The kernels' tables (torch: one Triton launch; JAX: jnp) hold NumPy's row and column bits."""
    words = plan.seed_words(seed)
    batch, heads, q_len, kv_len = 2, 3, 1100, 37  # q_len past one table block
    ops = plan.NUMPY_OPS
    with np.errstate(over="ignore"):
        b, h = np.meshgrid(np.arange(batch), np.arange(heads), indexing="ij")
        stream = plan.stream(ops.u32(words[0]), ops.u32(words[1]), b, h, heads, ops)[..., None]
        rows = plan.row_bits(stream, np.arange(q_len), ops)
        cols = plan.col_bits(np.arange(kv_len), ops)
    t_rows, t_cols = triton_dropout.tables(words, batch * heads, q_len, kv_len, DEVICE)
    np.testing.assert_array_equal(t_rows.cpu().numpy().view(np.uint32).reshape(rows.shape), rows)
    np.testing.assert_array_equal(t_cols.cpu().numpy().view(np.uint32), cols)
    j_rows, j_cols = jax_dropout.tables(jnp.asarray(words, jnp.uint32), batch, heads, q_len, kv_len)
    np.testing.assert_array_equal(np.asarray(j_rows), rows)
    np.testing.assert_array_equal(np.asarray(j_cols), cols)


def test_seed_words_of_keys():
    """torch's seed s is the JAX key of the words (s >> 32, s & 0xffffffff): `jax.random.key(s)` for
    s < 2^32, under x64 for s < 2^63; `wrap_key_data` for any s."""
    for s in (0, 5, 2 ** 32 - 1):
        assert tuple(np.asarray(jax_dropout.seed_words(jax.random.key(s)))) == plan.seed_words(s)
    with jax.enable_x64(True):
        for s in (2 ** 32, 2 ** 40 + 3, 2 ** 63 - 1):
            assert tuple(np.asarray(jax_dropout.seed_words(jax.random.key(s)))) == plan.seed_words(s)
    for s in SEEDS:
        assert tuple(np.asarray(jax_dropout.seed_words(jax_key(s)))) == plan.seed_words(s)
    assert plan.seed_words(2 ** 40 + 3) == (256, 3)


def _one_hot_run(framework, implementation, rate, seed, shape):
    """q = k = 0 (uniform softmax over Sk keys), v[j] = e_j, dO[i] of query head h = e_(g Sq + i)
    (g = h mod group): out[b, i, h] = keep[b, h, i] / (Sk (1 - rate)) and
    dv[b, j, kv head, g Sq + i] = keep[b, kv head * group + g, i, j] / (Sk (1 - rate))."""
    B, Sq, Sk, Hq, Hkv = shape
    group = Hq // Hkv
    q = np.zeros((B, Sq, Hq, Sk))
    k = np.zeros((B, Sk, Hkv, Sk))
    v = np.broadcast_to(np.eye(Sk)[None, :, None, :], (B, Sk, Hkv, Sk)).copy()
    do = np.zeros((B, Sq, Hq, Sk))
    for h in range(Hq):
        do[:, np.arange(Sq), h, (h % group) * Sq + np.arange(Sq)] = 1.0
    if framework == "jax":
        @jax.jit
        def run(q, k, v, do):
            out, vjp = jax.vjp(lambda q, k, v: jax_attn.flash_attention(
                q, k, v, dropout_rate=rate, dropout_key=jax_key(seed), implementation=implementation), q, k, v)
            return out, vjp(do)[2]
        return tuple(np.asarray(x) for x in run(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, do))))
    leaves = [torch.tensor(x, dtype=torch.float32, device=DEVICE, requires_grad=True) for x in (q, k, v)]
    out = torch_ref.flash_attention(*leaves, dropout_rate=rate, dropout_seed=seed, implementation=implementation)
    out.backward(torch.tensor(do, dtype=torch.float32, device=DEVICE))
    return out.detach().cpu().numpy(), leaves[2].grad.cpu().numpy()


@pytest.mark.parametrize("framework, implementation", [("jax", "triton"), ("jax", "xla"), ("torch", "triton"),
                                                       ("torch", "eager")])
def test_kernels_apply_the_mask(framework, implementation):
    """The forward's mask (read from out) and the dK/dV kernel's (read from dv) are NumPy's."""
    B, Sq, Sk, Hq, Hkv, rate, seed = 2, 20, 64, 4, 2, 0.3, 2 ** 40 + 99
    group = Hq // Hkv
    out, dv = _one_hot_run(framework, implementation, rate, seed, (B, Sq, Sk, Hq, Hkv))
    keep = plan.keep_mask(plan.seed_words(seed), B, Hq, Sq, Sk, rate)  # [B, Hq, Sq, Sk]
    value = 1.0 / (Sk * (1.0 - rate))
    np.testing.assert_allclose(out, np.where(keep, value, 0.0).transpose(0, 2, 1, 3), rtol=1e-6, atol=0)
    dv_mask = dv[..., :group * Sq].reshape(B, Sk, Hkv, group, Sq).transpose(0, 2, 3, 4, 1).reshape(B, Hq, Sq, Sk)
    np.testing.assert_allclose(dv_mask, np.where(keep, value, 0.0), rtol=1e-6, atol=0)


def test_jax_kernels_lower_for_cuda():
    """The compiled (not interpreted) Pallas Triton forward, dK/dV and dQ kernels with dropout lower
    for CUDA here: the uint32 tables, products and unsigned compares pass Triton's lowering."""
    from jax_attn.ops.common.spec import AttentionSpec
    from jax_attn.ops.softmax import triton as engine
    spec = AttentionSpec(scale=64 ** -0.5, causal=True, dropout=0.1)
    q = jax.ShapeDtypeStruct((2, 200, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)

    def fwd_bwd(q, k, v, seed):
        out, vjp = jax.vjp(lambda q, k, v: engine.flash_attention_pallas(q, k, v, None, None, spec, interpret=False,
                                                                       seed=seed)[0], q, k, v)
        return vjp(out)

    lowered = jax.jit(fwd_bwd).trace(q, kv, kv, jax.ShapeDtypeStruct((2,), jnp.uint32))
    assert lowered.lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 3


# ---------------------------------------------------------------------------------------------
# (b) rate statistics
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [1e-3, 0.1, 0.5, 0.9])
def test_drop_fraction_and_independence(rate):
    """The dropped fraction is the rate within 5 sigma, overall and per (batch, head); neighbouring
    rows, columns, heads, batch rows and seeds agree as independent masks do (r^2 + (1 - r)^2)."""
    B, H, S = 2, 4, 256
    keep = torch_dropout.keep_mask(plan.seed_words(2 ** 33 + 1), B, H, S, S, rate).numpy()

    def within(observed, p, n):
        return abs(observed - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12

    assert within(1 - keep.mean(), rate, keep.size), 1 - keep.mean()
    for frac in (1 - keep.reshape(B * H, -1).mean(1)):
        assert within(frac, rate, S * S), frac
    agree = rate ** 2 + (1 - rate) ** 2
    other_seed = torch_dropout.keep_mask(plan.seed_words(2 ** 33 + 2), B, H, S, S, rate).numpy()
    for a, b in ((keep[:, :, 1:], keep[:, :, :-1]), (keep[..., 1:], keep[..., :-1]), (keep[:, 1:], keep[:, :-1]),
                 (keep[1:], keep[:-1]), (keep, other_seed)):
        assert within((a == b).mean(), agree, a.size), (a == b).mean()
    # 2x2: rows i, i + di and columns j, j + dj, the pattern a sum or XOR of row and column hashes
    # would tie together; the four are independent draws when the parity of their drops is
    # 1/2 (1 - (1 - 2 rate)^4) and all four drop with probability rate^4
    drop = ~keep
    for di, dj in ((1, 1), (1, 7), (5, 64)):
        corners = (drop[..., di:, dj:], drop[..., :-di, dj:], drop[..., di:, :-dj], drop[..., :-di, :-dj])
        parity = corners[0] ^ corners[1] ^ corners[2] ^ corners[3]
        assert within(parity.mean(), (1 - (1 - 2 * rate) ** 4) / 2, parity.size), (di, dj, parity.mean())
        all_four = corners[0] & corners[1] & corners[2] & corners[3]
        assert within(all_four.mean(), rate ** 4, all_four.size), (di, dj, all_four.mean())


def test_threshold():
    assert plan.threshold(0.0) == 0 and plan.threshold(0.5) == 2 ** 31
    assert plan.threshold(1.0 - 2 ** -40) == 2 ** 32 - 1  # stays a uint32
    assert triton_dropout.constexprs(0.25) == dict(DROPOUT=0.25, DROP_THRESHOLD=2 ** 30)


# ---------------------------------------------------------------------------------------------
# (c) every implementation against the golden replaying the mask; (d) the goldens agree
# ---------------------------------------------------------------------------------------------
CASES = [
    make_case("drop_causal_gqa_odd", (1, 37, 53, 4, 2, 40), causal=True, dropout_rate=0.1,
              dropout_seed=2 ** 33 + 5),
    make_case("drop_window_sorted_fp16", (2, 45, 45, 2, 1, 32), "float16", window=(7, 3), segments="sorted",
              dropout_rate=0.5, dropout_seed=99, stat_grad=True),
    make_case("drop_cross_mqa_empty_rows", (1, 29, 70, 4, 1, 64), segments="pair_with_empty_rows",
              dropout_rate=0.5, dropout_seed=2 ** 64 - 1),
    make_case("drop_rope_alibi_offsets_fp16", (1, 23, 31, 4, 2, 32), "float16", rope=("half", 500.0), causal=True,
              q_offset=8, alibi_slopes=(0.5, 0.25, 0.125, 0.0625), dropout_rate=0.1, dropout_seed=0),
    # compiled kernels, bf16 (make test-gpu)
    make_case("gpu_bf16_dropout_2x1024x8x64", (2, 1024, 1024, 8, 8, 64), "bfloat16", dropout_rate=0.1,
              dropout_seed=2 ** 40 + 1, gpu=True),
]


@pytest.mark.parametrize("framework, implementation, case", harness.grid_params(RECORD, CASES))
def test_against_golden(framework, implementation, case):
    """Out, lse, dq, dk, dv within the tolerance rule of the float64 golden with the same mask."""
    harness.assert_rule(RECORD, framework, implementation, case)


@pytest.mark.parametrize("case", [c for c in CASES if not c.gpu], ids=str)
def test_goldens_agree(case):
    """jax "xla" with the key of the seed's words and torch "eager" with the seed, float64: 1e-10."""
    harness.assert_goldens_agree(RECORD, case)


def _f64_inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    B, Sq, Sk, Hq, Hkv, D = shape
    return [rng.standard_normal(s) for s in ((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, Hq, D))]


def test_jax_key_and_torch_seed_agree_float64():
    """jax_attn "xla" with jax.random.key(s) (x64) and torch_ref "eager" with dropout_seed=s: the same
    out and gradients in float64 (s below and above 2^32)."""
    q, k, v, do = _f64_inputs((2, 19, 27, 4, 2, 16))
    kw = dict(causal=True, dropout_rate=0.3)
    with jax.enable_x64(True):
        @jax.jit
        def run(key):
            out, vjp = jax.vjp(lambda q, k, v: jax_attn.flash_attention(q, k, v, dropout_key=key, implementation="xla",
                                                                        **kw), q, k, v)
            return (out, *vjp(jnp.asarray(do)))

        expected = {seed: [np.asarray(x) for x in run(jax.random.key(seed))] for seed in (5, 2 ** 40 + 3)}
    for seed, want in expected.items():
        leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        out = torch_ref.flash_attention(*leaves, dropout_seed=seed, implementation="eager", **kw)
        got = [out.detach().numpy(), *(g.numpy() for g in torch.autograd.grad(out, leaves, torch.tensor(do)))]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=f"{name} seed {seed}")


@pytest.mark.parametrize("cu_k", [None, np.array([0, 9, 30, 31], np.int32)], ids=["packed", "aligned"])
def test_varlen_agrees(cu_k):
    """flash_attention_varlen with dropout: the two frameworks' references, one mask (float32)."""
    rng = np.random.default_rng(3)
    cu_q = np.array([0, 7, 20, 26], np.int32)
    total_k = cu_q[-1] if cu_k is None else cu_k[-1]
    q, k, v = (rng.standard_normal((n, 4, 16)).astype(np.float32) for n in (cu_q[-1], total_k, total_k))
    seed = 2 ** 35 + 9
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(lambda q, k, v: jax_attn.flash_attention_varlen(
            q, k, v, jnp.asarray(cu_q), None if cu_k is None else jnp.asarray(cu_k), causal=True, dropout_rate=0.4,
            dropout_key=jax_key(seed), implementation="xla"))(q, k, v)
    tq, tk, tv = (torch.tensor(x) for x in (q, k, v))
    tcu_k = None if cu_k is None else torch.tensor(cu_k)
    got = torch_ref.flash_attention_varlen(tq, tk, tv, torch.tensor(cu_q), tcu_k, causal=True, dropout_rate=0.4,
                                           dropout_seed=seed, implementation="eager")
    np.testing.assert_allclose(got.numpy(), np.asarray(expected), rtol=0, atol=2e-6)
    plain = torch_ref.flash_attention_varlen(tq, tk, tv, torch.tensor(cu_q), tcu_k, causal=True,
                                             implementation="eager")
    assert not np.allclose(got.numpy(), plain.numpy())


# ---------------------------------------------------------------------------------------------
# (e) determinism and seeds
# ---------------------------------------------------------------------------------------------
def _torch_run(seed, implementation="triton", rate=0.2, **kw):
    q, k, v, do = (torch.tensor(x, dtype=torch.float32, device=DEVICE) for x in _f64_inputs((1, 33, 41, 4, 2, 32)))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = torch_ref.flash_attention(*leaves, causal=True, dropout_rate=rate, dropout_seed=seed,
                                    implementation=implementation, **kw)
    return [out.detach(), *torch.autograd.grad(out, leaves, do)]


def test_torch_same_seed_same_bits_other_seed_differs():
    first, second, other = _torch_run(11), _torch_run(11), _torch_run(12)
    for a, b, c in zip(first, second, other):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)


def test_jax_same_seed_same_bits_other_seed_differs():
    q, k, v, do = (jnp.asarray(x, jnp.float32) for x in _f64_inputs((1, 33, 41, 4, 2, 32)))

    @jax.jit
    def run(key):
        out, vjp = jax.vjp(lambda q, k, v: jax_attn.flash_attention(
            q, k, v, causal=True, dropout_rate=0.2, dropout_key=key, implementation="triton"), q, k, v)
        return (out, *vjp(do))

    first, second, other = run(jax.random.key(11)), run(jax.random.key(11)), run(jax.random.key(12))
    for a, b, c in zip(first, second, other):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)


def test_torch_rate_zero_is_no_dropout():
    for a, b in zip(_torch_run(5, rate=0.0), _torch_run(None, rate=0.0)):
        assert torch.equal(a, b)


def test_torch_default_seed_follows_the_generator():
    """dropout_seed=None draws two words from torch's default CPU generator (torch.manual_seed makes
    it reproducible; the next call draws anew); generator= draws from that generator instead."""
    torch.manual_seed(123)
    first = _torch_run(None, "eager")
    torch.manual_seed(123)
    hi, lo = torch.randint(0, 2 ** 32, (2,), dtype=torch.int64).tolist()
    for a, b in zip(first, _torch_run((hi << 32) | lo, "eager")):
        assert torch.equal(a, b)
    torch.manual_seed(123)
    again, following = _torch_run(None, "eager"), _torch_run(None, "eager")
    assert torch.equal(first[0], again[0]) and not torch.equal(again[0], following[0])
    by_generator = [_torch_run(None, "eager", generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(by_generator[0][0], by_generator[1][0])


# ---------------------------------------------------------------------------------------------
# (f) errors
# ---------------------------------------------------------------------------------------------
BAD_RATES = [-0.1, 1.0, 1.5, float("nan"), True, "0.1", None]


@pytest.mark.parametrize("rate", BAD_RATES, ids=repr)
def test_bad_rate(rate):
    x = jnp.zeros((1, 4, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"dropout_rate must be a float in \[0, 1\)"):
        jax_attn.flash_attention(x, x, x, dropout_rate=rate, dropout_key=jax.random.key(0))
    t = torch.zeros(1, 4, 2, 16)
    for implementation in ("triton", "eager"):
        with pytest.raises(ValueError, match=r"dropout_rate must be a float in \[0, 1\)"):
            torch_ref.flash_attention(t, t, t, dropout_rate=rate, dropout_seed=0, implementation=implementation)


def test_jax_key_errors():
    x = jnp.zeros((1, 4, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="dropout_rate > 0 needs dropout_key"):
        jax_attn.flash_attention(x, x, x, dropout_rate=0.1)
    with pytest.raises(TypeError, match="dropout_key must be a JAX PRNG key"):
        jax_attn.flash_attention(x, x, x, dropout_rate=0.1, dropout_key=5)
    with pytest.raises(ValueError, match="dropout_key must be one key"):
        jax_attn.flash_attention(x, x, x, dropout_rate=0.1, dropout_key=jax.random.split(jax.random.key(0), 2))


@pytest.mark.parametrize("seed, error, match", [
    (1.5, TypeError, "dropout_seed must be None or an int"), (True, TypeError, "dropout_seed must be None or an int"),
    ("3", TypeError, "dropout_seed must be None or an int"), (torch.tensor(3), TypeError, "dropout_seed must be"),
    (-1, ValueError, r"dropout_seed must be an int in \[0, 2\*\*64\)"),
    (2 ** 64, ValueError, r"dropout_seed must be an int in \[0, 2\*\*64\)")], ids=repr)
def test_torch_bad_seed(seed, error, match):
    t = torch.zeros(1, 4, 2, 16)
    for rate in (0.1, 0.0):  # checked whatever the rate
        with pytest.raises(error, match=match):
            torch_ref.flash_attention(t, t, t, dropout_rate=rate, dropout_seed=seed)
    assert torch_ref.flash_attention(t, t, t, dropout_rate=0.1, dropout_seed=np.uint64(2 ** 64 - 1)).shape == t.shape


def test_torch_generator_errors():
    t = torch.zeros(1, 4, 2, 16)
    with pytest.raises(TypeError, match="generator must be None or a torch.Generator"):
        torch_ref.flash_attention(t, t, t, dropout_rate=0.1, generator=3)
    with pytest.raises(ValueError, match="pass dropout_seed or generator"):
        torch_ref.flash_attention(t, t, t, dropout_rate=0.1, dropout_seed=1, generator=torch.Generator())


def test_mosaic_refuses_dropout():
    spec = jax_attn.AttentionSpec(scale=1.0, causal=True, dropout=0.1)
    reason = jax_attn.ops.softmax.mosaic.unsupported_reason(spec, 64, jnp.bfloat16)
    assert reason is not None and "dropout" in reason
    x = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError):
        jax_attn.flash_attention(x, x, x, causal=True, dropout_rate=0.1, dropout_key=jax.random.key(0),
                                 implementation="mosaic")


def test_row_map_refuses_dropout():
    from torch_ref.ops.softmax import triton as engine

    t = torch.zeros(1, 16, 2, 16, device=DEVICE)
    with pytest.raises(NotImplementedError, match="dropout with a row map"):
        engine.forward(t, t, t, causal=False, scale=1.0, row_map=RowMap(rate=2, heads=1, kv_heads=1), grid_heads=1,
                       dropout=(0.1, (0, 1)))
