"""What a parity case is: a variant's call at one shape and dtype, with its seeded inputs.

A `Case` names its variant (the `VariantRecord` of `parity.variants` that runs it: "softmax" —
`flash_attention`, with or without fused RoPE, "stick_breaking" or "dilated", Sq == Sk), its shape
(B, Sq, Sk, Hq, Hkv, D), its compute dtype, the keyword arguments of the call and how the inputs
beyond q, k, v are drawn (segment ids, RoPE positions, a random cotangent on the row statistic,
the input magnitude). The record's `draw(case)` draws them from the case's seed in NumPy, once,
for both frameworks. `gpu=True` cases (fp16/bf16 at realistic sizes) run only where a GPU is
present; `quick=True` cases form the `--quick` subset of `python -m parity.check`; `slow=True`
cases of the test grids run in the slow test tier (`pytest -m slow`).

The case lists live with their records (`parity.variants.softmax`, `parity.variants.stick_breaking`);
`CASES` here is all records' parity cases, in order (what `python -m parity.check` runs).
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, NamedTuple

import numpy as np

SEGMENTS = (None, "packed", "sorted", "pair_zeros", "pair_sorted", "pair_unsorted", "pair_empty_tail", "pair_with_empty_rows")
POSITIONS = (None, "restart_per_segment", "restart_halfway", "pair_random", "pair_offset", "pair_large")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    variant: str  # the record's name: "softmax" | "stick_breaking" | "dilated" | "nsa"
    shape: tuple[int, int, int, int, int, int]  # B, Sq, Sk, Hq, Hkv, D
    dtype: str  # "float32" | "float16" | "bfloat16"
    kwargs: tuple[tuple[str, Any], ...] = ()
    segments: str | None = None  # one of SEGMENTS (see `segment_ids`)
    rope: tuple[str, float] | None = None  # (style, base): fused RoPE, built per framework
    positions: str | None = None  # one of POSITIONS (see `positions`); None: arange
    stat_grad: bool = False  # a random cotangent on the row statistic (lse / rem), else zero
    amp: float = 1.0  # q, k, v magnitude (large values drive a softcap's tanh into saturation)
    seed: int = 0
    gpu: bool = False
    quick: bool = False
    slow: bool = False

    @property
    def decay(self):
        """Stick-breaking decay: a float or a per-head tuple (a learnable leaf in both frameworks)."""
        return dict(self.kwargs).get("decay", 0.0)

    def call_kwargs(self) -> dict:
        return {k: v for k, v in self.kwargs if k != "decay"}

    def __str__(self):
        return self.name


class Inputs(NamedTuple):
    """Float64 NumPy inputs of a case: q, k, v, the cotangents of out and of the row statistic,
    segment ids (None, [B, S] or a pair) and positions (None, [B, S] or a pair), int32."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    dstat: np.ndarray
    segment_ids: Any
    positions: Any


def draw(case: Case) -> Inputs:
    """The case's seeded inputs (the draw order is fixed: q, k, v, do, segment ids, positions,
    the statistic's cotangent)."""
    rng = np.random.default_rng(case.seed)
    b, sq, sk, hq, hkv, d = case.shape
    q = rng.standard_normal((b, sq, hq, d)) * case.amp
    k = rng.standard_normal((b, sk, hkv, d)) * case.amp
    v = rng.standard_normal((b, sk, hkv, d)) * case.amp
    do = rng.standard_normal((b, sq, hq, d))
    seg = segment_ids(case, rng)
    pos = positions(case, rng, seg)
    dstat = rng.standard_normal((b, hq, sq)) if case.stat_grad else np.zeros((b, hq, sq))
    return Inputs(q, k, v, do, dstat, seg, pos)


