"""One step of a sequence-parallel attention: a block of queries against a block of keys, as row
statistics for a caller that merges several steps, and the backward at statistics it is given.

    forward(q, k, v, q_seg, kv_seg, spec)  -> o [B, Sq, Hq, D] fp32 (normalised within the step),
                                              m2, inv_l [B, Hq, Sq] fp32
    backward(q, k, v, q_seg, kv_seg, spec, do, m2, inv_l, delta) -> dq, dk, dv (fp32; dk, dv per
                                              kv head)

Statistics in the engine's convention: P = exp2(s2 - m2) * inv_l with s2 = log2(e) * scores; a row
with no visible key has m2 = +inf, inv_l = 0 (so P = 0). delta = rowsum(dO * O) - dlse at the
MERGED output. `Step(implementation, blocks)` picks the backend: "xla" is plain jnp (the scores of
the step in memory), "triton" and "mosaic" are the flash engine's row-mapped calls
(`softmax.triton.mapped_forward` / `mapped_backward`, rows=None), Pallas Triton or Hopper Mosaic.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_attn.ops.common.rope import wide_float
from jax_attn.ops.common.spec import LOG2E, AttentionSpec, padded_head_dim, visible
from jax_attn.ops.softmax import mosaic
from jax_attn.ops.softmax.triton import mapped_backward, mapped_forward


def _scores2(q, k, spec: AttentionSpec, q_seg, kv_seg):
    """-> (s2 [B, Hkv, G, Sq, Sk] in log2 units with -inf where invisible, mask, tanh of the soft cap)."""
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    wide = wide_float(q.dtype)
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=spec.precision, preferred_element_type=wide)
    t = None
    if spec.softcap is None:
        s = s * spec.scale
    else:
        t = jnp.tanh(s * (spec.scale / spec.softcap))
        s = t * spec.softcap
    rows = jnp.arange(q_len)[None, None, None, :, None]
    cols = jnp.arange(kv_len)[None, None, None, None, :]
    seg_q = q_seg[:, None, None, :, None] if spec.has_segments else None
    seg_k = kv_seg[:, None, None, None, :] if spec.has_segments else None
    mask = jnp.broadcast_to(visible(spec, rows, cols, kv_len, seg_q, seg_k), s.shape)
    return jnp.where(mask, s * LOG2E, -jnp.inf), mask, t


def _xla_forward(q, k, v, q_seg, kv_seg, spec: AttentionSpec):
    batch, q_len, num_heads, head_dim = q.shape
    s2, mask, _ = _scores2(q, k, spec, q_seg, kv_seg)
    m2 = s2.max(-1)
    m_safe = jnp.where(m2 == -jnp.inf, 0.0, m2)
    p = jnp.where(mask, jnp.exp2(s2 - m_safe[..., None]), 0.0)
    l = p.sum(-1)
    empty = l == 0.0
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, precision=spec.precision,
                   preferred_element_type=p.dtype)
    o = (o * inv_l.transpose(0, 3, 1, 2)[..., None]).reshape(batch, q_len, num_heads, head_dim)
    to_rows = lambda x: x.reshape(batch, num_heads, q_len)
    return o, to_rows(jnp.where(empty, jnp.inf, m2)), to_rows(inv_l)


def _xla_backward(q, k, v, q_seg, kv_seg, spec: AttentionSpec, do, m2, inv_l, delta):
    """FA2 Alg. 2 at the given statistics: P, dV = P^T dO, dP = dO V^T, dS = P (dP - delta)."""
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    wide = wide_float(q.dtype)
    s2, mask, t = _scores2(q, k, spec, q_seg, kv_seg)
    as_groups = lambda x: x.reshape(batch, num_kv_heads, group, q_len)[..., None]
    p = jnp.where(mask, jnp.exp2(s2 - as_groups(m2)) * as_groups(inv_l), 0.0)
    dog = do.reshape(batch, q_len, num_kv_heads, group, head_dim)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), dog, precision=spec.precision,
                    preferred_element_type=wide)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, v, precision=spec.precision, preferred_element_type=wide)
    ds = p * (dp - as_groups(delta))
    if t is not None:  # d/draw [cap * tanh(raw * scale / cap)] = scale * (1 - t^2)
        ds = ds * (1.0 - t * t)
    ds = jnp.where(mask, ds, 0.0) * spec.scale
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), k, precision=spec.precision,
                    preferred_element_type=wide).reshape(q.shape)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), qg, precision=spec.precision,
                    preferred_element_type=wide)
    return dq, dk, dv


@dataclasses.dataclass(frozen=True)
class Step:
    """The backend of every step of one call: implementation "xla", "triton" or "mosaic" (canonical
    names) and its tile config (a `BlockSizes`, a `MosaicBlockSizes`, or None: the default)."""

    implementation: str
    blocks: object = None

    def _mosaic_blocks(self, spec: AttentionSpec, head_dim: int):
        if self.implementation != "mosaic":
            return None
        return self.blocks or mosaic.default_mosaic_block_sizes(padded_head_dim(spec, head_dim))

    def forward(self, q, k, v, q_seg, kv_seg, spec: AttentionSpec):
        if self.implementation == "xla":
            return _xla_forward(q, k, v, q_seg, kv_seg, spec)
        mosaic_blocks = self._mosaic_blocks(spec, q.shape[3])
        o, m2, inv_l = mapped_forward(q, k, v, q_seg, spec, None, kv_seg=kv_seg, out_dtype=jnp.float32,
                                      blocks=None if mosaic_blocks else self.blocks, mosaic_blocks=mosaic_blocks)
        return o.astype(jnp.float32), m2, inv_l

    def backward(self, q, k, v, q_seg, kv_seg, spec: AttentionSpec, do, m2, inv_l, delta):
        if self.implementation == "xla":
            return _xla_backward(q, k, v, q_seg, kv_seg, spec, do.astype(q.dtype), m2, inv_l, delta)
        mosaic_blocks = self._mosaic_blocks(spec, q.shape[3])
        grads = mapped_backward(q, k, v, q_seg, spec, None, do, m2, inv_l, delta, kv_seg=kv_seg,
                                grad_dtype=jnp.float32, blocks=None if mosaic_blocks else self.blocks,
                                mosaic_blocks=mosaic_blocks)
        return tuple(g.astype(jnp.float32) for g in grads)


def merge(acc, o, m2, inv_l):
    """Fold one step's (o, m2, inv_l) into the running (acc, m, l) of its query rows (fp32, the
    online softmax across steps): m [B, Hq, Sq] the running max in log2 units (-inf: nothing seen),
    l the running sum relative to it, acc [B, Sq, Hq, D] the unnormalised output relative to it."""
    acc_o, m, l = acc
    seen = inv_l > 0
    m_s = jnp.where(seen, m2, -jnp.inf)
    l_s = jnp.where(seen, 1.0 / jnp.where(seen, inv_l, 1.0), 0.0)
    new_m = jnp.maximum(m, m_s)
    base = jnp.where(new_m == -jnp.inf, 0.0, new_m)
    a, b = jnp.exp2(m - base), jnp.exp2(m_s - base)
    rows = lambda x: x.transpose(0, 2, 1)[..., None]  # [B, H, S] -> [B, S, H, 1]
    return acc_o * rows(a) + o * rows(l_s * b), new_m, l * a + l_s * b


def empty_accumulator(batch: int, length: int, num_heads: int, head_dim: int, dtype=jnp.float32):
    return (jnp.zeros((batch, length, num_heads, head_dim), dtype),
            jnp.full((batch, num_heads, length), -jnp.inf, dtype), jnp.zeros((batch, num_heads, length), dtype))


def finish(acc, out_dtype):
    """(acc, m, l) -> out [B, S, H, D] (out_dtype), lse [B, H, S], and the statistics the backward
    runs at: m2 (+inf on rows with no visible key), inv_l (0 there)."""
    acc_o, m, l = acc
    empty = l == 0.0
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    out = acc_o * inv_l.transpose(0, 2, 1)[..., None]
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) / LOG2E)
    return out.astype(out_dtype), lse, jnp.where(empty, jnp.inf, m), inv_l


def delta_of(out, do, dlse):
    """delta = rowsum(dO * O) - dlse [B, H, S] fp32 (FA2 Alg. 2 line 4; dlse makes lse differentiable)."""
    wide = wide_float(out.dtype)
    return jnp.einsum("bshd,bshd->bhs", out.astype(wide), do.astype(wide)) - dlse.astype(wide)


__all__ = ["Step", "delta_of", "empty_accumulator", "finish", "merge"]
