"""Space-filling-curve orderings (`attn_spec.orderings`) and their JAX / PyTorch wrappers: every
ordering a bijection, the curves' continuity where they promise it, each ordering against an
independent definition written here (the classic Hilbert d2xy, bit interleaving, Gray code, bit
reversal), inverse, argument errors, caching, and the locality that is the point of it all."""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from attn_spec import orderings
from jax_attn import orderings as jax_orderings
from torch_ref import orderings as torch_orderings

NAMES = orderings.ORDERINGS
NS = list(range(0, 71)) + [255, 256, 1000]
GRIDS_2D = [(1, 1), (1, 17), (17, 1), (2, 2), (4, 4), (8, 8), (3, 5), (5, 3), (7, 7), (6, 10), (9, 4),
            (2, 33), (33, 2), (16, 32), (31, 47), (64, 64)]
GRIDS_3D = [(1, 1, 1), (2, 2, 2), (4, 4, 4), (3, 5, 7), (2, 3, 4), (1, 6, 5), (5, 1, 1), (8, 4, 2), (7, 2, 6)]


def _walk(name, grid):
    """Cells (grid coordinates) of the full grid in the ordering's order, [cells, ndim]."""
    pi = orderings.permutation(name, math.prod(grid), grid)
    return np.stack(np.unravel_index(pi, grid), axis=1)


def _steps(cells):
    """Manhattan length of each step of a walk."""
    return np.abs(np.diff(cells, axis=0)).sum(axis=1)


def _is_permutation(pi, n):
    return pi.shape == (n,) and np.array_equal(np.sort(pi), np.arange(n))


# --- bijections --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_bijection_on_the_default_grid(name):
    for n in NS:
        pi = orderings.permutation(name, n)
        assert pi.dtype == np.int32 and _is_permutation(pi, n), n


@pytest.mark.parametrize("name, grid", [(name, grid) for name in NAMES for grid in GRIDS_2D + GRIDS_3D
                                         if len(grid) == 2 or name in orderings.GRID_3D_ORDERINGS], ids=str)
