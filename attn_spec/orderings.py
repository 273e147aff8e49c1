"""Space-filling-curve orderings of a token sequence (framework-free).

An ordering is a permutation `pi` of [0, n): position t of the ordered sequence holds original
token pi[t], so `x_ordered = x[pi]` and `x = x_ordered[inverse(pi)]`. Ordered attention lays its
locality pattern (window, dilated segments, local blocks) on the ordered sequence: a 1-D window
over a Hilbert-ordered image is a compact 2-D neighbourhood, where over row-major order it is a
thin strip.

The grid orderings ("hilbert", "zorder", "snake") lay the tokens row-major on a grid (rows, cols),
or (depth, rows, cols) for "hilbert" and "zorder" (token (r, c) is r * cols + c; (z, r, c) is
(z * rows + r) * cols + c), walk the whole grid in the curve's order and drop the cells >= n,
which keeps the relative order of the rest. On a full grid (n == number of cells) nothing is
dropped; otherwise a dropped cell is a gap in the walk, so the continuity guarantees below hold
on full grids only. Without a grid, `default_grid(n)`.

- "hilbert": the generalised Hilbert curve (Červený's "gilbert" construction for arbitrary
  rectangles and boxes, re-derived below with a parity rule of its own). On every full 2-D or 3-D
  grid, whatever its sides, each step moves to a neighbouring cell (4-neighbourhood; 6 in 3-D);
  gilbert itself takes one diagonal step on rectangles whose longer side is odd and shorter side
  even, this curve runs along the even side there instead (see below). It starts at cell (0, 0)
  and ends at the other end of the edge through (0, 0) along the major axis (the longest even
  side, else the longest). On 2^k x 2^k grids it is the classic Hilbert curve (the d2xy rotation
  algorithm with x = col, y = row: first step down a row, ending at (0, 2^k - 1)); on 2^k cubes
  it is a 3-D Hilbert curve (every aligned sub-cube of every level is one stretch of the walk).
- "zorder": Morton order: cells sorted by the bit interleave of (row, col) (col bit b at code bit
  2b, row bit b at 2b + 1; in 3-D col, row, depth at 3b, 3b + 1, 3b + 2).
- "snake": boustrophedon rows: even rows left to right, odd rows right to left (continuous on
  full grids).
- "gray": the Gray-code walk: g(i) = i ^ (i >> 1) for i = 0, 1, ..., 2^k - 1, k = ceil(log2 n),
  keeping the values < n (g is a bijection of [0, 2^k), so this is a permutation of [0, n)).
- "bit_reversal": the tokens sorted by their index bit-reversed over k = ceil(log2 n) bits
  (equivalently rev(j) for j = 0, ..., 2^k - 1, keeping the values < n).
- "identity".
The 1-D orderings ("gray", "bit_reversal", "identity") accept a 2-D grid and ignore its shape.

Permutations are computed once per (name, n, grid) and cached; the arrays are read-only int32.
"""
from __future__ import annotations

import functools
import itertools
import math
import numbers

import numpy as np

ORDERINGS = ("hilbert", "zorder", "gray", "bit_reversal", "snake", "identity")
GRID_ORDERINGS = ("hilbert", "zorder", "snake")  # the ones whose order depends on the grid
GRID_3D_ORDERINGS = ("hilbert", "zorder")


def default_grid(n: int) -> tuple[int, int]:
    """The near-square grid (rows, cols) for n tokens: cols = ceil(sqrt(n)), rows = ceil(n / cols),
    so rows <= cols, rows * cols >= n, and the shortfall is less than one row. The curve is laid
    over the whole grid and the cells >= n (the tail of the last row) are dropped, keeping the
    relative order of the rest. (1, 1) for n = 0."""
    n = _check_n(n)
    if n == 0:
        return 1, 1
    cols = math.isqrt(n - 1) + 1
    return -(-n // cols), cols


def permutation(name: str, n: int, grid=None) -> np.ndarray:
    """pi int32 [n], read-only and cached per (name, n, grid): position t of the ordered sequence
    holds original token pi[t]. grid: (rows, cols), or (depth, rows, cols) for "hilbert" and
    "zorder", with at least n cells; the tokens are laid on it row-major (None: `default_grid(n)`).
    See the module docstring for each ordering."""
    if not isinstance(name, str) or name not in ORDERINGS:
        raise ValueError(f"name must be one of {ORDERINGS}, got {name!r}")
    n = _check_n(n)
    grid = _check_grid(name, n, grid)
    if name not in GRID_ORDERINGS:
        grid = None  # the 1-D orderings share one cache entry whatever grid they were given
    elif grid is None:
        grid = default_grid(n)
    return _permutation(name, n, grid)


def inverse(perm) -> np.ndarray:
    """inv int32 [n] with inv[perm[t]] = t: the ordered position of each original token
    (`x = x_ordered[inv]`)."""
    perm = np.asarray(perm)
    if perm.ndim != 1 or not np.issubdtype(perm.dtype, np.integer):
        raise ValueError(f"perm must be a 1-D integer array, got dtype {perm.dtype} and shape {perm.shape}")
    n = perm.shape[0]
    if n and (perm.min() < 0 or perm.max() >= n or np.bincount(perm, minlength=n).max() != 1):
        raise ValueError(f"perm must be a permutation of [0, {n})")
    inv = np.empty(n, np.int32)
    inv[perm] = np.arange(n, dtype=np.int32)
    return inv


# --- argument checks --------------------------------------------------------------------------

def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"n must be an int, got {n!r} of type {type(n).__name__}")
    if not 0 <= n < 2**31:
        raise ValueError(f"n must be in [0, 2**31), got {n}")
    return int(n)


