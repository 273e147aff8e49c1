"""Dilated attention (LongNet, arXiv 2307.02486): the plain reference.

Branch k cuts the sequence into segments of w_k and keeps rows `offset + m * r_k` of each; the kept
rows of a segment attend densely among themselves (causal inside the dilated segment if asked).
`merge="lse"`: every head in every branch with offset h mod r_k, merged by the branches' lse (Eq. 10);
`merge="head_groups"`: head group k runs branch k alone with offset k mod r_k (docs/design/dilated.md).

Each branch is the slot view of `attn_spec.dilation` made explicit: pad, reshape, gather every head's
slot, run `attention_reference` over the virtual batch (padding masked by segment ids), and scatter
the compact rows back by a one-hot over the slot axis. Float64 under jax.enable_x64 (the golden);
gradients by autodiff.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn_spec.dilation import Branch, RowMap, branches, check_config, head_plan
from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.ops.softmax.reference import attention_reference


def _slot_view(x, branch: Branch):
    """[B, S, Hx, D] -> [B, n, L, r * Hx, D]: zero-padded to n segments of `rows * rate`, then
    row m of head slot `o * Hx + h` is row `seg * w + m * r + o` of head h."""
    batch, seq_len, heads, head_dim = x.shape
    n, w, r = branch.num_segments, branch.segment, branch.rate
    x = jnp.pad(x, ((0, 0), (0, n * w - seq_len), (0, 0), (0, 0))).reshape(batch, n, w, heads, head_dim)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, branch.padded_segment - w), (0, 0), (0, 0)))
    return x.reshape(batch, n, branch.rows, r * heads, head_dim)


def _branch(q, k, v, branch: Branch, plan: RowMap, num_heads: int, causal: bool, scale: float, positions=None):
    """The `num_heads` heads that `plan` maps (global heads plan.head_base + h), through one branch
    -> (out [B, S, num_heads, D] in q.dtype, lse [B, num_heads, S]): rows the branch does not keep
    give out 0, lse -inf. positions: int [S], the rows' own positions for causality (an ordered
    sequence's original positions), None: the rows' indices."""
    batch, seq_len, _, head_dim = q.shape
    n, rows, r = branch.num_segments, branch.rows, branch.rate
    heads = np.arange(num_heads)
    offsets = np.array([plan.offset_of(h) for h in heads])
    q_slots = np.array([plan.q_slot(h) for h in heads])
    kv_slots = np.array([plan.kv_slot(h) for h in heads])  # per query head: GQA resolved here

    # Gather every head's kept rows, the heads folded into the batch: [B * n * heads, rows, 1, D].
    def gather(x, slots):
        x = _slot_view(x, branch)[:, :, :, slots]  # [B, n, rows, heads, D]
        return x.transpose(0, 1, 3, 2, 4).reshape(batch * n * num_heads, rows, 1, head_dim)

    # Padded rows are a suffix of each virtual sequence: id 1, never visible to the real rows (id 0).
    kept = branch.kept_rows()[:, offsets]  # [n, heads]
    ids = (np.arange(rows)[None, None, :] >= kept[:, :, None]).astype(np.int32)
    ids = jnp.asarray(np.broadcast_to(ids[None], (batch, n, num_heads, rows)).reshape(-1, rows))
    spec = AttentionSpec(scale=scale, causal=causal, has_segments=True, ordered=positions is not None)
    orig = None
    if positions is not None:  # each virtual sequence's rows' positions, as the rows are gathered
        pos = jnp.broadcast_to(jnp.asarray(positions)[None, :, None, None], (batch, seq_len, 1, 1))
        orig = _slot_view(pos, branch)[:, :, :, offsets]  # [B, n, rows, heads, 1]
        orig = orig.transpose(0, 1, 3, 2, 4).reshape(batch * n * num_heads, rows)
    o, lse = attention_reference(gather(q, q_slots), gather(k, kv_slots), gather(v, kv_slots), ids, ids, spec,
                                 q_orig=orig, kv_orig=orig)

    # Back to the original rows: kept row m of head h sits at slot offset(h) of padded row m * r.
    own = jnp.asarray(np.arange(r)[:, None] == offsets[None, :])  # [r, heads]
    o = o.reshape(batch, n, num_heads, rows, head_dim).transpose(0, 1, 3, 2, 4)[:, :, :, None]
    o = jnp.where(own[None, None, None, :, :, None], o, jnp.zeros((), o.dtype))  # [B, n, rows, r, heads, D]
    lse = lse.reshape(batch, n, num_heads, rows).transpose(0, 1, 3, 2)[:, :, :, None]
    lse = jnp.where(own[None, None, None], lse, jnp.array(-jnp.inf, lse.dtype))  # [B, n, rows, r, heads]

    def unview(x):  # [B, n, rows, r, heads, ...] -> [B, S, heads, ...]
        x = x.reshape(batch, n, rows * r, *x.shape[4:])[:, :, :branch.segment]
        return x.reshape(batch, n * branch.segment, *x.shape[3:])[:, :seq_len]

    return unview(o), unview(lse).transpose(0, 2, 1)


def _merge_lse(outs, lses):
    """LongNet Eq. 10: lse = logsumexp_k lse_k, out = sum_k exp(lse_k - lse) o_k, in the lse dtype.
    Rows no branch keeps: out 0, lse -inf, zero (never NaN) gradients."""
    lse_k = jnp.stack(lses)  # [K, B, H, S]
    top = jax.lax.stop_gradient(jnp.max(lse_k, axis=0))
    top = jnp.where(jnp.isfinite(top), top, jnp.zeros((), top.dtype))
    total = jnp.sum(jnp.exp(lse_k - top[None]), axis=0)
    kept = total > 0
    lse = jnp.where(kept, top + jnp.log(jnp.where(kept, total, jnp.ones((), total.dtype))),
                    jnp.array(-jnp.inf, total.dtype))
    lse_safe = jnp.where(kept, lse, jnp.zeros((), lse.dtype))
    weights = jnp.exp(lse_k - lse_safe[None]).transpose(0, 1, 3, 2)[..., None]  # [K, B, S, H, 1]
    out = jnp.sum(weights * jnp.stack(outs).astype(weights.dtype), axis=0)
    return out, lse


def dilated_reference(q, k, v, *, segment_lengths, dilation_rates, causal: bool, merge: str, scale: float,
                      positions=None):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] (query head h reads kv head h // (Hq / Hkv)) ->
    (out [B, S, Hq, D] in q.dtype, lse [B, Hq, S]; float32 for 16-bit inputs, float64 for float64).

    Plain jnp through `attention_reference` (scores materialised per branch and segment): the
    `"xla"` implementation and the golden under jax.enable_x64. Gradients by autodiff.
    positions: int [S] or None: the positions causality compares (those of an ordered sequence's
    tokens in the original one, for ordered attention's composite); None: the row indices."""
    batch, seq_len, num_heads, head_dim = q.shape
    if k.shape[1] != seq_len or v.shape[1] != seq_len:
        raise ValueError(f"dilated attention needs Sq == Sk, got {q.shape=}, {k.shape=}, {v.shape=}")
    if num_heads % k.shape[2]:
        raise ValueError(f"number of heads in k/v ({k.shape[2]}) must divide heads in q ({num_heads})")
    lengths, rates = check_config(segment_lengths, dilation_rates, merge, num_heads)
    num_kv_heads = k.shape[2]
    parts = branches(lengths, rates, seq_len)
    if merge == "lse":
        results = [_branch(q, k, v, b, head_plan(merge, num_heads, len(parts), i, b.rate, num_kv_heads),
                           num_heads, causal, scale, positions) for i, b in enumerate(parts)]
        out, lse = _merge_lse([o for o, _ in results], [l for _, l in results])
        return out.astype(q.dtype), lse
    # head_groups: group i (heads i * size .. (i + 1) * size - 1) runs branch i alone.
    size = num_heads // len(parts)
    results = [_branch(q, k, v, b, head_plan(merge, num_heads, len(parts), i, b.rate, num_kv_heads),
                       size, causal, scale, positions) for i, b in enumerate(parts)]
    out = jnp.concatenate([o for o, _ in results], axis=2)
    lse = jnp.concatenate([l for _, l in results], axis=1)
    return out.astype(q.dtype), lse
