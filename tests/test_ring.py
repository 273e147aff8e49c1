"""Sequence parallelism (`ring_attention`, `context_parallel_attention`): ring (zigzag and contiguous
layouts) and all-gather context parallelism on 2, 4 and 8 CPU devices (tests/conftest.py asks XLA for
eight host devices) against the single-device attention.

Three results per case, the tolerance rule of docs/design/parity.md: the float64 golden
(`flash_attention(implementation="xla")` under x64, one device, sequence order), the same plain
reference in the compute dtype, and the sequence-parallel call (whose steps run "xla" or the Pallas
engine interpreted); out, lse and dq, dk, dv through `jax.vjp` with random cotangents on out and lse.
Shard lengths are not block multiples (24, 40 rows). Then: the zigzag helpers, `ring_attention`
under a caller's own shard_map, determinism, the error against the ring size, and the errors.
`gpu` tests run the compiled kernels on every visible GPU at S = 16k, bf16.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_attn
from one_device_check import assert_matches_one_device
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare

NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def _mesh(devices: int) -> Mesh:
    available = jax.devices()
    assert len(available) >= devices, f"{devices} devices needed, {len(available)} visible (XLA_FLAGS set too late?)"
    return Mesh(np.array(available[:devices]), ("sp",))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    devices: int
    layout: str
    strategy: str
    implementation: str
    shape: tuple  # B, S, Hq, Hkv, D
    dtype: str = "float32"
    causal: bool = False
    window: tuple | None = None
    softcap: float | None = None
    segments: str | None = None  # "packed": three packed sequences; "pair": q ids no key has on some rows
    rope: bool = False

    def kwargs(self, segment_ids):
        kw = dict(causal=self.causal, window=self.window, softcap=self.softcap, segment_ids=segment_ids)
        if self.rope:
            kw["rope"] = jax_attn.Rope(style="half")
        return kw


def _draw(case: Case):
    batch, seq, heads, kv_heads, dim = case.shape
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    shapes = [(batch, seq, heads, dim), (batch, seq, kv_heads, dim), (batch, seq, kv_heads, dim),
              (batch, seq, heads, dim), (batch, heads, seq)]
    arrays = [rng.standard_normal(s) for s in shapes]
    ids = None
    if case.segments == "packed":
        ids = np.searchsorted(np.array([seq // 3, seq // 3 + 17]), np.arange(seq), side="right")[None].repeat(batch, 0)
    elif case.segments == "pair":  # some queries carry an id no key has: no visible key there
        kv_ids = (np.arange(seq) >= seq // 2).astype(np.int32)[None].repeat(batch, 0)
        q_ids = kv_ids.copy()
        q_ids[:, 5:9] = 7
        ids = (q_ids.astype(np.int32), kv_ids)
    return arrays, ids


def _as_ids(ids):
    if ids is None:
        return None
    if isinstance(ids, tuple):
        return tuple(jnp.asarray(x, jnp.int32) for x in ids)
    return jnp.asarray(ids, jnp.int32)


def _vjp_run(f, arrays, dtype):
    q, k, v, do, dlse = (jnp.asarray(x, dtype) for x in arrays)

    def g(q, k, v, do, dlse):
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return (out, lse, *vjp((do, dlse.astype(jnp.float32) if dtype != jnp.float64 else dlse)))
    return [np.asarray(x, np.float64) for x in jax.jit(g)(q, k, v, do, dlse)]


def _single(case: Case, dtype, arrays, ids):
    f = lambda q, k, v: jax_attn.flash_attention(q, k, v, return_lse=True, implementation="xla",
                                                 **case.kwargs(_as_ids(ids)))
    return _vjp_run(f, arrays, dtype)


@functools.lru_cache(maxsize=None)
def _golden(case: Case):
    arrays, ids = _draw(case)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        return _single(case, jnp.float64, arrays, ids)


def _parallel(case: Case, arrays, ids):
    mesh = _mesh(case.devices)
    f = lambda q, k, v: jax_attn.context_parallel_attention(
        q, k, v, mesh=mesh, axis="sp", strategy=case.strategy, layout=case.layout, return_lse=True,
        implementation=case.implementation, **case.kwargs(_as_ids(ids)))
    return _vjp_run(f, arrays, jnp.dtype(case.dtype))


def _check(case: Case):
    """The rule on every quantity -> (fast, golden) by name."""
    arrays, ids = _draw(case)
    golden = _golden(case)
    with jax.default_matmul_precision("highest"):  # fp32: exact dots on every side
        naive = _single(case, jnp.dtype(case.dtype), arrays, ids)
        fast = _parallel(case, arrays, ids)
    failed = []
    for name, f, n, g in zip(QUANTITIES, fast, naive, golden):
        verdict = compare(f, n, g, NP_DTYPE[case.dtype], FORWARD_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR)
        if not verdict.ok:
            failed.append(f"{name}: error {verdict.error:.3g} > allowed {verdict.allowed:.3g} {verdict.reason}")
    assert not failed, "; ".join(failed)
    return dict(zip(QUANTITIES, fast)), dict(zip(QUANTITIES, golden))


CASES = [
    # shard lengths 24 and 40 (zigzag chunks of 12 and 20): not multiples of the interpreter's 32-row tiles
    Case("xla_zigzag_ring_causal_gqa_p4", 4, "zigzag", "ring", "xla", (1, 96, 4, 2, 16), causal=True),
    Case("xla_contiguous_ring_window_p8", 8, "contiguous", "ring", "xla", (1, 192, 2, 1, 16), causal=True,
         window=(30, 0)),
    Case("xla_zigzag_allgather_segments_fp16_p2", 2, "zigzag", "all_gather", "xla", (1, 80, 4, 2, 32), "float16",
         causal=True, segments="packed"),
    Case("xla_contiguous_allgather_window_softcap_p4", 4, "contiguous", "all_gather", "xla", (1, 96, 2, 2, 16),
         window=(13, 7), softcap=5.0),
    Case("xla_zigzag_ring_noncausal_rope_p4", 4, "zigzag", "ring", "xla", (1, 96, 2, 1, 16), rope=True),
    Case("triton_zigzag_ring_causal_gqa_p2", 2, "zigzag", "ring", "triton", (1, 80, 4, 2, 16), causal=True),
    Case("triton_zigzag_ring_causal_rope_fp16_p4", 4, "zigzag", "ring", "triton", (1, 96, 2, 2, 16), "float16",
         causal=True, rope=True),
    Case("triton_contiguous_allgather_segments_p2", 2, "contiguous", "all_gather", "triton", (1, 80, 2, 1, 16),
         causal=True, segments="pair"),
]
SLOW_CASES = [
    Case("triton_zigzag_ring_window_p8", 8, "zigzag", "ring", "triton", (1, 192, 2, 1, 32), causal=True,
         window=(40, 0)),
    Case("triton_zigzag_allgather_causal_p4", 4, "zigzag", "all_gather", "triton", (1, 160, 4, 2, 16),
         causal=True),
    Case("triton_contiguous_ring_window_both_softcap_p4", 4, "contiguous", "ring", "triton", (1, 96, 2, 1, 16),
         window=(20, 9), softcap=5.0, segments="packed"),
    Case("xla_zigzag_ring_causal_bf16_p8", 8, "zigzag", "ring", "xla", (1, 256, 4, 1, 32), "bfloat16", causal=True),
    Case("xla_zigzag_ring_window_both_gqa_p4", 4, "zigzag", "ring", "xla", (1, 160, 4, 2, 16), window=(23, 31)),
    Case("xla_zigzag_allgather_pair_rope_p8", 8, "zigzag", "all_gather", "xla", (1, 192, 2, 2, 16), causal=True,
         segments="pair", rope=True),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES]
                         + [pytest.param(c, id=c.name, marks=pytest.mark.slow) for c in SLOW_CASES])
def test_matches_single_device(case):
    """out, lse, dq, dk, dv within the rule against the float64 golden; rows with no visible key
    (segments="pair") give out 0, lse -inf and no NaN."""
    fast, golden = _check(case)
    for name, x in fast.items():
        assert not np.isnan(x).any(), name
    if case.segments == "pair":
        empty = np.isneginf(golden["lse"])
        assert empty.any() and np.isneginf(fast["lse"][empty]).all()
        assert (fast["out"].transpose(0, 2, 1, 3)[empty] == 0).all()


def test_zigzag_helpers():
    """to_zigzag puts chunks (d, 2P-1-d) on shard d; from_zigzag undoes it; layout_positions says
    where every row came from; the in-shard reorder of context_parallel_attention agrees."""
    x = jnp.arange(2 * 24 * 3, dtype=jnp.float32).reshape(2, 24, 3)
    z = jax_attn.to_zigzag(x, 3)  # 6 chunks of 4 rows: order 0, 5, 1, 4, 2, 3
    order = [0, 5, 1, 4, 2, 3]
    np.testing.assert_array_equal(np.asarray(z), np.asarray(x).reshape(2, 6, 4, 3)[:, order].reshape(2, 24, 3))
    np.testing.assert_array_equal(np.asarray(jax_attn.from_zigzag(z, 3)), np.asarray(x))
    positions = jax_attn.layout_positions("zigzag", 3, 24)
    np.testing.assert_array_equal(np.asarray(z)[0, :, 0], positions * 3)
    np.testing.assert_array_equal(jax_attn.layout_positions("contiguous", 3, 24), np.arange(24))
    with pytest.raises(ValueError, match="multiple of 6"):
        jax_attn.to_zigzag(jnp.zeros((1, 20, 2)), 3)


def _under_own_shard_map(devices, q, k, v, **kw):
    """A caller's own shard_map over zigzag-ordered arrays, ring_attention inside."""
    mesh = _mesh(devices)
    spec = P(None, "sp")
    f = jax.shard_map(lambda q, k, v: jax_attn.ring_attention(q, k, v, axis_name="sp", return_lse=True, **kw),
                      mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P(None, None, "sp")), check_vma=False)
    zig = lambda x: jax.device_put(jax_attn.to_zigzag(x, devices), NamedSharding(mesh, spec))
    out, lse = jax.jit(f)(zig(q), zig(k), zig(v))
    return jax_attn.from_zigzag(out, devices), jax_attn.from_zigzag(lse, devices, axis=2)


