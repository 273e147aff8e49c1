"""Native Sparse Attention in JAX: `selection_attention`, `compress_kv`, `compression_attention`,
`select_blocks`, `nsa_attention`.

Every differentiable quantity is held to the tolerance rule (docs/design/parity.md): the kernel
path ("triton": the selection kernels, the flash engine, chunked importance) against the float64
golden (the plain reference, "xla", under jax.enable_x64), with the plain reference in the compute
dtype as the naive run. Gradients through `jax.vjp` with random cotangents (lse's too).
`select_blocks` is checked against a NumPy recomputation of the rule of attn_spec/nsa.py.

CPU runs the kernels through the Pallas interpreter at small, awkward shapes; tests marked `gpu`
run the compiled kernels at realistic shapes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_attn
from attn_spec import nsa
from attn_spec.nsa import CompressParams
from jax_attn import compress_kv, compression_attention, nsa_attention, select_blocks, selection_attention
from jax_attn.ops.nsa import branches, importance, plan, reference
from jax_golden import NP_DTYPE
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare

ON_GPU = jax.default_backend() == "gpu"


# ---------------------------------------------------------------------------------------------
# The three results of the tolerance rule for any function of float arrays
# ---------------------------------------------------------------------------------------------

def _run(fn, arrays, cotangents, dtype, implementation):
    """Outputs and gradients (float64 NumPy) of fn(implementation, *arrays) through jax.vjp;
    float arrays cast to dtype, cotangents to each output's dtype."""
    cast = lambda x: jnp.asarray(x, dtype)
    outs, vjp = jax.vjp(lambda *a: fn(implementation, *a), *[cast(a) for a in arrays])
    outs = outs if isinstance(outs, tuple) else (outs,)
    cts = tuple(jnp.asarray(c, o.dtype) for c, o in zip(cotangents, outs))
    grads = vjp(cts if len(cts) > 1 else cts[0])
    return [np.asarray(x, np.float64) for x in (*outs, *grads)]


def check_rule(fn, arrays, cotangents, dtype=jnp.float32, num_outputs=None, implementation="triton"):
    """fn(implementation, *arrays) -> output(s). Golden (float64, "xla"), naive ("xla", dtype), fast
    (`implementation`, dtype): every output within 2x, every gradient within 3x the naive error
    plus the rounding floor. Returns (fast, golden)."""
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        gold = _run(fn, arrays, cotangents, jnp.float64, "xla")
    with jax.default_matmul_precision("highest"):  # fp32: exact dots on both sides
        naive = _run(fn, arrays, cotangents, dtype, "xla")
        fast = _run(fn, arrays, cotangents, dtype, implementation)
    outputs = len(cotangents) if num_outputs is None else num_outputs
    for i, (f, n, g) in enumerate(zip(fast, naive, gold)):
        factor = FORWARD_FACTOR if i < outputs else GRADIENT_FACTOR
        verdict = compare(f, n, g, NP_DTYPE[dtype], factor)
        assert verdict.ok, f"{'output' if i < outputs else 'gradient'} {i}: {verdict}"
    return fast, gold


def _qkv(rng, batch, seq_len, heads, kv_heads, head_dim):
    return (rng.standard_normal((batch, seq_len, heads, head_dim)),
            rng.standard_normal((batch, seq_len, kv_heads, head_dim)),
            rng.standard_normal((batch, seq_len, kv_heads, head_dim)))


def _cotangents(rng, batch, seq_len, heads, head_dim):
    return rng.standard_normal((batch, seq_len, heads, head_dim)), rng.standard_normal((batch, heads, seq_len))