def _check_grid(name: str, n: int, grid) -> tuple[int, ...] | None:
    if grid is None:
        return None
    if (isinstance(grid, (str, bytes)) or not hasattr(grid, "__len__") or len(grid) not in (2, 3)
            or any(isinstance(g, bool) or not isinstance(g, numbers.Integral) for g in grid)):
        raise ValueError(f"grid must be (rows, cols) or (depth, rows, cols) of ints, got {grid!r}")
    grid = tuple(int(g) for g in grid)
    if min(grid) < 1:
        raise ValueError(f"grid must have positive sizes, got {grid}")
    if len(grid) == 3 and name not in GRID_3D_ORDERINGS:
        raise ValueError(f"grid: a 3-D grid (depth, rows, cols) is taken by {GRID_3D_ORDERINGS} only, "
                         f"got {grid} for {name!r}")
    if math.prod(grid) < n:
        raise ValueError(f"grid {grid} has {math.prod(grid)} cells, fewer than n={n}")
    return grid


# --- the orderings ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _permutation(name: str, n: int, grid: tuple[int, ...] | None) -> np.ndarray:
    if name in GRID_ORDERINGS:
        cells = _GRID_WALKS[name](grid)  # [cells, ndim] coordinates in walk order
        tokens = np.ravel_multi_index(tuple(cells.T), grid)
        pi = tokens[tokens < n]
    elif name == "identity":
        pi = np.arange(n)
    else:
        k = (n - 1).bit_length() if n else 0  # ceil(log2 n)
        walk = np.arange(1 << k)
        walk = walk ^ (walk >> 1) if name == "gray" else _bit_reverse(walk, k)
        pi = walk[walk < n]
    pi = np.ascontiguousarray(pi, dtype=np.int32)
    pi.flags.writeable = False
    return pi


def _bit_reverse(x: np.ndarray, bits: int) -> np.ndarray:
    out = np.zeros_like(x)
    for b in range(bits):
        out |= ((x >> b) & 1) << (bits - 1 - b)
    return out


def _snake(grid: tuple[int, ...]) -> np.ndarray:
    rows, cols = grid
    col = np.tile(np.arange(cols), (rows, 1))
    col[1::2] = col[1::2, ::-1]
    return np.stack([np.repeat(np.arange(rows), cols), col.ravel()], axis=1)


def _zorder(grid: tuple[int, ...]) -> np.ndarray:
    cells = np.indices(grid).reshape(len(grid), -1).T  # row-major
    code = np.zeros(len(cells), np.int64)
    dims = len(grid)
    for b in range(max(grid).bit_length()):
        for rank, axis in enumerate(reversed(range(dims))):  # the last axis (cols) in the lowest bit
            code |= ((cells[:, axis] >> b) & 1) << (dims * b + rank)
    return cells[np.argsort(code, kind="stable")]


