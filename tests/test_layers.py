"""Layer level: jax_attn.nn.layers / torch_ref.nn.layers twins and their shared argument checks
(attn_spec.layers), positions (attn_spec.positions), the parameter and array bridge, the flax
attention_fn adapter, and the layer parity cases of parity.layers (tolerance rule against a float64
golden, every parameter gradient, a 20-step training run).

CPU: the kernels go through the Pallas and Triton interpreters (see tests/conftest.py), only in the
cases that ask for them. Tests that use position="rope" need the fused RoPE option of
`flash_attention` and `stick_breaking_attention` in both frameworks (rope=, positions=).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from torch import nn  # noqa: E402

import attn_spec.positions as sp  # noqa: E402
import jax_attn  # noqa: E402
import jax_attn.nn.layers as jl  # noqa: E402
import jax_attn.nn.positions as jp  # noqa: E402
import jax_attn.ops.common.rope as jrope  # noqa: E402
import torch_ref  # noqa: E402
import torch_ref.nn.layers as tl  # noqa: E402
import torch_ref.nn.positions as tp  # noqa: E402
import torch_ref.ops.common.rope as trope  # noqa: E402
from attn_spec.dropout import seed_words  # noqa: E402
from attn_spec.layers import check_dilated_args, check_layer_args, check_multihead_args  # noqa: E402
from attn_spec.rope import Rope  # noqa: E402
from parity import bridge  # noqa: E402
from parity import layers as pl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _exact_fp32():
    with pl.exact_fp32():
        yield


def _pair(kind="encoder", position="none", d_model=32, heads=4, kv_heads=2, seed=0, **kw):
    """A perturbed fp32 Flax layer ("xla") and its torch twin ("eager") holding the same weights."""
    kw = dict(kw, num_kv_heads=kv_heads, position=position)
    if position == "rope":
        kw.setdefault("rope", Rope())
    if kind == "encoder":
        f = jl.EncoderBlock(d_model, heads, 48, implementation="xla", rngs=nnx.Rngs(seed), **kw)
        t = tl.EncoderBlock(d_model, heads, 48, implementation="eager", device=DEVICE, **kw)
    else:
        f = jl.MultiHeadSelfAttention(d_model, heads, implementation="xla", rngs=nnx.Rngs(seed), **kw)
        t = tl.MultiHeadSelfAttention(d_model, heads, implementation="eager", device=DEVICE, **kw)
    pl.perturb(f, seed + 1)
    bridge.flax_to_torch(f, t)
    return f, t


def _flax_params(module) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)}


# ------------------------------------------------------------------------------------------------
# Absolute positions
# ------------------------------------------------------------------------------------------------
def _pe_direct(length, dim):
    pe = np.zeros((length, dim))
    for p in range(length):
        for i in range(dim // 2):
            pe[p, 2 * i] = math.sin(p / 10000 ** (2 * i / dim))
            pe[p, 2 * i + 1] = math.cos(p / 10000 ** (2 * i / dim))
    return pe


@pytest.mark.parametrize("dim", [2, 8, 32])
def test_sinusoidal_table_matches_formula(dim):
    want = _pe_direct(40, dim)
    np.testing.assert_allclose(np.asarray(jp.sinusoidal_positions(40, dim)), want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(tp.sinusoidal_positions(40, dim).numpy(), want, atol=1e-5, rtol=0)
    with jax.enable_x64(True):
        j64 = jp.sinusoidal_positions(40, dim, jnp.float64)
        assert j64.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(j64), want, atol=1e-12, rtol=0)
    t64 = tp.sinusoidal_positions(40, dim, torch.float64)
    assert t64.dtype == torch.float64
    np.testing.assert_allclose(t64.numpy(), want, atol=1e-12, rtol=0)
    assert jp.sinusoidal_positions(5, dim, jnp.bfloat16).dtype == jnp.bfloat16


def test_sinusoidal_formula_is_written_once():
    """attn_spec.positions evaluated with NumPy in float64 is the formula; both frameworks evaluate
    the same definition with their own ops (same float32 results on the same positions)."""
    want = _pe_direct(40, 16)
    spec64 = sp.sinusoidal_encoding(np.arange(40, dtype=np.float64), np.arange(8, dtype=np.float64), np)
    np.testing.assert_allclose(spec64, want, atol=1e-12, rtol=0)
    spec32 = sp.sinusoidal_encoding(np.arange(40, dtype=np.float32), np.arange(8, dtype=np.float32), np)
    assert spec32.dtype == np.float32 and spec32.shape == (40, 16)
    np.testing.assert_allclose(np.asarray(jp.sinusoidal_positions(40, 16)), tp.sinusoidal_positions(40, 16).numpy(),
                               atol=1e-6, rtol=0)


def test_attn_spec_imports_neither_framework():
    code = ("import sys, attn_spec.layers, attn_spec.positions, attn_spec.rope; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'torch', 'flax', 'triton')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_sinusoidal_at_gathers_the_table():
    pos = np.array([[0, 3, 7, 7], [39, 1, 0, 2]])
    np.testing.assert_allclose(np.asarray(jp.sinusoidal_at(jnp.asarray(pos), 16)),
                               np.asarray(jp.sinusoidal_positions(40, 16))[pos], atol=1e-6, rtol=0)
    np.testing.assert_allclose(tp.sinusoidal_at(torch.tensor(pos), 16).numpy(),
                               tp.sinusoidal_positions(40, 16).numpy()[pos], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dim", [7, 0, -2])
def test_sinusoidal_rejects_bad_dim(dim):
    with pytest.raises(ValueError, match="even dim"):
        jp.sinusoidal_positions(4, dim)
    with pytest.raises(ValueError, match="even dim"):
        tp.sinusoidal_positions(4, dim)


@pytest.mark.parametrize("length", [-1, 2.0, True])
def test_sinusoidal_rejects_bad_length(length):
    with pytest.raises(ValueError, match="length must be a non-negative int"):
        jp.sinusoidal_positions(length, 8)
    with pytest.raises(ValueError, match="length must be a non-negative int"):
        tp.sinusoidal_positions(length, 8)
    assert jp.sinusoidal_positions(0, 8).shape == (0, 8) and tp.sinusoidal_positions(0, 8).shape == (0, 8)


# ------------------------------------------------------------------------------------------------
# Parameter bridge
# ------------------------------------------------------------------------------------------------
def test_bridge_maps_every_parameter_once():
    f, t = _pair("encoder")
    pairs = bridge.param_pairs(f, t)
    assert sorted(name for _, name, _ in pairs) == sorted(n for n, _ in t.named_parameters())
    assert len(pairs) == len(_flax_params(f)) == 16
    transposed = {name for _, name, tr in pairs if tr}
    assert transposed == {"attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight",
                          "attn.out_proj.weight", "mlp_in.weight", "mlp_out.weight"}
    # nnx.Linear kernel [in, out] is torch weight [out, in]; LayerNorm scale <-> weight.
    np.testing.assert_array_equal(t.mlp_in.weight.detach().cpu().numpy(), np.asarray(f.mlp_in.kernel.get_value()).T)
    np.testing.assert_array_equal(t.ln1.weight.detach().cpu().numpy(), np.asarray(f.ln1.scale.get_value()))
    np.testing.assert_array_equal(t.ln2.bias.detach().cpu().numpy(), np.asarray(f.ln2.bias.get_value()))


def test_bridge_maps_the_learned_decay():
    f, t = _pair("attention", "rope", attention="stick_breaking", causal=True, decay=0.2, learn_decay=True)
    pairs = {name: path for path, name, _ in bridge.param_pairs(f, t)}
    assert pairs["decay_logit"] == ("decay_logit",) and len(pairs) == 9
    np.testing.assert_array_equal(t.decay_logit.detach().cpu().numpy(), np.asarray(f.decay_logit.get_value()))
    softmax = tl.MultiHeadSelfAttention(32, 4, num_kv_heads=2, device=DEVICE)  # no decay_logit
    with pytest.raises(bridge.BridgeError, match="decay_logit: missing in the torch module"):
        bridge.flax_to_torch(f, softmax)


def test_bridge_round_trip_is_exact():
    f, t = _pair("encoder", position="absolute")
    original = _flax_params(f)
    g = jl.EncoderBlock(32, 4, 48, num_kv_heads=2, position="absolute", rngs=nnx.Rngs(99))  # other weights
    bridge.torch_to_flax(t, g)
    for path, value in _flax_params(g).items():
        np.testing.assert_array_equal(value, original[path], err_msg=str(path))
    # fp32 -> float64 twin -> fp32 is exact too, and the float64 copy holds the same values.
    t64 = tl.EncoderBlock(32, 4, 48, num_kv_heads=2, position="absolute", param_dtype=torch.float64,
                          dtype=torch.float64, device=DEVICE)
    bridge.flax_to_torch(f, t64)
    assert all(p.dtype == torch.float64 for p in t64.parameters())
    for (name, p32), (_, p64) in zip(t.named_parameters(), t64.named_parameters()):
        np.testing.assert_array_equal(p64.detach().cpu().numpy(), p32.detach().cpu().numpy().astype(np.float64))
    h = jl.EncoderBlock(32, 4, 48, num_kv_heads=2, position="absolute", rngs=nnx.Rngs(7))
    bridge.torch_to_flax(t64, h)
    for path, value in _flax_params(h).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, original[path], err_msg=str(path))


def test_bridge_values_do_not_alias_torch_memory():
    f, t = _pair("attention")
    g = jl.MultiHeadSelfAttention(32, 4, num_kv_heads=2, rngs=nnx.Rngs(5))
    bridge.torch_to_flax(t, g)
    before = np.asarray(g.q_proj.bias.get_value()).copy()
    with torch.no_grad():
        t.q_proj.bias.add_(1.0)  # an in-place torch update must not reach the Flax copy
    np.testing.assert_array_equal(np.asarray(g.q_proj.bias.get_value()), before)


def test_bridge_rejects_mismatches():
    f, _ = _pair("encoder")
    wrong_ff = tl.EncoderBlock(32, 4, 64, num_kv_heads=2, device=DEVICE)
    with pytest.raises(bridge.BridgeError, match=r"mlp_in\.weight.*shape"):
        bridge.flax_to_torch(f, wrong_ff)
    extra = tl.EncoderBlock(32, 4, 48, num_kv_heads=2, device=DEVICE)
    extra.extra_scale = nn.Parameter(torch.ones(3, device=DEVICE))
    before = {n: p.detach().clone() for n, p in extra.named_parameters()}
    with pytest.raises(bridge.BridgeError, match="extra_scale has no flax counterpart"):
        bridge.flax_to_torch(f, extra)
    for n, p in extra.named_parameters():  # nothing was written
        assert torch.equal(p, before[n]), n
    no_bias = tl.MultiHeadSelfAttention(32, 4, num_kv_heads=2, use_bias=False, device=DEVICE)
    with pytest.raises(bridge.BridgeError, match=r"q_proj\.bias: missing in the torch module"):
        bridge.flax_to_torch(f.attn, no_bias)
    with pytest.raises(bridge.BridgeError, match="no torch mapping"):
        bridge.flax_to_torch(nnx.Embed(10, 4, rngs=nnx.Rngs(0)), nn.Embedding(10, 4))
    with pytest.raises(bridge.BridgeError, match="owner is"):  # same names, other module types
        bridge.param_pairs(nnx.LayerNorm(4, rngs=nnx.Rngs(0)), _WrongOwner())


class _WrongOwner(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.bias = nn.Parameter(torch.zeros(4))


# ------------------------------------------------------------------------------------------------
# Array exchange
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "float16"])
def test_array_exchange_round_trip_exact(dtype):
    rng = np.random.default_rng(0)
    host = rng.standard_normal((3, 5, 7)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype) \
        if dtype != "int32" else rng.integers(-100, 100, (3, 5, 7)).astype(np.int32)
    x = jnp.asarray(host)
    t, method = bridge.to_torch(x, return_method=True)
    assert method == "dlpack" and t.device.type == ("cuda" if jax.default_backend() == "gpu" else "cpu")
    back, method_back = bridge.to_jax(t, return_method=True)
    assert method_back == "dlpack"
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back), host)
    if t.device.type == "cpu":  # zero-copy: the same buffer on both sides
        assert t.data_ptr() == x.unsafe_buffer_pointer() == back.unsafe_buffer_pointer()


def test_array_exchange_float64_and_copies():
    with jax.enable_x64(True):
        x = jnp.arange(12.0, dtype=jnp.float64).reshape(3, 4) / 3
        t = bridge.to_torch(x)
        assert t.dtype == torch.float64
        np.testing.assert_array_equal(bridge.to_jax(t), np.asarray(x))
    src = torch.arange(12.0).reshape(3, 4).to(DEVICE)
    y, method = bridge.to_jax(src.T, return_method=True)  # not contiguous: host copy
    assert method == "copy"
    np.testing.assert_array_equal(np.asarray(y), src.T.cpu().numpy())
    cpu_t, method = bridge.to_torch(jnp.ones(3), device="cpu", return_method=True)
    assert method == ("copy" if jax.default_backend() == "gpu" else "dlpack") and cpu_t.device.type == "cpu"
    grad_t = torch.ones(3, requires_grad=True)
    np.testing.assert_array_equal(bridge.to_jax(grad_t), np.ones(3))  # detached
    with pytest.raises(TypeError):
        bridge.to_torch(np.ones(3))
    with pytest.raises(TypeError):
        bridge.to_jax(np.ones(3))


# ------------------------------------------------------------------------------------------------
# The layers
# ------------------------------------------------------------------------------------------------
SB = dict(attention="stick_breaking", causal=True)


@pytest.mark.parametrize("kind,position,kwargs,explicit", [
    ("attention", "absolute", dict(causal=True), True),
    ("encoder", "none", dict(softcap=4.0), False),
    ("encoder", "rope", dict(window=(3, 1)), True),
    ("attention", "rope", dict(SB, decay=0.1, rope=Rope(style="half")), True),
    ("encoder", "none", dict(SB, decay=0.05, learn_decay=True), False),
    ("encoder", "absolute", SB, True),
])
def test_layer_outputs_match(kind, position, kwargs, explicit):
    """Forward outputs of the twins agree (explicit, unsorted positions here; gradients and the
    other configurations: the parity cases below and `python -m parity.check`)."""
    f, t = _pair(kind, position, **kwargs)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 12, 32)).astype(np.float32)
    pos = rng.integers(0, 50, (2, 12)).astype(np.int32) if explicit else None
    want = t(torch.tensor(x, device=DEVICE), positions=None if pos is None else torch.tensor(pos, device=DEVICE))
    got = f(jnp.asarray(x), positions=None if pos is None else jnp.asarray(pos))
    assert got.shape == (2, 12, 32) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want.detach().cpu().numpy(), atol=2e-5, rtol=0)


def test_default_positions_are_arange():
    f, t = _pair("attention", "absolute")
    x = np.random.default_rng(4).standard_normal((2, 12, 32)).astype(np.float32)
    arange = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))
    explicit = f(jnp.asarray(x), positions=jnp.asarray(arange))
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(x))), np.asarray(explicit), atol=1e-6, rtol=0)
    xt = torch.tensor(x, device=DEVICE)
    torch.testing.assert_close(t(xt), t(xt, positions=torch.tensor(arange, device=DEVICE)), rtol=0, atol=1e-6)


def test_encoder_block_structure():
    f, t = _pair("encoder")
    assert {n for n, _ in t.named_children()} == {"attn", "ln1", "ln2", "mlp_in", "mlp_out"}
    assert {n for n, _ in t.attn.named_children()} == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert isinstance(f.attn.q_proj, nnx.Linear) and isinstance(f.ln1, nnx.LayerNorm)
    assert f.ln1.epsilon == t.ln1.eps == 1e-5
    assert t.attn.k_proj.weight.shape == (16, 32) and f.attn.k_proj.kernel.get_value().shape == (32, 16)  # GQA


@pytest.mark.parametrize("case", [c for c in pl.LAYER_CASES if c.quick], ids=lambda c: c.name)
def test_layer_parity_case(case):
    """The --quick layer cases (all of them: `python -m parity.check --variant layers`)."""
    rows = pl.check_layer_case(case, DEVICE)
    bad = [r for r in rows if not r["ok"]]
    assert rows and not bad, bad
    impls = {r["impl"] for r in rows}
    assert {"golden torch-f64 vs jax-f64", "jax xla", "torch eager"} <= impls
    if case.kind == "train":
        assert "jax xla (naive: torch eager)" in impls
    if case.kind != "train":  # every parameter gradient and the input gradients are compared
        names = {f"d {n}" for n, _ in pl.build_torch(case, "eager", "float32", DEVICE).named_parameters()}
        wanted = names | {"out", *case.input_gradients()}
        assert wanted <= {r["quantity"] for r in rows if r["impl"] == "torch eager"}
    if case.cpu_kernels or DEVICE == "cuda":
        assert {"jax pallas_triton", "torch triton"} <= impls


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
FRAMEWORKS = {
    "jax": lambda *a, **kw: jl.MultiHeadSelfAttention(*a, rngs=nnx.Rngs(0), **kw),
    "jax-encoder": lambda *a, **kw: jl.EncoderBlock(*a, rngs=nnx.Rngs(0), **kw),
    "torch": lambda *a, **kw: tl.MultiHeadSelfAttention(*a, **kw),
    "torch-encoder": lambda *a, **kw: tl.EncoderBlock(*a, **kw),
}


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("args,kwargs,error,match", [
    ((32, 4), dict(position="alibi"), ValueError, r"unknown position='alibi'; choose one of"),
    ((32, 4), dict(position="exposb"), ValueError,
     r"unknown position='exposb'; choose one of \('none', 'absolute', 'rope'\)"),
    ((32, 4), dict(attention="flash"), ValueError,
     r"unknown attention='flash'; choose one of \('softmax', 'stick_breaking', 'dilated', 'nsa'\)"),
    ((30, 4), {}, ValueError, r"d_model \(30\) must be divisible by num_heads \(4\)"),
    ((32, 4), dict(num_kv_heads=3), ValueError, r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
    ((32, 0), {}, ValueError, r"num_heads must be a positive int"),
    ((18, 2), dict(position="rope"), ValueError, r"position='rope' needs an even head dim"),
    ((9, 3), dict(position="absolute"), ValueError, r"position='absolute' needs an even d_model"),
    ((32, 4), dict(attention="stick_breaking"), ValueError,
     r"attention='stick_breaking' is strictly causal: pass causal=True"),
    ((32, 4), dict(SB, window=(3, 0)), ValueError, r"attention='stick_breaking' does not take window=\(3, 0\)$"),
    ((32, 4), dict(SB, softcap=2.0, window=(1, 1)), ValueError, r"does not take window=\(1, 1\), softcap=2.0$"),
    ((32, 4), dict(SB, decay=-1.0), ValueError, "decay must be a finite float >= 0, got decay=-1.0"),
    ((32, 4), dict(SB, decay=float("nan")), ValueError, "decay must be a finite float >= 0"),
    ((32, 4), dict(SB, learn_decay=True), ValueError, "learn_decay=True needs decay > 0"),
    ((32, 4), dict(decay=0.1), ValueError, r"attention='softmax' does not take decay=0.1$"),
    ((32, 4), dict(position="rope", learn_decay=True, decay=0.1), ValueError,
     r"attention='softmax' does not take decay=0.1, learn_decay=True$"),
    ((18, 2), dict(SB, position="rope"), ValueError, r"position='rope' needs an even head dim"),
    ((32, 4), dict(rope=Rope(style="half")), ValueError,
     r"rope=Rope\(.*style='half'\) applies to position='rope' only, not position='none'"),
    ((32, 4), dict(position="rope", rope="half"), TypeError, r"rope must be a Rope \(attn_spec.rope.Rope.*got str"),
])
def test_constructor_errors(framework, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        FRAMEWORKS[framework](*args, **kwargs)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("args,kwargs", [
    ((18, 2), dict(SB)),  # odd head dim (9): fine without RoPE
    ((32, 4), dict(SB, position="rope", window=None, softcap=None, decay=1e-3, learn_decay=True)),
    ((32, 4), dict(decay=0.0, learn_decay=False, window=(0, 0), softcap=1.0, causal=True)),
    ((32, 4), dict(SB, position="absolute", rope=Rope())),  # the default Rope is neutral
    ((20, 2), dict(position="rope", num_kv_heads=1)),  # head dim 10: even
])
def test_constructor_boundaries_pass(framework, args, kwargs):
    module = FRAMEWORKS[framework](*args, **kwargs)
    spec = module.spec if hasattr(module, "spec") else module.attn.spec
    assert spec == check_layer_args(*args, **kwargs)
    assert spec.attention == kwargs.get("attention", "softmax") and spec.position == kwargs.get("position", "none")


def test_twins_share_one_spec():
    f, t = _pair("encoder", "rope", attention="stick_breaking", causal=True, decay=0.1)
    assert f.attn.spec == t.attn.spec and f.attn.spec.rope == Rope()
    assert jrope.Rope is trope.Rope is Rope  # one config class for both frameworks


def test_stick_breaking_learned_decay_starts_at_decay():
    kw = dict(attention="stick_breaking", position="rope", causal=True, decay=0.3, learn_decay=True)
    f = jl.MultiHeadSelfAttention(32, 4, rngs=nnx.Rngs(0), **kw)
    t = tl.MultiHeadSelfAttention(32, 4, **kw)
    np.testing.assert_allclose(np.asarray(jax.nn.softplus(f.decay_logit[...])), 0.3, rtol=1e-6)
    np.testing.assert_allclose(torch.nn.functional.softplus(t.decay_logit).detach().numpy(), 0.3, rtol=1e-6)
    with pytest.raises(ValueError, match="attention='stick_breaking' takes no segment_ids"):
        f(jnp.zeros((1, 4, 32)), segment_ids=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="attention='stick_breaking' takes no segment_ids"):
        t(torch.zeros(1, 4, 32), segment_ids=torch.zeros(1, 4, dtype=torch.int32))
    fn, tn = _pair("attention", "none", **SB)
    with pytest.raises(ValueError, match="position='none' does not use them"):
        fn(jnp.zeros((1, 4, 32)), positions=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="position='none' does not use them"):
        tn(torch.zeros(1, 4, 32, device=DEVICE), positions=torch.zeros(1, 4, dtype=torch.int32, device=DEVICE))


def test_wrong_rope_type_and_stray_positions():
    with pytest.raises(TypeError, match="rope must be a Rope.*got dict"):
        tl.MultiHeadSelfAttention(32, 4, position="rope", rope={"style": "half"})
    with pytest.raises(TypeError, match="rope must be a Rope.*got NoneType"):
        jl.MultiHeadSelfAttention(32, 4, position="rope", rope=None, rngs=nnx.Rngs(0))
    f, t = _pair("attention", "none")
    pos = np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match="position='none' does not use them"):
        f(jnp.zeros((1, 4, 32)), positions=jnp.asarray(pos))
    with pytest.raises(ValueError, match="position='none' does not use them"):
        t(torch.zeros(1, 4, 32, device=DEVICE), positions=torch.tensor(pos, device=DEVICE))
    with pytest.raises(ValueError, match="d_model=32"):
        f(jnp.zeros((1, 4, 16)))
    with pytest.raises(ValueError, match="d_model=32"):
        t(torch.zeros(1, 4, 16, device=DEVICE))
    fa, ta = _pair("attention", "absolute")
    with pytest.raises(ValueError, match="positions must have shape"):
        fa(jnp.zeros((1, 4, 32)), positions=jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(TypeError, match="integer"):
        ta(torch.zeros(1, 4, 32, device=DEVICE), positions=torch.zeros(1, 4, device=DEVICE))


# ------------------------------------------------------------------------------------------------
# flax attention_fn adapter
# ------------------------------------------------------------------------------------------------
def _mha(attention_fn=None, **kw):
    kw = dict(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0), **kw)
    if attention_fn is not None:
        kw["attention_fn"] = attention_fn
    return nnx.MultiHeadAttention(**kw)


@pytest.mark.parametrize("implementation,kv_heads,causal_via", [
    ("xla", None, None), ("xla", 2, "call"), ("pallas_triton", 1, "factory")])
def test_attention_fn_matches_nnx_default(implementation, kv_heads, causal_via):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 12, 32)), jnp.float32)
    kw = {} if kv_heads is None else dict(num_kv_heads=kv_heads)
    want = _mha(**kw)(x, is_causal=causal_via is not None)
    fn = jl.make_attention_fn(causal=causal_via == "factory", implementation=implementation)
    got = _mha(fn, **kw)(x, is_causal=causal_via == "call")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_attention_fn_default_precision_and_batch_dims():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 12, 32)), jnp.float32)
    want = _mha(precision=jax.lax.Precision.HIGHEST)(x)
    got = _mha(jl.attention_fn, precision=jax.lax.Precision.HIGHEST)(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((2, 3, 9, 2, 8)), jnp.float32) for i in range(3))
    got = jl.make_attention_fn(implementation="xla")(q, k, v)
    flat = lambda a: a.reshape(6, 9, 2, 8)
    want = jax.nn.dot_product_attention(flat(q), flat(k), flat(v)).reshape(q.shape)
    assert got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    deterministic = _mha(jl.make_attention_fn(implementation="xla"), dropout_rate=0.5)(x, deterministic=True)
    np.testing.assert_allclose(np.asarray(deterministic), np.asarray(_mha(dropout_rate=0.5)(x, deterministic=True)),
                               atol=2e-5, rtol=0)


def test_attention_fn_refuses_what_it_cannot_honour():
    x = jnp.ones((1, 5, 32))
    fn = jl.make_attention_fn(implementation="xla")
    with pytest.raises(NotImplementedError, match="mask arrays are not supported.*make_attention_fn"):
        _mha(fn)(x, mask=nnx.make_causal_mask(jnp.ones((1, 5))))
    with pytest.raises(NotImplementedError, match="dropout_rate=0.1 with broadcast_dropout=True"):
        _mha(fn, dropout_rate=0.1)(x, deterministic=False)
    with pytest.raises(NotImplementedError, match="module .sow_weights=True."):
        _mha(fn)(x, sow_weights=True)
    with pytest.raises(NotImplementedError, match="precision"):
        _mha(fn, precision=jax.lax.Precision.HIGH)(x)
    q = jnp.ones((1, 5, 2, 8))
    with pytest.raises(NotImplementedError, match="bias is not supported"):
        fn(q, q, q, bias=jnp.zeros((1, 2, 5, 5)))
    with pytest.raises(NotImplementedError, match=r"\['softmax_fn'\]"):
        fn(q, q, q, softmax_fn=jax.nn.softmax)
    with pytest.raises(NotImplementedError, match="precision"):
        fn(q, q, q, precision="tensorfloat32")
    np.testing.assert_array_equal(np.asarray(fn(q, q, q, precision="highest")), np.ones((1, 5, 2, 8)))


# ------------------------------------------------------------------------------------------------
# Dilated layers: DilatedAttention, MultiheadDilatedAttention, EncoderBlock(attention="dilated")
# ------------------------------------------------------------------------------------------------
DIL = dict(segment_lengths=(4, 8), dilation_rates=(1, 2))


def _jit(module, *args, **kwargs):
    """module(*args, **kwargs) compiled once: op-by-op dispatch of the plain dilated path costs
    seconds on CPU."""
    return nnx.jit(lambda m, *a: m(*a, **kwargs))(module, *args)


def _mda_pair(num_heads=4, in_features=24, qkv_features=32, out_features=20, num_kv_heads=2, seed=0, **kw):
    """A perturbed fp32 MultiheadDilatedAttention ("xla") and its torch twin ("eager"), same weights."""
    kw = {**DIL, **kw}
    f = jl.MultiheadDilatedAttention(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                                     implementation="xla", rngs=nnx.Rngs(seed), **kw)
    t = tl.MultiheadDilatedAttention(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                                     implementation="eager", device=DEVICE, **kw)
    pl.perturb(f, seed + 1)
    bridge.flax_to_torch(f, t)
    return f, t


def test_dilated_layers_are_exported():
    assert jax_attn.DilatedAttention is jl.DilatedAttention and torch_ref.DilatedAttention is tl.DilatedAttention
    assert jax_attn.MultiheadDilatedAttention is jl.MultiheadDilatedAttention
    assert torch_ref.MultiheadDilatedAttention is tl.MultiheadDilatedAttention
    assert {"DilatedAttention", "MultiheadDilatedAttention"} <= set(jax_attn.__all__) & set(torch_ref.__all__)


@pytest.mark.parametrize("merge,causal", [("lse", False), ("head_groups", True)])
def test_dilated_attention_layer_is_the_function(merge, causal):
    """The weightless layer calls dilated_attention with its configuration (scale included)."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 13, h, 8)).astype(np.float32) for h in (4, 2, 2))
    cfg = dict(DIL, causal=causal, merge=merge, scale=0.4)
    f = jl.DilatedAttention(**cfg, implementation="xla")
    t = tl.DilatedAttention(**cfg, implementation="eager")
    got, lse = _jit(f, *map(jnp.asarray, (q, k, v)), return_lse=True)
    want = jax.jit(lambda *a: jax_attn.dilated_attention(*a, **cfg, implementation="xla"))(*map(jnp.asarray, (q, k, v)))
    assert got.shape == (2, 13, 4, 8) and lse.shape == (2, 4, 13)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    tq, tk, tv = (torch.tensor(a, device=DEVICE) for a in (q, k, v))
    np.testing.assert_array_equal(t(tq, tk, tv).cpu().numpy(),
                                  torch_ref.dilated_attention(tq, tk, tv, **cfg, implementation="eager").cpu().numpy())
    np.testing.assert_allclose(t(tq, tk, tv).cpu().numpy(), np.asarray(got), atol=2e-6, rtol=0)
    assert f.spec == t.spec == check_dilated_args(**cfg)
    assert not list(t.parameters()) and not _flax_params(f)  # no weights
    assert bridge.param_pairs(f, t) == []