def _messy_indices(rng, batch, seq_len, kv_heads, n, block_size):
    """Block lists with every kind of ignored entry: -1, beyond the frontier, past the sequence,
    repeated; each row has its own block 0 or own block (for some visible keys)."""
    num = -(-seq_len // block_size)
    idx = rng.integers(-1, num + 1, (batch, seq_len, kv_heads, n))
    own = np.arange(seq_len)[None, :, None] // block_size
    idx[..., 0] = own
    idx[..., 1] = idx[..., 2] if n > 2 else idx[..., 1]  # a repeat
    return idx.astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Selection attention
# ---------------------------------------------------------------------------------------------

SELECTION = [
    # (batch, seq_len, heads, kv_heads, head_dim, block_size, n)
    pytest.param(1, 37, 4, 2, 16, 16, 3, id="gqa2_s37"),
    pytest.param(2, 29, 2, 2, 16, 8, 4, id="ratio1_s29_block8"),  # blocks under 16 keys: walked as ranges
    pytest.param(1, 33, 8, 2, 40, 16, 2, id="gqa4_d40"),
    pytest.param(1, 20, 16, 1, 16, 16, 2, id="ratio16"),
    pytest.param(1, 23, 6, 2, 16, 16, 3, id="gqa3_not_pow2"),
]


@pytest.mark.parametrize("batch, seq_len, heads, kv_heads, head_dim, block_size, n", SELECTION)
def test_selection_lists(batch, seq_len, heads, kv_heads, head_dim, block_size, n):
    rng = np.random.default_rng(seq_len + heads)
    arrays = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    idx = _messy_indices(rng, batch, seq_len, kv_heads, n, block_size)
    fn = lambda impl, q, k, v: selection_attention(q, k, v, jnp.asarray(idx), block_size=block_size,
                                                   return_lse=True, implementation=impl)
    check_rule(fn, arrays, _cotangents(rng, batch, seq_len, heads, head_dim))


@pytest.mark.parametrize("config", [jax_attn.NSABlockSizes(2, 2, 16, 4, 1, 4, 1, 1, 4, "tokens"),
                                    jax_attn.NSABlockSizes(1, 1, 16, 4, 1, 4, 1, 4, 8, "tokens"),
                                    jax_attn.NSABlockSizes(1, 1, 16, 4, 1, 4, 1, 8, 4, "blocks")],
                         ids=["chunks4", "gather4", "blocks_chunks4"])
def test_selection_dkdv_work_items(config):
    """dK/dV with block 0 selected by every token, cut into chunks of 4 or 8 tokens (many items per
    block, summed per block), one token or four gathered tokens a step; two or one tokens per
    forward program, or the forward and dQ visiting by blocks on the same items (steps of 8 tokens
    crossing the chunks' ends: their stores masked); segment ids."""
    rng = np.random.default_rng(11)
    batch, seq_len, heads, kv_heads, head_dim, bs, n = 2, 53, 4, 2, 16, 16, 3
    arrays = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    idx = _messy_indices(rng, batch, seq_len, kv_heads, n, bs)
    idx[..., 1] = 0
    ids = jnp.asarray(np.sort(rng.integers(0, 2, (batch, seq_len)), axis=1), jnp.int32)
    fn = lambda impl, q, k, v: selection_attention(q, k, v, jnp.asarray(idx), block_size=bs, segment_ids=ids,
                                                   return_lse=True, implementation=impl,
                                                   config=config if impl == "triton" else None)
    check_rule(fn, arrays, _cotangents(rng, batch, seq_len, heads, head_dim))


@pytest.mark.parametrize("heads, kv_heads, visit", [(2, 2, "tokens"), (16, 1, "blocks")])
def test_selection_visits(heads, kv_heads, visit):
    """Each visit where the group would choose the other: by tokens at ratio 1 (16-row tiles of 16
    tokens' block union), by blocks at 16 heads a kv head (each pair's partial output, lse and dQ,
    combined per token); segment ids, rows that see nothing."""
    rng = np.random.default_rng(heads)
    batch, seq_len, head_dim, bs, n = 2, 45, 16, 16, 3
    arrays = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    idx = _messy_indices(rng, batch, seq_len, kv_heads, n, bs)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (batch, seq_len)), axis=1), jnp.int32)
    config = jax_attn.NSABlockSizes(visit=visit, chunk_dkdv=8)
    fn = lambda impl, q, k, v: selection_attention(q, k, v, jnp.asarray(idx), block_size=bs, segment_ids=ids,
                                                   return_lse=True, implementation=impl,
                                                   config=config if impl == "triton" else None)
    check_rule(fn, arrays, _cotangents(rng, batch, seq_len, heads, head_dim))


def test_selection_counts_and_fp16():
    rng = np.random.default_rng(1)
    batch, seq_len, heads, kv_heads, head_dim, bs, n = 1, 41, 4, 2, 32, 16, 3
    arrays = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    idx = _messy_indices(rng, batch, seq_len, kv_heads, n, bs)
    counts = jnp.asarray(rng.integers(0, n + 1, (batch, seq_len, kv_heads)), jnp.int32)
    fn = lambda impl, q, k, v: selection_attention(q, k, v, jnp.asarray(idx), counts, block_size=bs,
                                                   return_lse=True, implementation=impl)
    for dtype in (jnp.float32, jnp.float16):
        check_rule(fn, arrays, _cotangents(rng, batch, seq_len, heads, head_dim), dtype)


def test_selection_segments_and_not_causal():
    rng = np.random.default_rng(2)
    batch, seq_len, heads, kv_heads, head_dim, bs, n = 2, 30, 4, 1, 16, 8, 3
    arrays = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    idx = jnp.asarray(rng.integers(-1, 4, (batch, seq_len, kv_heads, n)), jnp.int32)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (batch, seq_len)), axis=1), jnp.int32)
    for causal in (True, False):
        fn = lambda impl, q, k, v: selection_attention(q, k, v, idx, block_size=bs, causal=causal, segment_ids=ids,
                                                       return_lse=True, implementation=impl)
        check_rule(fn, arrays, _cotangents(rng, batch, seq_len, heads, head_dim))


