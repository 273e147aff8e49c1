"""Space-filling-curve orderings inside the kernels (`ordering=` of flash_attention and
dilated_attention), both frameworks.

Ordered attention is `unpermute(attn(permute(q), permute(k), permute(v)))` with the locality pattern
(window, dilated segments) on the ordered sequence and causality / segment ids on the original
positions (docs/design/orderings.md). Here:
  - every implementation of both frameworks on ordered cases (window, causal, segment ids, GQA/MQA,
    odd lengths, fp32/fp16; dilated with both merges) against the framework's float64 golden, the
    explicit composite, with the tolerance rule on out, lse, dq, dk, dv;
  - the golden composite against a direct NumPy statement of the definition (original coordinates);
  - the identity ordering is no ordering, bitwise; without a window an ordering changes nothing
    (the API shortcuts it, the kernels and the composite agree);
  - bad arguments raise clear errors; "mosaic" refuses ordered calls and None picks "triton";
  - `gpu`: compiled kernels at realistic shapes (S = 8k to 32k, bf16).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_attn
import jax_attn.registry
import torch_ref
import variant_harness as harness
from attn_spec import orderings as spec_orderings
from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.ops.orderings import reference as jax_ordered
from jax_attn.ops.softmax import reference as jax_softmax_ref
from jax_attn.ops.softmax import triton as jax_engine
from parity import variants
from parity.tolerance import compare
from parity.variants.dilated import _dl_case
from parity.variants.softmax import _case
from variant_harness import assert_rule, grid_params

SOFTMAX = variants.BY_NAME["softmax"]
DILATED = variants.BY_NAME["dilated"]

FLASH_CASES = [
    _case("ord_hilbert_window_causal_gqa", (1, 42, 42, 4, 2, 16), ordering="hilbert", grid=(6, 7), window=(5, 5),
          causal=True, seed=0),
    _case("ord_zorder_window_sorted_ids_fp16", (2, 33, 33, 2, 1, 16), "float16", ordering="zorder", window=(4, 2),
          segments="sorted", stat_grad=True, seed=0),
    _case("ord_snake_window_odd_mqa_d40", (1, 31, 31, 4, 1, 40), ordering="snake", window=(3, 6), seed=0),
    # dropout: the mask of the tokens' pairs (the unordered call's)
    _case("ord_zorder_window_dropout_causal_gqa", (1, 36, 36, 4, 2, 16), ordering="zorder", grid=(6, 6),
          window=(6, 3), causal=True, dropout_rate=0.25, dropout_seed=2 ** 40 + 3, seed=0),
    # ALiBi on the tokens' original distance
    _case("ord_zorder_window_alibi_fp16", (2, 33, 33, 4, 2, 16), "float16", ordering="zorder", window=(4, 4),
          alibi_slopes=(0.5, 0.25, 0.125, 0.0625), seed=0),
    # RoPE at each token's own position (rotated before the gathering kernels)
    _case("ord_hilbert_window_rope_restart_causal", (1, 42, 42, 4, 2, 32), ordering="hilbert", grid=(6, 7),
          window=(5, 5), causal=True, rope=("interleaved", 500.0), positions="restart_halfway", seed=0),
    _case("ord_gray_causal_window_packed", (2, 37, 37, 2, 2, 16), ordering="gray", window=(8, 0), causal=True,
          segments="packed", seed=0, slow=True),
    _case("ord_bit_reversal_causal_window_fp16_d64", (1, 29, 29, 2, 2, 64), "float16", ordering="bit_reversal",
          window=(6, 6), causal=True, seed=0, slow=True),
    # compiled, realistic: a 1-D window over a Hilbert-ordered 64 x 128 patch grid, causal on the patches' order
    _case("gpu_ord_hilbert_window_causal_bf16_8k", (1, 8192, 8192, 4, 2, 128), "bfloat16", ordering="hilbert",
          grid=(64, 128), window=(256, 256), causal=True, gpu=True),
    _case("gpu_ord_zorder_window_packed_fp16_8k", (1, 8192, 8192, 4, 4, 64), "float16", ordering="zorder",
          window=(512, 0), segments="packed", gpu=True),
    _case("gpu_ord_hilbert_window_rope_dropout_bf16_2k", (1, 2048, 2048, 4, 2, 64), "bfloat16", ordering="hilbert",
          grid=(32, 64), window=(128, 128), causal=True, rope=("half", 10000.0), dropout_rate=0.1, dropout_seed=99,
          gpu=True),
    _case("gpu_ord_hilbert_window_alibi_causal_bf16_4k", (1, 4096, 4096, 8, 2, 128), "bfloat16", ordering="hilbert",
          grid=(64, 64), window=(256, 256), causal=True, alibi_slopes=tuple(2.0 ** -(h + 1) for h in range(8)),
          gpu=True),
]
DILATED_CASES = [
    _dl_case("ord_dl_hilbert_lse_causal_gqa", (1, 42, 4, 2, 16), (8, 16), (1, 2), ordering="hilbert", grid=(6, 7),
             causal=True, seed=0),
    _dl_case("ord_dl_zorder_head_groups_fp16", (1, 37, 4, 2, 16), (5, 7), (2, 3), "float16", ordering="zorder",
             merge="head_groups", seed=0),
    _dl_case("ord_dl_snake_lse_dense_mqa", (2, 30, 2, 1, 32), (10, 30), (1, 3), ordering="snake", seed=0, slow=True),
    # compiled, realistic: segments (2048, 4096, 8192), rates (1, 2, 4) over a Hilbert-ordered 128 x 256 grid
    _dl_case("gpu_ord_dl_hilbert_bf16_32k", (1, 32768, 4, 2, 64), (2048, 4096, 8192), (1, 2, 4), "bfloat16",
             ordering="hilbert", grid=(128, 256), gpu=True),
    _dl_case("gpu_ord_dl_zorder_causal_bf16_16k", (1, 16384, 4, 4, 128), (2048, 4096), (1, 2), "bfloat16",
             ordering="zorder", causal=True, merge="head_groups", gpu=True),
]


# ---------------------------------------------------------------------------------------------
# Every implementation of both frameworks against the float64 composite
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("framework, implementation, case", grid_params(SOFTMAX, FLASH_CASES))
def test_flash_ordered_against_golden(framework, implementation, case):
    assert_rule(SOFTMAX, framework, implementation, case)


@pytest.mark.parametrize("framework, implementation, case", grid_params(DILATED, DILATED_CASES))
def test_dilated_ordered_against_golden(framework, implementation, case):
    assert_rule(DILATED, framework, implementation, case)


@pytest.mark.parametrize("record, case", [(SOFTMAX, FLASH_CASES[0]), (DILATED, DILATED_CASES[0])],
                         ids=["flash", "dilated"])
def test_goldens_agree(record, case):
    """The two frameworks' float64 composites are one golden."""
    harness.assert_goldens_agree(record, case)


