"""The GPU check shared by the sequence-parallel tests: a sharded call against the same attention on
one GPU, both in bf16, each measured against an fp32 one-GPU reference (exact fp32 dots)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def relative_errors(a, b):
    """Relative L2 errors of the arrays of `a` against those of `b` (bf16 against fp32 is computed in
    fp32: strict dtype promotion)."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return [float(jnp.linalg.norm(f32(x) - f32(y)) / jnp.linalg.norm(f32(y))) for x, y in zip(a, b)]


def assert_matches_one_device(seq_len: int, reference, one_device, parallel, label: str, deterministic=False):
    """B=1, `seq_len` rows, 16 query / 4 kv heads of 128, bf16 inputs: out, dq, dk, dv of
    `parallel` no further from `reference` (run in fp32 at "highest" matmul precision) than 2x (out)
    / 3x (gradients) the error of `one_device` (bf16) plus 1e-3; `deterministic`: a second run of
    `parallel` is bitwise equal."""
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    rng = np.random.default_rng(0)
    shapes = [(1, seq_len, 16, 128), (1, seq_len, 4, 128), (1, seq_len, 4, 128), (1, seq_len, 16, 128)]
    q, k, v, do = (jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(jnp.bfloat16) for s in shapes)

    def grads(f, dtype):
        def g(q, k, v, do):
            out, vjp = jax.vjp(f, q, k, v)
            return (out, *vjp(do.astype(out.dtype)))
        return jax.jit(g)(*(x.astype(dtype) for x in (q, k, v, do)))

    with jax.default_matmul_precision("highest"):
        ref = grads(reference, jnp.float32)
    one = grads(one_device, jnp.bfloat16)
    ours = grads(parallel, jnp.bfloat16)
    err_one, err_ours = relative_errors(one, ref), relative_errors(ours, ref)
    print(f"{len(jax.devices())} GPUs {label}: relative error one GPU {err_one}, sequence-parallel {err_ours}")
    for name, e1, e2, factor in zip(("out", "dq", "dk", "dv"), err_one, err_ours, (2, 3, 3, 3)):
        assert e2 <= factor * e1 + 1e-3, (name, e1, e2)
    if deterministic:
        for a, b in zip(ours, grads(parallel, jnp.bfloat16)):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