@pytest.mark.parametrize("tokens", [None, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_selection_ranges(causal, tokens):
    """Overlapping, empty and out-of-order ranges: their union, each key once. tokens=None: the
    forward and dQ programs take several tokens (the scan of their key tiles); 1: one token walking
    its own ranges."""
    rng = np.random.default_rng(3)
    batch, seq_len, heads, kv_heads, head_dim = 1, 35, 4, 2, 16
    arrays = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    ends = rng.integers(0, seq_len + 1, (batch, seq_len, kv_heads, 3, 2))
    ranges = np.sort(ends, axis=-1)
    ranges[..., 2, :] = ranges[..., 0, :] + [[2, 5]]  # overlaps range 0 (clipped below)
    ranges = np.minimum(ranges, seq_len)
    ranges[0, 5, 0, 1] = (7, 7)  # empty
    ids = jnp.asarray(np.sort(rng.integers(0, 2, (batch, seq_len)), axis=1), jnp.int32)
    config = jax_attn.NSABlockSizes(tokens=tokens, tokens_dq=tokens, block_k_ranges=16)
    fn = lambda impl, q, k, v: selection_attention(q, k, v, ranges=jnp.asarray(ranges, jnp.int32), causal=causal,
                                                   segment_ids=ids, return_lse=True, implementation=impl,
                                                   config=config if impl == "triton" else None)
    check_rule(fn, arrays, _cotangents(rng, batch, seq_len, heads, head_dim))


def test_canonical_blocks_rule():
    """-1, past the sequence, beyond the frontier, past counts and repeats are dropped; the rest
    ascending, then -1."""
    idx = jnp.asarray([[3, -1, 0, 0, 9, 1], [2, 2, 1, 0, -5, 1]], jnp.int32).reshape(1, 2, 1, 6)
    blocks, counts = plan.canonical_blocks(idx, jnp.asarray([[[6], [3]]], jnp.int32), 1, 4, causal=True)
    # row 0 (t = 0): only block 0 is within the frontier; row 1 (t = 1, counts 3: [2, 2, 1]): block 1
    np.testing.assert_array_equal(np.asarray(blocks)[0, 0, 0], [0, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(blocks)[0, 1, 0], [1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(counts)[0, :, 0], [1, 1])
    blocks, counts = plan.canonical_blocks(idx, None, 1, 4, causal=False)
    np.testing.assert_array_equal(np.asarray(blocks)[0, 0, 0], [0, 1, 3, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(blocks)[0, 1, 0], [0, 1, 2, -1, -1, -1])


def test_fully_masked_rows_no_nan():
    """Rows whose every entry is ignored (and, with segment ids, rows whose blocks lie in another
    segment): output 0, lse -inf, gradients finite and zero for those rows."""
    rng = np.random.default_rng(4)
    batch, seq_len, heads, kv_heads, head_dim, bs = 1, 40, 4, 2, 16, 16
    arrays = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    idx = np.full((batch, seq_len, kv_heads, 2), -1, np.int32)
    idx[:, ::2, :, 0] = np.arange(0, seq_len, 2)[None, :, None] // bs  # even rows see their own block
    idx[:, 1::4, :, 1] = 5  # beyond the frontier: ignored
    fn = lambda impl, q, k, v: selection_attention(q, k, v, jnp.asarray(idx), block_size=bs, return_lse=True,
                                                   implementation=impl)
    fast, gold = check_rule(fn, arrays, _cotangents(rng, batch, seq_len, heads, head_dim))
    out, lse, dq = fast[0], fast[1], fast[2]
    for x in fast:
        assert not np.isnan(x).any()
    assert np.isneginf(lse[:, :, 1::2]).all() and np.isfinite(lse[:, :, ::2]).all()
    assert (out[:, 1::2] == 0).all() and (dq[:, 1::2] == 0).all()


def test_deterministic():
    rng = np.random.default_rng(5)
    batch, seq_len, heads, kv_heads, head_dim, bs, n = 1, 40, 4, 2, 16, 16, 3
    arrays = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    idx = _messy_indices(rng, batch, seq_len, kv_heads, n, bs)
    cts = _cotangents(rng, batch, seq_len, heads, head_dim)
    for sel in (dict(block_indices=jnp.asarray(idx)),
                dict(ranges=jnp.asarray(np.sort(rng.integers(0, seq_len, (batch, seq_len, kv_heads, 2, 2)), -1),
                                        jnp.int32))):
        fn = lambda impl, q, k, v: selection_attention(q, k, v, block_size=bs, return_lse=True, implementation=impl,
                                                       **sel)
        first, second = (_run(fn, arrays, cts, jnp.float32, "triton") for _ in range(2))
        for a, b in zip(first, second):
            np.testing.assert_array_equal(a, b)


def test_transpose_plan():
    """Block j's tokens are those that selected it, ascending; `places` finds every pair there."""
    rng = np.random.default_rng(6)
    blocks, _ = plan.canonical_blocks(jnp.asarray(rng.integers(-1, 5, (2, 30, 3, 4)), jnp.int32), None, 8, 30, True)
    tokens, offsets, places = plan.transpose_plan(blocks, 4)
    b = np.asarray(blocks)
    for batch in range(2):
        for h in range(3):
            for j in range(4):
                got = np.asarray(tokens)[batch, h, offsets[batch, h, j]:offsets[batch, h, j + 1]]
                want = np.nonzero((b[batch, :, h] == j).any(-1))[0]
                np.testing.assert_array_equal(got, want)
            for t, i in zip(*np.nonzero(b[batch, :, h] >= 0)):
                place = int(places[batch, h, t * 4 + i])
                assert offsets[batch, h, b[batch, t, h, i]] <= place < offsets[batch, h, b[batch, t, h, i] + 1]
                assert tokens[batch, h, place] == t


# ---------------------------------------------------------------------------------------------
# Compression
# ---------------------------------------------------------------------------------------------

def _params(rng, block, head_dim, hidden):
    return CompressParams(rng.standard_normal((block, head_dim)) * 0.5,
                          rng.standard_normal((block * head_dim, hidden)) / np.sqrt(block * head_dim),
                          rng.standard_normal(hidden) * 0.1, rng.standard_normal((hidden, head_dim)) / np.sqrt(hidden),
                          rng.standard_normal(head_dim) * 0.1)


def test_compress_mean_is_block_mean():
    rng = np.random.default_rng(7)
    k, v = (rng.standard_normal((2, 45, 2, 8)).astype(np.float32) for _ in range(2))
    kc, vc = compress_kv(jnp.asarray(k), jnp.asarray(v), block=16, stride=8)
    assert kc.shape == (2, nsa.compressed_count(45, 16, 8), 2, 8)
    for i in range(kc.shape[1]):
        np.testing.assert_allclose(np.asarray(kc)[:, i], k[:, i * 8:i * 8 + 16].mean(1), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(vc)[:, i], v[:, i * 8:i * 8 + 16].mean(1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block, stride, mlp, segments", [
    (16, 8, False, False), (8, 8, True, False), pytest.param(16, 4, False, True, marks=pytest.mark.slow),
    pytest.param(8, 1, True, True, marks=pytest.mark.slow)])
def test_compression_branch(block, stride, mlp, segments):
    """compress_kv + compression_attention, gradients to q, k, v (and the MLP's parameters)."""
    rng = np.random.default_rng(block + stride)
    batch, seq_len, heads, kv_heads, head_dim = 2, 43, 4, 2, 16
    q, k, v = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    ids = jnp.asarray(np.sort(rng.integers(0, 2, (batch, seq_len)), axis=1), jnp.int32) if segments else None
    params = [*_params(rng, block, head_dim, 24), *_params(rng, block, head_dim, 24)] if mlp else []

    def fn(impl, q, k, v, *flat):
        pair = (CompressParams(*flat[:5]), CompressParams(*flat[5:])) if flat else None
        kc, vc = compress_kv(k, v, block=block, stride=stride, params=pair)
        return compression_attention(q, kc, vc, block=block, stride=stride, segment_ids=ids, return_lse=True,
                                     implementation=impl)

    check_rule(fn, [q, k, v, *params], _cotangents(rng, batch, seq_len, heads, head_dim))


@pytest.mark.parametrize("parts", [2, 3])
def test_compression_slots_in_parts(parts):
    """The folded slots split into batch rows with copies of the compressed keys (`parts`, which
    the device's SM count sets at scale; 7 slots in 3 parts pads the last with a zero slot): the
    same branch, the compressed keys' gradients added over the parts."""
    rng = np.random.default_rng(parts)
    batch, seq_len, heads, kv_heads, head_dim, block, stride = 2, 43, 4, 2, 16, 16, 8
    count = nsa.compressed_count(seq_len, block, stride)
    q = rng.standard_normal((batch, seq_len, heads, head_dim))
    kc, vc = (rng.standard_normal((batch, count, kv_heads, head_dim)) for _ in range(2))

    def fn(impl, q, kc, vc):
        if impl == "xla":
            return compression_attention(q, kc, vc, block=block, stride=stride, return_lse=True, implementation="xla")
        attention = lambda qs, ks, vs, seg: jax_attn.flash_attention(qs, ks, vs, causal=True, segment_ids=seg,
                                                                     scale=head_dim ** -0.5, return_lse=True)
        return branches.compression_engine(q, kc, vc, block=block, stride=stride, scale=head_dim ** -0.5,
                                           attention=attention, parts=parts)

    check_rule(fn, [q, kc, vc], _cotangents(rng, batch, seq_len, heads, head_dim))


def test_slot_parts():
    """About twice as many dK/dV programs as SMs, never more parts than slots, 1 without an SM count."""
    assert branches.slot_parts(63, 1, 4, 1024, 132) == 9  # 64k tokens, compression 64/64, 4 kv heads
    assert branches.slot_parts(15, 1, 4, 4095, 132) == 3  # 64k tokens, compression 32/16
    assert branches.slot_parts(15, 1, 16, 4095, 132) == 1
    assert branches.slot_parts(3, 1, 1, 16, 132) == 3
    assert branches.slot_parts(63, 1, 4, 1024, None) == 1


def test_compression_short_sequence():
    """S < block: no compressed key; every row 0, lse -inf."""
    q = jnp.ones((1, 5, 2, 8))
    kc, vc = compress_kv(q, q, block=8, stride=4)
    assert kc.shape == (1, 0, 2, 8)
    for impl in ("xla", "triton"):
        out, lse = compression_attention(q, kc, vc, block=8, stride=4, return_lse=True, implementation=impl)
        assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()


# ---------------------------------------------------------------------------------------------
# Top-n selection against NumPy
# ---------------------------------------------------------------------------------------------

def _numpy_select(q, k_cmp, lse, block, stride, select_block, n, scale):
    """The rule of attn_spec/nsa.py, loop by loop, in float64."""
    batch, seq_len, heads, _ = q.shape
    kv_heads = k_cmp.shape[2]
    group = heads // kv_heads
    overlap = nsa.overlap_matrix(seq_len, block, stride, select_block)
    num = overlap.shape[1]
    out = np.full((batch, seq_len, kv_heads, n), -1, np.int64)
    for b in range(batch):
        for t in range(seq_len):
            visible = nsa.compressed_end(np.arange(k_cmp.shape[1]), block, stride) <= t
            for g in range(kv_heads):
                imp = np.zeros(num)
                for h in range(g * group, (g + 1) * group):
                    if np.isfinite(lse[b, h, t]):
                        p = np.exp(scale * k_cmp[b, :, g] @ q[b, t, h] - lse[b, h, t]) * visible
                        imp += p @ overlap
                frontier = t // select_block
                forced = {f for f in nsa.forced_blocks(t, select_block) if f >= 0}
                rest = sorted((j for j in range(frontier + 1) if j not in forced), key=lambda j: (-imp[j], j))
                chosen = sorted(sorted(forced)[:n] + rest[:max(0, n - len(forced))])
                out[b, t, g, :len(chosen)] = chosen
    return out


@pytest.mark.parametrize("block, stride, select_block, n", [(16, 8, 16, 3), (8, 8, 8, 5), (16, 4, 32, 2),
                                                            (32, 16, 8, 4)])
def test_select_blocks_rule(block, stride, select_block, n):
    rng = np.random.default_rng(block * stride + n)
    batch, seq_len, heads, kv_heads, head_dim = 2, 70, 4, 2, 16
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _qkv(rng, batch, seq_len, heads, kv_heads, head_dim))
    q = q * 3.0  # peaked probabilities: importance gaps far above rounding
    with jax.default_matmul_precision("highest"):
        kc, vc = compress_kv(k, v, block=block, stride=stride)
        _, lse = compression_attention(q, kc, vc, block=block, stride=stride, return_lse=True)
        want = _numpy_select(np.asarray(q, np.float64), np.asarray(kc, np.float64), np.asarray(lse, np.float64),
                             block, stride, select_block, n, head_dim ** -0.5)
        for impl in ("xla", "triton"):
            got = select_blocks(q, kc, lse, block=block, stride=stride, select_block=select_block, num_selected=n,
                                implementation=impl)
            assert got.dtype == jnp.int32 and got.shape == (batch, seq_len, kv_heads, n)
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=impl)


def test_top_n_ties_and_forced():
    """Equal importance: the lower index first; forced blocks whatever their importance; -1 last."""
    imp = np.zeros((1, 6, 1, 6), np.float32)
    imp[0, 5, 0] = [0.0, 5.0, 5.0, 5.0, -1.0, 0.0]  # t = 5, select_block 1: frontier 5, forced 0, 4, 5
    imp[0, 3, 0] = [9.0, 1.0, 1.0, 0.0, 0.0, 0.0]   # t = 3: forced 0, 2, 3; then 1
    got = np.asarray(reference.top_n(jnp.asarray(imp), 1, 4))[0, :, 0]
    np.testing.assert_array_equal(got[5], [0, 1, 4, 5])
    np.testing.assert_array_equal(got[3], [0, 1, 2, 3])
    np.testing.assert_array_equal(got[0], [0, -1, -1, -1])
    np.testing.assert_array_equal(got[1], [0, 1, -1, -1])
    ties = np.zeros((1, 40, 1, 5), np.float32)  # select_block 8, t = 39: forced 0, 3, 4; ties: 1 before 2
    np.testing.assert_array_equal(np.asarray(reference.top_n(jnp.asarray(ties), 8, 4))[0, 39, 0], [0, 1, 3, 4])


@pytest.mark.parametrize("rows, count, n", [(5, 6, 4), (37, 300, 16), (64, 40, 3), (3, 700, 5)])
def test_top_n_kernel_ranks_as_lax_top_k(rows, count, n):
    """The top-n kernel on scores with many ties, +inf and -inf (one row all -inf, one row with
    fewer finite entries than n), over several column tiles: `lax.top_k`'s choice, ascending, -1 last."""
    rng = np.random.default_rng(rows)
    x = rng.integers(0, 5, (rows, count)).astype(np.float32)
    x[rng.random((rows, count)) < 0.2] = -np.inf
    x[rng.random((rows, count)) < 0.05] = np.inf
    x[0] = -np.inf
    x[1, 2:] = -np.inf
    values, idx = jax.lax.top_k(jnp.asarray(x), n)
    idx = np.sort(np.where(np.asarray(values) == -np.inf, count, np.asarray(idx)), axis=-1)
    want = np.where(idx == count, -1, idx)
    got = np.asarray(importance.top_n_rows(jnp.asarray(x), n, interpret=True))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (6, 2), (2, 2)])
def test_selection_kernel_path_matches_reference(heads, kv_heads):
    """The importance kernel (groups padded inside), the shifted-slice overlap map and the chunked
    top-n (chunks far smaller than the sequence) choose what the dense reference chooses, with and
    without segment ids."""
    rng = np.random.default_rng(8)
    q, k, _ = (jnp.asarray(x, jnp.float32) for x in _qkv(rng, 1, 77, heads, kv_heads, 16))
    q = q * 3.0  # peaked probabilities: importance gaps far above rounding
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (1, 77)), axis=1), jnp.int32)
    for block, stride, select_block, seg in ((32, 8, 16, None), (16, 16, 16, ids), (16, 8, 4, ids)):
        kc, _ = compress_kv(k, k, block=block, stride=stride)
        with jax.default_matmul_precision("highest"):
            _, lse = compression_attention(q, kc, kc, block=block, stride=stride, segment_ids=seg, return_lse=True,
                                           implementation="xla")
            kw = dict(block=block, stride=stride, select_block=select_block, scale=0.25,
                      precision=jax.lax.Precision.HIGHEST, q_ids=seg)
            want = reference.top_n(reference.importance_reference(q, kc, lse, **kw), select_block, 3)
            got = importance.select_pallas(q, kc, lse, num_selected=3, max_bytes=4 * 16 * kv_heads * 4, **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---------------------------------------------------------------------------------------------
# nsa_attention
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads, kv_heads, window, mlp, segments", [
    pytest.param(4, 2, 8, False, False, marks=pytest.mark.slow), (2, 2, 0, True, False),
    pytest.param(4, 1, 12, False, True, marks=pytest.mark.slow)])