def test_ring_attention_under_callers_shard_map():
    """ring_attention on zigzag-ordered shards under the caller's shard_map gives what
    context_parallel_attention gives (which reorders inside, by ppermutes) and matches the
    single-device output."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.float32) for _ in range(3))
    out, lse = _under_own_shard_map(4, q, k, v, causal=True, implementation="xla")
    ref, ref_lse = jax.jit(lambda q, k, v: jax_attn.context_parallel_attention(
        q, k, v, mesh=_mesh(4), axis="sp", causal=True, implementation="xla", strategy="ring",
        return_lse=True))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)  # the same steps, fused apart
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-6)
    single, single_lse = jax_attn.flash_attention(q, k, v, causal=True, implementation="xla", return_lse=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(single), atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(single_lse), atol=2e-6)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_deterministic(strategy):
    """Two runs of forward and backward are bitwise equal."""
    case = Case("det", 4, "zigzag", strategy, "xla", (1, 64, 2, 1, 16), causal=True)
    arrays, ids = _draw(case)
    first, second = (_parallel(case, arrays, ids) for _ in range(2))
    for name, a, b in zip(QUANTITIES, first, second):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_error_does_not_grow_with_ring_size():
    """fp16, causal, the same inputs on 2, 4 and 8 devices: every run within the rule, and the
    error of out and of every gradient on 8 devices at most 1.5x that on 2 (fp32 merges: more
    steps add no rounding of their own)."""
    errors = {}
    for devices in (2, 4, 8):
        case = Case("ring_size", devices, "zigzag", "ring", "xla", (1, 192, 2, 1, 32), "float16", causal=True)
        fast, golden = _check(case)
        errors[devices] = {n: float(np.max(np.abs(fast[n] - golden[n])[np.isfinite(golden[n])])) for n in QUANTITIES}
    print("max |error| by ring size:", errors)
    for name in QUANTITIES:
        assert errors[8][name] <= 1.5 * errors[2][name] + 1e-6, (name, errors)


def test_errors():
    mesh = _mesh(4)
    q = jnp.zeros((1, 36, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 8 for layout='zigzag'"):
        jax_attn.context_parallel_attention(q, q, q, mesh=mesh, axis="sp")  # 36 % (2 * 4) != 0
    out = jax.eval_shape(lambda q: jax_attn.context_parallel_attention(  # 36 % 4 == 0: traces
        q, q, q, mesh=mesh, axis="sp", layout="contiguous", implementation="xla"), q)
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="multiple of 4 for layout='contiguous'"):
        r = jnp.zeros((1, 38, 2, 16), jnp.float32)
        jax_attn.context_parallel_attention(r, r, r, mesh=mesh, axis="sp", layout="contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        jax_attn.context_parallel_attention(q, q, q, mesh=mesh, axis="sp", layout="striped")
    with pytest.raises(ValueError, match="strategy must be one of"):
        jax_attn.context_parallel_attention(q, q, q, mesh=mesh, axis="sp", layout="contiguous", strategy="tree")
    with pytest.raises(ValueError, match="is not an axis of the mesh"):
        jax_attn.context_parallel_attention(q, q, q, mesh=mesh, axis="seq")
    with pytest.raises(ValueError, match="is not a mesh axis bound here"):
        jax_attn.ring_attention(q, q, q, axis_name="sp")
    with pytest.raises(ValueError, match="same length"):
        jax_attn.context_parallel_attention(q, q[:, :32], q[:, :32], mesh=mesh, axis="sp", layout="contiguous")
    with pytest.raises(NotImplementedError, match="mosaic"):
        jax_attn.context_parallel_attention(q, q, q, mesh=mesh, axis="sp", layout="contiguous", implementation="mosaic")

    spec = P(None, "sp")
    odd = jax.shard_map(lambda q: jax_attn.ring_attention(q, q, q, axis_name="sp"), mesh=mesh, in_specs=spec,
                        out_specs=spec, check_vma=False)
    with pytest.raises(ValueError, match="shard length must be even"):
        odd(jnp.zeros((1, 36, 2, 16), jnp.float32))  # 9 rows per shard
    with pytest.raises(ValueError, match="strategy must be one of"):
        jax.shard_map(lambda q: jax_attn.ring_attention(q, q, q, axis_name="sp", strategy="tree"), mesh=mesh,
                      in_specs=spec, out_specs=spec, check_vma=False)(q)
    q = jnp.zeros((1, 64, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="check_vma=False"):
        jax.shard_map(lambda q: jax_attn.ring_attention(q, q, q, axis_name="sp", implementation="triton"),
                      mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)(q)
    checked = jax.shard_map(lambda q: jax_attn.ring_attention(q, q, q, axis_name="sp", implementation="xla"),
                            mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
    assert jax.eval_shape(checked, q).shape == q.shape  # the plain steps type-check


def test_default_strategy_rule():
    assert jax_attn.default_strategy(8192, 4, 16, 16) == "all_gather"  # 2048-row shards
    assert jax_attn.default_strategy(131072, 4, 16, 2) == "all_gather"  # GQA 8
    assert jax_attn.default_strategy(131072, 4, 16, 16) == "ring"


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels on every visible GPU at a realistic shape
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout, strategy", [("zigzag", "ring"), ("contiguous", "ring"), ("zigzag", "all_gather")])
def test_gpu_matches_one_device(layout, strategy):
    """B=1, S=16k, 16 heads of 128 (GQA 16/4), bf16, causal, on all visible GPUs: out, dq, dk, dv
    against an fp32 reference (the engine on one GPU, exact fp32 dots) no further than 2x (out) /
    3x (gradients) the one-GPU bf16 kernel's error plus 1e-3; a second run bitwise equal."""
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    assert_matches_one_device(
        16384, lambda q, k, v: jax_attn.flash_attention(q, k, v, causal=True, implementation="triton"),
        lambda q, k, v: jax_attn.flash_attention(q, k, v, causal=True),
        lambda q, k, v: jax_attn.context_parallel_attention(q, k, v, mesh=mesh, axis="sp", causal=True,
                                                            layout=layout, strategy=strategy),
        f"{layout} {strategy}", deterministic=True)