# ---------------------------------------------------------------------------------------------
# The composite is the definition: a direct NumPy statement in original coordinates
# ---------------------------------------------------------------------------------------------

def _softmax_rows(s, mask, v):
    """float64 masked softmax rows of s [Sq, Sk] against v [Sk, D] -> (out [Sq, D], lse [Sq])."""
    s = np.where(mask, s, -np.inf)
    top = np.max(s, axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    p = np.where(mask, np.exp(s - top), 0.0)
    total = p.sum(1)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(np.where(total > 0, total, 1.0)) + top[:, 0], -np.inf)
    return p @ v / np.where(total > 0, total, 1.0)[:, None], lse


def _numpy_ordered_flash(q, k, v, perm, window, causal, ids):
    """Token i sees token j iff |ordered distance| within the window, j <= i when causal, same id."""
    b_, s_, h_, d_ = q.shape
    inv = spec_orderings.inverse(perm)
    left, right = window
    rank_i, rank_j = inv[:, None], inv[None, :]
    mask = (rank_j >= rank_i - left) & (rank_j <= rank_i + right)
    if causal:
        mask &= np.arange(s_)[None, :] <= np.arange(s_)[:, None]
    out, lse = np.zeros_like(q), np.zeros((b_, h_, s_))
    group = h_ // k.shape[2]
    for b in range(b_):
        m = mask if ids is None else mask & (ids[b][:, None] == ids[b][None, :])
        for h in range(h_):
            out[b, :, h], lse[b, h] = _softmax_rows(q[b, :, h] @ k[b, :, h // group].T * d_ ** -0.5, m,
                                                    v[b, :, h // group])
    return out, lse


def _numpy_ordered_dilated(q, k, v, perm, lengths, rates, causal, merge):
    """Ordered position t of branch (w, r) is kept by head offset o iff (t mod w) mod r == o; kept
    rows of one segment see each other (causal: original position perm[u] <= perm[t]); LSE merge."""
    b_, s_, h_, d_ = q.shape
    group, t = h_ // k.shape[2], np.arange(s_)
    parts = []  # (head, out [B, S, D], lse [B, S]) in ordered positions
    for i, (w, r) in enumerate(zip(lengths, rates)):
        w = min(w, -(-s_ // r) * r)
        heads = range(h_) if merge == "lse" else range(i * h_ // len(lengths), (i + 1) * h_ // len(lengths))
        for h in heads:
            off = h % r if merge == "lse" else i % r
            kept = (t % w) % r == off
            mask = kept[:, None] & kept[None, :] & (t[:, None] // w == t[None, :] // w)
            if causal:
                mask &= perm[None, :] <= perm[:, None]
            o, l = np.zeros((b_, s_, d_)), np.zeros((b_, s_))
            for b in range(b_):
                qo, ko, vo = q[b, perm, h], k[b, perm, h // group], v[b, perm, h // group]
                o[b], l[b] = _softmax_rows(qo @ ko.T * d_ ** -0.5, mask, vo)
            parts.append((h, o, l))
    out, lse = np.zeros((b_, s_, h_, d_)), np.full((b_, h_, s_), -np.inf)
    for h in range(h_):
        mine = [(o, l) for hh, o, l in parts if hh == h]
        ls = np.stack([l for _, l in mine])
        top = np.max(ls, axis=0)
        top = np.where(np.isfinite(top), top, 0.0)
        total = np.exp(ls - top).sum(0)
        with np.errstate(divide="ignore"):
            merged = np.where(total > 0, top + np.log(np.where(total > 0, total, 1.0)), -np.inf)
        w_ = np.exp(ls - np.where(np.isfinite(merged), merged, 0.0)[None])
        o = sum(wk[..., None] * ok for wk, (ok, _) in zip(w_, mine))
        inv = spec_orderings.inverse(perm)
        out[:, :, h], lse[:, h] = o[:, inv], merged[:, inv]
    return out, lse


def _draw(shape, seed=0):
    rng = np.random.default_rng(seed)
    b, s, h, hk, d = shape
    return rng.standard_normal((b, s, h, d)), rng.standard_normal((b, s, hk, d)), rng.standard_normal((b, s, hk, d))


@pytest.mark.parametrize("causal", [False, True])
def test_flash_composite_is_the_definition(causal):
    q, k, v = _draw((2, 30, 4, 2, 8))
    ids = np.repeat(np.array([[0] * 13 + [1] * 17]), 2, 0).astype(np.int32)
    perm = spec_orderings.permutation("hilbert", 30, (5, 6))
    want_out, want_lse = _numpy_ordered_flash(q, k, v, perm, (4, 3), causal, ids)
    with jax.enable_x64(True):
        out, lse = jax_attn.flash_attention(*(jnp.asarray(x) for x in (q, k, v)), window=(4, 3), causal=causal,
                                            segment_ids=jnp.asarray(ids), ordering="hilbert", grid=(5, 6),
                                            return_lse=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=0, atol=1e-12)
    out, lse = torch_ref.flash_attention(*(torch.tensor(x) for x in (q, k, v)), window=(4, 3), causal=causal,
                                         segment_ids=torch.tensor(ids), ordering="hilbert", grid=(5, 6),
                                         return_lse=True, implementation="eager")
    np.testing.assert_allclose(out.numpy(), want_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal, merge", [(True, "lse"), (False, "head_groups")])
def test_dilated_composite_is_the_definition(causal, merge):
    q, k, v = _draw((1, 30, 4, 2, 8))
    perm = spec_orderings.permutation("zorder", 30, (5, 6))
    kw = dict(segment_lengths=(8, 12), dilation_rates=(1, 2), causal=causal, merge=merge)
    want_out, want_lse = _numpy_ordered_dilated(q, k, v, perm, (8, 12), (1, 2), causal, merge)
    with jax.enable_x64(True):
        out, lse = jax_attn.dilated_attention(*(jnp.asarray(x) for x in (q, k, v)), ordering="zorder", grid=(5, 6),
                                              return_lse=True, implementation="xla", **kw)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(want_lse))
    out, lse = torch_ref.dilated_attention(*(torch.tensor(x) for x in (q, k, v)), ordering="zorder", grid=(5, 6),
                                           return_lse=True, implementation="eager", **kw)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Identity is no ordering; without a locality pattern an ordering changes nothing
# ---------------------------------------------------------------------------------------------

def _inputs(framework, shape, dtype="float32", seed=1):
    q, k, v = _draw(shape, seed)
    if framework == "jax":
        return tuple(jnp.asarray(x, dtype) for x in (q, k, v))
    return tuple(torch.tensor(x, dtype=getattr(torch, dtype)) for x in (q, k, v))


def _fn(framework, variant):
    lib = jax_attn if framework == "jax" else torch_ref
    return lib.flash_attention if variant == "flash" else lib.dilated_attention


def _np(x):
    return np.asarray(x.detach().numpy() if isinstance(x, torch.Tensor) else x)


@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("variant, kw", [("flash", dict(window=(3, 2), causal=True)),
                                         ("dilated", dict(segment_lengths=(8,), dilation_rates=(2,)))])
def test_identity_is_no_ordering_bitwise(framework, variant, kw):
    q, k, v = _inputs(framework, (1, 21, 2, 1, 16))
    f = _fn(framework, variant)
    plain = _np(f(q, k, v, implementation="triton", **kw))
    for ordering in ("identity", np.arange(21)):
        np.testing.assert_array_equal(_np(f(q, k, v, ordering=ordering, implementation="triton", **kw)), plain)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_no_window_no_effect(framework):
    """Dense attention (causal, segment ids) is invariant to the ordering: the API runs it as
    without one, bitwise, on every implementation."""
    q, k, v = _inputs(framework, (2, 24, 2, 2, 16))
    ids = np.repeat(np.array([[0] * 10 + [1] * 14]), 2, 0)
    ids = jnp.asarray(ids) if framework == "jax" else torch.tensor(ids)
    f = _fn(framework, "flash")
    for impl in ("triton", "xla" if framework == "jax" else "eager"):
        plain = _np(f(q, k, v, causal=True, segment_ids=ids, implementation=impl))
        ordered = _np(f(q, k, v, causal=True, segment_ids=ids, ordering="hilbert", implementation=impl))
        np.testing.assert_array_equal(ordered, plain)


def test_no_window_invariance_holds_in_the_kernels_and_the_composite():
    """Not only by the shortcut: the gathering kernels (every tile masked by original-position
    causality) and the float64 composite both give unordered attention when there is no window."""
    q, k, v = _inputs("jax", (1, 40, 4, 2, 16))
    ids = jnp.asarray(np.array([[0] * 15 + [1] * 25]))
    perm = jnp.asarray(spec_orderings.permutation("hilbert", 40))
    spec = AttentionSpec(scale=0.25, causal=True, has_segments=True, precision=jax.lax.Precision.HIGHEST)
    ordered_spec = AttentionSpec(scale=0.25, causal=True, has_segments=True, ordered=True,
                                 precision=jax.lax.Precision.HIGHEST)
    fast, _ = jax_engine.flash_attention_pallas(q, k, v, ids, ids, ordered_spec, order=perm)
    naive, _ = jax_softmax_ref.attention_reference(q, k, v, ids, ids, spec)
    with jax.enable_x64(True):
        q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
        gold, gold_lse = jax_softmax_ref.attention_reference(q64, k64, v64, ids, ids, spec)
        comp, comp_lse = jax_ordered.ordered_attention_reference(q64, k64, v64, ids, ids, ordered_spec, perm)
        np.testing.assert_allclose(np.asarray(comp), np.asarray(gold), rtol=0, atol=1e-13)
        np.testing.assert_allclose(np.asarray(comp_lse), np.asarray(gold_lse), rtol=0, atol=1e-13)
    verdict = compare(fast, naive, gold, np.float32, 2.0)
    assert verdict.ok, verdict


def test_traced_permutation_under_jit():
    q, k, v = _inputs("jax", (1, 30, 2, 2, 16))
    perm = spec_orderings.permutation("gray", 30)
    f = jax.jit(lambda q, k, v, p: jax_attn.flash_attention(q, k, v, window=(4, 4), ordering=p))
    want = jax_attn.flash_attention(q, k, v, window=(4, 4), ordering="gray")
    np.testing.assert_array_equal(np.asarray(f(q, k, v, jnp.asarray(perm))), np.asarray(want))


# ---------------------------------------------------------------------------------------------
# Errors and the implementation rule
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("variant", ["flash", "dilated"])
def test_bad_orderings(framework, variant):
    q, k, v = _inputs(framework, (1, 30, 2, 2, 16))
    kw = dict(window=(2, 2)) if variant == "flash" else dict(segment_lengths=(8,), dilation_rates=(2,))
    f = _fn(framework, variant)
    with pytest.raises(ValueError, match="ordering must be one of"):
        f(q, k, v, ordering="hilbret", **kw)
    with pytest.raises(ValueError, match="1-D integer of length 30"):
        f(q, k, v, ordering=np.arange(29), **kw)
    with pytest.raises(ValueError, match="non-integer"):
        f(q, k, v, ordering=np.arange(30.0), **kw)
    with pytest.raises(ValueError, match="not a permutation"):
        f(q, k, v, ordering=np.zeros(30, np.int64), **kw)
    with pytest.raises(ValueError, match="has 32 cells but the sequence has 30 tokens"):
        f(q, k, v, ordering="hilbert", grid=(4, 8), **kw)
    with pytest.raises(ValueError, match="fewer than n=30"):
        f(q, k, v, ordering="zorder", grid=(4, 4), **kw)
    with pytest.raises(ValueError, match="without an ordering"):
        f(q, k, v, grid=(5, 6), **kw)
    with pytest.raises(ValueError, match="not to a permutation array"):
        f(q, k, v, ordering=np.arange(30), grid=(5, 6), **kw)
    # the boundary: a grid of exactly the sequence, a permutation array
    assert f(q, k, v, ordering="hilbert", grid=(5, 6), **kw).shape == q.shape
    assert f(q, k, v, ordering=np.random.default_rng(0).permutation(30), **kw).shape == q.shape


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_ordering_needs_self_attention_and_refuses_positions(framework):
    q, k, v = _inputs(framework, (1, 30, 2, 2, 16))
    f = _fn(framework, "flash")
    with pytest.raises(ValueError, match="Sq == Sk"):
        f(q[:, :20], k, v, window=(2, 2), ordering="hilbert")
    with pytest.raises(NotImplementedError, match="does not combine with q_offset/kv_offset"):
        f(q, k, v, window=(2, 2), ordering="hilbert", q_offset=3, kv_offset=3)


def _feature_kwargs(framework, feature):
    """flash_attention's arguments of a feature that follows the tokens under an ordering."""
    if feature == "dropout":
        return dict(dropout_rate=0.3, **({"dropout_key": jax.random.key(7)} if framework == "jax"
                                         else {"dropout_seed": 7}))
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    return dict(alibi_slopes=jnp.asarray(slopes) if framework == "jax" else torch.tensor(slopes))


@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("feature, ordering", [("dropout", "zorder"), ("alibi", "hilbert")])
def test_ordered_features_follow_the_tokens(framework, feature, ordering):
    """Dropout under an ordering drops the pairs of tokens that the unordered call drops, and ALiBi
    penalises the tokens' original distance |pi[t] - pi[u]|: with a window wider than the sequence
    (ordered, every key visible) the call equals the unordered one (the same seed, the same slopes),
    on the kernels and on the composite, out and gradients; a narrow window differs."""
    lib = jax_attn if framework == "jax" else torch_ref
    q, k, v = _inputs(framework, (2, 30, 4, 2, 16))
    kw = dict(causal=True, **_feature_kwargs(framework, feature))
    if framework == "jax":
        def run(impl, **extra):
            f = lambda q, k, v: lib.flash_attention(q, k, v, implementation=impl, **kw, **extra)
            out, vjp = jax.vjp(f, q, k, v)
            return [np.asarray(x) for x in (out, *vjp(jnp.ones_like(out)))]
    else:
        def run(impl, **extra):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            out = lib.flash_attention(*leaves, implementation=impl, **kw, **extra)
            return [_np(x) for x in (out, *torch.autograd.grad(out.sum(), leaves))]
    for impl in ("triton", "xla" if framework == "jax" else "eager"):
        plain = run(impl)
        wide = run(impl, window=(30, 30), ordering=ordering, grid=(5, 6))
        for got, want in zip(wide, plain):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)  # a few ulps of values up to 8
        narrow = run(impl, window=(3, 3), ordering=ordering, grid=(5, 6))
        assert np.abs(narrow[0] - plain[0]).max() > 1e-2  # the window on the ordered sequence took effect


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_ordered_rope_rotates_at_the_original_positions(framework):
    """RoPE under an ordering: token t keeps its own position (given or arange), whatever its place
    in the ordered sequence. A window wider than the sequence keeps the ordering (the kernels
    gather) yet leaves every key visible, so the call must equal unordered attention with RoPE
    rotated inside the kernels; with a narrow window the ordering takes effect."""
    lib = jax_attn if framework == "jax" else torch_ref
    q, k, v = _inputs(framework, (1, 30, 4, 2, 32))
    pos = np.arange(30)[None] * 3 + 7  # positions of their own: not the row indices
    pos = jnp.asarray(pos, jnp.int32) if framework == "jax" else torch.tensor(pos, dtype=torch.int32)
    f = lib.flash_attention
    kw = dict(rope=lib.Rope(style="half", base=500.0), positions=pos, causal=True, implementation="triton")
    plain = _np(f(q, k, v, **kw))
    wide = _np(f(q, k, v, window=(30, 30), ordering="hilbert", grid=(5, 6), **kw))
    np.testing.assert_allclose(wide, plain, rtol=0, atol=4e-6)
    narrow = _np(f(q, k, v, window=(4, 4), ordering="hilbert", grid=(5, 6), **kw))
    assert np.abs(narrow - plain).max() > 1e-2  # the window on the ordered sequence took effect


def test_mosaic_refuses_and_the_rule_picks_triton():
    q, k, v = _inputs("jax", (1, 30, 2, 2, 16))
    with pytest.raises(NotImplementedError, match="contiguous TMA boxes"):
        jax_attn.flash_attention(q, k, v, window=(2, 2), ordering="hilbert", implementation="mosaic")
    with pytest.raises(NotImplementedError, match="contiguous TMA boxes"):
        jax_attn.dilated_attention(q, k, v, segment_lengths=(8,), dilation_rates=(2,), ordering="hilbert",
                                   implementation="mosaic")
    ordered = AttentionSpec(scale=1.0, causal=True, window_left=64, window_right=0, ordered=True)
    call = jax_attn.registry.Call(ordered, 128, jnp.dtype(jnp.bfloat16))
    assert jax_attn.registry.REGISTRY["softmax"]["mosaic"].unsupported_reason(call) is not None
    assert jax_attn.registry.choose("softmax", call) in ("triton", "xla")  # "xla" where Pallas Triton cannot run
    assert jax_attn.registry.choose("dilated", call) in ("triton", "xla")


# ---------------------------------------------------------------------------------------------
# Layers: ordering= and grid= on the attention layers, HilbertDilatedAttention and its torch twin
# ---------------------------------------------------------------------------------------------

_LAYER_CASES = ["layer_attention_hilbert_window_causal", "layer_hilbert_dilated_causal_gqa",
                "layer_dilated_zorder_head_groups"]


@pytest.mark.parametrize("name", _LAYER_CASES)
def test_layer_parity(name):
    """The Flax layer and its torch twin with the same weights (parity.bridge): out, dx and every
    parameter gradient within the rule of the float64 torch golden, kernels included."""
    import parity.layers as pl

    case = next(c for c in pl.LAYER_CASES if c.name == name)
    rows = pl.check_layer_case(case, "cpu")
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    assert any(r["impl"] in ("jax pallas_triton", "torch triton") for r in rows) or not case.cpu_kernels


def test_hilbert_dilated_layer_is_the_ordered_multihead_layer():
    from flax import nnx

    kw = dict(segment_lengths=(4, 8), dilation_rates=(1, 2), causal=True)
    hilbert = jax_attn.HilbertDilatedAttention(4, 32, grid=(4, 5), rngs=nnx.Rngs(0), **kw)
    plain = jax_attn.MultiheadDilatedAttention(4, 32, ordering="hilbert", grid=(4, 5), rngs=nnx.Rngs(0), **kw)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 20, 32)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(hilbert(x)), np.asarray(plain(x)))
    with pytest.raises(ValueError, match="has 24 cells but the sequence has 20"):
        jax_attn.HilbertDilatedAttention(4, 32, grid=(4, 6), rngs=nnx.Rngs(0), **kw)(x)
    with pytest.raises(ValueError, match="grid must be"):
        torch_ref.HilbertDilatedAttention(4, 32, grid=(4, "5"), **kw)
    with pytest.raises(ValueError, match="ordering must be one of"):
        torch_ref.MultiHeadSelfAttention(32, 4, window=(2, 2), ordering="peano")
    with pytest.raises(ValueError, match="does not take ordering"):
        torch_ref.MultiHeadSelfAttention(32, 4, attention="stick_breaking", causal=True, ordering="hilbert")
