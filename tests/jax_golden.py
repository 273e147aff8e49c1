"""Shared JAX test helpers: seeded inputs, the float64 golden, and the tolerance check."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_attn import flash_attention
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare

NP_DTYPE = {jnp.float64: np.float64, jnp.float32: np.float32, jnp.float16: np.float16, jnp.bfloat16: ml_dtypes.bfloat16}


def _inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim):
    q = rng.standard_normal((batch, q_len, heads, head_dim))
    k = rng.standard_normal((batch, kv_len, kv_heads, head_dim))
    v = rng.standard_normal((batch, kv_len, kv_heads, head_dim))
    do = rng.standard_normal((batch, q_len, heads, head_dim))
    return q, k, v, do


def _run(q, k, v, do, dtype, implementation, **kw):
    """out, lse, dq, dk, dv as float64 NumPy, through jax.vjp with cotangent do (and 0 for lse)."""
    cast = lambda x: jnp.asarray(x, dtype)
    f = lambda q, k, v: flash_attention(q, k, v, return_lse=True, implementation=implementation, **kw)
    (out, lse), vjp = jax.vjp(f, cast(q), cast(k), cast(v))
    grads = vjp((cast(do), jnp.zeros_like(lse)))
    return [np.asarray(x, np.float64) for x in (out, lse, *grads)]


def _golden(q, k, v, do, **kw):
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        return _run(q, k, v, do, jnp.float64, "xla", **kw)


def check_against_golden(shape, dtype=jnp.float32, seed=0, implementation="pallas_triton", config=None, **kw):
    """Golden (float64), naive (xla reference in dtype), kernel (with its tile `config`, None: the
    default): kernel error within the rule."""
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, *shape)
    golden = _golden(q, k, v, do, **kw)
    with jax.default_matmul_precision("highest"):  # fp32: exact dots on both sides
        naive = _run(q, k, v, do, dtype, "xla", **kw)
        fast = _run(q, k, v, do, dtype, implementation, **kw, **({} if config is None else {"config": config}))
    for name, f, n, g in zip(("out", "lse", "dq", "dk", "dv"), fast, naive, golden):
        factor = FORWARD_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR
        verdict = compare(f, n, g, NP_DTYPE[dtype], factor)
        assert verdict.ok, f"{name}: {verdict}"
    return fast, golden
