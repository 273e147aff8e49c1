"""Sequence-parallel softmax attention under `jax.shard_map`: ring attention and all-gather context
parallelism, forward and backward, on the one flash engine (`step.Step`).

Every shard holds its queries and its keys/values as one or two chunks (`layout`). The attention of
a query chunk is the online-softmax merge, in fp32, of its attention to every key chunk of the
sequence, pair by pair: each pair is one static case (`layout.pair_case`: skipped, unmasked, or
masked at a static position offset). A visit's pairs are lined up across the shards into engine
calls (`layout.visit_calls`): a call reads each shard's rows at a per-shard offset (the shard index
is traced) and switches (`lax.switch`, which costs XLA a host round trip) only where the shards'
cases differ; the zigzag ring never does, and runs a shard's own chunks as one causal call.

- ring (Liu et al., "Ring Attention with Blockwise Transformers", arXiv 2310.01889): K/V (with
  their segment ids) travel the ring with `lax.ppermute`, P steps; the next step's transfer is
  issued before the current step's work so that XLA overlaps them.
- all_gather (Llama 3's context parallelism, kvax): K/V are all-gathered once (in the backward
  again), the gather overlapping the first visit (the shard's own K/V).

The merged output is one softmax over all the keys, so the backward (a `custom_vjp`) runs every
pair's backward at the merged statistics (m2, inv_l, delta), as ring-flash-attention does: dQ
accumulates locally, dK/dV accumulators (fp32) travel the ring, one step behind the keys they
belong to (under all_gather too: each transfer overlaps a step's work, where a reduce-scatter of
every shard's gradients of the whole sequence would follow the last step), and come home after
the last step. Every sum runs in a fixed order: deterministic. Design: docs/design/ring.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_attn.ops.common.rope import wide_float
from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.ops.ring import layout as lay
from jax_attn.ops.ring.step import Step, delta_of, empty_accumulator, finish, merge

STRATEGIES = ("ring", "all_gather")


@dataclasses.dataclass(frozen=True)
class Static:
    """What one call computes: the mesh axis and its size, the layout of the compute chunks
    ("contiguous" when no position mask: then chunks do not matter), the strategy, the base spec
    (scale, causal, window, soft cap, segments, precision; offset 0) and the step backend."""

    axis_name: object
    num_shards: int
    layout: str
    strategy: str
    spec: AttentionSpec
    step: Step
    group: int = 0  # ring: rings of `group` consecutive shards (0: one ring of all; the sequence
    # of a ring is its shards' rows, e.g. one dilated segment spread over them)
    skip_own: bool = False  # a shard's pairs with its own K/V are skipped (the caller computes them
    # apart, e.g. under a mask the steps cannot express)

    def __post_init__(self):
        if self.group and (self.strategy != "ring" or self.num_shards % self.group):
            raise ValueError(f"rings of {self.group} shards need strategy='ring' and a multiple of {self.group} "
                             f"shards, got strategy={self.strategy!r} over {self.num_shards}")

    @property
    def ring_size(self) -> int:
        return self.group or self.num_shards

    @property
    def mask(self) -> lay.Mask:
        return lay.Mask(self.spec.causal, self.spec.window_left, self.spec.window_right)

    @property
    def chunks(self) -> int:
        return lay.chunks_per_shard(self.layout)

    def spec_for(self, case) -> AttentionSpec:
        if case == lay.FULL:
            return dataclasses.replace(self.spec, causal=False, window_left=None, window_right=None, offset=0)
        return dataclasses.replace(self.spec, offset=case)

    def visit_calls(self, source_of, chunk: int):
        return lay.visit_calls(self.mask, self.layout, self.ring_size, source_of, chunk, self.skip_own)

    def sources(self):
        """Per visit t: shard -> the shard whose K/V it sees, d - t (the ring's order, also for the
        gathered K/V: every shard then meets the same cases at every visit); shards numbered within
        their ring."""
        p = self.ring_size
        return [lambda d, t=t: (d - t) % p for t in range(p)]

    def case_specs(self, shard_len: int) -> tuple[AttentionSpec, ...]:
        """The specs of every engine call the call makes (for choosing and checking the backend)."""
        chunk = shard_len // self.chunks
        cases = {c for source in self.sources() for call in self.visit_calls(source, chunk) for c in call.cases
                 if c != lay.EMPTY}
        return tuple(self.spec_for(c) for c in sorted(cases, key=str))


def _switch(call: lay.Call, shard, branch, operands):
    """Run the shard's case of a call: a static call where every shard has the same case."""
    if len(call.cases) == 1:
        return branch(call.cases[0])(*operands)
    return lax.switch(jnp.asarray(call.case_of)[shard], [branch(c) for c in call.cases], *operands)


