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
import jax_attn.nn.layers as jl  # noqa: E402
import jax_attn.nn.positions as jp  # noqa: E402
import jax_attn.ops.common.rope as jrope  # noqa: E402
import torch_ref.nn.layers as tl  # noqa: E402
import torch_ref.nn.positions as tp  # noqa: E402
import torch_ref.ops.common.rope as trope  # noqa: E402
from attn_spec.layers import check_layer_args  # noqa: E402
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
    if case.kind != "train":  # every parameter gradient and dx are compared
        names = {f"d {n}" for n, _ in pl.build_torch(case, "eager", "float32", DEVICE).named_parameters()}
        assert names | {"out", "dx"} <= {r["quantity"] for r in rows if r["impl"] == "torch eager"}
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
     r"unknown attention='flash'; choose one of \('softmax', 'stick_breaking'\)"),
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
    with pytest.raises(NotImplementedError, match="dropout_rate=0.1 with deterministic=False"):
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