def test_multihead_dilated_shapes_and_parameters():
    """nnx.MultiHeadAttention's widths: q of qkv_features, k/v of num_kv_heads * head_dim, output of
    out_features; the same parameter names and (transposed) shapes in both frameworks."""
    f, t = _mda_pair()
    shapes = {n: tuple(p.shape) for n, p in t.named_parameters()}
    assert shapes == {"q_proj.weight": (32, 24), "q_proj.bias": (32,), "k_proj.weight": (16, 24),
                      "k_proj.bias": (16,), "v_proj.weight": (16, 24), "v_proj.bias": (16,),
                      "out_proj.weight": (20, 32), "out_proj.bias": (20,)}
    pairs = bridge.param_pairs(f, t)
    assert len(pairs) == 8 and {name for _, name, tr in pairs if tr} == {f"{p}.weight" for p in
                                                                        ("q_proj", "k_proj", "v_proj", "out_proj")}
    assert isinstance(f.q_proj, nnx.Linear) and f.spec == t.spec and f.spec.head_dim == 8
    x = np.random.default_rng(0).standard_normal((2, 11, 24)).astype(np.float32)
    got = _jit(f, jnp.asarray(x))
    want = t(torch.tensor(x, device=DEVICE))
    assert got.shape == tuple(want.shape) == (2, 11, 20)
    np.testing.assert_allclose(np.asarray(got), want.detach().cpu().numpy(), atol=2e-5, rtol=0)
    defaults = jl.MultiheadDilatedAttention(4, 24, rngs=nnx.Rngs(0), **DIL)  # qkv/out features default to in
    assert defaults.q_proj.kernel.get_value().shape == defaults.out_proj.kernel.get_value().shape == (24, 24)
    no_bias = tl.MultiheadDilatedAttention(4, 24, use_bias=False, **DIL)
    assert all(p.ndim == 2 for p in no_bias.parameters())