def _of_shard(table, shard):
    """A per-shard table's entry: a Python int where every shard has the same."""
    return int(table[0]) if (table == table[0]).all() else jnp.asarray(table)[shard]


def _take(x, start, count: int, axis: int = 1):
    """Rows start .. start + count - 1 of x along `axis` (start: int or traced)."""
    if x is None:
        return None
    if isinstance(start, int):
        return lax.slice_in_dim(x, start, start + count, axis=axis)
    return lax.dynamic_slice_in_dim(x, start, count, axis=axis)


def _put(x, rows, start, axis: int = 1):
    """x with rows start .. start + len - 1 along `axis` replaced by `rows`."""
    if isinstance(start, int) and start == 0 and rows.shape[axis] == x.shape[axis]:
        return rows
    return lax.dynamic_update_slice_in_dim(x, rows, start, axis=axis)


def _shard_in_ring(st: Static):
    shard = lax.axis_index(st.axis_name)
    return shard % st.ring_size if st.ring_size != st.num_shards else shard


def _shift(tree, st: Static):
    """Every shard sends to the next one on its ring (shard d receives shard d - 1's)."""
    g = st.ring_size
    return lax.ppermute(tree, st.axis_name, [(d, d - d % g + (d % g + 1) % g) for d in range(st.num_shards)])


def _gather(x, st: Static):
    return None if x is None else lax.all_gather(x, st.axis_name, axis=1, tiled=True)


def _visits(st: Static, k, v, kv_seg):
    """(source_of, (k, v, kv_seg) of that source) per visit; the ring issues the next transfer
    before the caller works on the current visit (a generator: the caller's work comes between)."""
    if st.strategy == "all_gather":
        gathered = [_gather(x, st) for x in (k, v, kv_seg)]
        length, shard = k.shape[1], _shard_in_ring(st)
        for t, source in enumerate(st.sources()):
            # the first visit is the shard's own K/V: it waits for no gather, which overlaps it
            yield source, ((k, v, kv_seg) if t == 0 else
                           tuple(_take(x, source(shard) * length, length) for x in gathered))
        return
    kv = (k, v, kv_seg)
    for t, source in enumerate(st.sources()):
        following = _shift(kv, st) if t + 1 < st.ring_size else None  # issued before this step's work
        yield source, kv
        kv = following


def _call_rows(call: lay.Call, shard, size: int):
    """(first query row, first key row, rows) of a call on this shard."""
    return _of_shard(call.q_first, shard) * size, _of_shard(call.kv_first, shard) * size, call.chunks * size


def _forward(st: Static, q, k, v, q_seg, kv_seg):
    """-> out [B, L, Hq, D], lse, m2, inv_l [B, Hq, L] (merged over the whole sequence)."""
    batch, length, num_heads, head_dim = q.shape
    size = length // st.chunks
    shard = _shard_in_ring(st)
    acc = empty_accumulator(batch, length, num_heads, head_dim, wide_float(q.dtype))

    def branch(case):
        def run(acc, q, k, v, q_seg, kv_seg):
            if case == lay.EMPTY:  # skipped: nothing computed
                return acc
            return merge(acc, *st.step.forward(q, k, v, q_seg, kv_seg, st.spec_for(case)))
        return run

    for source, (k_, v_, kv_seg_) in _visits(st, k, v, kv_seg):
        for call in st.visit_calls(source, size):
            qa, ka, rows = _call_rows(call, shard, size)
            part = (_take(acc[0], qa, rows), *(_take(x, qa, rows, axis=2) for x in acc[1:]))
            part = _switch(call, shard, branch, (part, _take(q, qa, rows), _take(k_, ka, rows), _take(v_, ka, rows),
                                                 _take(q_seg, qa, rows), _take(kv_seg_, ka, rows)))
            acc = (_put(acc[0], part[0], qa), *(_put(x, y, qa, axis=2) for x, y in zip(acc[1:], part[1:])))
    return finish(acc, q.dtype)


