"""Sequence-parallel dilated attention under an ordering applied within each shard
(`ring_dilated_attention(ordering=, grid=)`, `context_parallel_dilated_attention`, and the layers'
`mesh=`) on 2 and 4 CPU devices (tests/conftest.py asks XLA for eight host devices).

The definition: shard d holds rows d L .. (d + 1) L - 1 (for an image, a band of grid[0] / P grid
rows); its rows are put in the ordering's order over its sub-grid (grid[0] / P, cols); the global
ordered sequence is the shards' orders concatenated, i.e. the global permutation
concat_d(d L + order). So the single-device reference is `dilated_attention(ordering=that global
permutation)`. Three results per case (docs/design/parity.md): its float64 golden, the same in the
compute dtype, and the sharded call; out, lse and dq, dk, dv through `jax.vjp` with random
cotangents. Segment lengths cover branches inside a shard (no traffic) and branches spanning 2 or
all shards (their dilated rows gathered from the ordered positions and sent round a ring), GQA 4/2,
causal (original positions) and not. Then: no traffic when every segment fits a shard, the layer,
the errors, and a `gpu` test on every visible GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_attn
from attn_spec import orderings as spec_orderings
from one_device_check import assert_matches_one_device
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare

NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def _mesh(devices: int) -> Mesh:
    available = jax.devices()
    assert len(available) >= devices, f"{devices} devices needed, {len(available)} visible (XLA_FLAGS set too late?)"
    return Mesh(np.array(available[:devices]), ("sp",))


def global_permutation(ordering, grid, devices: int, seq_len: int) -> np.ndarray:
    """The shards' orders concatenated: shard d's ordered rows are d L + order, order over the
    shard's band of the grid (grid[0] / P leading rows; None: the default grid of L tokens)."""
    length = seq_len // devices
    if isinstance(ordering, str):
        local_grid = None if grid is None else (grid[0] // devices, *grid[1:])
        order = spec_orderings.permutation(ordering, length, local_grid)
    else:
        order = np.asarray(ordering)
    return np.concatenate([d * length + order for d in range(devices)]).astype(np.int32)


def _vjp_run(f, arrays, dtype):
    q, k, v, do, dlse = (jnp.asarray(x, dtype) for x in arrays)

    def g(q, k, v, do, dlse):
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return (out, lse, *vjp((do, dlse.astype(lse.dtype))))
    return [np.asarray(x, np.float64) for x in jax.jit(g)(q, k, v, do, dlse)]


def _arrays(seq_len: int, seed: int):
    rng = np.random.default_rng(seed)
    shapes = [(1, seq_len, 4, 16), (1, seq_len, 2, 16), (1, seq_len, 2, 16), (1, seq_len, 4, 16), (1, 4, seq_len)]
    return [rng.standard_normal(s) for s in shapes]


@functools.lru_cache(maxsize=None)
def _golden(seed, seq_len, perm_bytes, config_items):
    perm, config = np.frombuffer(perm_bytes, np.int32), dict(config_items)
    single = lambda q, k, v: jax_attn.dilated_attention(q, k, v, return_lse=True, implementation="xla",
                                                        ordering=perm, **config)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        return _vjp_run(single, _arrays(seq_len, seed), jnp.float64)


def _check(devices, ordering, grid, config, dtype, implementation, seq_len=128, seed=0):
    perm = global_permutation(ordering, grid, devices, seq_len)
    arrays = _arrays(seq_len, seed)
    golden = _golden(seed, seq_len, perm.tobytes(), tuple(sorted(config.items())))
    single = lambda q, k, v: jax_attn.dilated_attention(q, k, v, return_lse=True, implementation="xla",
                                                        ordering=perm, **config)
    spec = P(None, "sp")
    sharded = jax.shard_map(
        lambda q, k, v: jax_attn.ring_dilated_attention(q, k, v, axis_name="sp", return_lse=True, ordering=ordering,
                                                        grid=grid, implementation=implementation, **config),
        mesh=_mesh(devices), in_specs=(spec,) * 3, out_specs=(spec, P(None, None, "sp")), check_vma=False)
    with jax.default_matmul_precision("highest"):
        naive = _vjp_run(single, arrays, jnp.dtype(dtype))
        fast = _vjp_run(sharded, arrays, jnp.dtype(dtype))
    for name, f, n, g in zip(QUANTITIES, fast, naive, golden):
        verdict = compare(f, n, g, NP_DTYPE[dtype], FORWARD_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR)
        assert verdict.ok, f"{name}: {verdict}"
    return fast


# S = 128. 4 shards of 32 (grid (8, 16): bands of 2 x 16): segments 16 and 32 inside a shard, 64 over
# 2 shards, 256 (cut to 128) over all 4. 2 shards of 64 (bands of 4 x 16): 16 and 64 inside, 128 over both.
FOUR = dict(segment_lengths=(16, 32, 64, 256), dilation_rates=(1, 2, 2, 4))
TWO = dict(segment_lengths=(16, 64, 128), dilation_rates=(1, 2, 4))
CASES = [
    pytest.param(4, "hilbert", (8, 16), FOUR, False, "float32", id="p4_hilbert_fp32"),
    pytest.param(4, "hilbert", (8, 16), FOUR, True, "float32", id="p4_hilbert_fp32_causal"),
    pytest.param(2, "hilbert", (8, 16), TWO, True, "float32", id="p2_hilbert_fp32_causal"),
    pytest.param(2, "hilbert", (8, 16), TWO, False, "float16", id="p2_hilbert_fp16"),
    pytest.param(2, "zorder", None, TWO, True, "float16", id="p2_zorder_default_grid_fp16_causal"),
    pytest.param(4, "hilbert", (8, 4, 4), FOUR, True, "float32", id="p4_hilbert_3d_grid_fp32_causal"),
]


@pytest.mark.parametrize("devices, ordering, grid, config, causal, dtype", CASES)
def test_matches_single_device_with_global_permutation(devices, ordering, grid, config, causal, dtype):
    """out, lse, dq, dk, dv within the rule against dilated_attention(ordering=shard orders
    concatenated) on one device (steps on "xla": this is about the sharding logic)."""
    _check(devices, ordering, grid, dict(config, causal=causal), dtype, "xla")


def test_permutation_array_applied_within_each_shard():
    """ordering= a permutation array [L]: the same order on every shard."""
    order = np.random.default_rng(5).permutation(32).astype(np.int32)
    _check(4, order, None, dict(FOUR, causal=True), "float32", "xla", seed=1)


def test_ordering_differs_from_no_ordering():
    """The sharded ordering is not a no-op: the Hilbert result differs from the unordered one (the
    segments cut other rows), so the agreement above is not vacuous."""
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _arrays(128, 2)[:3])
    call = lambda **kw: jax.jit(lambda q, k, v: jax_attn.context_parallel_dilated_attention(
        q, k, v, mesh=_mesh(4), axis="sp", implementation="xla", **FOUR, **kw))(q, k, v)
    assert float(jnp.abs(call(ordering="hilbert", grid=(8, 16)) - call()).max()) > 1e-2