@pytest.mark.parametrize("position,kwargs", [
    ("absolute", dict(causal=True)),
    ("rope", dict(merge="head_groups", rope=Rope(style="half"))),
    ("none", dict(segment_lengths=(3, 16), dilation_rates=(3, 4), causal=True, num_kv_heads=1)),
])
def test_multihead_dilated_twins_agree(position, kwargs):
    """Separate key/value inputs and explicit (unsorted) positions: the twins agree; self-attention
    (inputs_k = inputs_v = inputs_q by default) is the same layer called on x three times."""
    kv = kwargs.pop("num_kv_heads", 2)
    f, t = _mda_pair(num_kv_heads=kv, position=position, **kwargs)
    rng = np.random.default_rng(7)
    xq, xk, xv = (rng.standard_normal((2, 13, 24)).astype(np.float32) for _ in range(3))
    pos = rng.integers(0, 40, (2, 13)).astype(np.int32) if position != "none" else None
    jpos = None if pos is None else jnp.asarray(pos)
    tpos = None if pos is None else torch.tensor(pos, device=DEVICE)
    got = _jit(f, jnp.asarray(xq), jnp.asarray(xk), jnp.asarray(xv), positions=jpos)
    want = t(*(torch.tensor(a, device=DEVICE) for a in (xq, xk, xv)), positions=tpos)
    np.testing.assert_allclose(np.asarray(got), want.detach().cpu().numpy(), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(_jit(f, jnp.asarray(xq), positions=jpos)),
                               np.asarray(_jit(f, *(jnp.asarray(xq),) * 3, positions=jpos)), atol=1e-6, rtol=0)
    xt = torch.tensor(xq, device=DEVICE)
    torch.testing.assert_close(t(xt, positions=tpos), t(xt, xt, xt, positions=tpos), rtol=0, atol=0)


