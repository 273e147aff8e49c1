"""Where the rows of a sequence-sharded array live, and what one (query chunk, key chunk) pair of a
sequence-parallel attention has to compute.

A sequence of S rows over P shards is cut into chunks. Layout "contiguous": P chunks of S / P,
shard d holds chunk d. Layout "zigzag": 2P chunks of S / (2P), shard d holds chunks d and
2P - 1 - d (in that order): under a causal mask every shard then has the same work (an early chunk
sees few keys, its partner many). A global array is put into a layout by permuting its chunks
(`to_layout`, e.g. zigzag order [0, 2P-1, 1, 2P-2, ...]) so that plain contiguous sharding of the
permuted array gives each shard its chunks; `from_layout` undoes it.

Every pair of a query chunk and a key chunk is one of a few static cases (`pair_case`): nothing
visible (skipped), everything visible (the engine without a mask), or partly visible (the
engine with causality / window at the pair's static position offset). Which pairs a shard has
depends on the shard (a traced `axis_index` under shard_map); `visit_calls` lines the shards'
pairs up into calls, each with the cases the P shards meet (a switch only where they differ) and
per-shard tables of the rows it reads.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("zigzag", "contiguous")
EMPTY, FULL = "empty", "full"  # the other case: an int, the pair's offset (query minus key position)


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got layout={layout!r}")
    return layout


def chunks_per_shard(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def chunk_of(layout: str, num_shards: int, shard, slot: int):
    """Global chunk index of a shard's chunk `slot` (shard: a Python int or a traced int)."""
    if layout == "zigzag" and slot == 1:
        return 2 * num_shards - 1 - shard
    return shard


def chunk_order(layout: str, num_shards: int) -> np.ndarray:
    """The global chunk at every position of the layout's order, [P * chunks_per_shard]."""
    n = chunks_per_shard(check_layout(layout))
    return np.array([chunk_of(layout, num_shards, d, m) for d in range(num_shards) for m in range(n)])