def test_interpreted_kernels_match_single_device():
    """The default kernels (Pallas Triton, interpreted on CPU): local branches read the rows through
    the shard's permutation in the kernel, spanning ones run the ring steps on the gathered rows."""
    _check(2, "hilbert", (8, 16), dict(segment_lengths=(32, 128), dilation_rates=(2, 4), causal=True), "float32",
           "triton", seed=3)


def test_no_traffic_when_segments_fit_a_shard():
    """Segments inside a shard under an ordering: no collective in the program (the shard's
    permutation is the local kernel's index map); a spanning one adds the ring's ppermutes."""
    spec = P(None, "sp")

    def program(config):
        f = jax.shard_map(lambda q: jax_attn.ring_dilated_attention(q, q, q, axis_name="sp", ordering="hilbert",
                                                                    grid=(8, 16), implementation="xla", **config),
                          mesh=_mesh(4), in_specs=spec, out_specs=spec, check_vma=False)
        return str(jax.make_jaxpr(f)(jnp.zeros((1, 128, 2, 16), jnp.float32)))

    assert "ppermute" not in program(dict(segment_lengths=(16, 32), dilation_rates=(1, 2), causal=True))
    assert "ppermute" in program(dict(segment_lengths=(16, 64), dilation_rates=(1, 2), causal=True))