# --- the generalised Hilbert curve -------------------------------------------------------------
#
# A curve is built in the frame of its box: axis 0 is the major axis, of length w; the curve runs
# through every cell from the origin to (w - 1, 0[, 0]), the corner next to it along the major
# axis. A box is cut into a few boxes whose curves, each in a frame of its own (an origin and signed
# unit axes in the parent's frame), chain up: one ends next to where the next one begins.
#
# When can such a curve step only to neighbours? Colour cell x by sum(x) mod 2: every step changes
# colour, so a path over N cells from the origin (colour 0) to (w - 1, 0, ...) (colour (w - 1) mod 2)
# needs w even, or w and N both odd; and w = 1 only for a single cell. Call such a box "joinable".
# The cuts below choose the split points (near halves, of either parity) so that every part of a
# joinable box is joinable again (such a cut always exists, see `_cut`), which by induction keeps
# the whole curve continuous. Červený's gilbert rounds odd half-splits up to even and keeps the
# longer side as the major axis; on a rectangle whose longer side is odd and shorter side even that
# box is not joinable, and gilbert takes one diagonal step. Here the top level picks a joinable
# major axis instead (the longest even side; all sides odd: the longest), which always exists, so
# no grid needs a diagonal step; the price on such rectangles is a curve that first runs along the
# shorter side (a u-turn over the long one), which is slightly less compact.
# On 2^k squares every split is an exact half and the cuts are the Hilbert curve's quadrants.

def _joinable(shape: tuple[int, ...]) -> bool:
    w, rest = shape[0], math.prod(shape[1:])
    return (w % 2 == 0 or rest % 2 == 1) and (w > 1 or rest == 1)


