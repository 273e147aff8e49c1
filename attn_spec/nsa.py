"""Native Sparse Attention (Yuan et al. 2025, arXiv 2502.11089): the facts both frameworks share
(framework-free). Layout as everywhere: q [B, S, Hq, D], k, v [B, S, Hkv, D], query head h in kv
group h // (Hq // Hkv); self-attention (Sq == Sk), query t at position t.

Three branches per query token, combined by gates g [B, S, Hq, 3] (compression, selection, window):
`o = g[..., 0] * o_cmp + g[..., 1] * o_slc + g[..., 2] * o_win`.

- **Compression**: block i covers keys [i * stride, i * stride + block) (overlapping when
  stride < block); only complete blocks exist (`compressed_count`). Its key and value are
  `phi(k[block])`, `phi(v[block])`: mean pooling, or the learnable map (`CompressParams`): an MLP
  over the flattened block plus an intra-block position embedding,
  `phi(x) = gelu((x + pos).reshape(block * D) @ w1 + b1) @ w2 + b2` (exact erf GELU).
  Query t sees compressed block i iff the block is complete at t: `i * stride + block - 1 <= t`
  (`compressed_end`). A row that sees none returns 0 (lse -inf).
- **Selection importance**: `p_cmp[b, t, h, i]` are the compression branch's softmax probabilities;
  selection block j (keys [j * select_block, (j + 1) * select_block)) gets
  `imp[b, t, g, j] = sum_{h in group g} sum_i p_cmp[b, t, h, i] * overlap[i, j]`, where
  `overlap[i, j] = 1` iff compression block i and selection block j share a key
  (`overlap_matrix`; with block == stride == select_block it is the identity, fla's setting).
- **Top-n**: blocks beyond the causal frontier (`j > t // select_block`) are out; block 0 and the
  `LOCAL_BLOCKS` blocks ending at t's (`t // select_block - 1`, `t // select_block`) are always in
  (`forced_blocks`); the rest are filled by importance, the larger first, ties to the lower index.
  The result holds the chosen indices in ascending order, then -1 for slots no block fills
  (`num_selected` may exceed the blocks a row can see). Not differentiated.
- **Selection attention**: exact attention of query t over the keys of its selected blocks with
  key position <= t (causal); entries that are -1, beyond the frontier, past `block_counts`, or
  repeated are ignored (a key counts once). The ranges form: R `[start, end)` key ranges per row,
  their union (causal too).
- **Window**: the last `window` keys, `t - window < j <= t` (window 0: the branch is off, its
  output 0).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import typing

import numpy as np

LOCAL_BLOCKS = 2  # selection blocks always chosen that end at the query's own block (the paper's 2)
BRANCHES = ("compression", "selection", "window")  # the gates' last axis, in this order
# the ranges form up to this many tokens: programs of several tokens scan the key tiles from their
# ranges' lowest start to their highest end (beyond, one token walks only its own ranges)
RANGES_SCAN_KEYS = 4096


def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def check_block(name: str, value) -> int:
    """A block size: a power of two >= 1."""
    value = _int(name, value, 1)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


def check_compress_geometry(block, stride) -> tuple[int, int]:
    """A compression geometry: block and stride powers of two, stride <= block."""
    block = check_block("block", block)
    stride = check_block("stride", stride)
    if stride > block:
        raise ValueError(f"stride ({stride}) must not exceed block ({block}): blocks would leave keys out")
    return block, stride


@dataclasses.dataclass(frozen=True)
class NSAConfig:
    compress_block: int = 32
    compress_stride: int = 16
    select_block: int = 64
    num_selected: int = 16
    window: int = 512


def check_config(seq_len: int, *, compress_block, compress_stride, select_block, num_selected,
                 window) -> NSAConfig:
    """Validates an NSA configuration for sequences of `seq_len` tokens."""
    block = check_block("compress_block", compress_block)
    stride = check_block("compress_stride", compress_stride)
    if stride > block:
        raise ValueError(f"compress_stride ({stride}) must not exceed compress_block ({block}): "
                         f"blocks would leave keys out")
    select = check_block("select_block", select_block)
    n = _int("num_selected", num_selected, 1)
    if n > selection_count(seq_len, select):
        raise ValueError(f"num_selected ({n}) is larger than the {selection_count(seq_len, select)} "
                         f"selection blocks of {select} in a sequence of {seq_len}")
    return NSAConfig(block, stride, select, n, _int("window", window, 0))


def compressed_count(seq_len: int, block: int, stride: int) -> int:
    """Complete compression blocks in a sequence: block i covers [i * stride, i * stride + block)."""
    return 0 if seq_len < block else (seq_len - block) // stride + 1


def compressed_end(i, block: int, stride: int):
    """The last key position of compression block i: query t sees the block iff this is <= t."""
    return i * stride + block - 1


def selection_count(seq_len: int, select_block: int) -> int:
    return -(-seq_len // select_block)


@functools.lru_cache(maxsize=64)
def overlap_matrix(seq_len: int, block: int, stride: int, select_block: int) -> np.ndarray:
    """float32 [compressed_count, selection_count]: 1 where compression block i and selection
    block j share a key."""
    i = np.arange(compressed_count(seq_len, block, stride))[:, None]
    j = np.arange(selection_count(seq_len, select_block))[None, :]
    start = i * stride
    out = (start < (j + 1) * select_block) & (start + block > j * select_block)
    out = out.astype(np.float32)
    out.flags.writeable = False
    return out


def forced_blocks(t, select_block: int):
    """The selection blocks every query t takes: (0, t // select_block - 1, t // select_block);
    entries below 0 are to be ignored. Works on ints and on integer arrays of any framework."""
    own = t // select_block
    return (own * 0, own - 1, own)


class CompressParams(typing.NamedTuple):
    """The learnable compression map of one of k, v: `pos [block, D]`, `w1 [block * D, hidden]`,
    `b1 [hidden]`, `w2 [hidden, D]`, `b2 [D]` (arrays of either framework; a NamedTuple, so a JAX
    pytree). `nsa_attention` takes one per k and v: `compress_params=(for_k, for_v)`."""

    pos: object
    w1: object
    b1: object
    w2: object
    b2: object


def check_compress_params(params, block: int, head_dim: int, name: str) -> None:
    """Shapes of a `CompressParams` for blocks of `block` keys of `head_dim`."""
    if not isinstance(params, CompressParams):
        raise TypeError(f"{name} must be a CompressParams, got {type(params).__name__}")
    hidden = params.b1.shape[0] if len(params.b1.shape) == 1 else None
    want = {"pos": (block, head_dim), "w1": (block * head_dim, hidden), "b1": (hidden,),
            "w2": (hidden, head_dim), "b2": (head_dim,)}
    for field, shape in want.items():
        got = tuple(getattr(params, field).shape)
        if hidden is None or got != shape:
            raise ValueError(f"{name}.{field} must have shape {shape} (block {block}, head dim "
                             f"{head_dim}, hidden from b1), got {got}")