def test_multihead_dilated_rope_rotates_q_and_k_outside_the_kernel():
    """position="rope" on dilated attention: q and k rotated (plain apply_rope) at the positions
    (default 0 .. S-1), then dilated_attention."""
    f, _ = _mda_pair(qkv_features=32, out_features=24, position="rope", causal=True)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 12, 24)), jnp.float32)

    @nnx.jit
    def by_hand(f, x):
        q, k, v = (p(x).reshape(2, 12, h, 8) for p, h in ((f.q_proj, 4), (f.k_proj, 2), (f.v_proj, 2)))
        q, k = jax_attn.apply_rope(q, None, Rope()), jax_attn.apply_rope(k, None, Rope())
        o = jax_attn.dilated_attention(q, k, v, **DIL, causal=True, implementation="xla")
        return f.out_proj(o.reshape(2, 12, 32))

    want = by_hand(f, x)
    np.testing.assert_allclose(np.asarray(_jit(f, x)), np.asarray(want), atol=1e-6, rtol=0)
    arange = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    np.testing.assert_allclose(np.asarray(_jit(f, x, positions=arange)), np.asarray(want), atol=1e-6, rtol=0)


def test_self_attention_with_attention_dilated_is_the_multihead_layer():
    """MultiHeadSelfAttention(d_model, H, attention="dilated") = MultiheadDilatedAttention(H, d_model)
    with the same weights (the encoder block's attention)."""
    cfg = dict(DIL, merge="head_groups", causal=True, position="absolute")
    mhsa = jl.MultiHeadSelfAttention(32, 4, num_kv_heads=2, attention="dilated", implementation="xla",
                                     rngs=nnx.Rngs(0), **cfg)
    mda = jl.MultiheadDilatedAttention(4, 32, num_kv_heads=2, implementation="xla", rngs=nnx.Rngs(1), **cfg)
    nnx.update(mda, nnx.state(mhsa, nnx.Param))
    x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 10, 32)), jnp.float32)
    out = _jit(mhsa, x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_jit(mda, x)))
    t = tl.MultiheadDilatedAttention(4, 32, num_kv_heads=2, implementation="eager", device=DEVICE, **cfg)
    bridge.flax_to_torch(mhsa, t)  # the same parameter names: the bridge maps one onto the other
    np.testing.assert_allclose(t(torch.tensor(np.asarray(x), device=DEVICE)).detach().cpu().numpy(),
                               np.asarray(out), atol=2e-5, rtol=0)