def _backward(st: Static, q, k, v, q_seg, kv_seg, out, m2, inv_l, do, dlse):
    size = q.shape[1] // st.chunks
    shard = _shard_in_ring(st)
    wide = wide_float(q.dtype)
    delta = delta_of(out, do, dlse)
    do = do.astype(q.dtype)
    dq = jnp.zeros(q.shape, wide)
    kv_zeros = lambda: jnp.zeros(k.shape, wide)

    def branch(case):
        def run(grads, q, k, v, q_seg, kv_seg, do, m2, inv_l, delta):
            if case == lay.EMPTY:
                return grads
            step = st.step.backward(q, k, v, q_seg, kv_seg, st.spec_for(case), do, m2, inv_l, delta)
            return tuple(g + s for g, s in zip(grads, step))
        return run

    def visit(source, kv, dq, dk, dv):
        k_, v_, kv_seg_ = kv
        for call in st.visit_calls(source, size):
            qa, ka, rows = _call_rows(call, shard, size)
            q_rows = lambda x, axis=1: _take(x, qa, rows, axis)
            kv_rows = lambda x: _take(x, ka, rows)
            grads = _switch(call, shard, branch,
                            ((q_rows(dq), kv_rows(dk), kv_rows(dv)), q_rows(q), kv_rows(k_), kv_rows(v_), q_rows(q_seg),
                             kv_rows(kv_seg_), q_rows(do), *(q_rows(x, 2) for x in (m2, inv_l, delta))))
            dq, dk, dv = _put(dq, grads[0], qa), _put(dk, grads[1], ka), _put(dv, grads[2], ka)
        return dq, dk, dv

    # K/V gathered again under all_gather rather than kept from the forward (memory)
    dkv = None
    for source, kv in _visits(st, k, v, kv_seg):
        # this step's dK/dV apart from the arriving accumulators, so that their transfer
        # overlaps the step's work; added just before they move on
        dq, dk, dv = visit(source, kv, dq, kv_zeros(), kv_zeros())
        if dkv is not None:
            dk, dv = dkv[0] + dk, dkv[1] + dv
        dkv = _shift((dk, dv), st)  # to the shard that visits these keys next; after the last step, home
    dk, dv = dkv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st, q, k, v, q_seg, kv_seg):
    out, lse, _, _ = _forward(st, q, k, v, q_seg, kv_seg)
    return out, lse


def _attend_fwd(st, q, k, v, q_seg, kv_seg):
    out, lse, m2, inv_l = _forward(st, q, k, v, q_seg, kv_seg)
    return (out, lse), (q, k, v, q_seg, kv_seg, out, m2, inv_l)


def _attend_bwd(st, residuals, cotangents):
    q, k, v, q_seg, kv_seg, out, m2, inv_l = residuals
    do, dlse = cotangents
    dq, dk, dv = _backward(st, q, k, v, q_seg, kv_seg, out, m2, inv_l, do, dlse)
    return dq, dk, dv, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def sequence_parallel_attention(st: Static, q, k, v, q_seg=None, kv_seg=None):
    """Inside shard_map: local shards q [B, L, Hq, D], k/v [B, L, Hkv, D] (validated; RoPE already
    applied), ids [B, L] or None -> (out [B, L, Hq, D], lse [B, Hq, L])."""
    return _attend(st, q, k, v, q_seg, kv_seg)
