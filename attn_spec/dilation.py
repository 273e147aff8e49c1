"""Dilated attention (LongNet): its configuration, the checks, and each branch's geometry as the
engine sees it (framework-free).

Branch k cuts the sequence into segments of w_k and keeps rows `offset + m * r_k` of each. With S a
multiple of w and w of r, `x.reshape(B * S / w, w / r, r * H, D)` is a free view in which row m of
head slot `o * H + h` is original row `seg * w + m * r + o` of head h: the branch is dense attention
over that virtual batch, heads read through a `RowMap`. Other lengths are padded up to it (the
sequence to a multiple of w, each segment to a multiple of r); the padded rows of a virtual
sequence are a suffix, `Branch.kept_rows` counts the real ones.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

import numpy as np

MERGES = ("lse", "head_groups")


def _positive_ints(name: str, values) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ValueError(f"{name} must be a sequence of positive ints, got {values!r}")
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} must not be empty")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
            raise ValueError(f"{name} must hold positive ints, got {values!r}")
    return tuple(int(x) for x in values)


def check_config(segment_lengths, dilation_rates, merge: str, num_heads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validates a dilated configuration -> (segment_lengths, dilation_rates) as int tuples."""
    lengths = _positive_ints("segment_lengths", segment_lengths)
    rates = _positive_ints("dilation_rates", dilation_rates)
    if len(lengths) != len(rates):
        raise ValueError(f"segment_lengths and dilation_rates must have the same count, got "
                         f"{len(lengths)} and {len(rates)}")
    for w, r in zip(lengths, rates):
        if r > w:
            raise ValueError(f"dilation_rates: rate {r} is larger than its segment length {w}")
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if merge == "head_groups" and (len(lengths) > num_heads or num_heads % len(lengths)):
        raise ValueError(f"merge='head_groups' splits the {num_heads} heads into one group per branch: "
                         f"the head count must be a multiple of the branch count {len(lengths)}")
    return lengths, rates


@dataclasses.dataclass(frozen=True)
class Branch:
    """One (segment, rate) branch over a sequence of `seq_len` rows."""

    segment: int  # w, cut to the sequence (rounded up to a multiple of the rate)
    rate: int
    seq_len: int

    @property
    def num_segments(self) -> int:
        return -(-self.seq_len // self.segment)

    @property
    def rows(self) -> int:
        """Rows of one virtual sequence: the padded segment over the rate."""
        return -(-self.segment // self.rate)

    @property
    def padded_segment(self) -> int:
        return self.rows * self.rate

    @property
    def padded(self) -> bool:
        """Whether the view needs padding (else it is a free reshape)."""
        return self.seq_len != self.num_segments * self.segment or self.segment != self.padded_segment

    def kept_rows(self) -> np.ndarray:
        """[num_segments, rate] int32: real rows of each virtual sequence (segment, offset); the
        rest of its `rows` are padding."""
        return _kept_rows(self)


@functools.lru_cache(maxsize=256)
def _kept_rows(branch: Branch) -> np.ndarray:
    seg_len = np.minimum(branch.segment, branch.seq_len - branch.segment * np.arange(branch.num_segments))
    kept = -(-(seg_len[:, None] - np.arange(branch.rate)[None, :]) // branch.rate)
    kept = np.clip(kept, 0, branch.rows).astype(np.int32)
    kept.flags.writeable = False
    return kept


def branches(segment_lengths, dilation_rates, seq_len: int) -> tuple[Branch, ...]:
    """The branches of a checked configuration over `seq_len` rows."""
    return tuple(Branch(min(w, -(-seq_len // r) * r), r, seq_len) for w, r in zip(segment_lengths, dilation_rates))


@dataclasses.dataclass(frozen=True)
class RowMap:
    """Which rows a kernel program reads: its grid head h is global head `head_base + h`, which
    reads head slot `offset * heads + head` of the [B', L, rate * heads, D] view (`offset`: the
    global head mod the rate, or a fixed one); its key/value head likewise among `kv_heads`. The
    identity map (rate 1) is ordinary attention. The methods take Python or traced ints."""

    rate: int = 1
    heads: int = 1
    kv_heads: int = 1
    head_base: int = 0
    offset: int | None = None  # None: (head_base + h) mod rate (LongNet's per-head offset)
    grid_heads: int | None = None  # programs per batch row (None: heads)

    @property
    def programs(self) -> int:
        return self.heads if self.grid_heads is None else self.grid_heads

    def offset_of(self, h):
        return (self.head_base + h) % self.rate if self.offset is None else self.offset

    def q_slot(self, h):
        return self.offset_of(h) * self.heads + self.head_base + h

    def kv_slot(self, h):
        return self.offset_of(h) * self.kv_heads + (self.head_base + h) // (self.heads // self.kv_heads)

    def side_row(self, b, h):
        """Row of the per-(virtual sequence, offset) tables (kept rows, segment ids)."""
        return b * self.rate + self.offset_of(h)


def head_plan(merge: str, num_heads: int, num_branches: int, branch: int, rate: int, num_kv_heads: int) -> RowMap:
    """The row map of one branch: `lse`: every head, offset h mod r; `head_groups`: the branch's
    group of heads, offset k mod r."""
    if merge == "lse":
        return RowMap(rate, num_heads, num_kv_heads)
    size = num_heads // num_branches
    return RowMap(rate, num_heads, num_kv_heads, head_base=branch * size, offset=branch % rate, grid_heads=size)
