"""Stick-breaking attention (ExpoSB): the public entry point, its validation and the plain reference.

Strictly causal; for j < i (DESIGN.md "ExpoSB"; Tan et al., arXiv 2410.17980):
  z_ij = scale * q~_i . k~_j - decay_h * (i - j),   beta_ij = sigmoid(z_ij),
  A_ij = beta_ij * prod_{j<m<i} (1 - beta_im),    o_i = sum_j A_ij v_j,   rem_i = 1 - sum_j A_ij.
The kernels are in `stick_breaking_pallas`.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn import api
from jax_attn.device import pallas_triton_unsupported_reason
from jax_attn.rope import Rope, apply_rope
from jax_attn.spec import AttentionSpec
from jax_attn.stick_breaking_pallas import stick_breaking_pallas


def stick_breaking_reference(q, k, v, decay, spec: AttentionSpec, *, pos=None):
    """Plain jnp, materialising [B, Hq, S, S] (float64 under jax.enable_x64: the golden).

    decay [Hq]. Log-space math in float32 (float64 for float64); A is rounded to v.dtype for the
    A v product, as in the kernels. Gradients by autodiff."""
    if spec.rope is not None:
        q, k = apply_rope(q, pos, spec.rope), apply_rope(k, pos, spec.rope)
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    wide = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.reshape(batch, seq_len, num_kv_heads, group, head_dim)
    raw = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=spec.precision, preferred_element_type=wide)
    rows = jnp.arange(seq_len)[:, None]
    cols = jnp.arange(seq_len)[None, :]
    lam = decay.astype(wide).reshape(num_kv_heads, group)[None, :, :, None, None]
    z = raw * spec.scale - lam * (rows - cols).astype(wide)
    valid = cols < rows
    sp = jnp.where(valid, jax.nn.softplus(z), 0.0)
    suffix = jnp.cumsum(sp[..., ::-1], axis=-1)[..., ::-1] - sp  # sum over j < m < i
    a = jnp.where(valid, jnp.exp(jax.nn.log_sigmoid(z) - suffix), 0.0)
    a_v, v_a = a.astype(v.dtype), v
    if v.dtype == jnp.float16:
        # A's cotangent, dO . v, passes fp16's range under loss scaling (cotangents x 2^13) and
        # would come back inf from an fp16 product: take the product in fp32 on A rounded to fp16
        # (the same values; fp16 is exact in fp32 and TF32), the cotangent straight through in fp32
        a_v, v_a = a + jax.lax.stop_gradient(a_v.astype(wide) - a), v.astype(wide)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", a_v, v_a, precision=spec.precision, preferred_element_type=wide)
    out = out.reshape(batch, seq_len, num_heads, head_dim).astype(q.dtype)
    rem = jnp.exp(-sp.sum(axis=-1)).reshape(batch, num_heads, seq_len)
    return out, rem


IMPLEMENTATIONS = {
    "pallas_triton": stick_breaking_pallas,
    # the forward on the Hopper kernel (`stick_breaking_mosaic`), the backward on Pallas Triton's
    "mosaic_gpu": functools.partial(stick_breaking_pallas, forward="mosaic_gpu"),
    "xla": stick_breaking_reference,
}


def _check_decay(decay, num_heads, dtype):
    """-> decay [Hq] in the compute dtype (float32; float64 for the golden). Broadcasting a scalar
    here makes autodiff sum its gradient back over the heads."""
    if isinstance(decay, numbers.Real) and not isinstance(decay, bool):
        decay = np.float64(decay)
    if not hasattr(decay, "shape") or not hasattr(decay, "dtype"):
        raise TypeError(f"decay must be a float or a float array, got {type(decay).__name__}")
    if not jnp.issubdtype(decay.dtype, jnp.floating):
        raise TypeError(f"decay must have a floating dtype, got decay.dtype={decay.dtype}")
    if decay.shape not in ((), (num_heads,)):
        raise ValueError(f"decay must be a scalar or have shape [Hq] = ({num_heads},), got {decay.shape}")
    try:  # concrete values are checked; a traced (learnable) decay cannot be inspected here
        concrete = np.asarray(decay)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        concrete = None
    if concrete is not None and not (np.all(np.isfinite(concrete)) and np.all(concrete >= 0)):
        raise ValueError(f"decay must be finite and >= 0, got decay={concrete}")
    compute = jnp.float64 if dtype == jnp.float64 else jnp.float32
    return jnp.broadcast_to(jnp.asarray(decay, compute), (num_heads,))


def stick_breaking_attention(q, k, v, *, scale: float | None = None, decay=0.0, rope: Rope | None = None,
                             positions=None, return_remainder: bool = False,
                             implementation: str | None = None):
    """Stick-breaking attention (ExpoSB), strictly causal: token i attends to keys j < i.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] (same S), Hq % Hkv == 0 (GQA/MQA); D <= 256; any S.
        float32, float16, bfloat16 (float64 with "xla" only, under jax.enable_x64).
      scale: logit scale, default D ** -0.5.
      decay: lambda >= 0 of the distance penalty -lambda (i - j): a float, a scalar array or an
        array [Hq] (per head). Differentiable (a learnable decay gets its gradient, same shape).
        The distance is the token index difference, whatever the RoPE positions.
      rope: a `Rope`: q and k are rotated inside the kernels; positions int [B, S], default arange.
      return_remainder: also return rem [B, Hq, S] float32, the unspent stick 1 - sum_j A_ij
        (1 on row 0, which has no key; its output is 0). Differentiable.
      implementation: None (the Pallas Triton kernels where Pallas Triton runs, else "xla"),
        "pallas_triton", "mosaic_gpu" (Hopper, 16-bit, head dim 33 to 128, no RoPE: the forward
        on a Mosaic GPU kernel, the backward on Pallas Triton's) or "xla" (plain jnp,
        [B, Hq, S, S] in memory). Not "mosaic_gpu" by default even where it serves the call: its
        forward walks every tile, while the Triton forward ends a row block's walk where its
        sticks are spent (H100, 2x8192x16x128 bf16, paired, inputs ~ N(0, 1): forward+backward
        1.79 against 3.23 ms; where no stick is spent 8.96 against 8.88, and the forward alone
        2.09 against 1.77).

    Returns: out [B, S, Hq, D] in q.dtype, or (out, rem).
    """
    api._check_arrays(q, k, v)
    batch, seq_len, num_heads, head_dim = q.shape
    if k.shape[1] != seq_len:
        raise ValueError(f"stick-breaking attention is causal self-attention: q and k need the same "
                         f"length, got {q.shape=} and {k.shape=}")
    pos, _ = api._check_rope(rope, positions, batch, seq_len, seq_len, head_dim)
    scale = api._check_positive("scale", scale)
    decay = _check_decay(decay, num_heads, q.dtype)
    spec = AttentionSpec(scale=head_dim ** -0.5 if scale is None else scale, causal=True,
                         precision=api._fp32_precision(q.dtype), rope=rope)
    if implementation is None:
        implementation = api.default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise NotImplementedError(
            f"unknown implementation={implementation!r}; choose one of {sorted(IMPLEMENTATIONS)} or None")
    if q.dtype == jnp.float64 and implementation != "xla":
        raise NotImplementedError(f"float64 inputs are served by implementation='xla' only, not {implementation!r}")
    if implementation in ("pallas_triton", "mosaic_gpu") and (reason := pallas_triton_unsupported_reason()):
        raise NotImplementedError(f"implementation={implementation!r} cannot serve this call: {reason}")
    out, rem = IMPLEMENTATIONS[implementation](q, k, v, decay, spec, pos=pos)
    return (out, rem) if return_remainder else out