def test_nsa_attention(heads, kv_heads, window, mlp, segments):
    """All branches gated; gradients to q, k, v, gates (and the MLP). num_selected = every block, so
    the choice is the same in every dtype (the golden and the run select alike)."""
    rng = np.random.default_rng(heads * 10 + window)
    batch, seq_len, head_dim, block, stride, select_block = 1, 45, 16, 16, 8, 16
    q, k, v = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    gates = 1.0 / (1.0 + np.exp(-rng.standard_normal((batch, seq_len, heads, 3))))
    ids = jnp.asarray(np.sort(rng.integers(0, 2, (batch, seq_len)), axis=1), jnp.int32) if segments else None
    params = [*_params(rng, block, head_dim, 16), *_params(rng, block, head_dim, 16)] if mlp else []
    n = nsa.selection_count(seq_len, select_block)

    def fn(impl, q, k, v, gates, *flat):
        pair = (CompressParams(*flat[:5]), CompressParams(*flat[5:])) if flat else None
        return nsa_attention(q, k, v, gates, compress_block=block, compress_stride=stride, select_block=select_block,
                             num_selected=n, window=window, compress_params=pair, segment_ids=ids,
                             implementation=impl)

    check_rule(fn, [q, k, v, gates, *params], [rng.standard_normal((batch, seq_len, heads, head_dim))])


