"""The implementation registries of both frameworks: the rule for implementation=None (on pretended
devices), names and accepted spellings, refusals with their reasons, and the `config=` argument."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_attn
import torch_ref
from jax_attn import registry as jreg
from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.ops.softmax import mosaic as softmax_mosaic
from torch_ref import registry as treg

HOPPER = jax_attn.DeviceInfo("gpu", "NVIDIA H100 (pretended)", (9, 0), None, 132)
AMPERE = jax_attn.DeviceInfo("gpu", "NVIDIA A100 (pretended)", (8, 0), None, 108)
TPU = jax_attn.DeviceInfo("tpu", "TPU v5 (pretended)", None, None, None)


def _pretend(monkeypatch, info):
    import jax_attn.device
    monkeypatch.setattr(jax_attn.device, "device_info", lambda *a: info)
    monkeypatch.setattr(softmax_mosaic, "device_info", lambda *a: info)


def _call(dtype=jnp.bfloat16, head_dim=128, positions=False, **spec):
    return jreg.Call(AttentionSpec(scale=1.0, **spec), head_dim, dtype, positions)


# ------------------------------------------------------------------------------------------------
# jax_attn: the rule for None
# ------------------------------------------------------------------------------------------------
def test_jax_none_rule_per_device(monkeypatch):
    causal = _call(causal=True)
    _pretend(monkeypatch, HOPPER)
    assert jreg.choose("softmax", causal) == "mosaic"
    assert jreg.choose("softmax", _call(jnp.float32, causal=True)) == "triton"
    assert jreg.choose("softmax", _call(softcap=5.0)) == "triton"
    assert jreg.choose("stick_breaking", causal) == "triton"  # on Hopper too (see stick_breaking_attention)
    _pretend(monkeypatch, AMPERE)
    assert jreg.choose("softmax", causal) == jreg.choose("stick_breaking", causal) == "triton"
    _pretend(monkeypatch, TPU)
    assert jreg.choose("softmax", causal) == jreg.choose("stick_breaking", causal) == "xla"
    assert jax_attn.default_implementation(causal.spec, 128, jnp.bfloat16) == "xla"


def test_jax_none_rule_on_this_cpu():
    assert jreg.choose("softmax", _call(causal=True)) == "triton"  # the Pallas interpreter
    assert jax_attn.default_implementation() == "triton"


def test_jax_explicit_refusals_say_why(monkeypatch):
    _pretend(monkeypatch, TPU)
    with pytest.raises(NotImplementedError, match=r"implementation='triton' cannot serve this call: .*'tpu'"):
        jreg.resolve("softmax", "pallas_triton", _call())
    with pytest.raises(NotImplementedError, match=r"implementation='mosaic' cannot serve this call"):
        jreg.resolve("stick_breaking", "mosaic", _call(causal=True))
    assert jreg.resolve("softmax", "xla", _call()).name == "xla"
    _pretend(monkeypatch, HOPPER)
    with pytest.raises(NotImplementedError, match=r"implementation='mosaic' cannot serve this call: .*softcap"):
        jreg.resolve("softmax", "mosaic", _call(softcap=5.0))
    with pytest.raises(NotImplementedError, match=r"float64 inputs are served by implementation='xla' only"):
        jreg.resolve("softmax", "triton", _call(jnp.float64))


def test_jax_public_refusals():
    x = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"implementation='mosaic' cannot serve this call: .*Hopper"):
        jax_attn.flash_attention(x, x, x, implementation="mosaic")
    with pytest.raises(NotImplementedError, match=r"implementation='mosaic' cannot serve this call: .*Hopper"):
        jax_attn.stick_breaking_attention(x, x, x, implementation="mosaic_gpu")


def test_jax_names_and_old_spellings(monkeypatch):
    assert jax_attn.IMPLEMENTATIONS == ("triton", "mosaic", "xla")
    assert jreg.resolve("softmax", "pallas_triton", _call()) is jreg.REGISTRY["softmax"]["triton"]
    assert jreg.canonical("stick_breaking", "mosaic_gpu") == "mosaic"
    _pretend(monkeypatch, HOPPER)
    assert jreg.resolve("softmax", "mosaic_gpu", _call(causal=True)) is jreg.REGISTRY["softmax"]["mosaic"]
    monkeypatch.undo()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 17, 2, 16)), jnp.float32)
    for f in (jax_attn.flash_attention, jax_attn.stick_breaking_attention):
        np.testing.assert_array_equal(np.asarray(f(x, x, x, implementation="pallas_triton")),
                                      np.asarray(f(x, x, x, implementation="triton")))


@pytest.mark.parametrize("name", ["cuda", "eager", "Triton", 3, ""])
def test_jax_unknown_names(name):
    x = jnp.ones((1, 8, 2, 16), jnp.float32)
    for f in (jax_attn.flash_attention, jax_attn.stick_breaking_attention):
        with pytest.raises(jax_attn.UnknownImplementationError,
                           match=r"unknown implementation=.*choose one of None, 'triton', 'mosaic', 'xla' "
                                 r"\(also accepted: 'pallas_triton' for 'triton', 'mosaic_gpu' for 'mosaic'\)"):
            f(x, x, x, implementation=name)
    assert issubclass(jax_attn.UnknownImplementationError, ValueError)
    assert issubclass(jax_attn.UnknownImplementationError, NotImplementedError)


# ------------------------------------------------------------------------------------------------
# jax_attn: configs
# ------------------------------------------------------------------------------------------------
def test_jax_config_classes_validate():
    jax_attn.BlockSizes(block_q=16, block_k=16, num_warps=1, num_stages=1)  # the boundary passes
    with pytest.raises(ValueError, match=r"BlockSizes.block_q=8 must be a power of two >= 16"):
        jax_attn.BlockSizes(block_q=8)
    with pytest.raises(ValueError, match=r"BlockSizes.block_k_dq=48 must be a power of two"):
        jax_attn.BlockSizes(block_k_dq=48)
    with pytest.raises(ValueError, match=r"BlockSizes.num_warps=3 must be a power of two"):
        jax_attn.BlockSizes(num_warps=3)
    with pytest.raises(ValueError, match=r"BlockSizes.num_stages_bwd=0 must be >= 1"):
        jax_attn.BlockSizes(num_stages_bwd=0)
    with pytest.raises(TypeError, match=r"BlockSizes.block_q=64.0 must be an int"):
        jax_attn.BlockSizes(block_q=64.0)
    jax_attn.StickBreakingBlockSizes(16, 16, 16, 1, 1, num_stages_dkv=None)
    with pytest.raises(ValueError, match=r"StickBreakingBlockSizes.block_q_dkv=24 must be a power of two"):
        jax_attn.StickBreakingBlockSizes(block_q_dkv=24)
    jax_attn.MosaicBlockSizes(block_q=64, num_stages=2)
    with pytest.raises(ValueError, match=r"MosaicBlockSizes.block_k=0 must be a multiple of 64"):
        jax_attn.MosaicBlockSizes(block_k=0)
    with pytest.raises(ValueError, match=r"MosaicBlockSizes.num_stages=1 must be >= 2"):
        jax_attn.MosaicBlockSizes(num_stages=1)


def test_jax_config_argument():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 37, 2, 16)), jnp.float32) for _ in range(3))
    small = jax_attn.BlockSizes(16, 16, 16, 16, 16, 16, 4, 1, 4, 1)
    ref = jax_attn.flash_attention(q, k, v, causal=True, implementation="xla")
    out = jax_attn.flash_attention(q, k, v, causal=True, implementation="triton", config=small)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    call = jreg.Call(AttentionSpec(scale=0.25, causal=True), 16, jnp.float32)
    default = jreg.REGISTRY["softmax"]["triton"].default_config(call)
    assert default == jax_attn.default_block_sizes(16, True, jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax_attn.flash_attention(q, k, v, causal=True, config=default)),
                                  np.asarray(jax_attn.flash_attention(q, k, v, causal=True)))
    sb = jax_attn.stick_breaking_attention(q, k, v, config=jax_attn.StickBreakingBlockSizes(16, 32, 16, 4, 1))
    np.testing.assert_allclose(np.asarray(sb), np.asarray(jax_attn.stick_breaking_attention(q, k, v, implementation="xla")),
                               rtol=2e-5, atol=2e-5)
    with pytest.raises(TypeError, match=r"config must be a .*\.BlockSizes for implementation='triton', "
                                        r"got StickBreakingBlockSizes"):
        jax_attn.flash_attention(q, k, v, config=jax_attn.StickBreakingBlockSizes())
    with pytest.raises(TypeError, match=r"config must be a .*StickBreakingBlockSizes for implementation='triton'"):
        jax_attn.stick_breaking_attention(q, k, v, config=small)
    with pytest.raises(TypeError, match=r"implementation='xla' takes no tile config"):
        jax_attn.flash_attention(q, k, v, implementation="xla", config=small)
    with pytest.raises(TypeError, match=r"config must be a .*BlockSizes"):
        jax_attn.flash_attention(q, k, v, config={"block_q": 16})


def test_jax_config_that_cannot_serve_the_call(monkeypatch):
    _pretend(monkeypatch, HOPPER)
    sb_mosaic = jreg.REGISTRY["stick_breaking"]["mosaic"]
    call = _call(causal=True)
    assert jreg.check_config(sb_mosaic, jax_attn.StickBreakingBlockSizes(block_k=64), call).block_k == 64
    with pytest.raises(ValueError, match=r"cannot serve this call: .*block_k must be 64, got 32"):
        jreg.check_config(sb_mosaic, jax_attn.StickBreakingBlockSizes(block_k=32), call)
    mosaic = jreg.REGISTRY["softmax"]["mosaic"]
    rope = _call(causal=True, rope=jax_attn.Rope())
    jreg.check_config(mosaic, jax_attn.MosaicBlockSizes(block_k=128), rope)
    jreg.check_config(mosaic, jax_attn.MosaicBlockSizes(block_q=128), call)  # without RoPE it serves
    with pytest.raises(ValueError, match=r"block_q = block_q_bwd = block_k_bwd = 64"):
        jreg.check_config(mosaic, jax_attn.MosaicBlockSizes(block_q=128), rope)
    assert mosaic.default_config(call) == jax_attn.default_mosaic_block_sizes(128)


# ------------------------------------------------------------------------------------------------
# torch_ref
# ------------------------------------------------------------------------------------------------
def _tcall(device="cpu", dtype=torch.float32):
    return treg.Call(torch.device(device), dtype, 16)


def test_torch_none_rule(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for variant in treg.VARIANTS:
        assert treg.choose(variant, _tcall()) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    for variant in treg.VARIANTS:
        assert treg.choose(variant, _tcall()) == "eager"
        assert treg.choose(variant, _tcall("cuda")) == "triton"  # a pretended CUDA tensor
    assert torch_ref.IMPLEMENTATIONS == ("triton", "eager")


@pytest.mark.parametrize("name", ["xla", "pallas_triton", "mosaic", "TRITON", 0])
def test_torch_unknown_names(name):
    x = torch.zeros(1, 8, 2, 16)
    for f in (torch_ref.flash_attention, torch_ref.stick_breaking_attention):
        with pytest.raises(torch_ref.UnknownImplementationError,
                           match=r"unknown implementation=.*choose one of None, 'triton', 'eager'$"):
            f(x, x, x, implementation=name)


def test_torch_refusals_say_why(monkeypatch):
    x = torch.zeros(1, 8, 2, 16, dtype=torch.float64)
    for f in (torch_ref.flash_attention, torch_ref.stick_breaking_attention):
        with pytest.raises(NotImplementedError, match=r"implementation='triton' cannot serve this call: .*not float64"):
            f(x, x, x, implementation="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(NotImplementedError, match=r"cannot serve this call: .*CUDA tensor or the Triton interpreter"):
        treg.resolve("stick_breaking", "triton", _tcall())
    assert treg.resolve("softmax", None, _tcall()).name == "eager"


def test_torch_config_classes_share_the_vocabulary():
    fields = lambda cls: [f.name for f in dataclasses.fields(cls)]
    assert fields(torch_ref.BlockSizes) == fields(jax_attn.BlockSizes)
    assert not hasattr(torch_ref, "FlashConfig") and not hasattr(torch_ref, "StickBreakingConfig")
    torch_ref.BlockSizes(block_q=16, block_k_dq=16, num_warps=1)  # the boundary passes
    with pytest.raises(ValueError, match=r"BlockSizes.block_q=8 must be a power of two >= 16"):
        torch_ref.BlockSizes(block_q=8)
    with pytest.raises(ValueError, match=r"StickBreakingBlockSizes.block_k_bwd=48 must be a power of two"):
        torch_ref.StickBreakingBlockSizes(block_k_bwd=48)
    with pytest.raises(ValueError, match=r"StickBreakingBlockSizes.num_warps_bwd=6 must be a power of two"):
        torch_ref.StickBreakingBlockSizes(num_warps_bwd=6)


def test_torch_config_argument(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 37, 2, 16, generator=gen) for _ in range(3))
    small = torch_ref.BlockSizes(16, 16, 16, 16, 16, 16, 4, 1, 4, 1)
    ref = torch_ref.flash_attention(q, k, v, causal=True, implementation="eager")
    out = torch_ref.flash_attention(q, k, v, causal=True, implementation="triton", config=small)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    default = treg.REGISTRY["softmax"]["triton"].default_config(treg.Call.of(q))
    assert torch.equal(torch_ref.flash_attention(q, k, v, config=default), torch_ref.flash_attention(q, k, v))
    sb_cfg = torch_ref.StickBreakingBlockSizes(16, 16, 16, 32, 16, 4, 1, 4, 1)
    sb = torch_ref.stick_breaking_attention(q, k, v, config=sb_cfg)
    torch.testing.assert_close(sb, torch_ref.stick_breaking_attention(q, k, v, implementation="eager"),
                               rtol=2e-5, atol=2e-5)
    with pytest.raises(TypeError, match=r"config must be a .*\.BlockSizes for implementation='triton', "
                                        r"got StickBreakingBlockSizes"):
        torch_ref.flash_attention(q, k, v, config=sb_cfg)
    with pytest.raises(TypeError, match=r"config must be a .*StickBreakingBlockSizes"):
        torch_ref.stick_breaking_attention(q, k, v, config=jax_attn.StickBreakingBlockSizes())
    with pytest.raises(TypeError, match=r"implementation='eager' takes no tile config"):
        torch_ref.stick_breaking_attention(q, k, v, implementation="eager", config=sb_cfg)