@pytest.mark.parametrize("position,merge", [("none", "lse"), ("rope", "head_groups"), ("absolute", "lse")])
def test_encoder_block_dilated(position, merge):
    f, t = _pair("encoder", position, attention="dilated", merge=merge, causal=merge == "lse", **DIL)
    assert f.attn.spec.attention == "dilated" and f.attn.spec.dilated.merge == merge
    assert f.attn.spec == t.attn.spec
    x = np.random.default_rng(10).standard_normal((2, 15, 32)).astype(np.float32)
    got = _jit(f, jnp.asarray(x))
    want = t(torch.tensor(x, device=DEVICE))
    assert got.shape == (2, 15, 32)
    np.testing.assert_allclose(np.asarray(got), want.detach().cpu().numpy(), atol=2e-5, rtol=0)


def test_bridge_round_trip_dilated_layers_is_exact():
    f, t = _mda_pair(position="absolute")
    original = _flax_params(f)
    g = jl.MultiheadDilatedAttention(4, 24, 32, 20, 2, position="absolute", rngs=nnx.Rngs(99), **DIL)
    bridge.torch_to_flax(t, g)
    for path, value in _flax_params(g).items():
        np.testing.assert_array_equal(value, original[path], err_msg=str(path))
    t64 = tl.MultiheadDilatedAttention(4, 24, 32, 20, 2, position="absolute", dtype=torch.float64,
                                       param_dtype=torch.float64, device=DEVICE, **DIL)
    bridge.flax_to_torch(g, t64)
    h = jl.MultiheadDilatedAttention(4, 24, 32, 20, 2, position="absolute", rngs=nnx.Rngs(7), **DIL)
    bridge.torch_to_flax(t64, h)
    for path, value in _flax_params(h).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, original[path], err_msg=str(path))
    fe, te = _pair("encoder", "rope", attention="dilated", **DIL)
    ge = jl.EncoderBlock(32, 4, 48, num_kv_heads=2, position="rope", attention="dilated", rngs=nnx.Rngs(3), **DIL)
    bridge.torch_to_flax(te, ge)
    for path, value in _flax_params(ge).items():
        np.testing.assert_array_equal(value, _flax_params(fe)[path], err_msg=str(path))
    wrong = tl.MultiheadDilatedAttention(4, 24, 32, 24, 2, device=DEVICE, **DIL)  # other out_features
    with pytest.raises(bridge.BridgeError, match=r"out_proj\.weight.*shape"):
        bridge.flax_to_torch(f, wrong)