@pytest.mark.slow
def test_nsa_attention_sparse_selection_matches_xla():
    """num_selected below the block count: the kernel path and the plain path choose the same blocks
    and agree to fp32 rounding."""
    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _qkv(rng, 1, 70, 4, 2, 16))
    gates = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((1, 70, 4, 3)), jnp.float32))
    with jax.default_matmul_precision("highest"):
        outs = [nsa_attention(q * 3.0, k, v, gates, compress_block=16, compress_stride=8, select_block=8,
                              num_selected=4, window=8, implementation=impl) for impl in ("xla", "triton")]
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

Q, KV = jnp.zeros((1, 32, 4, 16)), jnp.zeros((1, 32, 2, 16))
IDX = jnp.zeros((1, 32, 2, 2), jnp.int32)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(block_indices=IDX[..., 0]), ValueError, r"block_indices must have shape \[B, S, Hkv, n\]"),
    (dict(block_indices=IDX.astype(jnp.float32)), TypeError, r"block_indices must be an integer array"),
    (dict(block_indices=IDX, block_counts=jnp.zeros((1, 32, 2), jnp.float32)), TypeError,
     r"block_counts must be an integer array"),
    (dict(block_indices=IDX, block_counts=jnp.zeros((1, 32), jnp.int32)), ValueError,
     r"block_counts must have shape \(1, 32, 2\)"),
    (dict(), ValueError, r"exactly one of block_indices and ranges"),
    (dict(block_indices=IDX, ranges=jnp.zeros((1, 32, 2, 1, 2), jnp.int32)), ValueError, r"exactly one"),
    (dict(ranges=jnp.asarray(np.tile([[5, 3]], (1, 32, 2, 1, 1)), jnp.int32)), ValueError,
     r"ranges must have start <= end; ranges\[0, 0, 0, 0\] = \[5, 3\]"),
    (dict(ranges=jnp.zeros((1, 32, 2, 1, 3), jnp.int32)), ValueError, r"ranges must have shape \[B, S, Hkv, R, 2\]"),
    (dict(block_indices=IDX, block_size=48), ValueError, r"block_size must be a power of two, got 48"),
    (dict(block_indices=IDX, block_size=0), ValueError, r"block_size must be an int >= 1"),
    (dict(block_indices=IDX, segment_ids=jnp.zeros((1, 31), jnp.int32)), ValueError,
     r"segment_ids must have shape \(1, 32\)"),
    (dict(block_indices=IDX, implementation="mosaic"), NotImplementedError, r"unknown implementation='mosaic'"),
    (dict(block_indices=IDX, implementation="triton", config=jax_attn.BlockSizes()), TypeError,
     r"config must be a .*NSABlockSizes"),
])
def test_selection_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        selection_attention(Q, KV, KV, **kwargs)


