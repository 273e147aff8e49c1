"""Native Sparse Attention as a layer: `NativeSparseAttention` (jax_attn.nn.layers and its torch twin),
`CompressMLP`, EncoderBlock(attention="nsa"), their shared checks (attn_spec.layers) and the weight
bridge. The layer parity cases (tolerance rule, every parameter gradient, the training run) are in
parity.layers; tests/test_layers.py runs the --quick ones.

CPU: the plain implementations ("xla", "eager") unless a test says otherwise (the kernels go
through the interpreters there; see tests/conftest.py).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import jax_attn  # noqa: E402
import jax_attn.nn.layers as jl  # noqa: E402
import torch_ref  # noqa: E402
import torch_ref.nn.layers as tl  # noqa: E402
from attn_spec import nsa  # noqa: E402
from attn_spec.layers import NSASpec, check_layer_args  # noqa: E402
from attn_spec.rope import Rope  # noqa: E402
from parity import bridge  # noqa: E402
from parity import layers as pl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# a small geometry: 8-key compression blocks every 4 keys, selection blocks of 8, 3 of them, window 8
SMALL = dict(compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=8)


@pytest.fixture(autouse=True)
def _exact_fp32():
    with pl.exact_fp32():
        yield


def _nsa_pair(d_model=32, heads=4, kv_heads=2, seed=0, jax_impl="xla", torch_impl="eager", **kw):
    """A perturbed fp32 NativeSparseAttention and its torch twin holding the same weights."""
    kw = {**SMALL, **kw, "num_kv_heads": kv_heads}
    f = jl.NativeSparseAttention(d_model, heads, implementation=jax_impl, rngs=nnx.Rngs(seed), **kw)
    t = tl.NativeSparseAttention(d_model, heads, implementation=torch_impl, device=DEVICE, **kw)
    pl.perturb(f, seed + 1)
    bridge.flax_to_torch(f, t)
    return f, t


def _encoder_pair(seed=0, **kw):
    kw = {**SMALL, "attention": "nsa", "causal": True, "num_kv_heads": 2, **kw}
    f = jl.EncoderBlock(32, 4, 48, implementation="xla", rngs=nnx.Rngs(seed), **kw)
    t = tl.EncoderBlock(32, 4, 48, implementation="eager", device=DEVICE, **kw)
    pl.perturb(f, seed + 1)
    bridge.flax_to_torch(f, t)
    return f, t


def _jit(module, *args, **kwargs):
    return nnx.jit(lambda m, *a: m(*a, **kwargs))(module, *args)


def _flax_params(module) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)}


def _packed(batch, seq_len, cuts):
    ids = np.searchsorted(np.asarray(cuts), np.arange(seq_len), side="right")
    starts = np.concatenate([[0], cuts])[ids]
    return (np.broadcast_to(ids, (batch, seq_len)).astype(np.int32).copy(),
            np.broadcast_to(np.arange(seq_len) - starts, (batch, seq_len)).astype(np.int32).copy())


# ------------------------------------------------------------------------------------------------
# Structure
# ------------------------------------------------------------------------------------------------
def test_layers_are_exported():
    assert jax_attn.NativeSparseAttention is jl.NativeSparseAttention
    assert torch_ref.NativeSparseAttention is tl.NativeSparseAttention
    assert jax_attn.CompressMLP is jl.CompressMLP and torch_ref.CompressMLP is tl.CompressMLP


@pytest.mark.parametrize("compress,gate_hidden", [("mlp", None), ("mean", 16)])
def test_parameters_and_shapes(compress, gate_hidden):
    f, t = _nsa_pair(compress=compress, gate_hidden=gate_hidden, compress_hidden=None if compress == "mean" else 24)
    names = dict(t.named_parameters())
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"} <= set(names)
    assert tuple(names["k_proj.weight"].shape) == (16, 32)  # 2 kv heads of head dim 8
    if gate_hidden is None:
        assert tuple(names["gate_proj.weight"].shape) == (12, 32)  # 3 branches x 4 heads
        assert not any(n.startswith("gate_in") for n in names)
    else:
        assert tuple(names["gate_in.weight"].shape) == (16, 32) and tuple(names["gate_out.weight"].shape) == (12, 16)
    if compress == "mlp":
        want = {"pos": (8, 8), "w1": (64, 24), "b1": (24,), "w2": (24, 8), "b2": (8,)}
        for kv in ("k", "v"):
            for field, shape in want.items():
                assert tuple(names[f"compress_{kv}.{field}"].shape) == shape
                assert getattr(getattr(f, f"compress_{kv}"), field)[...].shape == shape
    else:
        assert not hasattr(f, "compress_k") and not any(n.startswith("compress") for n in names)
    assert f.spec == t.spec and f.spec.nsa.compress == compress
    x = np.random.default_rng(0).standard_normal((2, 21, 32)).astype(np.float32)
    assert _jit(f, jnp.asarray(x)).shape == (2, 21, 32)
    assert tuple(t(torch.tensor(x, device=DEVICE)).shape) == (2, 21, 32)


def test_defaults_are_the_papers():
    f = jl.NativeSparseAttention(64, 4, rngs=nnx.Rngs(0))
    assert f.spec.nsa == NSASpec(32, 16, 64, 16, 512, "mlp", 16, None)  # compress_hidden: the head dim
    assert f.spec.causal and f.spec.num_kv_heads == 4
    assert tl.NativeSparseAttention(64, 4).spec == f.spec
    e = jl.EncoderBlock(64, 4, attention="nsa", causal=True, rngs=nnx.Rngs(0))
    assert isinstance(e.attn, jl.NativeSparseAttention) and e.attn.spec.nsa == f.spec.nsa


def test_compress_mlp_initialisation():
    m = jl.CompressMLP(8, 16, 32, rngs=nnx.Rngs(0))
    assert float(jnp.abs(m.b1[...]).max()) == 0.0 and float(jnp.abs(m.b2[...]).max()) == 0.0
    assert 0.005 < float(jnp.std(m.pos[...])) < 0.05
    assert 0.5 / np.sqrt(128) < float(jnp.std(m.w1[...])) < 1.5 / np.sqrt(128)
    p = m.params(jnp.bfloat16)
    assert isinstance(p, nsa.CompressParams) and p.w1.dtype == jnp.bfloat16
    nsa.check_compress_params(p, 8, 16, "p")


# ------------------------------------------------------------------------------------------------
# The twins compute the same (plain implementations; the kernels: the layer parity cases)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("position,kw", [
    ("none", dict(compress_hidden=12)),
    ("rope", dict(compress="mean", gate_hidden=16)),
    ("absolute", dict(num_selected=16, window=0)),  # num_selected capped at the 5 blocks of S = 37
])
def test_twins_agree(position, kw):
    kw = dict(kw, position=position)
    if position == "rope":
        kw["rope"] = Rope(style="half")
    f, t = _nsa_pair(**kw)
    x = np.random.default_rng(1).standard_normal((2, 37, 32)).astype(np.float32)
    got = _jit(f, jnp.asarray(x))
    want = t(torch.tensor(x, device=DEVICE))
    np.testing.assert_allclose(np.asarray(got), want.detach().cpu().numpy(), atol=2e-5, rtol=0)


def test_packed_sequences_and_positions_agree():
    f, t = _nsa_pair(position="absolute")
    ids, pos = _packed(2, 33, [13, 20])
    x = np.random.default_rng(2).standard_normal((2, 33, 32)).astype(np.float32)
    got = _jit(f, jnp.asarray(x), segment_ids=jnp.asarray(ids), positions=jnp.asarray(pos))
    want = t(torch.tensor(x, device=DEVICE), segment_ids=torch.tensor(ids, device=DEVICE),
             positions=torch.tensor(pos, device=DEVICE))
    np.testing.assert_allclose(np.asarray(got), want.detach().cpu().numpy(), atol=2e-5, rtol=0)
    # the first sequence does not see the others: alone (its blocks start at 0 either way) it gives
    # the same rows
    alone = _jit(f, jnp.asarray(x[:, :13]), positions=jnp.asarray(pos[:, :13]))
    np.testing.assert_allclose(np.asarray(got)[:, :13], np.asarray(alone), atol=2e-5, rtol=0)


def test_layer_is_nsa_attention_on_its_projections():
    """The layer = out_proj(nsa_attention(q_proj x, k_proj x, v_proj x, sigmoid(gate_proj x), params))."""
    f, _ = _nsa_pair(compress_hidden=12)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 29, 32)), jnp.float32)
    q, k, v = (p(x).reshape(1, 29, h, 8) for p, h in ((f.q_proj, 4), (f.k_proj, 2), (f.v_proj, 2)))
    gates = jax.nn.sigmoid(f.gate_proj(x)).reshape(1, 29, 4, 3)
    params = tuple(nsa.CompressParams(*(getattr(m, n)[...] for n in nsa.CompressParams._fields))
                   for m in (f.compress_k, f.compress_v))
    o = jax_attn.nsa_attention(q, k, v, gates, compress_params=params, implementation="xla", **SMALL)
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(f.out_proj(o.reshape(1, 29, 32))), atol=1e-6, rtol=0)


def test_gradients_reach_gates_and_compression():
    f, t = _nsa_pair(compress_hidden=12, gate_hidden=8)
    x = np.random.default_rng(4).standard_normal((1, 37, 32)).astype(np.float32)
    graphdef, params = nnx.split(f, nnx.Param)
    grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(jnp.asarray(x)) ** 2))(params)
    flat = bridge.flax_tree_in_torch_layout(f, grads)
    out = t(torch.tensor(x, device=DEVICE))
    torch_grads = dict(zip([n for n, _ in t.named_parameters()],
                           torch.autograd.grad((out ** 2).sum(), list(t.parameters()))))
    assert set(flat) == set(torch_grads)
    for name in ("gate_in.weight", "gate_out.bias", "compress_k.pos", "compress_k.w1", "compress_v.w2",
                 "compress_v.b2"):
        assert np.abs(flat[name]).max() > 0, name
        np.testing.assert_allclose(flat[name], torch_grads[name].cpu().double().numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_compute_dtype_and_param_dtype():
    f = jl.NativeSparseAttention(32, 4, num_kv_heads=2, dtype=jnp.bfloat16, implementation="xla",
                                 rngs=nnx.Rngs(0), **SMALL)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((1, 24, 32)), jnp.bfloat16)
    assert f(x).dtype == jnp.bfloat16
    assert f.compress_k.w1[...].dtype == jnp.float32 and f.compress_params()[0].w1.dtype == jnp.bfloat16
    t = tl.NativeSparseAttention(32, 4, num_kv_heads=2, dtype=torch.float16, implementation="eager", **SMALL)
    y = t(torch.randn(1, 24, 32, dtype=torch.float16))
    assert y.dtype == torch.float16 and t.compress_v.b1.dtype == torch.float32
    assert t.gates(torch.randn(1, 24, 32)).dtype == torch.float16


# ------------------------------------------------------------------------------------------------
# The encoder block
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("position,kw", [("none", {}), ("rope", dict(compress="mean")),
                                         ("absolute", dict(gate_hidden=8, compress_hidden=4))])
def test_encoder_block_nsa(position, kw):
    kw = dict(kw, position=position)
    f, t = _encoder_pair(**kw)
    assert isinstance(f.attn, jl.NativeSparseAttention) and isinstance(t.attn, tl.NativeSparseAttention)
    assert f.attn.spec == t.attn.spec and f.attn.spec.attention == "nsa"
    x = np.random.default_rng(6).standard_normal((2, 27, 32)).astype(np.float32)
    got = _jit(f, jnp.asarray(x))
    want = t(torch.tensor(x, device=DEVICE))
    assert got.shape == (2, 27, 32)
    np.testing.assert_allclose(np.asarray(got), want.detach().cpu().numpy(), atol=3e-5, rtol=0)


def test_encoder_block_nsa_packed():
    f, t = _encoder_pair(position="rope")
    ids, pos = _packed(1, 30, [11])
    x = np.random.default_rng(7).standard_normal((1, 30, 32)).astype(np.float32)
    got = _jit(f, jnp.asarray(x), segment_ids=jnp.asarray(ids), positions=jnp.asarray(pos))
    want = t(torch.tensor(x, device=DEVICE), segment_ids=torch.tensor(ids, device=DEVICE),
             positions=torch.tensor(pos, device=DEVICE))
    np.testing.assert_allclose(np.asarray(got), want.detach().cpu().numpy(), atol=3e-5, rtol=0)


# ------------------------------------------------------------------------------------------------
# The bridge
# ------------------------------------------------------------------------------------------------
def test_bridge_maps_every_nsa_parameter_once():
    f, t = _nsa_pair(gate_hidden=8)
    pairs = bridge.param_pairs(f, t)
    assert sorted(name for _, name, _ in pairs) == sorted(n for n, _ in t.named_parameters())
    transposed = {name: tr for _, name, tr in pairs}
    assert transposed["gate_in.weight"] and not transposed["compress_k.w1"] and not transposed["compress_v.pos"]
    fe, te = _encoder_pair()
    assert {name for _, name, _ in bridge.param_pairs(fe, te)} == {n for n, _ in te.named_parameters()}
    assert "attn.compress_v.b1" in dict(te.named_parameters())


def test_bridge_round_trip_nsa_is_exact():
    f, t = _nsa_pair(gate_hidden=8, compress_hidden=12)
    original = _flax_params(f)
    g = jl.NativeSparseAttention(32, 4, num_kv_heads=2, gate_hidden=8, compress_hidden=12, rngs=nnx.Rngs(99),
                                 **SMALL)
    bridge.torch_to_flax(t, g)
    for path, value in _flax_params(g).items():
        np.testing.assert_array_equal(value, original[path], err_msg=str(path))
    t64 = tl.NativeSparseAttention(32, 4, num_kv_heads=2, gate_hidden=8, compress_hidden=12, dtype=torch.float64,
                                   param_dtype=torch.float64, device=DEVICE, **SMALL)
    bridge.flax_to_torch(g, t64)
    h = jl.NativeSparseAttention(32, 4, num_kv_heads=2, gate_hidden=8, compress_hidden=12, rngs=nnx.Rngs(7),
                                 **SMALL)
    bridge.torch_to_flax(t64, h)
    for path, value in _flax_params(h).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, original[path], err_msg=str(path))
    fe, te = _encoder_pair(gate_hidden=8)
    ge = jl.EncoderBlock(32, 4, 48, num_kv_heads=2, attention="nsa", causal=True, gate_hidden=8, rngs=nnx.Rngs(3),
                         **SMALL)
    bridge.torch_to_flax(te, ge)
    for path, value in _flax_params(ge).items():
        np.testing.assert_array_equal(value, _flax_params(fe)[path], err_msg=str(path))


@pytest.mark.parametrize("other,match", [
    (dict(compress="mean"), r"compress_k/pos.*missing in the torch module"),
    (dict(gate_hidden=8), r"gate_proj/kernel.*missing|torch parameter gate_in\.weight has no flax counterpart"),
    (dict(compress_hidden=16), r"compress_k\.w1.*shape"),
])
def test_bridge_rejects_other_nsa_configurations(other, match):
    f = jl.NativeSparseAttention(32, 4, num_kv_heads=2, rngs=nnx.Rngs(0), **SMALL)
    t = tl.NativeSparseAttention(32, 4, num_kv_heads=2, device=DEVICE, **{**SMALL, **other})
    with pytest.raises(bridge.BridgeError, match=match):
        bridge.flax_to_torch(f, t)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
NSA_LAYERS = {
    "jax": lambda **kw: jl.NativeSparseAttention(32, 4, rngs=nnx.Rngs(0), **kw),
    "torch": lambda **kw: tl.NativeSparseAttention(32, 4, **kw),
    "jax-encoder": lambda **kw: jl.EncoderBlock(32, 4, attention="nsa", causal=True, rngs=nnx.Rngs(0), **kw),
    "torch-encoder": lambda **kw: tl.EncoderBlock(32, 4, attention="nsa", causal=True, **kw),
}


@pytest.mark.parametrize("framework", NSA_LAYERS)
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(compress_block=24), ValueError, r"compress_block must be a power of two, got 24"),
    (dict(compress_block=8, compress_stride=16), ValueError, r"compress_stride \(16\) must not exceed compress_block"),
    (dict(select_block=0), ValueError, r"select_block must be an int >= 1, got 0"),
    (dict(num_selected=0), ValueError, r"num_selected must be a positive int, got num_selected=0"),
    (dict(window=-1), ValueError, r"window as an int >= 0.*window=-1"),
    (dict(window=(4, 0)), ValueError, r"window as an int >= 0.*window=\(4, 0\)"),
    (dict(compress="max"), ValueError, r"unknown compress='max'; choose one of \('mlp', 'mean'\)"),
    (dict(compress="mean", compress_hidden=8), ValueError, r"compress_hidden=8 applies to compress='mlp' only"),
    (dict(compress_hidden=0), ValueError, r"compress_hidden must be a positive int"),
    (dict(gate_hidden=2.5), ValueError, r"gate_hidden must be a positive int, got gate_hidden=2.5"),
    (dict(num_kv_heads=3), ValueError, r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
])
def test_nsa_constructor_errors(framework, kwargs, error, match):
    with pytest.raises(error, match=match):
        NSA_LAYERS[framework](**kwargs)


@pytest.mark.parametrize("framework", NSA_LAYERS)
@pytest.mark.parametrize("kwargs", [dict(compress_block=8, compress_stride=8, window=0), dict(compress="mean"),
                                    dict(select_block=1, num_selected=1, gate_hidden=1, compress_hidden=1)])
def test_nsa_constructor_boundaries_pass(framework, kwargs):
    NSA_LAYERS[framework](**kwargs)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_other_layers_refuse_nsa_and_its_arguments(framework):
    make = ((lambda *a, **kw: jl.MultiHeadSelfAttention(*a, rngs=nnx.Rngs(0), **kw),
             lambda *a, **kw: jl.EncoderBlock(*a, rngs=nnx.Rngs(0), **kw)) if framework == "jax"
            else (tl.MultiHeadSelfAttention, tl.EncoderBlock))
    mhsa, block = make
    with pytest.raises(ValueError, match=r"attention='nsa' has parameters of its own.*NativeSparseAttention"):
        mhsa(32, 4, attention="nsa", causal=True)
    with pytest.raises(ValueError, match=r"attention='nsa' is causal.*pass causal=True"):
        block(32, 4, attention="nsa")
    with pytest.raises(ValueError, match=r"attention='nsa' does not take softcap=5\.0"):
        block(32, 4, attention="nsa", causal=True, softcap=5.0)
    with pytest.raises(ValueError, match=r"attention='nsa' does not take dropout_rate=0\.1"):
        block(32, 4, attention="nsa", causal=True, dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"attention='softmax' does not take num_selected=4"):
        block(32, 4, num_selected=4)
    with pytest.raises(ValueError, match=r"attention='dilated' does not take compress='mean'"):
        block(32, 4, attention="dilated", segment_lengths=(4,), dilation_rates=(1,), compress="mean")


def test_check_layer_args_nsa():
    spec = check_layer_args(32, 4, 2, attention="nsa", causal=True, window=None, compress="mean")
    assert spec.nsa == NSASpec(32, 16, 64, 16, 512, "mean", None, None) and spec.window == 512
    assert spec.rope_outside_kernel is False
    assert check_layer_args(32, 4, attention="nsa", causal=True, position="rope").rope_outside_kernel
    kw = spec.attention_kwargs(seq_len=130, segment_ids="ids")
    assert kw == dict(compress_block=32, compress_stride=16, select_block=64, num_selected=3, window=512,
                      segment_ids="ids")


def test_sequence_errors_name_the_argument():
    f = jl.NativeSparseAttention(32, 4, implementation="xla", rngs=nnx.Rngs(0), **SMALL)
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, d_model=32\]"):
        f(jnp.zeros((1, 16, 24)))
    with pytest.raises(ValueError, match=r"positions were given but position='none'"):
        f(jnp.zeros((1, 16, 32)), positions=jnp.zeros((1, 16), jnp.int32))
    t = tl.NativeSparseAttention(32, 4, implementation="eager", **SMALL)
    with pytest.raises(ValueError, match=r"segment_ids"):
        t(torch.zeros(1, 16, 32), segment_ids=torch.zeros(1, 15, dtype=torch.int32))


# ------------------------------------------------------------------------------------------------
# Compiled kernels at a realistic size (make test-gpu)
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("compress", ["mlp", "mean"])
def test_gpu_layer_bf16_4k(compress):
    """The layer at 1 x 4096, d_model 1024, 16 / 2 heads, the paper's geometry, bf16: forward and
    backward finite in both frameworks, and the twins (bridged weights) agree to bf16 rounding."""
    kw = dict(num_kv_heads=2, compress=compress, dtype=jnp.bfloat16)
    f = jl.NativeSparseAttention(1024, 16, implementation="triton", rngs=nnx.Rngs(0), **kw)
    t = tl.NativeSparseAttention(1024, 16, implementation="triton", device=DEVICE,
                                 **dict(kw, dtype=torch.bfloat16))
    bridge.flax_to_torch(f, t)
    x = np.random.default_rng(0).standard_normal((1, 4096, 1024)).astype(np.float32)
    graphdef, params = nnx.split(f, nnx.Param)
    loss = lambda p, x: jnp.mean(nnx.merge(graphdef, p)(x).astype(jnp.float32) ** 2)
    value, grads = jax.jit(jax.value_and_grad(loss))(params, jnp.asarray(x, jnp.bfloat16))
    assert np.isfinite(float(value)) and all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    out = t(torch.tensor(x, device=DEVICE, dtype=torch.bfloat16))
    torch.mean(out.float() ** 2).backward()
    assert all(torch.isfinite(p.grad).all() for p in t.parameters())
    got = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(x, jnp.bfloat16)), np.float32)
    # on average: a near-tie in the top-n may pick another block for a few rows in one framework
    diff = np.abs(got - out.detach().float().cpu().numpy())
    assert diff.mean() <= 0.02 * np.abs(got).mean(), (diff.mean(), np.abs(got).mean())
