"""Dilated attention (LongNet) on the flash engine: every branch one row-mapped call, the branches
merged by their softmax statistics.

A branch is dense attention over the slot view of `attn_spec.dilation` (a free reshape when the
lengths divide, else padded): `softmax.triton.mapped_forward` reads q, k, v in place through the
branch's `RowMap` and writes the rows it keeps, compact. The merge works on the engine's row
statistics (m2 = row max in log2 units, l = row sum): with M = max_k m2_k and w_k = l_k 2^(m2_k - M),
out = sum_k w_k o_k / sum_k w_k, which is LongNet's Eq. 10, and the merged statistics are m2 = M,
1 / l = 1 / sum_k w_k. `head_groups` is the same merge where each head has one branch.

The merge is one softmax over the union of the branches' key sets, so the backward runs each
branch's backward kernels at the merged statistics (`mapped_backward`) and adds up the branches'
dq, dk, dv. Design: docs/design/dilated.md.

Under an ordering pi (docs/design/orderings.md) the segments are cut from the ordered sequence:
row m of virtual sequence (segment, offset) is ordered position p = seg * w + m * r + offset,
original token pi[p]. No view of q, k, v exists then: each branch's kernels gather their tiles'
rows from the unviewed arrays at those tokens (`_Plan.orig`), causality compares them. The
compact branch outputs are merged as above in the ordered layout and the merged out, lse, dq, dk,
dv are read back to the original order in the merge's last step (one XLA gather along the
sequence, before the cast to the input dtype).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from attn_spec.dilation import Branch, RowMap, branches, head_plan
from attn_spec.tiles import BlockSizes
from jax_attn.ops.common import summation
from jax_attn.ops.common.spec import LOG2E, AttentionSpec, padded_head_dim
from jax_attn.ops.softmax import mosaic
from jax_attn.ops.softmax.triton import mapped_backward, mapped_forward


@dataclasses.dataclass(frozen=True)
class _Static:
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    causal: bool
    merge: str
    scale: float
    precision: jax.lax.Precision
    blocks: BlockSizes | None
    interpret: bool | None
    mosaic: bool  # the Hopper kernels for the branches they serve (no segment ids)
    ordered: bool = False  # segments cut from an ordered sequence (the order is an argument)
    mosaic_blocks: mosaic.MosaicBlockSizes | None = None  # the Mosaic branches' tiles (None: their default)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One branch over a given sequence: its geometry, row map and engine spec."""

    branch: Branch
    rows: RowMap
    spec: AttentionSpec
    mosaic_blocks: mosaic.MosaicBlockSizes | None  # run on the Mosaic kernels

    def view(self, x):
        """[B, S, Hx, D] -> [B * n, rows, rate * Hx, D]; a reshape alone unless padding is needed."""
        br = self.branch
        batch, seq_len, heads, head_dim = x.shape
        if br.padded:
            x = jnp.pad(x, ((0, 0), (0, br.num_segments * br.segment - seq_len), (0, 0), (0, 0)))
            x = x.reshape(batch, br.num_segments, br.segment, heads, head_dim)
            x = jnp.pad(x, ((0, 0), (0, 0), (0, br.padded_segment - br.segment), (0, 0), (0, 0)))
        return x.reshape(batch * br.num_segments, br.rows, br.rate * heads, head_dim)

    def orig(self, perm, batch: int):
        """int32 [B * n * rate, rows]: the original row of each row of each virtual sequence
        (seg, offset) of the ordered sequence: perm[seg * w + m * r + offset]; padding rows get
        positions past the end (S + p), never visible under causality and clamped when loaded."""
        br = self.branch
        m = np.arange(br.rows)[None, None, :] * br.rate + np.arange(br.rate)[None, :, None]  # [1, r, rows]
        p = np.arange(br.num_segments)[:, None, None] * br.segment + m  # [n, r, rows]
        real = (m < br.segment) & (p < br.seq_len)
        where = jnp.asarray(np.where(real, p, 0).astype(np.int32))
        orig = jnp.where(jnp.asarray(real), jnp.take(perm.astype(jnp.int32), where), br.seq_len + jnp.asarray(p))
        return jnp.broadcast_to(orig[None], (batch,) + orig.shape).reshape(-1, br.rows).astype(jnp.int32)

    def segment_ids(self, batch: int):
        """[B * n * rate, rows]: 1 on the padded suffix of each virtual sequence (invisible keys)."""
        if not self.spec.has_segments:
            return None
        br = self.branch
        ids = (np.arange(br.rows)[None, None, :] >= br.kept_rows()[:, :, None]).astype(np.int32)
        return jnp.asarray(np.broadcast_to(ids[None], (batch,) + ids.shape).reshape(-1, br.rows))

    def owned(self, num_heads: int) -> np.ndarray:
        """[rate, H] bool: slot o of head h holds this branch's rows of h."""
        rm, heads = self.rows, np.arange(self.rows.programs)
        own = np.zeros((self.branch.rate, num_heads), bool)
        own[[rm.offset_of(h) for h in heads], rm.head_base + heads] = True
        return own

    def rows_to_full(self, x, batch: int, seq_len: int, num_heads: int, fill):
        """Compact rows [B * n, rows, P, *F] -> [B, S, H, *F], `fill` where the branch keeps no row."""
        br, rm = self.branch, self.rows
        feat = x.shape[3:]
        x = x.reshape(batch, br.num_segments, br.rows, 1, rm.programs, *feat)
        if rm.programs != num_heads:  # head groups: this branch's heads among all
            widths = [(0, 0)] * x.ndim
            widths[4] = (rm.head_base, num_heads - rm.head_base - rm.programs)
            x = jnp.pad(x, widths)
        own = jnp.asarray(self.owned(num_heads)).reshape((1, 1, 1, br.rate, num_heads) + (1,) * len(feat))
        x = jnp.where(own, x, jnp.asarray(fill, x.dtype))
        x = x.reshape(batch, br.num_segments * br.padded_segment, num_heads, *feat)
        if br.padded:
            x = x.reshape(batch, br.num_segments, br.padded_segment, num_heads, *feat)[:, :, :br.segment]
            x = x.reshape(batch, br.num_segments * br.segment, num_heads, *feat)[:, :seq_len]
        return x

    def full_to_rows(self, x, fill):
        """Row statistics [B, H, S] -> [B * n, P, rows], each program's own rows, `fill` on padding."""
        br, rm = self.branch, self.rows
        batch, num_heads, seq_len = x.shape
        x = jnp.pad(x, ((0, 0), (0, 0), (0, br.num_segments * br.segment - seq_len)), constant_values=fill)
        x = x.reshape(batch, num_heads, br.num_segments, br.segment)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, br.padded_segment - br.segment)), constant_values=fill)
        x = x.reshape(batch, num_heads, br.num_segments, br.rows, br.rate)
        heads = rm.head_base + np.arange(rm.programs)
        offsets = np.array([rm.offset_of(h) for h in range(rm.programs)])
        x = x[:, heads, :, :, offsets]  # advanced indices first: [P, B, n, rows]
        return x.transpose(1, 2, 0, 3).reshape(batch * br.num_segments, rm.programs, br.rows)