def test_selection_boundaries_pass():
    """The passing side of the checks: block size 1, ranges with start == end, n = 1."""
    selection_attention(Q, KV, KV, IDX[..., :1], block_size=1, implementation="xla")
    selection_attention(Q, KV, KV, ranges=jnp.zeros((1, 32, 2, 1, 2), jnp.int32), implementation="xla")


def test_other_errors():
    kc = jnp.zeros((1, 3, 2, 16))
    gates = jnp.zeros((1, 32, 4, 3))
    cases = [
        (lambda: compress_kv(KV, KV, block=24, stride=8), ValueError, r"block must be a power of two, got 24"),
        (lambda: compress_kv(KV, KV, block=8, stride=16), ValueError, r"stride \(16\) must not exceed block \(8\)"),
        (lambda: compress_kv(KV, KV, block=8, stride=8, params=CompressParams(*[jnp.zeros(1)] * 5)), TypeError,
         r"params must be a pair"),
        (lambda: compress_kv(KV, KV, block=8, stride=8, params=(_params(np.random.default_rng(0), 4, 16, 8),) * 2),
         ValueError, r"params\[0\].pos must have shape \(8, 16\)"),
        (lambda: compression_attention(Q, kc, kc, block=16, stride=4), ValueError,
         r"k_cmp must have shape \[B, Nc, Hkv, D\] with Nc = 5"),
        (lambda: compression_attention(Q, kc, kc[:, :, :1], block=16, stride=8), ValueError,
         r"k_cmp and v_cmp must have the same shape"),
        (lambda: select_blocks(Q, jnp.zeros((1, 3, 2, 16)), jnp.zeros((1, 4, 32)), block=16, stride=8,
                               select_block=8, num_selected=5), ValueError,
         r"num_selected \(5\) is larger than the 4 selection blocks of 8"),
        (lambda: select_blocks(Q, jnp.zeros((1, 3, 2, 16)), jnp.zeros((1, 32, 4)), block=16, stride=8,
                               select_block=8, num_selected=2), ValueError,
         r"lse_cmp must have shape \(1, 4, 32\)"),
        (lambda: select_blocks(Q, jnp.zeros((1, 3, 2, 16)), jnp.zeros((1, 4, 32)), block=16, stride=8,
                               select_block=12, num_selected=1), ValueError, r"select_block must be a power of two"),
        (lambda: nsa_attention(Q, KV, KV, gates[..., :2], compress_block=16, compress_stride=8, select_block=8,
                               num_selected=2), ValueError, r"gates must have shape \(1, 32, 4, 3\)"),
        (lambda: nsa_attention(Q, KV, KV, gates.astype(jnp.int32), compress_block=16, compress_stride=8,
                               select_block=8, num_selected=2), TypeError, r"gates must be a float array"),
        (lambda: nsa_attention(Q, KV, KV, gates, compress_block=16, compress_stride=8, select_block=8,
                               num_selected=2, window=-1), ValueError, r"window must be an int >= 0"),
        (lambda: nsa_attention(Q, KV, KV, gates, compress_block=16, compress_stride=8, select_block=8,
                               num_selected=8), ValueError, r"num_selected \(8\) is larger than the 4"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    # boundary: num_selected = every block, window 0
    nsa_attention(Q, KV, KV, gates, compress_block=16, compress_stride=8, select_block=8, num_selected=4, window=0,
                  implementation="xla")


def test_float64_only_on_xla():
    with jax.enable_x64(True):
        q, kv = Q.astype(jnp.float64), KV.astype(jnp.float64)
        with pytest.raises(NotImplementedError, match=r"implementation='triton' cannot serve this call: .*float64"):
            selection_attention(q, kv, kv, IDX, implementation="triton")


def test_registry_rule():
    expected = "xla" if jax_attn.device.pallas_triton_unsupported_reason() else "triton"
    assert jax_attn.registry.choose("nsa", None) == expected


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels at realistic shapes
# ---------------------------------------------------------------------------------------------

GPU_CONFIGS = [None, jax_attn.NSABlockSizes(tokens=1, tokens_dq=1), jax_attn.NSABlockSizes(tokens_dkdv=4),
               jax_attn.NSABlockSizes(visit="blocks"), jax_attn.NSABlockSizes(visit="tokens")]


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len, heads, kv_heads, config", [
    (4096, 16, 1, None), (4096, 16, 1, GPU_CONFIGS[1]), (4096, 16, 1, GPU_CONFIGS[2]), (4096, 8, 8, GPU_CONFIGS[2]),
    (4096, 16, 1, GPU_CONFIGS[3]), (4096, 8, 8, GPU_CONFIGS[4]), (4096, 16, 4, None),
    (8192, 16, 16, None), (16384, 64, 4, None)],
    ids=["r16", "r16_t1", "r16_gather", "r1_gather", "r16_blocks", "r1_tokens", "r4", "r1_8k", "r16_16k"])