def test_bijection_on_given_grids_full_and_partial(name, grid):
    """Full grids and grids with cells to drop (the tail of the row-major numbering); 3-D grids for
    the orderings that take them (the others: test_errors_name_the_argument)."""
    cells = math.prod(grid)
    for n in sorted({cells, cells - 1, cells // 2 + 1, 1}):
        assert _is_permutation(orderings.permutation(name, n, grid), n), n


@pytest.mark.parametrize("name", ["hilbert", "zorder", "snake"])
def test_dropping_cells_keeps_the_relative_order(name):
    """On a partial grid the walk is the full grid's walk with the cells >= n removed."""
    for grid in [(5, 7), (6, 6), (3, 5, 4)] if name != "snake" else [(5, 7), (6, 6)]:
        full = orderings.permutation(name, math.prod(grid), grid)
        for n in (1, 9, math.prod(grid) - 3):
            np.testing.assert_array_equal(orderings.permutation(name, n, grid), full[full < n])


def test_default_grid():
    assert orderings.default_grid(0) == (1, 1)
    assert [orderings.default_grid(n) for n in (1, 2, 3, 4, 5, 10, 20, 1000, 4096)] == [
        (1, 1), (1, 2), (2, 2), (2, 2), (2, 3), (3, 4), (4, 5), (32, 32), (64, 64)]
    for n in range(1, 3000):
        rows, cols = orderings.default_grid(n)
        assert rows <= cols and n <= rows * cols < n + cols, n  # less than one row dropped
        assert cols == math.ceil(math.sqrt(n)) and (cols - 1) ** 2 < n, n  # no squarer grid holds n


# --- continuity --------------------------------------------------------------------------------

def test_hilbert_is_continuous_on_every_small_grid():
    """Every step is to a 4-neighbour on every full grid up to 40 x 40 (odd x even included, where
    gilbert would take a diagonal step), from (0, 0) to the other end of the edge along the major
    axis: the longest even side, else the longest (cols on ties)."""
    for rows, cols in itertools.product(range(1, 41), repeat=2):
        cells = _walk("hilbert", (rows, cols))
        assert (_steps(cells) == 1).all(), (rows, cols)
        major = max([a for a in (1, 0) if (rows, cols)[a] % 2 == 0] or [1, 0], key=lambda a: (rows, cols)[a])
        end = [0, 0]
        end[major] = (rows, cols)[major] - 1
        assert tuple(cells[0]) == (0, 0) and tuple(cells[-1]) == tuple(end), (rows, cols)


def test_hilbert_3d_is_continuous_on_every_small_grid():
    """Every step is to a 6-neighbour on every full 3-D grid up to 9 x 9 x 9."""
    for grid in itertools.product(range(1, 10), repeat=3):
        cells = _walk("hilbert", grid)
        assert (_steps(cells) == 1).all() and not cells[0].any(), grid


@pytest.mark.parametrize("grid", [(128, 96), (97, 130), (255, 2), (3, 200), (100, 101)], ids=str)
def test_hilbert_is_continuous_on_larger_grids(grid):
    assert (_steps(_walk("hilbert", grid)) == 1).all()


@pytest.mark.parametrize("grid", GRIDS_2D, ids=str)
def test_snake_is_continuous(grid):
    cells = _walk("snake", grid)
    assert (_steps(cells) == 1).all()
    np.testing.assert_array_equal(cells[:, 0], np.repeat(np.arange(grid[0]), grid[1]))  # row by row


# --- against independent definitions -------------------------------------------------------------

def _d2xy(side: int, d: int) -> tuple[int, int]:
    """The classic Hilbert index -> (x, y) by quadrant rotations (Wikipedia, "Hilbert curve")."""
    x = y = 0
    s, t = 1, d
    while s < side:
        rx = 1 & (t // 2)
        ry = 1 & (t ^ rx)
        if ry == 0:
            if rx == 1:
                x, y = s - 1 - x, s - 1 - y
            x, y = y, x
        x, y = x + s * rx, y + s * ry
        t //= 4
        s *= 2
    return x, y


@pytest.mark.parametrize("k", range(0, 7))
def test_hilbert_on_power_of_two_squares_is_the_classic_curve(k):
    side = 1 << k
    expected = [y * side + x for x, y in (_d2xy(side, d) for d in range(side * side))]
    np.testing.assert_array_equal(orderings.permutation("hilbert", side * side, (side, side)), expected)
    if k:  # also the default grid of a square count
        np.testing.assert_array_equal(orderings.permutation("hilbert", side * side), expected)


@pytest.mark.parametrize("k", range(1, 5))
def test_hilbert_on_power_of_two_cubes_is_octant_recursive(k):
    """Every aligned sub-cube of side 2^j, at every level j, is one stretch of the walk."""
    side = 1 << k
    cells = _walk("hilbert", (side, side, side))
    for j in range(k):
        sub = 1 << j
        blocks = np.ravel_multi_index(tuple((cells // sub).T), (side // sub,) * 3)
        stretches = blocks.reshape(-1, sub ** 3)
        assert (stretches == stretches[:, :1]).all(), j
        assert len(np.unique(stretches[:, 0])) == (side // sub) ** 3


def _interleave(coords) -> int:
    """Morton code by strings: coordinates (.., row, col) bit by bit, most significant first."""
    bits = max(c.bit_length() for c in coords) or 1
    columns = [format(c, f"0{bits}b") for c in coords]
    return int("".join("".join(col[i] for col in columns) for i in range(bits)), 2)


@pytest.mark.parametrize("grid", [(8, 8), (5, 7), (16, 3), (1, 9), (4, 4, 4), (3, 6, 5)], ids=str)
def test_zorder_is_bit_interleaving(grid):
    cells = list(itertools.product(*map(range, grid)))  # row-major: token = position here
    for n in (math.prod(grid), math.prod(grid) - 2):
        expected = sorted((t for t in range(n)), key=lambda t: _interleave(cells[t]))
        np.testing.assert_array_equal(orderings.permutation("zorder", n, grid), expected)


def test_gray_and_bit_reversal_against_their_definitions():
    for n in list(range(0, 70)) + [255, 256, 257, 1000]:
        k = 0
        while (1 << k) < n:
            k += 1
        gray = [i ^ (i >> 1) for i in range(2 ** k) if i ^ (i >> 1) < n]
        rev = sorted(range(n), key=lambda i: int(format(i, f"0{k}b")[::-1] or "0", 2))
        np.testing.assert_array_equal(orderings.permutation("gray", n), gray)
        np.testing.assert_array_equal(orderings.permutation("bit_reversal", n), rev)
        np.testing.assert_array_equal(orderings.permutation("identity", n), np.arange(n))


def test_gray_steps_flip_one_bit_on_powers_of_two():
    pi = orderings.permutation("gray", 256).astype(np.int64)
    assert all(bin(int(a ^ b)).count("1") == 1 for a, b in zip(pi[:-1], pi[1:]))


def test_one_d_orderings_ignore_a_2d_grid():
    for name in ("gray", "bit_reversal", "identity"):
        assert orderings.permutation(name, 20, (4, 5)) is orderings.permutation(name, 20)


# --- inverse, caching, errors -------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_inverse(name):
    for n in (0, 1, 7, 64, 1000):
        pi = orderings.permutation(name, n)
        inv = orderings.inverse(pi)
        np.testing.assert_array_equal(inv[pi], np.arange(n))
        np.testing.assert_array_equal(pi[inv], np.arange(n))
        x = np.random.default_rng(n).standard_normal(n)
        np.testing.assert_array_equal(x[pi][inv], x)


def test_caching_returns_the_same_read_only_array():
    a = orderings.permutation("hilbert", 100)
    assert orderings.permutation("hilbert", 100) is a
    assert orderings.permutation("hilbert", 100, (10, 10)) is a  # the default grid, spelt out
    assert orderings.permutation("hilbert", np.int64(100), [10, 10]) is a
    assert orderings.permutation("hilbert", 100, (4, 25)) is not a
    assert not a.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        a[0] = 1


@pytest.mark.parametrize("args, error, match", [
    (("spiral", 8), ValueError, r"name must be one of .*'spiral'"),
    ((None, 8), ValueError, "name must be one of"),
    (("hilbert", -1), ValueError, r"n must be in \[0, 2\*\*31\), got -1"),
    (("hilbert", 2.0), TypeError, r"n must be an int, got 2.0"),
    (("hilbert", True), TypeError, "n must be an int"),
    (("hilbert", 13, (3, 4)), ValueError, r"grid \(3, 4\) has 12 cells, fewer than n=13"),
    (("zorder", 9, (2, 2, 2)), ValueError, r"grid \(2, 2, 2\) has 8 cells, fewer than n=9"),
    (("snake", 8, (2, 2, 2)), ValueError, r"grid: a 3-D grid .* 'snake'"),
    (("gray", 8, (2, 2, 2)), ValueError, r"grid: a 3-D grid .* 'gray'"),
    (("identity", 8, (2, 2, 2)), ValueError, r"grid: a 3-D grid .* 'identity'"),
    (("hilbert", 8, (8,)), ValueError, r"grid must be \(rows, cols\)"),
    (("hilbert", 8, (1, 2, 2, 2)), ValueError, r"grid must be \(rows, cols\)"),
    (("hilbert", 8, (2.0, 4)), ValueError, r"grid must be \(rows, cols\)"),
    (("hilbert", 8, "24"), ValueError, r"grid must be \(rows, cols\)"),
    (("hilbert", 0, (0, 4)), ValueError, "grid must have positive sizes"),
])
def test_errors_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        orderings.permutation(*args)


def test_error_boundaries_pass():
    assert orderings.permutation("hilbert", 12, (3, 4)).shape == (12,)  # exactly the cell count
    assert orderings.permutation("zorder", 8, (2, 2, 2)).shape == (8,)
    assert orderings.permutation("snake", 0).shape == (0,)
    with pytest.raises(ValueError, match="n must be in"):
        orderings.default_grid(-3)


def test_inverse_errors():
    with pytest.raises(ValueError, match="perm must be a permutation of \\[0, 3\\)"):
        orderings.inverse([0, 0, 2])
    with pytest.raises(ValueError, match="perm must be a permutation"):
        orderings.inverse([0, 3, 1])
    with pytest.raises(ValueError, match="perm must be a 1-D integer array"):
        orderings.inverse(np.zeros((2, 2), int))
    with pytest.raises(ValueError, match="perm must be a 1-D integer array"):
        orderings.inverse([0.0, 1.0])


# --- the framework wrappers ---------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_jax_and_torch_give_the_same_permutations(name):
    for n, grid in [(1, None), (37, None), (256, None), (60, (6, 10)), (64, (4, 4, 4))]:
        if grid is not None and len(grid) == 3 and name not in orderings.GRID_3D_ORDERINGS:
            continue
        expected = orderings.permutation(name, n, grid)
        pj = jax_orderings.permutation(name, n, grid)
        pt = torch_orderings.permutation(name, n, grid)
        assert pj.dtype == jnp.int32 and pt.dtype == torch.int64
        np.testing.assert_array_equal(np.asarray(pj), expected)
        np.testing.assert_array_equal(pt.numpy(), expected)
        np.testing.assert_array_equal(np.asarray(jax_orderings.inverse(pj)), orderings.inverse(expected))
        np.testing.assert_array_equal(torch_orderings.inverse(pt).numpy(), orderings.inverse(expected))


def test_permute_and_unpermute():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 30, 3, 4)).astype(np.float32)
    pi = orderings.permutation("hilbert", 30, (5, 6))
    pj, pt = jax_orderings.permutation("hilbert", 30, (5, 6)), torch_orderings.permutation("hilbert", 30, (5, 6))
    for axis in (1, -3):
        yj = jax_orderings.permute(jnp.asarray(x), pj, axis)
        yt = torch_orderings.permute(torch.from_numpy(x), pt, axis)
        np.testing.assert_array_equal(np.asarray(yj), x[:, pi])
        np.testing.assert_array_equal(yt.numpy(), x[:, pi])
        np.testing.assert_array_equal(np.asarray(jax_orderings.unpermute(yj, pj, axis)), x)
        np.testing.assert_array_equal(torch_orderings.unpermute(yt, pt, axis).numpy(), x)
    xs = rng.standard_normal((30, 2)).astype(np.float32)  # another axis
    np.testing.assert_array_equal(np.asarray(jax_orderings.permute(jnp.asarray(xs), pj, axis=0)), xs[pi])
    np.testing.assert_array_equal(torch_orderings.unpermute(torch.from_numpy(xs[pi]), pt, axis=0).numpy(), xs)
    with pytest.raises(ValueError, match=r"perm has 30 entries but x.shape\[1\] = 29"):
        jax_orderings.permute(jnp.zeros((2, 29, 3, 4)), pj)
    with pytest.raises(ValueError, match=r"perm has 30 entries but x.shape\[1\] = 29"):
        torch_orderings.unpermute(torch.zeros(2, 29, 3, 4), pt)
    with pytest.raises(ValueError, match="axis 4 is out of range"):
        jax_orderings.permute(jnp.zeros((2, 30, 3, 4)), pj, axis=4)


def test_jax_permutation_under_jit():
    """n and grid are static: the permutation is a constant of the trace."""
    @jax.jit
    def roundtrip(x):
        pi = jax_orderings.permutation("zorder", x.shape[1], (4, 5))
        return jax_orderings.permute(x, pi), jax_orderings.unpermute(jax_orderings.permute(x, pi), pi)

    x = jnp.arange(2 * 20, dtype=jnp.float32).reshape(2, 20)
    y, back = roundtrip(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x)[:, orderings.permutation("zorder", 20, (4, 5))])
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_dense_attention_does_not_see_the_order():
    """With no locality pattern an ordering changes nothing: unpermute(attn(permute(q), permute(k),
    permute(v))) equals attn(q, k, v) (plain softmax attention over [B, S, H, D], both frameworks)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 36, 2, 8)) for _ in range(3))
    s = np.einsum("bqhd,bkhd->bhqk", q, k)
    p = np.exp(s - s.max(-1, keepdims=True))
    expected = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)

    pj = jax_orderings.permutation("hilbert", 36)
    qj, kj, vj = (jax_orderings.permute(jnp.asarray(a, jnp.float32), pj) for a in (q, k, v))
    oj = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", qj, kj), axis=-1), vj)
    np.testing.assert_allclose(np.asarray(jax_orderings.unpermute(oj, pj)), expected, atol=1e-5)

    pt = torch_orderings.permutation("hilbert", 36)
    qt, kt, vt = (torch_orderings.permute(torch.from_numpy(a), pt) for a in (q, k, v))
    ot = torch.einsum("bhqk,bkhd->bqhd", torch.einsum("bqhd,bkhd->bhqk", qt, kt).softmax(-1), vt)
    np.testing.assert_allclose(torch_orderings.unpermute(ot, pt).numpy(), expected, atol=1e-12)


# --- locality -----------------------------------------------------------------------------------

def _window_spread(name, side=64, window=64):
    """Mean pairwise Euclidean distance between the cells of each aligned window of `window`
    consecutive ordered tokens, and the mean bounding-box area of every (sliding) window."""
    cells = _walk(name, (side, side)).astype(np.float64)
    groups = cells.reshape(-1, window, 2)
    dist = np.sqrt(((groups[:, :, None] - groups[:, None, :]) ** 2).sum(-1)).mean()
    slide = np.lib.stride_tricks.sliding_window_view(cells, window, axis=0)  # [n - w + 1, 2, w]
    area = ((slide.max(-1) - slide.min(-1) + 1).prod(-1)).mean()
    return dist, area


def test_locality_hilbert_windows_are_compact():
    """On a 64 x 64 grid a window of 64 consecutive Hilbert-ordered tokens is a compact patch: its
    mean pairwise distance is under a quarter of a row-major window's (one row: about 21), and its
    bounding box over sliding windows is smaller too (about 93 cells against 127, where a window
    straddling two rows spans both whole); z-order's distance lies in between."""
    hilbert, identity, zorder = (_window_spread(name) for name in ("hilbert", "identity", "zorder"))
    assert hilbert[0] < 0.25 * identity[0] and hilbert[1] < 0.8 * identity[1]
    assert hilbert[0] <= zorder[0] < identity[0]