DILATED_FRAMEWORKS = {
    "jax": lambda *a, **kw: jl.MultiheadDilatedAttention(*a, rngs=nnx.Rngs(0), **kw),
    "torch": lambda *a, **kw: tl.MultiheadDilatedAttention(*a, **kw),
}


@pytest.mark.parametrize("framework", DILATED_FRAMEWORKS)
@pytest.mark.parametrize("args,kwargs,match", [
    ((4, 24), dict(DIL, qkv_features=30), r"qkv_features \(30\) must be divisible by num_heads \(4\)"),
    ((4, 30), DIL, r"in_features \(30\) must be divisible by num_heads \(4\)"),
    ((4, 0), DIL, r"in_features must be a positive int, got in_features=0"),
    ((4, 24), dict(DIL, out_features=-1), r"out_features must be a positive int"),
    ((4, 24), dict(DIL, num_kv_heads=3), r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
    ((6, 24), dict(segment_lengths=(4, 8, 16, 32), dilation_rates=(1, 2, 4, 8), merge="head_groups"),
     r"merge='head_groups' splits the 6 heads into one group per branch"),
    ((4, 24), dict(DIL, merge="mean"), r"merge must be one of \('lse', 'head_groups'\), got 'mean'"),
    ((4, 24), dict(segment_lengths=(4, 8), dilation_rates=(1,)), "segment_lengths and dilation_rates must have "
                                                                 "the same count"),
    ((4, 24), dict(segment_lengths=(4, 2), dilation_rates=(1, 4)), "rate 4 is larger than its segment length 2"),
    ((4, 24), dict(segment_lengths=(4, 0), dilation_rates=(1, 1)), "segment_lengths must hold positive ints"),
    ((4, 24), dict(segment_lengths=None, dilation_rates=(1, 2)), "dilated attention needs segment_lengths"),
    ((4, 24), dict(segment_lengths=None, dilation_rates=None), "needs segment_lengths and dilation_rates"),
    ((4, 24), dict(segment_lengths=8, dilation_rates=2), "segment_lengths must be a sequence of positive ints"),
    ((4, 17), dict(DIL, position="absolute", qkv_features=16), "needs an even in_features, got in_features=17"),
    ((4, 20), dict(DIL, position="rope", qkv_features=12), r"needs an even head dim, got qkv_features / num_heads = 3"),
    ((4, 24), dict(DIL, causal="yes"), "causal must be a bool, got causal='yes'"),
])
def test_multihead_dilated_constructor_errors(framework, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DILATED_FRAMEWORKS[framework](*args, **kwargs)


@pytest.mark.parametrize("framework", DILATED_FRAMEWORKS)
@pytest.mark.parametrize("args,kwargs", [
    ((4, 24), dict(segment_lengths=(4, 8, 16, 32), dilation_rates=(1, 2, 4, 8), merge="head_groups")),  # H = K
    ((4, 24), dict(segment_lengths=(4, 8), dilation_rates=(4, 8), causal=np.bool_(True))),  # rate = segment
    ((4, 21, 12), dict(DIL, num_kv_heads=1)),  # MQA; odd in_features and head dim (3): fine without positions
    ((4, 22, 8), dict(DIL, position="rope", out_features=1)),  # head dim 2: even
])
def test_multihead_dilated_constructor_boundaries_pass(framework, args, kwargs):
    module = DILATED_FRAMEWORKS[framework](*args, **kwargs)
    assert module.spec == check_multihead_args(*args, attention="dilated", **kwargs)


@pytest.mark.parametrize("layer", ["jax", "torch"])
@pytest.mark.parametrize("kwargs,match", [
    (dict(segment_lengths=(4, 8), dilation_rates=(1, 2, 4)), "must have the same count"),
    (dict(segment_lengths=[], dilation_rates=[]), "segment_lengths must not be empty"),
    (dict(DIL, merge="sum"), "merge must be one of"),
    (dict(DIL, scale=0.0), r"scale must be a finite float > 0 or None \(D \*\* -0.5\), got scale=0.0"),
    (dict(DIL, scale=float("inf")), "scale must be a finite float > 0"),
    (dict(DIL, scale=True), "scale must be a finite float > 0"),
    (dict(DIL, causal=None), "causal must be a bool, got causal=None"),
])
def test_dilated_attention_layer_errors(layer, kwargs, match):
    cls = jl.DilatedAttention if layer == "jax" else tl.DilatedAttention
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_dilated_attention_layer_head_count_checked_at_the_call():
    cfg = dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), merge="head_groups")
    f, t = jl.DilatedAttention(**cfg, implementation="xla"), tl.DilatedAttention(**cfg, implementation="eager")
    with pytest.raises(ValueError, match="merge='head_groups'"):
        f(jnp.ones((1, 8, 4, 8)), jnp.ones((1, 8, 4, 8)), jnp.ones((1, 8, 4, 8)))
    with pytest.raises(ValueError, match="merge='head_groups'"):
        t(torch.ones(1, 8, 4, 8), torch.ones(1, 8, 4, 8), torch.ones(1, 8, 4, 8))
    assert _jit(f, *(jnp.ones((1, 8, 6, 8)),) * 3).shape == (1, 8, 6, 8)  # 6 heads: 3 groups of 2
    assert t(*(torch.ones(1, 8, 6, 8),) * 3).shape == (1, 8, 6, 8)


@pytest.mark.parametrize("framework", ["jax", "jax-encoder", "torch", "torch-encoder"])
@pytest.mark.parametrize("kwargs,match", [
    (dict(attention="dilated"), "dilated attention needs segment_lengths and dilation_rates"),
    (dict(DIL, attention="dilated", window=(2, 2)), r"attention='dilated' does not take window=\(2, 2\)$"),
    (dict(DIL, attention="dilated", softcap=3.0, decay=0.1),
     r"attention='dilated' does not take softcap=3.0, decay=0.1$"),
    (dict(DIL), r"attention='softmax' does not take segment_lengths=\(4, 8\), dilation_rates=\(1, 2\)$"),
    (dict(merge="head_groups"), r"attention='softmax' does not take merge='head_groups'$"),
    (dict(SB, segment_lengths=(4,)), r"attention='stick_breaking' does not take segment_lengths=\(4,\)$"),
    (dict(attention="dilated", segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), merge="head_groups"),
     "merge='head_groups' splits the 4 heads"),
])
def test_attention_dilated_constructor_errors(framework, kwargs, match):
    with pytest.raises(ValueError, match=match):
        FRAMEWORKS[framework](32, 4, **kwargs)


