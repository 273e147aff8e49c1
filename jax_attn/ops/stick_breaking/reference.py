"""Stick-breaking attention (ExpoSB): the plain reference.

Query i sits at key position p_i = i + Sk - Sq (the queries are the last Sq positions of the keys;
p_i = i when Sq == Sk). It sees the keys j < p_i (j <= p_i with attend_current) of its own segment
(segment ids); for those keys (Tan et al., arXiv 2410.17980):
  z_ij = scale * q~_i . k~_j - decay_h * (p_i - j),   beta_ij = sigmoid(z_ij),
  A_ij = beta_ij * prod_{m visible, m > j} (1 - beta_im),   o_i = sum_j A_ij v_j,   rem_i = 1 - sum_j A_ij.
Keys a row does not see neither take weight nor spend its stick (packed sequences restart it).
The kernels are in `triton.py` (Pallas Triton) and `mosaic.py` (the Hopper forward).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_attn.ops.common.rope import apply_rope, wide_float
from jax_attn.ops.common.spec import AttentionSpec


def stick_breaking_reference(q, k, v, decay, spec: AttentionSpec, *, pos=None, kv_pos=None, q_ids=None, kv_ids=None,
                             attend_current: bool = False):
    """Plain jnp, materialising [B, Hq, Sq, Sk] (float64 under jax.enable_x64: the golden).

    q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] with Sq <= Sk and spec.offset = Sk - Sq; decay () or [Hq];
    q_ids [B, Sq] / kv_ids [B, Sk] int or None (spec.has_segments); pos / kv_pos: RoPE positions
    (None: arange, the queries' from spec.offset). Log-space math in float32 (float64 for float64);
    A is rounded to v.dtype for the A v product, as in the kernels. Gradients by autodiff."""
    if spec.rope is not None:
        if pos is None and spec.offset:
            pos = jnp.broadcast_to(jnp.arange(q.shape[1]) + spec.offset, q.shape[:2])
        q, k = apply_rope(q, pos, spec.rope), apply_rope(k, pos if kv_pos is None else kv_pos, spec.rope)
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    wide = wide_float(q.dtype)
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    raw = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=spec.precision, preferred_element_type=wide)
    rows = jnp.arange(q_len) + spec.offset if spec.offset else jnp.arange(q_len)  # the queries' key positions
    rows = rows[:, None][None, None, None]  # [1, 1, 1, Sq, 1] against [B, Hkv, G, Sq, Sk]
    cols = jnp.arange(kv_len)[None, :][None, None, None]
    lam = jnp.broadcast_to(decay.astype(wide), (num_heads,)).reshape(num_kv_heads, group)[None, :, :, None, None]
    z = raw * spec.scale - lam * (rows - cols).astype(wide)
    valid = cols <= rows if attend_current else cols < rows
    if q_ids is not None:
        valid = valid & (q_ids[:, None, None, :, None] == kv_ids[:, None, None, None, :])
    sp = jnp.where(valid, jax.nn.softplus(z), 0.0)
    suffix = jnp.cumsum(sp[..., ::-1], axis=-1)[..., ::-1] - sp  # sum over the visible m > j
    a = jnp.where(valid, jnp.exp(jax.nn.log_sigmoid(z) - suffix), 0.0)
    a_v, v_a = a.astype(v.dtype), v
    if v.dtype == jnp.float16:
        # A's cotangent, dO . v, passes fp16's range under loss scaling (cotangents x 2^13) and
        # would come back inf from an fp16 product: take the product in fp32 on A rounded to fp16
        # (the same values; fp16 is exact in fp32 and TF32), the cotangent straight through in fp32
        a_v, v_a = a + jax.lax.stop_gradient(a_v.astype(wide) - a), v.astype(wide)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", a_v, v_a, precision=spec.precision, preferred_element_type=wide)
    out = out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)
    rem = jnp.exp(-sp.sum(axis=-1)).reshape(batch, num_heads, q_len)
    return out, rem
