"""Variable-length batches as FlashAttention expresses them (`cu_seqlens`), on the packed layout.

Sequence s holds queries cu_q[s] .. cu_q[s+1] - 1 and keys cu_k[s] .. cu_k[s+1] - 1 of one packed
batch row. Each sequence is aligned bottom-right, as FlashAttention's varlen functions: query i
of a sequence sits at key position i + len_k - len_q of that sequence, for causality, windows and
RoPE positions.

Where the packing allows (the same lengths for q and k, or no causal or window mask) segment ids
alone serve it, without a copy. Otherwise every sequence gets max(len_q, len_k) slots of an
aligned layout, its keys and queries right-aligned in them, so that one causal / window mask on
the slots aligns every sequence bottom-right; slots of neither side hold padding that sees nothing.
The index math is written once here over a small namespace of array ops (`ops`: arange(n),
maximum, cumsum, searchsorted_right(sorted, values)), evaluated by each framework with its own.
"""
from __future__ import annotations

import types


def layout(cu_q, cu_k, total_q: int, total_k: int, ops):
    """Per token: its sequence, its RoPE position and its slot in the aligned layout (length
    total_q + total_k). -> SimpleNamespace(seq_q, seq_k, pos_q, pos_k, slot_q, slot_k)."""
    seq_q = ops.searchsorted_right(cu_q[1:], ops.arange(total_q))
    seq_k = ops.searchsorted_right(cu_k[1:], ops.arange(total_k))
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    slots = ops.maximum(len_q, len_k)
    first_key_slot = ops.cumsum(slots) - len_k  # slots start at cumsum - slots; keys right-aligned
    pos_k = ops.arange(total_k) - cu_k[seq_k]
    pos_q = ops.arange(total_q) - cu_q[seq_q] + (len_k - len_q)[seq_q]  # bottom-right
    return types.SimpleNamespace(seq_q=seq_q, seq_k=seq_k, pos_q=pos_q, pos_k=pos_k,
                                 slot_q=first_key_slot[seq_q] + pos_q, slot_k=first_key_slot[seq_k] + pos_k)


def check_cu_seqlens(name: str, cu, total: int, concrete) -> None:
    """cu: 1-D, at least [0, total]; checked fully where its values are known (`concrete`, a NumPy
    array or None under tracing)."""
    if len(cu.shape) != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D [num_sequences + 1], got shape {tuple(cu.shape)}")
    if concrete is None:
        return
    if concrete[0] != 0 or concrete[-1] != total or (concrete[1:] < concrete[:-1]).any():
        raise ValueError(f"{name} must rise from 0 to the packed length {total}, got {concrete.tolist()}")


def attend(plan, q, k, v, *, aligned: bool, rope: bool, scatter, call):
    """Run `call(q, k, v, segment_ids, positions)` (one packed batch row) on the sequences of
    `plan` -> (out [total_q, ...], lse [H, total_q]). aligned: through the aligned layout, with
    scatter(x, slots, fill) placing rows into it (each framework's own); else on the packing."""
    if not aligned:  # the packing serves: segment ids, no copy
        positions = (plan.pos_q[None], plan.pos_k[None]) if rope else None
        out, lse = call(q[None], k[None], v[None], (plan.seq_q[None], plan.seq_k[None]), positions)
        return out[0], lse[0]
    ids = (scatter(plan.seq_q, plan.slot_q, -1)[None], scatter(plan.seq_k, plan.slot_k, -2)[None])  # padding: no match
    positions = (scatter(plan.pos_q, plan.slot_q, 0)[None], scatter(plan.pos_k, plan.slot_k, 0)[None]) if rope else None
    out, lse = call(scatter(q, plan.slot_q, 0)[None], scatter(k, plan.slot_k, 0)[None], scatter(v, plan.slot_k, 0)[None],
                    ids, positions)
    return out[0][plan.slot_q], lse[0][:, plan.slot_q]