def test_dilated_call_errors():
    f, t = _mda_pair()
    x = np.zeros((2, 9, 24), np.float32)
    with pytest.raises(ValueError, match=r"inputs_q must be \[batch, seq, in_features=24\], got shape \(2, 9, 32\)"):
        f(jnp.zeros((2, 9, 32)))
    with pytest.raises(ValueError, match=r"inputs_q must be \[batch, seq, in_features=24\]"):
        t(torch.zeros(2, 9, 32, device=DEVICE))
    with pytest.raises(ValueError, match=r"inputs_k must be \[batch, seq, in_features\] = \(2, 9, 24\).*same "
                                         r"sequence.*got shape \(2, 8, 24\)"):
        f(jnp.asarray(x), jnp.zeros((2, 8, 24)))
    with pytest.raises(ValueError, match=r"inputs_v must be \[batch, seq, in_features\]"):
        t(torch.tensor(x, device=DEVICE), None, torch.zeros(1, 9, 24, device=DEVICE))
    with pytest.raises(ValueError, match="position='none' does not use them"):
        f(jnp.asarray(x), positions=jnp.zeros((2, 9), jnp.int32))
    fa, ta = _mda_pair(position="rope")
    with pytest.raises(ValueError, match="positions must have shape"):
        fa(jnp.asarray(x), positions=jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(TypeError, match="integer"):
        ta(torch.tensor(x, device=DEVICE), positions=torch.zeros(2, 9, device=DEVICE))
    fe, te = _pair("attention", attention="dilated", **DIL)
    with pytest.raises(ValueError, match="attention='dilated' takes no segment_ids"):
        fe(jnp.zeros((1, 8, 32)), segment_ids=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="attention='dilated' takes no segment_ids"):
        te(torch.zeros(1, 8, 32, device=DEVICE), segment_ids=torch.zeros(1, 8, dtype=torch.int32, device=DEVICE))


# ------------------------------------------------------------------------------------------------
# Attention dropout in the layers
# ------------------------------------------------------------------------------------------------
DROP_SEEDS = (7, 2 ** 40 + 3)  # the second has both seed words non-zero


def _key(seed: int):
    """The JAX dropout key of torch's dropout_seed=seed (its two seed words)."""
    return jax.random.wrap_key_data(jnp.asarray(seed_words(seed), jnp.uint32))


def _x(seed=11, shape=(2, 12, 32)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kwargs,match", [
    (dict(dropout_rate=1.0), r"dropout_rate must be a float in \[0, 1\), got dropout_rate=1.0"),
    (dict(dropout_rate=-0.1), r"dropout_rate must be a float in \[0, 1\), got dropout_rate=-0.1"),
    (dict(dropout_rate=True), r"dropout_rate must be a float in \[0, 1\), got dropout_rate=True"),
    (dict(dropout_rate="0.1"), r"dropout_rate must be a float in \[0, 1\)"),
    (dict(SB, dropout_rate=0.1), r"attention='stick_breaking' does not take dropout_rate=0.1$"),
    (dict(DIL, attention="dilated", dropout_rate=0.2), r"attention='dilated' does not take dropout_rate=0.2$"),
])
def test_dropout_constructor_errors(framework, kwargs, match):
    with pytest.raises(ValueError, match=match):
        FRAMEWORKS[framework](32, 4, **kwargs)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_dilated_layers_refuse_dropout(framework):
    """Dilated attention has no dropout: the dilated layers keep dropout_rate at 0."""
    frameworks = (jl, dict(rngs=nnx.Rngs(0))) if framework == "jax" else (tl, {})
    module, extra = frameworks
    with pytest.raises(ValueError, match=r"attention='dilated' does not take dropout_rate=0.1$"):
        module.MultiheadDilatedAttention(4, 24, dropout_rate=0.1, **DIL, **extra)
    with pytest.raises(ValueError, match=r"dilated attention has no dropout: dropout_rate must be 0.0, got "
                                         r"dropout_rate=0.1"):
        module.DilatedAttention(**DIL, dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"dropout_rate must be a float in \[0, 1\)"):
        module.DilatedAttention(**DIL, dropout_rate=2)
    assert module.MultiheadDilatedAttention(4, 24, dropout_rate=0.0, **DIL, **extra).spec.dropout_rate == 0.0
    assert module.DilatedAttention(**DIL, dropout_rate=0).spec == check_dilated_args(**DIL)


def test_dropout_spec_and_attributes():
    assert check_layer_args(32, 4, dropout_rate=0.25).dropout_rate == 0.25
    assert check_layer_args(32, 4).dropout_rate == 0.0 and check_layer_args(32, 4, dropout_rate=0).dropout_rate == 0.0
    f = jl.EncoderBlock(32, 4, dropout_rate=0.1, rngs=nnx.Rngs(0))
    assert f.dropout_rate == f.attn.dropout_rate == 0.1 and f.deterministic is f.attn.deterministic is None
    assert isinstance(f.attn.rngs, nnx.RngStream)
    assert jl.MultiHeadSelfAttention(32, 4, rngs=nnx.Rngs(0)).rngs is None  # no stream without dropout
    assert jl.MultiHeadSelfAttention(32, 4, deterministic=True, dropout_rate=0.1, rngs=nnx.Rngs(0)).deterministic
    t = tl.EncoderBlock(32, 4, dropout_rate=0.1)
    assert t.dropout_rate == t.attn.dropout_rate == 0.1 and t.attn.spec == f.attn.spec


def _flax_dropout_pair(kind):
    """A Flax layer with dropout_rate 0.1 and one without, holding the same weights."""
    cls = jl.EncoderBlock if kind == "encoder" else jl.MultiHeadSelfAttention
    args = (32, 4, 48) if kind == "encoder" else (32, 4)
    f0 = cls(*args, num_kv_heads=2, causal=True, implementation="xla", rngs=nnx.Rngs(0))
    f1 = cls(*args, num_kv_heads=2, causal=True, dropout_rate=0.1, implementation="xla", rngs=nnx.Rngs(1))
    pl.perturb(f0, 1)
    nnx.update(f1, nnx.state(f0, nnx.Param))
    return f0, f1