def _permute_chunks(x, order: np.ndarray, axis: int):
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % len(order):
        raise ValueError(f"the sequence axis {axis} of length {length} must be a multiple of {len(order)} "
                         f"(the layout's chunk count) for this layout, got shape {x.shape}")
    chunked = x.reshape(*x.shape[:axis], len(order), length // len(order), *x.shape[axis + 1:])
    return jnp.take(chunked, jnp.asarray(order), axis=axis).reshape(x.shape)


def to_layout(x, layout: str, num_shards: int, axis: int = 1):
    """A global array in sequence order -> the same rows in the layout's order along `axis`, so that
    sharding it contiguously over `num_shards` gives every shard its chunks. "contiguous": x."""
    if check_layout(layout) == "contiguous":
        return x
    return _permute_chunks(x, chunk_order(layout, num_shards), axis)


def from_layout(x, layout: str, num_shards: int, axis: int = 1):
    """The inverse of `to_layout`: rows in the layout's order -> sequence order."""
    if check_layout(layout) == "contiguous":
        return x
    return _permute_chunks(x, np.argsort(chunk_order(layout, num_shards)), axis)


def to_zigzag(x, num_shards: int, axis: int = 1):
    """`to_layout(x, "zigzag", num_shards, axis)`: chunk order [0, 2P-1, 1, 2P-2, ..., P-1, P] of
    2P chunks; the sequence length must be a multiple of 2P."""
    return to_layout(x, "zigzag", num_shards, axis)


def from_zigzag(x, num_shards: int, axis: int = 1):
    """The inverse of `to_zigzag`."""
    return from_layout(x, "zigzag", num_shards, axis)


def shard_positions(layout: str, num_shards: int, shard, shard_len: int):
    """Global sequence positions of a shard's rows, int32 [shard_len] (shard may be traced)."""
    n = chunks_per_shard(check_layout(layout))
    chunk = shard_len // n
    parts = [chunk_of(layout, num_shards, shard, m) * chunk + jnp.arange(chunk, dtype=jnp.int32) for m in range(n)]
    return jnp.concatenate(parts).astype(jnp.int32)


def layout_positions(layout: str, num_shards: int, seq_len: int) -> np.ndarray:
    """Global positions of the rows of a layout-ordered array of `seq_len` rows, int [seq_len]
    (`to_layout(arange(seq_len))`)."""
    n = len(chunk_order(layout, num_shards))
    if seq_len % n:
        raise ValueError(f"seq_len={seq_len} must be a multiple of {n} for layout={layout!r} over {num_shards} shards")
    chunk = seq_len // n
    return (chunk_order(layout, num_shards)[:, None] * chunk + np.arange(chunk)[None, :]).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Mask:
    """The position part of the mask: causal, window (left, right) (None: unbounded)."""

    causal: bool
    left: int | None
    right: int | None

    @property
    def any(self) -> bool:
        return self.causal or self.left is not None or self.right is not None


def pair_case(mask: Mask, delta: int, chunk: int):
    """The case of a query chunk `delta` chunks after its key chunk (both of `chunk` rows):
    EMPTY, FULL, or the offset delta * chunk (query row 0's position minus key row 0's) of a
    partly visible pair. Query row r sees key row c when d = r + offset - c satisfies
    lo <= d <= hi (lo: 0 if causal, -right if a right window; hi: left)."""
    if not mask.any:
        return FULL
    bounds = [b for b in (0 if mask.causal else None, None if mask.right is None else -mask.right) if b is not None]
    lo = max(bounds) if bounds else None
    hi = mask.left
    first, last = delta * chunk - (chunk - 1), delta * chunk + (chunk - 1)  # the range of d
    if (lo is not None and last < lo) or (hi is not None and first > hi):
        return EMPTY
    if (lo is None or first >= lo) and (hi is None or last <= hi):
        return FULL
    return delta * chunk


def _case_key(case):
    return (case != EMPTY, case != FULL, case if isinstance(case, int) else 0)


@dataclasses.dataclass(frozen=True)
class Call:
    """One engine call of a visit, made by every shard on its own rows: the cases the shards meet
    (EMPTY first when present) with, per shard, the index of its case, int32 [P]; the query rows
    and key rows as each shard's first chunk, int32 [P], and a static number of chunks."""

    cases: tuple
    case_of: np.ndarray
    q_first: np.ndarray
    kv_first: np.ndarray
    chunks: int = 1


def visit_calls(mask: Mask, layout: str, num_shards: int, source_of, chunk: int,
                skip_own: bool = False) -> tuple[Call, ...]:
    """The engine calls of one visit (every shard's query chunks against the key chunks of shard
    `source_of(d)`): each shard's pairs that are not EMPTY, sorted by case, the i-th pairs of all
    shards forming call i. Where every shard meets the same case the call needs no switch, only
    per-shard rows (zigzag: every ring step). A zigzag shard's own chunks are in increasing
    positions, so under a plain causal mask its visit to itself is one causal call on the whole
    shard. skip_own: a shard's pairs with its own keys are EMPTY (the caller computes them apart)."""
    n = chunks_per_shard(layout)
    own = all(source_of(d) == d for d in range(num_shards))
    if own and n > 1 and mask.causal and mask.left is None and mask.right is None and not skip_own:
        zeros = np.zeros(num_shards, np.int32)
        return (Call((0,), zeros, zeros, zeros, n),)
    per_shard = []
    for d in range(num_shards):
        pairs = [] if skip_own and source_of(d) == d else [
            (case, m, c) for m in range(n) for c in range(n)
            if (case := pair_case(mask, chunk_of(layout, num_shards, d, m)
                                  - chunk_of(layout, num_shards, source_of(d), c), chunk)) != EMPTY]
        per_shard.append(sorted(pairs, key=lambda p: (_case_key(p[0]), p[1], p[2])))
    calls = []
    for i in range(max(len(p) for p in per_shard)):
        slot = [p[i] if i < len(p) else (EMPTY, 0, 0) for p in per_shard]
        cases = tuple(sorted({s[0] for s in slot}, key=_case_key))
        table = lambda j: np.array([s[j] for s in slot], np.int32)
        calls.append(Call(cases, np.array([cases.index(s[0]) for s in slot], np.int32), table(1), table(2)))
    return tuple(calls)


def shard_to_zigzag(x, axis_name, num_shards: int, inverse: bool = False, axis: int = 1):
    """Inside shard_map: a shard of the contiguous sharding (chunks 2d, 2d + 1 of 2P) -> the shard of
    the zigzag layout (chunks d, 2P - 1 - d), or back with `inverse`. Two `lax.ppermute`s, each a
    permutation of the shards: one moves every shard's first chunk, the other its second; shard d
    gets one chunk from each (its chunk d from the first when d is even)."""
    from jax import lax

    p = num_shards
    dest = lambda c: (c if c < p else 2 * p - 1 - c)  # the shard holding global chunk c under zigzag
    half = x.shape[axis] // 2
    parts = [lax.slice_in_dim(x, a * half, (a + 1) * half, axis=axis) for a in (0, 1)]
    even = lax.axis_index(axis_name) % 2 == 0
    if not inverse:
        moved = [lax.ppermute(parts[a], axis_name, [(s, dest(2 * s + a)) for s in range(p)]) for a in (0, 1)]
        first = jnp.where(even, moved[0], moved[1])  # chunk d came from the even move when d is even
        second = jnp.where(even, moved[1], moved[0])
        return jnp.concatenate([first, second], axis=axis)
    # inverse: shard d holds (chunk d, chunk 2P-1-d); chunk c goes home to shard c // 2, slot c % 2
    from_even = jnp.where(even, parts[0], parts[1])  # the even chunk of (d, 2P-1-d)
    from_odd = jnp.where(even, parts[1], parts[0])
    perm = lambda a: [(dest(2 * s + a), s) for s in range(p)]  # chunk 2s + a lives on dest(2s + a)
    return jnp.concatenate([lax.ppermute(from_even, axis_name, perm(0)),
                            lax.ppermute(from_odd, axis_name, perm(1))], axis=axis)