def _plans(st: _Static, q, k) -> tuple[_Plan, ...]:
    seq_len, num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], q.shape[3], k.shape[2]
    out = []
    for i, br in enumerate(branches(st.segment_lengths, st.dilation_rates, seq_len)):
        rows = head_plan(st.merge, num_heads, len(st.segment_lengths), i, br.rate, num_kv_heads)
        spec = AttentionSpec(scale=st.scale, causal=st.causal, has_segments=br.padded and not st.causal,
                             precision=st.precision, ordered=st.ordered)
        use_mosaic = st.mosaic and not st.ordered and mosaic.unsupported_reason(spec, head_dim, q.dtype) is None
        blocks = (st.mosaic_blocks or mosaic.default_mosaic_block_sizes(padded_head_dim(spec, head_dim))
                  if use_mosaic else None)
        out.append(_Plan(br, rows, spec, blocks))
    return tuple(out)


def _inputs(st: _Static, plan: _Plan, perm, xs, batch: int):
    """A branch's q, k, v (, dO) and keyword arguments: the views, or under an ordering the
    unviewed arrays with their rows' original positions."""
    if st.ordered:
        return xs, {"orig": plan.orig(perm, batch)}
    return tuple(plan.view(x) for x in xs), {}


def _forward(st: _Static, q, k, v, perm):
    """-> out [B, S, H, D], lse [B, H, S] (original order), m2, inv_l [B, H, S] (merged; ordered
    positions under an ordering)."""
    batch, seq_len, num_heads, _ = q.shape
    outs, maxes, sums = [], [], []
    for plan in _plans(st, q, k):
        xs, kw = _inputs(st, plan, perm, (q, k, v), batch)
        o, m2, inv_l = mapped_forward(*xs, plan.segment_ids(batch),
                                      plan.spec, plan.rows, blocks=st.blocks, interpret=st.interpret,
                                      out_dtype=jnp.float32, mosaic_blocks=plan.mosaic_blocks, **kw)
        kept = inv_l > 0  # rows with a visible key; the rest have m2 = +inf
        m2 = jnp.where(kept, m2, -jnp.inf)
        l = jnp.where(kept, 1.0 / jnp.where(kept, inv_l, 1.0), 0.0)
        full = lambda x, fill: plan.rows_to_full(x.transpose(0, 2, 1), batch, seq_len, num_heads, fill)
        maxes.append(full(m2, -jnp.inf))  # [B, S, H]
        sums.append(full(l, 0.0))
        outs.append(plan.rows_to_full(o, batch, seq_len, num_heads, 0.0))
    m = functools.reduce(jnp.maximum, maxes)  # [B, S, H]
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    weights = [l * jnp.exp2(mk - m_safe) for mk, l in zip(maxes, sums)]
    total = functools.reduce(jnp.add, weights)
    empty = total == 0.0  # kept by no branch: out 0, lse -inf
    inv_total = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
    out = functools.reduce(jnp.add, [w[..., None] * o.astype(jnp.float32) for w, o in zip(weights, outs)])
    out = out * inv_total[..., None]
    lse = jnp.where(empty, -jnp.inf, (m_safe + jnp.log2(jnp.where(empty, 1.0, total))) / LOG2E)
    to_bhs = lambda x: x.transpose(0, 2, 1)
    back = _to_original(st, perm)
    return (back(out, 1).astype(q.dtype), back(to_bhs(lse), 2), to_bhs(jnp.where(empty, jnp.inf, m)),
            to_bhs(inv_total))