@pytest.mark.parametrize("kind", ["attention", "encoder"])
def test_flax_dropout_train_eval(kind):
    """deterministic as in nnx.MultiHeadAttention: required with dropout; eval() = the rate-0 layer;
    train() drops, reproducibly for a key; the call's argument wins over the attribute."""
    f0, f1 = _flax_dropout_pair(kind)
    x = jnp.asarray(_x())
    want = np.asarray(f0(x))
    with pytest.raises(ValueError, match="No `deterministic` argument was provided to MultiHeadSelfAttention"):
        f1(x)
    f0(x, deterministic=None)  # without dropout nothing needs it
    np.testing.assert_array_equal(np.asarray(f1(x, deterministic=True)), want)
    f1.eval()
    assert f1.deterministic is True and (kind == "attention" or f1.attn.deterministic is True)
    np.testing.assert_array_equal(np.asarray(f1(x)), want)
    np.testing.assert_array_equal(np.asarray(f1(x, dropout_key=_key(3))), want)  # deterministic: no key used
    dropped = np.asarray(f1(x, deterministic=False, dropout_key=_key(3)))  # the call wins over eval()
    assert np.abs(dropped - want).max() > 1e-2
    f1.train()
    assert f1.deterministic is False and (kind == "attention" or f1.attn.deterministic is False)
    np.testing.assert_array_equal(np.asarray(f1(x, dropout_key=_key(3))), dropped)  # reproducible
    other = np.asarray(f1(x, dropout_key=_key(4)))
    assert np.abs(other - dropped).max() > 1e-2
    np.testing.assert_array_equal(np.asarray(f1(x, deterministic=True, dropout_key=_key(3))), want)
    # keys from the layer's own stream (forked from rngs): fresh on every call
    a, b = np.asarray(f1(x)), np.asarray(f1(x))
    assert np.abs(a - b).max() > 1e-2 and np.abs(a - want).max() > 1e-2
    # keys from the call's rngs (its dropout stream, or a stream): its first draw
    first = nnx.Rngs(dropout=5).dropout()
    by_key = np.asarray(f1(x, dropout_key=first))
    np.testing.assert_array_equal(np.asarray(f1(x, rngs=nnx.Rngs(dropout=5))), by_key)
    np.testing.assert_array_equal(np.asarray(f1(x, rngs=nnx.Rngs(dropout=5).dropout)), by_key)
    np.testing.assert_array_equal(np.asarray(f1(x, rngs=nnx.Rngs(dropout=5), dropout_key=_key(3))), dropped)


def test_flax_dropout_stream_under_jit():
    """Under nnx.jit the layer's stream advances between calls (its state goes in and out)."""
    f0, f1 = _flax_dropout_pair("attention")
    f1.train()
    x = jnp.asarray(_x())
    step = nnx.jit(lambda m, x: m(x))
    a, b = np.asarray(step(f1, x)), np.asarray(step(f1, x))
    assert np.abs(a - b).max() > 1e-2
    keyed = nnx.jit(lambda m, x, key: m(x, dropout_key=key))
    np.testing.assert_allclose(np.asarray(keyed(f1, x, _key(9))), np.asarray(f1(x, dropout_key=_key(9))),
                               atol=1e-6, rtol=0)
    f1.eval()
    np.testing.assert_allclose(np.asarray(step(f1, x)), np.asarray(f0(x)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["attention", "encoder"])
def test_torch_dropout_train_eval(kind):
    """training mode drops (reproducibly for a seed; None: a seed from torch's generator), eval is
    the rate-0 layer and draws nothing."""
    cls = tl.EncoderBlock if kind == "encoder" else tl.MultiHeadSelfAttention
    args = (32, 4, 48) if kind == "encoder" else (32, 4)
    t0 = cls(*args, num_kv_heads=2, causal=True, implementation="eager", device=DEVICE)
    t1 = cls(*args, num_kv_heads=2, causal=True, dropout_rate=0.1, implementation="eager", device=DEVICE)
    t1.load_state_dict(t0.state_dict())
    x = torch.tensor(_x(), device=DEVICE)
    with torch.no_grad():
        want = t0(x)
        assert t1.training
        dropped = t1(x, dropout_seed=3)
        assert (dropped - want).abs().max() > 1e-2
        torch.testing.assert_close(t1(x, dropout_seed=3), dropped, rtol=0, atol=0)
        assert (t1(x, dropout_seed=4) - dropped).abs().max() > 1e-2
        torch.manual_seed(0)
        drawn = t1(x)
        assert (t1(x) - drawn).abs().max() > 1e-2  # a new seed per call
        torch.manual_seed(0)
        torch.testing.assert_close(t1(x), drawn, rtol=0, atol=0)
        t1.eval()
        state = torch.random.get_rng_state()
        torch.testing.assert_close(t1(x), want, rtol=0, atol=0)
        torch.testing.assert_close(t1(x, dropout_seed=3), want, rtol=0, atol=0)
        assert torch.equal(torch.random.get_rng_state(), state)  # eval draws no seed
        t1.train()
        torch.testing.assert_close(t1(x, dropout_seed=3), dropped, rtol=0, atol=0)
        t0(x, dropout_seed=3)  # a layer without dropout ignores the seed


@pytest.mark.parametrize("kind,position,seed", [("attention", "rope", DROP_SEEDS[0]),
                                                ("encoder", "absolute", DROP_SEEDS[1])])
def test_dropout_layers_agree_across_frameworks(kind, position, seed):
    """The bridge-copied twins with one seed (JAX dropout_key of its words, torch dropout_seed) drop
    the same elements: outputs and input gradients agree."""
    f, t = _pair(kind, position, causal=True, dropout_rate=0.1)
    x = _x(12)
    jx = jnp.asarray(x)
    tx = torch.tensor(x, device=DEVICE, requires_grad=True)
    got, vjp = jax.vjp(lambda x: f(x, deterministic=False, dropout_key=_key(seed)), jx)
    want = t(tx, dropout_seed=seed)
    np.testing.assert_allclose(np.asarray(got), want.detach().cpu().numpy(), atol=2e-5, rtol=0)
    ct = np.random.default_rng(13).standard_normal(x.shape).astype(np.float32)
    (dx,) = vjp(jnp.asarray(ct))
    want.backward(torch.tensor(ct, device=DEVICE))
    np.testing.assert_allclose(np.asarray(dx), tx.grad.cpu().numpy(), atol=5e-5, rtol=0)
    without = t.eval()(torch.tensor(x, device=DEVICE)).detach().cpu().numpy()
    assert np.abs(np.asarray(got) - without).max() > 1e-2  # the dropout did drop


def test_attention_fn_dropout():
    """The flax adapter's dropout: dropout_rng is flash_attention's dropout_key (one mask per batch
    element and head: broadcast_dropout=False); flax's default broadcast_dropout=True is refused."""
    rng = np.random.default_rng(14)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 3, 9, 2, 8)), jnp.float32) for _ in range(3))
    fn = jl.make_attention_fn(causal=True, implementation="xla")
    key = _key(DROP_SEEDS[1])
    got = fn(q, k, v, dropout_rng=key, dropout_rate=0.2, broadcast_dropout=False, deterministic=False)
    flat = lambda a: a.reshape(6, 9, 2, 8)
    want = jax_attn.flash_attention(flat(q), flat(k), flat(v), causal=True, dropout_rate=0.2, dropout_key=key,
                                    implementation="xla").reshape(q.shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    plain = fn(q, k, v, dropout_rng=key, dropout_rate=0.2, broadcast_dropout=False, deterministic=True)
    assert np.abs(np.asarray(plain) - np.asarray(got)).max() > 1e-2
    with pytest.raises(NotImplementedError, match="broadcast_dropout=True.*broadcast_dropout=False"):
        fn(q, k, v, dropout_rng=key, dropout_rate=0.2, deterministic=False)
    # in nnx.MultiHeadAttention: keys from its rngs, the same stream gives the same output
    x = jnp.asarray(_x(15), jnp.float32)
    mha = _mha(fn, dropout_rate=0.1, broadcast_dropout=False)
    a = mha(x, deterministic=False, rngs=nnx.Rngs(dropout=2))
    np.testing.assert_array_equal(np.asarray(mha(x, deterministic=False, rngs=nnx.Rngs(dropout=2))), np.asarray(a))
    assert np.abs(np.asarray(mha(x, deterministic=True)) - np.asarray(a)).max() > 1e-2