# ---------------------------------------------------------------------------------------------
# Ring dilated attention
# ---------------------------------------------------------------------------------------------

DILATED = [
    # S = 128 over 4 shards of 32: segments 16 and 32 stay in a shard, 64 spans 2 shards, 256 (cut to
    # 128) all four; GQA (kv heads repeated per query head: the heads of a group keep other rows)
    pytest.param("xla", "float32", False, id="xla_fp32"),
    pytest.param("xla", "float16", True, id="xla_fp16_causal", marks=pytest.mark.slow),
    pytest.param("triton", "float32", True, id="triton_fp32_causal", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("implementation, dtype, causal", DILATED)
def test_ring_dilated_matches_single_device(implementation, dtype, causal):
    """ring_dilated_attention on 4 devices: out, lse, dq, dk, dv within the rule against the float64
    golden of dilated_attention on the global arrays."""
    config = dict(segment_lengths=(16, 32, 64, 256), dilation_rates=(1, 2, 2, 4), causal=causal)
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s) for s in [(1, 128, 4, 16), (1, 128, 2, 16), (1, 128, 2, 16), (1, 128, 4, 16),
                                               (1, 4, 128)]]
    single = lambda q, k, v: jax_attn.dilated_attention(q, k, v, return_lse=True, implementation="xla", **config)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        golden = _vjp_run(single, arrays, jnp.float64)
    mesh, spec = _mesh(4), P(None, "sp")
    sharded = jax.shard_map(
        lambda q, k, v: jax_attn.ring_dilated_attention(q, k, v, axis_name="sp", return_lse=True,
                                                        implementation=implementation, **config),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P(None, None, "sp")), check_vma=False)
    with jax.default_matmul_precision("highest"):
        naive = _vjp_run(single, arrays, jnp.dtype(dtype))
        fast = _vjp_run(sharded, arrays, jnp.dtype(dtype))
    for name, f, n, g in zip(QUANTITIES, fast, naive, golden):
        verdict = compare(f, n, g, NP_DTYPE[dtype], FORWARD_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR)
        assert verdict.ok, f"{name}: {verdict}"