def _to_original(st: _Static, perm):
    """(x, axis) -> x read back from ordered positions to the original order along `axis`."""
    if not st.ordered:
        return lambda x, axis: x
    inv = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))
    return lambda x, axis: jnp.take(x, inv, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dilated(st, q, k, v, perm):
    out, lse, _, _ = _forward(st, q, k, v, perm)
    return out, lse


def _dilated_fwd(st, q, k, v, perm):
    out, lse, m2, inv_l = _forward(st, q, k, v, perm)
    return (out, lse), (q, k, v, perm, out, m2, inv_l)


def _dilated_bwd(st, residuals, cotangents):
    q, k, v, perm, out, m2, inv_l = residuals
    do, dlse = cotangents
    batch, seq_len, num_heads, _ = q.shape
    num_kv_heads = k.shape[2]
    # delta = rowsum(dO * O). Over a short dilated segment a row's few scores leave dS = P (dP -
    # delta) to the difference of two close numbers: fp32 inputs take it nearly correctly rounded
    # (4-8x the plain reduction's time on the GPU, docs/design/dilated.md); for 16-bit inputs the
    # plain fp32 reduction's rounding is far below their own
    o32, do32 = out.astype(jnp.float32), do.astype(jnp.float32)
    if q.dtype == jnp.float32:
        delta = summation.dot_compensated(o32, do32).transpose(0, 2, 1) - dlse
    else:
        delta = jnp.einsum("bshd,bshd->bhs", o32, do32) - dlse
    if st.ordered:  # the merged statistics are in ordered positions
        delta = jnp.take(delta, perm, axis=2)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(q.shape, jnp.float32)  # per query head; summed over the GQA group below
    dv = jnp.zeros(q.shape, jnp.float32)
    for plan in _plans(st, q, k):
        (qx, kx, vx, dox), kw = _inputs(st, plan, perm, (q, k, v, do.astype(q.dtype)), batch)
        gq, gk, gv = mapped_backward(qx, kx, vx, plan.segment_ids(batch),
                                     plan.spec, plan.rows, dox,
                                     plan.full_to_rows(m2, jnp.inf), plan.full_to_rows(inv_l, 0.0),
                                     plan.full_to_rows(delta, 0.0), blocks=st.blocks, interpret=st.interpret,
                                     mosaic_blocks=plan.mosaic_blocks, **kw)
        full = lambda x: plan.rows_to_full(x.astype(jnp.float32), batch, seq_len, num_heads, 0.0)
        dq, dk, dv = dq + full(gq), dk + full(gk), dv + full(gv)
    group = num_heads // num_kv_heads
    back = _to_original(st, perm)
    by_kv = lambda x: back(x.reshape(batch, seq_len, num_kv_heads, group, -1).sum(3), 1)
    return back(dq, 1).astype(q.dtype), by_kv(dk).astype(k.dtype), by_kv(dv).astype(v.dtype), None


_dilated.defvjp(_dilated_fwd, _dilated_bwd)


def dilated_attention_triton(q, k, v, *, segment_lengths, dilation_rates, causal: bool, merge: str,
                             scale: float, precision=jax.lax.Precision.DEFAULT, blocks: BlockSizes | None = None,
                             interpret: bool | None = None, mosaic: bool = False, order=None,
                             mosaic_blocks=None):
    """q [B, S, H, D], k/v [B, S, Hkv, D] (validated) -> (out [B, S, H, D], lse [B, H, S]).
    mosaic: the branches the Hopper kernels serve (those without segment ids: no padding, or
    causal) run on them with `mosaic_blocks` (None: their default), the others on the Triton
    kernels with `blocks`. order: int [S], an ordering pi whose
    ordered sequence the segments are cut from (gathered in the kernels; Triton kernels only)."""
    if order is not None and mosaic:
        raise NotImplementedError("orderings gather rows in the Triton kernels; the Mosaic GPU kernels load "
                                  "contiguous TMA boxes")
    st = _Static(tuple(segment_lengths), tuple(dilation_rates), causal, merge, float(scale), precision, blocks,
                 interpret, mosaic, ordered=order is not None, mosaic_blocks=mosaic_blocks)
    perm = jnp.zeros((0,), jnp.int32) if order is None else jnp.asarray(order).astype(jnp.int32)
    return _dilated(st, q, k, v, perm)