def test_gpu_selection_bf16(seq_len, heads, kv_heads, config):
    """The selection kernels against the plain reference in bf16 (forward and gradients) and the
    fp32 reference as the golden, with the canonical NSA selection (16 blocks of 64)."""
    rng = np.random.default_rng(seq_len)
    batch, head_dim, bs, n = 1, 128, 64, 16
    q, k, v = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    num = seq_len // bs
    t = np.arange(seq_len)[None, :, None, None]
    idx = np.minimum(rng.integers(0, num, (batch, seq_len, kv_heads, n)), t // bs).astype(np.int32)
    idx[..., 0] = t[..., 0] // bs
    cts = _cotangents(rng, batch, seq_len, heads, head_dim)
    fn = lambda impl, q, k, v: selection_attention(q, k, v, jnp.asarray(idx), return_lse=True, implementation=impl,
                                                   config=config if impl == "triton" else None)
    if seq_len > 8192:  # the dense reference would not fit: the kernel in fp32 is the golden's stand-in
        gold = _run(fn, (q, k, v), cts, jnp.float32, "triton")
        fast = _run(fn, (q, k, v), cts, jnp.bfloat16, "triton")
        for f, g in zip(fast, gold):
            finite = np.isfinite(g)
            assert np.array_equal(np.isfinite(f), finite)
            assert np.abs(f[finite] - g[finite]).max() <= 0.05 * max(1.0, np.abs(g[finite]).max())
        return
    gold = _run(fn, (q, k, v), cts, jnp.float32, "xla")
    naive = _run(fn, (q, k, v), cts, jnp.bfloat16, "xla")
    fast = _run(fn, (q, k, v), cts, jnp.bfloat16, "triton")
    for i, (f, nv, g) in enumerate(zip(fast, naive, gold)):
        verdict = compare(f, nv, g, NP_DTYPE[jnp.bfloat16], FORWARD_FACTOR if i < 2 else GRADIENT_FACTOR)
        assert verdict.ok, f"{i}: {verdict}"


@pytest.mark.gpu
def test_gpu_nsa_attention_bf16():
    """Full NSA at 8k, 64/4 heads: finite, and the kernel path agrees with the kernel path in fp32."""
    rng = np.random.default_rng(0)
    batch, seq_len, heads, kv_heads, head_dim = 1, 8192, 64, 4, 128
    q, k, v = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    gates = 1.0 / (1.0 + np.exp(-rng.standard_normal((batch, seq_len, heads, 3))))
    fn = lambda impl, q, k, v, g: nsa_attention(q, k, v, g, implementation=impl)
    ct = [rng.standard_normal((batch, seq_len, heads, head_dim))]
    fast = _run(fn, (q, k, v, gates), ct, jnp.bfloat16, "triton")
    for x in fast:
        assert np.isfinite(x).all()


@pytest.mark.gpu
def test_gpu_ranges_bf16():
    """The ranges form compiled: two ranges per row (a window and a prefix), against the reference."""
    rng = np.random.default_rng(1)
    batch, seq_len, heads, kv_heads, head_dim = 1, 2048, 16, 2, 128
    q, k, v = _qkv(rng, batch, seq_len, heads, kv_heads, head_dim)
    t = np.arange(seq_len)[None, :, None]
    ranges = np.stack([np.stack([np.maximum(t - 300, 0), t + 1], -1),
                       np.stack([np.zeros_like(t), np.minimum(t, 100)], -1)], axis=-2)
    ranges = np.broadcast_to(ranges, (batch, seq_len, kv_heads, 2, 2)).astype(np.int32)
    fn = lambda impl, q, k, v: selection_attention(q, k, v, ranges=jnp.asarray(ranges), return_lse=True,
                                                   implementation=impl)
    cts = _cotangents(rng, batch, seq_len, heads, head_dim)
    gold = _run(fn, (q, k, v), cts, jnp.float32, "xla")
    naive = _run(fn, (q, k, v), cts, jnp.bfloat16, "xla")
    fast = _run(fn, (q, k, v), cts, jnp.bfloat16, "triton")
    for i, (f, nv, g) in enumerate(zip(fast, naive, gold)):
        verdict = compare(f, nv, g, NP_DTYPE[jnp.bfloat16], FORWARD_FACTOR if i < 2 else GRADIENT_FACTOR)
        assert verdict.ok, f"{i}: {verdict}"
    # the dK/dV partials of the token chunks are added in a fixed order: a second run is bitwise equal
    for a, b in zip(fast, _run(fn, (q, k, v), cts, jnp.bfloat16, "triton")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_gpu_select_blocks_matches_reference():
    """The compiled importance kernel and chunked top-n choose blocks as good as the dense
    reference's: where the choices differ, the chosen sets have the same total importance (ties
    in fp32)."""
    rng = np.random.default_rng(2)
    batch, seq_len, heads, kv_heads, head_dim = 1, 8192, 64, 4, 128
    q, k, _ = (jnp.asarray(x, jnp.float32) for x in _qkv(rng, batch, seq_len, heads, kv_heads, head_dim))
    with jax.default_matmul_precision("highest"):
        kc, _ = compress_kv(k, k)
        _, lse = compression_attention(q, kc, kc, return_lse=True)
        kw = dict(block=32, stride=16, select_block=64, scale=head_dim ** -0.5,
                  precision=jax.lax.Precision.HIGHEST)
        imp = reference.importance_reference(q, kc, lse, **kw)
        want = np.asarray(reference.top_n(imp, 64, 16))
        got = np.asarray(select_blocks(q, kc, lse, implementation="triton"))
    differ = (got != want).any(-1)
    assert differ.mean() < 0.01
    imp = np.asarray(imp, np.float64)
    total = lambda sel: np.where(sel >= 0, np.take_along_axis(imp, np.maximum(sel, 0), -1), 0.0).sum(-1)
    np.testing.assert_allclose(total(got)[differ], total(want)[differ], rtol=1e-5)