def test_ring_dilated_errors():
    mesh, spec = _mesh(4), P(None, "sp")
    q = jnp.zeros((1, 96, 2, 16), jnp.float32)  # shards of 24

    def call(**config):
        return jax.eval_shape(jax.shard_map(
            lambda q: jax_attn.ring_dilated_attention(q, q, q, axis_name="sp", implementation="xla", **config),
            mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False), q)

    assert call(segment_lengths=(12, 48), dilation_rates=(1, 2)).shape == q.shape  # 12 tiles 24; 48 spans 2
    with pytest.raises(ValueError, match="rate 5 must divide the shard length"):
        call(segment_lengths=(20,), dilation_rates=(5,))
    with pytest.raises(ValueError, match="segment length 16 must divide the shard length"):
        call(segment_lengths=(16,), dilation_rates=(1,))
    with pytest.raises(ValueError, match="must span a whole number of shards"):
        call(segment_lengths=(36,), dilation_rates=(1,))
    with pytest.raises(ValueError, match="must span a whole number of shards"):
        call(segment_lengths=(72,), dilation_rates=(1,))  # 3 shards of 4
    with pytest.raises(ValueError, match="is not a mesh axis bound here"):
        jax_attn.ring_dilated_attention(q, q, q, axis_name="sp", segment_lengths=(8,), dilation_rates=(1,))


