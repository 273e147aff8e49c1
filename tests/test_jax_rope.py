"""Fused RoPE in the Pallas engine: against the float64 golden (rotate in plain jnp, then
attend), both pairings, per-token positions, masks, GQA; the relative-position property; errors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_attn import Rope, apply_rope, flash_attention
from jax_golden import _inputs, check_against_golden

STYLES = ["interleaved", "half"]


@pytest.mark.parametrize("style, shape, kw", [
    ("interleaved", (1, 47, 47, 4, 2, 32), dict(causal=True)),
    ("half", (2, 31, 58, 6, 2, 40), dict(window=(12, 5))),  # D/2 = 20: each half padded inside
    ("interleaved", (1, 33, 33, 4, 1, 16), dict(softcap=4.0)),
    ("half", (1, 20, 20, 2, 2, 72), {}),
], ids=["interleaved_causal_gqa", "half_cross_window_d40", "interleaved_mqa_softcap_d16", "half_d72"])
def test_rope_against_golden(style, shape, kw):
    check_against_golden(shape, rope=Rope(base=500.0, style=style), **kw)


def test_rope_fp16():
    check_against_golden((1, 64, 64, 2, 2, 64), dtype=jnp.float16, causal=True, rope=Rope(style="half"))


@pytest.mark.parametrize("style", STYLES)
def test_rope_packed_positions_with_segments(style):
    """Packed sequences: positions restart at 0 in each segment, ids keep segments apart."""
    lengths = [20, 33, 17]
    ids = jnp.asarray(np.repeat(np.arange(3), lengths)[None], jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(n) for n in lengths])[None], jnp.int32)
    check_against_golden((1, 70, 70, 4, 2, 32), causal=True, segment_ids=ids, positions=pos,
                         rope=Rope(style=style))


def test_rope_position_pair_cross_attention():
    rng = np.random.default_rng(1)
    q_pos = jnp.asarray(rng.integers(0, 4000, (1, 25)), jnp.int32)
    kv_pos = jnp.asarray(rng.integers(0, 4000, (1, 41)), jnp.int32)
    check_against_golden((1, 25, 41, 2, 1, 32), positions=(q_pos, kv_pos), rope=Rope())


@pytest.mark.parametrize("style", STYLES)
def test_rope_is_relative(style):
    """Shifting every position by a constant leaves the attention output unchanged."""
    rng = np.random.default_rng(2)
    q, k, v, _ = (jnp.asarray(x, jnp.float32) for x in _inputs(rng, 1, 40, 40, 2, 2, 32))
    pos = jnp.arange(40, dtype=jnp.int32)[None]
    with jax.default_matmul_precision("highest"):
        a = flash_attention(q, k, v, causal=True, rope=Rope(style=style), positions=pos)
        b = flash_attention(q, k, v, causal=True, rope=Rope(style=style), positions=pos + 37)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_fused_equals_rotate_then_attend():
    """The fused kernel computes what rotating in XLA and calling the plain kernel computes."""
    rng = np.random.default_rng(3)
    q, k, v, _ = (jnp.asarray(x, jnp.float32) for x in _inputs(rng, 1, 50, 50, 4, 2, 64))
    pos = jnp.broadcast_to(jnp.arange(50, dtype=jnp.int32), (1, 50))
    rope = Rope(style="half")
    with jax.default_matmul_precision("highest"):
        fused = flash_attention(q, k, v, causal=True, rope=rope)
        unfused = flash_attention(apply_rope(q, pos, rope), apply_rope(k, pos, rope), v, causal=True)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(unfused), rtol=1e-5, atol=1e-6)


def test_rope_errors():
    x = jnp.ones((1, 8, 2, 16), jnp.float32)
    odd = jnp.ones((1, 8, 2, 15), jnp.float32)
    with pytest.raises(ValueError, match=r"unknown rope style='neox'"):
        Rope(style="neox")
    with pytest.raises(ValueError, match=r"rope base must be a number > 1"):
        Rope(base=1.0)
    with pytest.raises(ValueError, match=r"head dim must be even for RoPE, got D=15"):
        flash_attention(odd, odd, odd, rope=Rope())
    with pytest.raises(ValueError, match=r"positions are given but rope is None"):
        flash_attention(x, x, x, positions=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(TypeError, match=r"rope must be a jax_attn.Rope"):
        flash_attention(x, x, x, rope="half")
    with pytest.raises(ValueError, match=r"q positions must have shape \(1, 8\)"):
        flash_attention(x, x, x, rope=Rope(), positions=jnp.zeros((1, 9), jnp.int32))
    with pytest.raises(TypeError, match=r"q positions must be an integer array"):
        flash_attention(x, x, x, rope=Rope(), positions=jnp.zeros((1, 8)))
    short = jnp.ones((1, 6, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"single positions array needs Sq == Sk"):
        flash_attention(x, short, short, rope=Rope(), positions=jnp.zeros((1, 8), jnp.int32))
    # boundary: the smallest even head dim passes
    two = jnp.ones((1, 8, 2, 2), jnp.float32)
    assert flash_attention(two, two, two, rope=Rope()).shape == (1, 8, 2, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("implementation", ["pallas_triton", "mosaic_gpu"])
def test_gpu_rope(style, implementation):
    assert jax.default_backend() == "gpu"
    check_against_golden((2, 1024, 1024, 8, 2, 128), dtype=jnp.bfloat16, causal=True,
                         rope=Rope(style=style), implementation=implementation)
