"""Visit plans: for every block of rows, the partner blocks it visits (framework-free).

Query i sees key j when i - before <= j <= i + after (`reach`; None: unbounded) and j < kv_len.
For a block of query rows the key blocks some row sees form one interval [lo, hi); inside it, the
blocks every row sees whole, [plain_lo, plain_hi), need no element mask. The transpose (for every
key block, the query blocks that see it) drives the dK/dV kernels: the same relation with
before and after swapped. Padding on either side (arrays padded to tile multiples) is never
visible; padded query rows are computed but widen no interval, and the plain interval holds for
them too, so the kernels may run them unmasked.

One module, two forms of the same plan:
- `block_table`: the whole table, built once per static shape (NumPy, cached), which the Triton
  kernels of both frameworks read (JAX narrows it further by segment ids at run time);
- `partner_blocks`: the interval of one block of rows in closed form, in any array namespace
  (the Mosaic kernels evaluate it in-kernel on traced scalars).
`block_lists` is the third kind of plan: explicit lists of blocks with counts (stick-breaking's
unspent sticks; NSA's selected blocks).
"""
from __future__ import annotations

import functools
import types

import numpy as np

NUMPY_OPS = types.SimpleNamespace(minimum=np.minimum, maximum=np.maximum, cdiv=lambda a, b: -(-a // b))


def reach(causal: bool, window_left: int | None, window_right: int | None, offset: int = 0):
    """(before, after): query i sees keys i - before <= j <= i + after (None: unbounded); offset:
    q_offset - kv_offset, query i sitting at key position i + offset (before or after may then be
    negative)."""
    bounds = [b for b in (0 if causal else None, window_right) if b is not None]
    after = min(bounds) if bounds else None
    return (None if window_left is None else window_left - offset), (None if after is None else after + offset)


def partner_blocks(first, size: int, block: int, num: int, before, after, last_masked: bool = False,
                   valid: int | None = None, ops=NUMPY_OPS):
    """Own rows [first, first + size) see partners y with x - before <= y <= x + after (None:
    unbounded), in `num` blocks of `block`. -> (lo, plain_lo, plain_hi, hi): the blocks some row
    sees are [lo, hi); inside, [plain_lo, plain_hi) are seen whole by every row (no mask). With
    `last_masked` the last block (padding) is never plain. `valid` (static): partners >= valid are
    padding, which may span several blocks (the arrays are padded to the widest tile, the
    backward's blocks are narrower): blocks of padding alone are not visited and the one holding
    `valid` is never plain. Monotone in `first`. `ops`: minimum, maximum and cdiv of the array
    namespace `first` lives in."""
    if valid is not None:
        # A plain block of zero padded keys gives s = 0 and P = 2^-m2, which overflows 16-bit
        # dS (and, past 2^128, fp32) on rows whose lse is very negative: inf * 0 = NaN in dQ.
        num = min(num, -(-valid // block))
        last_masked = last_masked or valid % block != 0
    lo = 0 if before is None else ops.minimum(ops.maximum(first - before, 0) // block, num)
    hi = num if after is None else ops.minimum(ops.cdiv(first + size + after, block), num)
    plain_lo = lo if before is None else ops.cdiv(ops.maximum(first + size - 1 - before, 0), block)
    plain_hi = num - int(last_masked)
    if after is not None:
        plain_hi = ops.minimum((first + after + 1) // block, plain_hi)
    plain_lo = ops.minimum(ops.maximum(plain_lo, lo), hi)
    return lo, plain_lo, ops.minimum(ops.maximum(plain_hi, plain_lo), hi), hi


@functools.lru_cache(maxsize=256)
def block_masks(before, after, q_len: int, kv_len: int, block_q: int, block_k: int, nq: int, nk: int,
                queries_padded: bool = True):
    """(any, all) [nq, nk] bool: some / every (query, key) pair of the two blocks is visible.
    queries_padded: the query arrays hold whole blocks (padding rows in memory, which may run
    unmasked); if not, a block holding q_len is never plain (its loads need bounds checks)."""
    r0 = np.arange(nq)[:, None] * block_q  # first row of each query block
    r1_real = np.minimum(r0 + block_q, q_len) - 1  # last real row ("any" ignores padding rows)
    r1_pad = r0 + block_q - 1  # last row incl. padding ("all" must hold for padding rows too)
    c0 = np.arange(nk)[None, :] * block_k
    c1 = c0 + block_k - 1
    big = 1 << 40
    left = big if before is None else before
    right = big if after is None else after
    # Row r sees the interval [r - left, r + right]; both ends grow with r, so a block of rows
    # sees the union [r0 - left, r1 + right] and sees every key of [c0, c1] iff
    # r1 - left <= c0 and c1 <= r0 + right.
    any_ = (c0 <= r1_real + right) & (c1 >= r0 - left) & (c0 < kv_len) & (r0 < q_len)
    all_ = (c0 >= r1_pad - left) & (c1 <= r0 + right) & (c1 < kv_len) & (queries_padded | (r1_pad < q_len))
    return any_, all_ & any_


def intervals(any_, all_, xp=np):
    """Per row of the block matrices: (lo, plain_lo, plain_hi, hi) int32 in namespace `xp`
    (NumPy, or jax.numpy for masks narrowed at run time); an empty row gives lo = hi = n."""
    n = any_.shape[-1]
    idx = xp.arange(n)
    lo = xp.min(xp.where(any_, idx, n), axis=-1)
    hi = xp.max(xp.where(any_, idx + 1, 0), axis=-1)
    hi = xp.maximum(hi, lo)
    plain_lo = xp.min(xp.where(all_, idx, n), axis=-1)
    plain_hi = xp.max(xp.where(all_, idx + 1, 0), axis=-1)
    plain_lo = xp.clip(plain_lo, lo, hi)
    plain_hi = xp.clip(plain_hi, plain_lo, hi)
    return xp.stack([lo, plain_lo, plain_hi, hi], axis=-1).astype(xp.int32)


@functools.lru_cache(maxsize=256)
def block_table(before, after, q_len: int, kv_len: int, block_q: int, block_k: int, nq: int, nk: int,
                key_major: bool, queries_padded: bool = True) -> np.ndarray:
    """int32 [n_outer, 4] = (lo, plain_lo, plain_hi, hi). key_major=False: for each of the nq
    query blocks, its key blocks (forward, dQ); True: for each of the nk key blocks, the query
    blocks that see it (dK/dV). Read-only (cached). queries_padded: see `block_masks`."""
    any_, all_ = block_masks(before, after, q_len, kv_len, block_q, block_k, nq, nk, queries_padded)
    if key_major:
        any_, all_ = any_.T, all_.T
    table = intervals(any_, all_)
    table.flags.writeable = False
    return table


def block_lists(needed, start, width: int, xp=np):
    """Explicit plans: needed [..., n_outer, steps] bool, start [..., n_outer, 1] int (broadcast
    against needed, same rank) -> (near, count,
    lists). Each outer block walks steps [start, near) contiguously, `near` being the first step
    from `start` on that is not needed (steps when none is), then the `count` needed steps past
    `near`, listed in order in lists [..., n_outer, width >= steps] (0 past count). The steps in
    neither part add nothing."""
    steps = needed.shape[-1]
    step = xp.arange(steps).reshape((1,) * (needed.ndim - 1) + (steps,))
    near = xp.where((step >= start) & ~needed, step, steps).min(axis=-1)
    extra = needed & (step > near[..., None])
    outer = extra.shape[:-1]
    total = int(np.prod(outer))
    row_start = (xp.arange(total) * width).reshape(*outer, 1)
    slot = xp.where(extra, row_start + xp.cumsum(extra, axis=-1) - 1, total * width)  # else dropped
    order = xp.broadcast_to(step, extra.shape)
    if xp is np:
        lists = np.zeros(total * width + 1, np.int32)
        lists[slot.ravel()] = order.ravel()
        lists = lists[:-1]
    else:
        lists = xp.zeros(total * width, xp.int32).at[slot.ravel()].set(order.ravel(), mode="drop")
    return near, extra.sum(axis=-1), lists.reshape(*outer, width)


def first_visible_keys(q_ids, kv_ids, ops):
    """Per query row, the first key with the row's segment id (Sk where no key has it), [B, Sq]:
    no key left of it is visible to the row, whatever the ids (sorted or not), so the tiles left of
    its block add nothing (stick-breaking's packed sequences: its forward and dQ walks start there,
    and a row counts those key blocks as spent). One stable sort of the key ids per batch row, then
    a binary search per query. `ops`: argsort (stable, last axis), take (along the last axis),
    searchsorted_left (batched over the first axis), where, minimum."""
    kv_len = kv_ids.shape[-1]
    order = ops.argsort(kv_ids)  # stable: equal ids keep their key order
    sorted_ids = ops.take(kv_ids, order)
    at = ops.minimum(ops.searchsorted_left(sorted_ids, q_ids), kv_len - 1)
    return ops.where(ops.take(sorted_ids, at) == q_ids, ops.take(order, at), kv_len)