def test_context_parallel_matches_shard_map():
    """context_parallel_dilated_attention (global arrays) is the shard_map around ring_dilated_attention."""
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _arrays(128, 6)[:3])
    mesh, spec = _mesh(4), P(None, "sp")
    kw = dict(FOUR, causal=True, ordering="hilbert", grid=(8, 16), implementation="xla")
    ours = jax.jit(lambda q, k, v: jax_attn.context_parallel_dilated_attention(q, k, v, mesh=mesh, axis="sp", **kw))
    theirs = jax.jit(jax.shard_map(lambda q, k, v: jax_attn.ring_dilated_attention(q, k, v, axis_name="sp", **kw),
                                   mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False))
    np.testing.assert_array_equal(np.asarray(ours(q, k, v)), np.asarray(theirs(q, k, v)))


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------

def _layer(mesh=None, dtype=jnp.float32, **kw):
    return jax_attn.HilbertDilatedAttention(4, 32, num_kv_heads=2, segment_lengths=(16, 64), dilation_rates=(1, 2),
                                            grid=(8, 16), causal=True, implementation="xla", mesh=mesh,
                                            dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0), **kw)


def _layer_reference(layer, x, perm):
    """The layer's definition written out: its projections around dilated_attention(ordering=perm)."""
    batch, seq, _ = x.shape
    q, k, v = (p(x).reshape(batch, seq, h, 8) for p, h in ((layer.q_proj, 4), (layer.k_proj, 2), (layer.v_proj, 2)))
    out = jax_attn.dilated_attention(q, k, v, segment_lengths=(16, 64), dilation_rates=(1, 2), causal=True,
                                     ordering=perm, implementation="xla")
    return layer.out_proj(out.reshape(batch, seq, 32))


def test_layer_sharded_matches_its_definition():
    """HilbertDilatedAttention(mesh=) on 4 devices: the same parameters as the one-device layer, and
    output and input gradient within the rule against its definition (projections around
    dilated_attention with the shard orders concatenated), float64 golden."""
    mesh = _mesh(4)
    sharded, one = _layer(mesh), _layer()
    shapes = lambda m: jax.tree.map(lambda a: a.shape, nnx.state(m, nnx.Param))
    assert shapes(sharded) == shapes(one)
    perm = global_permutation("hilbert", (8, 16), 4, 128)
    rng = np.random.default_rng(7)
    x, dy = rng.standard_normal((2, 1, 128, 32))

    def run(f, layer, dtype):
        graph, state = nnx.split(layer)

        def g(state, x, dy):
            y, vjp = jax.vjp(lambda x: f(nnx.merge(graph, state), x), x)
            return y, *vjp(dy)
        return [np.asarray(a, np.float64) for a in jax.jit(g)(state, jnp.asarray(x, dtype), jnp.asarray(dy, dtype))]

    reference = lambda layer, x: _layer_reference(layer, x, perm)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        wide = _layer(dtype=jnp.float64)
        nnx.update(wide, jax.tree.map(lambda a: a.astype(jnp.float64), nnx.state(one, nnx.Param)))
        golden = run(reference, wide, jnp.float64)
    with jax.default_matmul_precision("highest"):
        naive = run(reference, one, jnp.float32)
        fast = run(lambda layer, x: layer(x), sharded, jnp.float32)
    for name, f, n, g, factor in zip(("out", "dx"), fast, naive, golden, (FORWARD_FACTOR, GRADIENT_FACTOR)):
        verdict = compare(f, n, g, np.float32, factor)
        assert verdict.ok, f"{name}: {verdict}"


