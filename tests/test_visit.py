"""The visit planner (`attn_spec.visit`) against brute force over the element mask: the table the
Triton kernels of both frameworks read, its closed form in the Mosaic kernels, and explicit lists."""
from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from attn_spec import visit

REACHES = [(None, None), (None, 0), (5, 0), (0, 7), (17, 3), (40, None), (3, 3)]
GRIDS = [(1, 1, 16, 16), (17, 31, 16, 16), (64, 64, 32, 16), (100, 47, 16, 32), (129, 203, 32, 64), (65, 300, 64, 64)]


def _visible(before, after, q_pad, kv_pad):
    """[q_pad, kv_pad] visibility by position alone (padding rows and keys too)."""
    rows = np.arange(q_pad)[:, None]
    cols = np.arange(kv_pad)[None, :]
    ok = np.ones((q_pad, kv_pad), bool)
    if before is not None:
        ok &= cols >= rows - before
    if after is not None:
        ok &= cols <= rows + after
    return ok


@pytest.mark.parametrize("reach", REACHES, ids=str)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "q{}k{}bq{}bk{}".format(*g))
@pytest.mark.parametrize("key_major", [False, True], ids=["query_major", "key_major"])
@pytest.mark.parametrize("queries_padded", [True, False], ids=["padded", "unpadded"])
def test_block_table_against_the_element_mask(reach, grid, key_major, queries_padded):
    """Visited = the key block starts inside the keys and some real query of the block sees some
    position of it (the padded tail of a partial key block counts: that block is masked anyway);
    plain = every query row of the block, padding rows included, sees every key of the block and
    all of them are real (and, for unpadded query arrays, all the rows are real too)."""
    before, after = reach
    q_len, kv_len, bq, bk = grid
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    vis = _visible(before, after, nq * bq, nk * bk)
    table = visit.block_table(before, after, q_len, kv_len, bq, bk, nq, nk, key_major, queries_padded)
    assert table.shape == ((nk if key_major else nq), 4) and table.dtype == np.int32
    for i, j in itertools.product(range(nq), range(nk)):
        tile = vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        some = tile[:max(0, min(bq, q_len - i * bq))].any() and j * bk < kv_len
        every = tile.all() and (j + 1) * bk <= kv_len and (queries_padded or (i + 1) * bq <= q_len)
        lo, plain_lo, plain_hi, hi = table[j] if key_major else table[i]
        inner = i if key_major else j
        assert (lo <= inner < hi) == some, (i, j)
        assert (plain_lo <= inner < plain_hi) == (every and some), (i, j)


@pytest.mark.parametrize("reach", REACHES, ids=str)
@pytest.mark.parametrize("grid", [(128, 128, 64, 64), (256, 200, 64, 128), (384, 130, 64, 64), (256, 1, 64, 64)],
                         ids=lambda g: "q{}k{}bq{}bk{}".format(*g))
def test_closed_form_equals_the_table(reach, grid):
    """`partner_blocks` (the Mosaic kernels' in-kernel form) on whole query blocks visits the
    table's blocks, the same ones plain, for queries and (transposed) for keys."""
    before, after = reach
    q_len, kv_len, bq, bk = grid
    nq, nk = q_len // bq, -(-kv_len // bk)
    table = visit.block_table(before, after, q_len, kv_len, bq, bk, nq, nk, False)
    for i in range(nq):
        lo, plain_lo, plain_hi, hi = (int(x) for x in visit.partner_blocks(i * bq, bq, bk, nk, before, after,
                                                                            valid=kv_len))
        t_lo, t_plain_lo, t_plain_hi, t_hi = table[i]
        assert set(range(lo, hi)) == set(range(t_lo, t_hi)), i
        assert set(range(plain_lo, plain_hi)) == set(range(t_plain_lo, t_plain_hi)), i


def _lists_by_loop(needed, start):
    near = np.empty(needed.shape[:-1], int)
    lists = []
    for idx in np.ndindex(*needed.shape[:-1]):
        row, s = needed[idx], int(start[0, 0, idx[-1], 0])
        steps = [t for t in range(s, row.size) if not row[t]]
        near[idx] = steps[0] if steps else row.size
        lists.append([t for t in range(near[idx] + 1, row.size) if row[t]])
    return near, lists


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_block_lists(xp):
    rng = np.random.default_rng(3)
    needed = rng.random((2, 3, 5, 12)) < 0.3
    start = rng.integers(0, 13, (1, 1, 5, 1))
    near, count, lists = visit.block_lists(xp.asarray(needed), xp.asarray(start), 16, xp=xp)
    want_near, want_lists = _lists_by_loop(needed, start)
    np.testing.assert_array_equal(np.asarray(near), want_near)
    for idx, want in zip(np.ndindex(*needed.shape[:-1]), want_lists):
        assert int(np.asarray(count)[idx]) == len(want)
        assert list(np.asarray(lists)[idx][:len(want)]) == want
        assert not np.asarray(lists)[idx][len(want):].any()