def segment_ids(case: Case, rng):
    """None; "packed": 4 sorted segments, the same in every batch row ([B, S], Sq == Sk);
    "pair_zeros": one segment, as a pair;
    "sorted": sorted ids in 0..2 per row ([B, S]); "pair_sorted" / "pair_unsorted": a pair of ids
    in 0..2 for q and k (Sq != Sk allowed); "pair_empty_tail": sorted pair where the last 5 queries
    have an id no key has; "pair_with_empty_rows": unsorted pair, 5 middle queries with no key."""
    b, sq, sk = case.shape[:3]
    kind = case.segments
    if kind is None:
        return None
    sort = lambda x: np.sort(x, axis=1).astype(np.int32)
    if kind == "packed":
        return _packed(rng, b, sq)
    if kind == "sorted":
        return sort(rng.integers(0, 3, (b, sq)))
    if kind == "pair_zeros":  # one segment, given as a pair (Sq != Sk allowed)
        return np.zeros((b, sq), np.int32), np.zeros((b, sk), np.int32)
    if kind == "pair_sorted":
        return sort(rng.integers(0, 3, (b, sq))), sort(rng.integers(0, 3, (b, sk)))
    if kind == "pair_unsorted":
        return rng.integers(0, 3, (b, sq)).astype(np.int32), rng.integers(0, 3, (b, sk)).astype(np.int32)
    if kind == "pair_empty_tail":
        q_ids, kv_ids = sort(rng.integers(0, 2, (b, sq))), sort(rng.integers(0, 2, (b, sk)))
        q_ids[:, -5:] = 2
        return q_ids, kv_ids
    if kind == "pair_with_empty_rows":  # unsorted ids; id 9 has no keys at all
        q_ids = rng.integers(0, 3, (b, sq)).astype(np.int32)
        q_ids[:, sq // 2: sq // 2 + 5] = 9
        return q_ids, rng.integers(0, 3, (b, sk)).astype(np.int32)
    raise ValueError(f"unknown segments={kind!r}")


def positions(case: Case, rng, seg):
    """None (arange); "restart_per_segment": 0, 1, ... in each segment (of the case's ids, or of
    packed ids drawn here; a pair for a pair of ids); "restart_halfway": arange restarting at S // 2;
    "pair_random" / "pair_large": unsorted (q_pos, kv_pos) below 4096 / 20000; "pair_offset": q
    placed after a per-row prefix of the keys."""
    b, sq, sk = case.shape[:3]
    kind = case.positions
    if kind is None:
        return None
    if kind == "restart_per_segment":
        seg = _packed(rng, b, sq) if seg is None else seg
        return tuple(restart_positions(s) for s in seg) if isinstance(seg, tuple) else restart_positions(seg)
    if kind == "restart_halfway":
        pos = np.broadcast_to(np.arange(sq), (b, sq)).copy()
        pos[:, sq // 2:] -= sq // 2
        return pos.astype(np.int32)
    if kind in ("pair_random", "pair_large"):
        top = 4096 if kind == "pair_random" else 20000
        return rng.integers(0, top, (b, sq)).astype(np.int32), rng.integers(0, top, (b, sk)).astype(np.int32)
    if kind == "pair_offset":
        prefix = rng.integers(0, 50, (b, 1))
        return ((np.arange(sq)[None] + prefix + max(sk - sq, 0)).astype(np.int32),
                (np.arange(sk)[None] + prefix).astype(np.int32))
    raise ValueError(f"unknown positions={kind!r}")


def restart_positions(ids: np.ndarray) -> np.ndarray:
    """Per-token positions restarting at 0 where the (sorted) segment id changes."""
    s = ids.shape[1]
    starts = np.maximum.accumulate(np.where(np.diff(ids, prepend=-1, axis=1) != 0, np.arange(s)[None, :], 0),
                                   axis=1)
    return (np.arange(s)[None, :] - starts).astype(np.int32)


def _packed(rng, batch, seq_len):
    """Sorted ids of 4 packed sequences, the same in every batch row."""
    cuts = np.sort(rng.choice(np.arange(1, seq_len), size=3, replace=False))
    ids = (np.arange(seq_len)[None, :] >= cuts[:, None]).sum(0)
    return np.broadcast_to(ids, (batch, seq_len)).astype(np.int32).copy()


def case(name, shape, dtype="float32", *, variant="softmax", segments=None, rope=None, positions=None,
         stat_grad=False, amp=1.0, gpu=False, quick=False, slow=False, seed=None, **kwargs) -> Case:
    """A case seeded by its name (or `seed`). `shape`: (B, Sq, Sk, Hq, Hkv, D)."""
    assert segments in SEGMENTS and positions in POSITIONS, (segments, positions)
    return Case(name, variant, tuple(shape), dtype, tuple(sorted(kwargs.items())), segments, rope, positions,
                stat_grad, amp, seed=zlib.crc32(name.encode()) if seed is None else seed, gpu=gpu, quick=quick, slow=slow)


def __getattr__(name):
    if name == "CASES":  # every record's parity cases (imported lazily: the records import the frameworks)
        from parity.variants import RECORDS

        return [c for record in RECORDS for c in record.cases]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