def test_layer_errors():
    mesh = _mesh(2)
    with pytest.raises(ValueError, match="merge must be 'lse' with a mesh"):
        jax_attn.MultiheadDilatedAttention(4, 32, segment_lengths=(16, 64), dilation_rates=(1, 2),
                                           merge="head_groups", mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="axis='sp' is given without a mesh"):
        _layer(axis="sp")
    with pytest.raises(ValueError, match="axis='seq' is not an axis of the mesh"):
        _layer(mesh, axis="seq")
    with pytest.raises(ValueError, match="name the sequence axis"):
        _layer(Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "sp")))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        _layer(mesh="sp")
    with pytest.raises(ValueError, match="config"):
        _layer(mesh, config=jax_attn.BlockSizes())
    two_axes = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "sp"))
    assert _layer(two_axes, axis="sp").axis == "sp"  # the boundary: an axis named on a 2-D mesh


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def test_errors():
    mesh, spec = _mesh(4), P(None, "sp")
    q = jnp.zeros((1, 128, 2, 16), jnp.float32)  # shards of 32

    def call(**kw):
        return jax.eval_shape(jax.shard_map(
            lambda q: jax_attn.ring_dilated_attention(q, q, q, axis_name="sp", segment_lengths=(16, 64),
                                                      dilation_rates=(1, 2), implementation="xla", **kw),
            mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False), q)

    assert call(ordering="hilbert", grid=(4, 32)).shape == q.shape  # the boundary: bands of one grid row
    assert call(ordering="hilbert").shape == q.shape  # grid None: each shard's default grid
    with pytest.raises(ValueError, match=r"grid=\(2, 64\): its leading dimension 2 must be a multiple of the 4 shards"):
        call(ordering="hilbert", grid=(2, 64))
    with pytest.raises(ValueError, match="grid=\\(8, 8\\) has 64 cells but the global sequence has 128 tokens"):
        call(ordering="hilbert", grid=(8, 8))
    with pytest.raises(ValueError, match="grid must be"):
        call(ordering="hilbert", grid="8x16")
    with pytest.raises(ValueError, match="without an ordering"):
        call(grid=(8, 16))
    with pytest.raises(ValueError, match="ordering must be one of"):
        call(ordering="peano")
    with pytest.raises(ValueError, match="length 32"):
        call(ordering=np.arange(128, dtype=np.int32))  # the shard's permutation, not the global one
    with pytest.raises(ValueError, match="not a permutation"):
        call(ordering=np.zeros(32, np.int32))
    with pytest.raises(ValueError, match="applies to a named ordering"):
        call(ordering=np.arange(32, dtype=np.int32), grid=(8, 16))
    with pytest.raises(ValueError, match="is not an axis of the mesh"):
        jax_attn.context_parallel_dilated_attention(q, q, q, mesh=mesh, axis="seq", segment_lengths=(16,),
                                                    dilation_rates=(1,))
    with pytest.raises(ValueError, match="must be a multiple of the 4 devices"):
        r = jnp.zeros((1, 126, 2, 16), jnp.float32)
        jax_attn.context_parallel_dilated_attention(r, r, r, mesh=mesh, axis="sp", segment_lengths=(16,),
                                                    dilation_rates=(1,))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        jax_attn.context_parallel_dilated_attention(q, q, q, mesh=None, axis="sp", segment_lengths=(16,),
                                                    dilation_rates=(1,))


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_hilbert_sharded_matches_one_device(causal):
    """B=1, a 256 x 128 patch grid (S = 32k), 16 heads of 128 (GQA 16/4), bf16, segments
    (2048, 8192, 32768) at rates (1, 2, 4) on all visible GPUs (bands of 256 / P grid rows; the
    longest segment spans them all), Hilbert within each band: out, dq, dk, dv against an fp32
    one-GPU dilated_attention with the shard orders concatenated (exact fp32 dots), no further
    than 2x / 3x the one-GPU bf16 call's error plus 1e-3."""
    devices = len(jax.devices())
    assert devices in (1, 2, 4, 8), f"32k rows over {devices} GPUs: 1, 2, 4 or 8 GPUs"
    mesh, spec = Mesh(np.array(jax.devices()), ("sp",)), P(None, "sp")
    grid = (256, 128)
    config = dict(segment_lengths=(2048, 8192, 32768), dilation_rates=(1, 2, 4), causal=causal)
    perm = jnp.asarray(global_permutation("hilbert", grid, devices, 32768))
    sharded = jax.shard_map(lambda q, k, v: jax_attn.ring_dilated_attention(q, k, v, axis_name="sp", ordering="hilbert",
                                                                            grid=grid, **config),
                            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    assert_matches_one_device(
        32768, lambda q, k, v: jax_attn.dilated_attention(q, k, v, ordering=perm, implementation="triton", **config),
        lambda q, k, v: jax_attn.dilated_attention(q, k, v, ordering=perm, **config), sharded,
        f"Hilbert ring dilated (causal={causal})")