def _halves(x: int) -> list[int]:
    """Split points of a side of x cells: the ones nearest x / 2 of each parity, nearest first."""
    near = {c for c in (x // 2, x // 2 + 1) if 1 <= c < x}
    return sorted(near, key=lambda c: (abs(2 * c - x), c % 2))


def _neg(v: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-c for c in v)


# A cut maker is (split axes, parts(*splits)); parts are (origin, frame axes, shape) in the parent's
# frame. The makers come in order of preference, by the box's aspect ratio as in gilbert.

def _cuts_2d(shape):
    w, h = shape
    I, J = (1, 0), (0, 1)

    def halve(w1):  # two boxes side by side along the major axis
        return [((0, 0), (I, J), (w1, h)), ((w1, 0), (I, J), (w - w1, h))]

    def u_turn(w1, h1):  # up the minor axis, across the far half along the major, back down
        return [((0, 0), (J, I), (h1, w1)),
                ((0, h1), (I, J), (w, h - h1)),
                ((w - 1, h1 - 1), (_neg(J), _neg(I)), (h1, w - w1))]

    cuts = [((0,), halve), ((0, 1), u_turn)]
    return cuts if 2 * w > 3 * h else cuts[::-1]


def _cuts_3d(shape):
    w, h, d = shape
    I, J, K = (1, 0, 0), (0, 1, 0), (0, 0, 1)

    def halve(w1):
        return [((0, 0, 0), (I, J, K), (w1, h, d)), ((w1, 0, 0), (I, J, K), (w - w1, h, d))]

    def u_turn_j(w1, h1):  # the 2-D u-turn in the (i, j) plane, k whole
        return [((0, 0, 0), (J, K, I), (h1, d, w1)),
                ((0, h1, 0), (I, J, K), (w, h - h1, d)),
                ((w - 1, h1 - 1, 0), (_neg(J), K, _neg(I)), (h1, d, w - w1))]

    def u_turn_k(w1, d1):  # the 2-D u-turn in the (i, k) plane, j whole
        return [((0, 0, 0), (K, I, J), (d1, w1, h)),
                ((0, 0, d1), (I, J, K), (w, h, d - d1)),
                ((w - 1, 0, d1 - 1), (_neg(K), _neg(I), J), (d1, w - w1, h))]

    def octants(w1, h1, d1):  # the 3-D Hilbert step: eight octants in five boxes
        return [((0, 0, 0), (J, K, I), (h1, d1, w1)),
                ((0, h1, 0), (K, I, J), (d, w1, h - h1)),
                ((0, h1 - 1, d - 1), (I, _neg(J), _neg(K)), (w, h1, d - d1)),
                ((w - 1, h1, d - 1), (_neg(K), _neg(I), J), (d, w - w1, h - h1)),
                ((w - 1, h1 - 1, 0), (_neg(J), K, _neg(I)), (h1, d1, w - w1))]

    cuts = {"halve": ((0,), halve), "j": ((0, 1), u_turn_j), "k": ((0, 2), u_turn_k),
            "octants": ((0, 1, 2), octants)}
    if 2 * w > 3 * h and 2 * w > 3 * d:
        first = "halve"
    elif 3 * h > 4 * d:
        first = "j"
    elif 3 * d > 4 * h:
        first = "k"
    else:
        first = "octants"
    return [cuts[first]] + [cut for name, cut in cuts.items() if name != first]


def _cut(shape: tuple[int, ...]):
    """The parts of a joinable box with at least two sides > 1: the first cut, in order of
    preference, whose parts are all joinable, trying the split points near the halves.

    One always exists. 2-D (w, h): for h >= 3 the u-turn with h1 even (parts (h1, w1) and
    (h1, w - w1) have an even major side; (w, h - h1) has w even, or h and so h - h1 odd); for
    h = 2, w is even: w = 2 is the u-turn of single cells, w >= 4 halves into even widths. 3-D
    (w, h, d) likewise: the u-turn in (i, j) for h >= 3, in (i, k) for d >= 3; otherwise h, d <= 2
    with one of them 2, so w is even: halve into even widths for w >= 4, and for w = 2 the u-turn
    or the octants of single cells."""
    for axes, parts in (_cuts_2d if len(shape) == 2 else _cuts_3d)(shape):
        for splits in itertools.product(*(_halves(shape[a]) for a in axes)):
            cut = parts(*splits)
            if all(_joinable(sub) for _, _, sub in cut):
                return cut
    raise AssertionError(f"no joinable cut of the box {shape}")  # unreachable, see the docstring


def _curve(shape: tuple[int, ...], memo: dict) -> np.ndarray:
    """[prod(shape), ndim] int64: the box's cells in curve order, in the box's frame. `memo` holds
    the curves of the shapes met so far (the cuts repeat few shapes)."""
    if shape not in memo:
        long = [a for a, s in enumerate(shape) if s > 1]
        if len(long) <= 1:  # a line (or one cell)
            cells = np.zeros((math.prod(shape), len(shape)), np.int64)
            if long:
                cells[:, long[0]] = np.arange(shape[long[0]])
        else:
            cells = np.concatenate([np.asarray(origin) + _curve(sub, memo) @ np.asarray(axes)
                                    for origin, axes, sub in _cut(shape)])
        memo[shape] = cells
    return memo[shape]


def _hilbert(grid: tuple[int, ...]) -> np.ndarray:
    """Cells of the grid (grid axes) in Hilbert order. Frame axes: the major axis (the longest even
    side, else the longest; ties to the later grid axis), then the other grid axes from the last
    (cols) to the first."""
    order = list(reversed(range(len(grid))))  # cols, rows[, depth]
    even = [a for a in order if grid[a] % 2 == 0]
    major = max(even or order, key=lambda a: grid[a])  # max keeps the first of equals: cols first
    order.remove(major)
    order.insert(0, major)
    local = _curve(tuple(grid[a] for a in order), {})
    cells = np.empty_like(local)
    cells[:, order] = local
    return cells


_GRID_WALKS = {"hilbert": _hilbert, "zorder": _zorder, "snake": _snake}


# --- the `ordering=` argument of the attention functions --------------------------------------

def check_ordering(ordering, grid, n: int, shape=None, is_integer: bool = True, values=None):
    """Validates an `ordering=` argument (with its `grid=`) for a sequence of n tokens.

    ordering: None, a name of `ORDERINGS` (with an optional grid), or a permutation array given by
    its `shape`, whether its dtype is an integer one, and its `values` as a NumPy array when they
    are concrete (None while traced under jit: then it is taken as given). -> None where the
    ordering is the identity (no effect), "array" for a given array, else the cached int32
    permutation of the name."""
    if ordering is None:
        if grid is not None:
            raise ValueError(f"grid={grid!r} is given without an ordering (pass ordering='hilbert', ...)")
        return None
    if isinstance(ordering, str):
        if ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS} or a permutation array, got {ordering!r}")
        if grid is not None:
            g = _check_grid(ordering, n, grid)
            if math.prod(g) != n:
                raise ValueError(f"grid {g} has {math.prod(g)} cells but the sequence has {n} tokens: "
                                 f"a token grid must hold exactly the sequence")
        perm = permutation(ordering, n, grid)
        return None if ordering == "identity" else perm
    if grid is not None:
        raise ValueError(f"grid={grid!r} applies to a named ordering, not to a permutation array")
    if shape is None:
        raise TypeError(f"ordering must be a name of {ORDERINGS} or a 1-D integer array, got "
                        f"{type(ordering).__name__}")
    if tuple(shape) != (n,) or not is_integer:
        raise ValueError(f"ordering: a permutation array must be 1-D integer of length {n} (the sequence), "
                         f"got shape {tuple(shape)}{'' if is_integer else ' and a non-integer dtype'}")
    if values is not None:
        values = np.asarray(values)
        if n and (values.min() < 0 or values.max() >= n or np.bincount(values, minlength=n).max() != 1):
            raise ValueError(f"ordering: the array is not a permutation of [0, {n})")
        if np.array_equal(values, np.arange(n)):
            return None
    return "array"