def test_transfer_issued_before_the_steps_work():
    """In the traced program every ring step's K/V transfer precedes that step's work (XLA then
    overlaps them): the first ppermute comes before the first score product, and the P - 1
    transfers are there."""
    mesh, spec = _mesh(4), P(None, "sp")
    f = jax.shard_map(lambda q: jax_attn.ring_attention(q, q, q, axis_name="sp", causal=True, layout="contiguous",
                                                        implementation="xla"),
                      mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    text = str(jax.make_jaxpr(f)(jnp.zeros((1, 64, 2, 16), jnp.float32)))
    assert text.index("ppermute") < text.index("dot_general")
    assert text.count("ppermute[") >= 3  # (the custom_vjp prints its forward more than once)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_zigzag_has_no_switch(strategy):
    """The zigzag layout's calls line up across the shards (per-shard rows, the same case), so its
    forward and backward hold no conditional (XLA runs one with a host round trip on GPUs), ring
    or gathered; a shard's own chunks are one causal call."""
    from jax_attn.ops.ring import layout as lay

    mesh, spec = _mesh(4), P(None, "sp")
    f = jax.shard_map(lambda q: jax_attn.ring_attention(q, q, q, axis_name="sp", causal=True, layout="zigzag",
                                                        strategy=strategy, implementation="xla"),
                      mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    text = str(jax.make_jaxpr(jax.grad(lambda q: f(q).sum()))(jnp.zeros((1, 64, 2, 16), jnp.float32)))
    assert "cond[" not in text and "dot_general" in text
    mask = lay.Mask(True, None, None)
    own = lay.visit_calls(mask, "zigzag", 4, lambda d: d, 8)
    assert len(own) == 1 and own[0].cases == (0,) and own[0].chunks == 2
    for t in (1, 2, 3):
        calls = lay.visit_calls(mask, "zigzag", 4, lambda d, t=t: (d - t) % 4, 8)
        assert [c.cases for c in calls] == [(lay.FULL,), (lay.FULL,)]


@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_steps_lower_for_cuda(causal):
    """The Hopper kernels as ring steps (the engine's row-mapped calls with rows=None: a full pair
    and a diagonal one, GQA 4/2): forward and backward at given statistics lower for CUDA (no
    interpreter runs Mosaic GPU kernels on CPU; the gpu tests run them)."""
    from jax_attn.ops.common.spec import AttentionSpec
    from jax_attn.ops.ring.step import Step

    spec = AttentionSpec(scale=0.125, causal=causal)
    step = Step("mosaic")
    q = jax.ShapeDtypeStruct((1, 320, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 320, 2, 64), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1, 4, 320), jnp.float32)
    f = jax.jit(lambda q, k, v: step.forward(q, k, v, None, None, spec))
    assert "mosaic_gpu" in f.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    g = jax.jit(lambda q, k, v, do, m2, inv_l, delta: step.backward(q, k, v, None, None, spec, do, m2, inv_l, delta))
    assert "mosaic_gpu" in g.trace(q, kv, kv, q, rows, rows, rows).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
def test_gpu_ring_dilated_matches_one_device():
    """B=1, S=32k, 16 heads of 128 (GQA 16/4), bf16, segments (2048, 8192, 32768) at rates (1, 2, 4)
    on all visible GPUs (1, 2, 4 or 8: shards of 32k / P rows; the longest segment spans them all):
    out, dq, dk, dv against an fp32 reference (one GPU, exact fp32 dots) no further than 2x / 3x the
    one-GPU bf16 call's error plus 1e-3."""
    devices = len(jax.devices())
    assert devices in (1, 2, 4, 8), f"32k rows over {devices} GPUs: 1, 2, 4 or 8 GPUs"
    mesh, spec = Mesh(np.array(jax.devices()), ("sp",)), P(None, "sp")
    config = dict(segment_lengths=(2048, 8192, 32768), dilation_rates=(1, 2, 4))
    sharded = jax.shard_map(lambda q, k, v: jax_attn.ring_dilated_attention(q, k, v, axis_name="sp", **config),
                            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    assert_matches_one_device(
        32768, lambda q, k, v: jax_attn.dilated_attention(q, k, v, implementation="triton", **config),
        lambda q, k, v: jax_attn.dilated_attention(q, k, v, **config), sharded, "ring dilated")


def test_given_rope_positions_follow_their_rows():
    """RoPE positions given per token (packed sequences restarting at 0) reach every shard with its
    rows (reordered into zigzag order with them): the result is the single-device one."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.float32) for _ in range(3))
    ids = jnp.asarray((np.arange(64) >= 40).astype(np.int32))[None]
    positions = jnp.asarray(np.where(np.arange(64) >= 40, np.arange(64) - 40, np.arange(64)).astype(np.int32))[None]
    kw = dict(causal=True, segment_ids=ids, positions=positions, rope=jax_attn.Rope(style="interleaved"),
              implementation="xla")
    mesh = _mesh(4)
    ours = jax.jit(lambda q, k, v: jax_attn.context_parallel_attention(q, k, v, mesh=mesh, axis="sp", **kw))(q, k, v)
    single = jax_attn.flash_attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(single), atol=2e-6)
