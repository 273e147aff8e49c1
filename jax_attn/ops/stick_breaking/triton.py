"""Stick-breaking attention (ExpoSB: Tan et al., "Scaling Stick-Breaking Attention", arXiv
2410.17980, with an exponential distance decay) as Pallas kernels (Triton lowering): forward, dQ, dK/dV.

Causal, for j < i (the plain reference, `reference.py`, gives the options: attend_current, j <= i;
segment ids, only keys of the row's id; Sq < Sk, i read as the query's key position i + Sk - Sq):
  z_ij = scale * q~_i . k~_j - decay_h * (i - j)          (q~, k~: RoPE-rotated when asked)
  log A_ij = log sigmoid(z_ij) - sum_{j<m<i} softplus(z_im),   o_i = sum_j A_ij v_j,
  rem_i = exp(-sum_{j<i} softplus(z_ij)) = 1 - sum_j A_ij.
Backward, with g_ij = A_ij (dO_i . v_j) and sigma = sigmoid(z):
  dz_ij = g_ij - sigma_ij (drem_i rem_i + sum_{m<=j} g_im),
  dq = scale dz k~, dk = scale dz^T q~, dv = A^T dO, d decay_h = -sum dz_ij (i - j).

The forward walks key blocks from the diagonal leftwards with the softplus sum to the right and
stores it at every key-block boundary; the dQ kernel walks rightwards with the g prefix sums and
stores them; the dK/dV kernel (per key block and kv head) reads both. Each sum runs in its own
direction, never a total minus a partial sum, whose cancellation costs fp32 gradient digits; no
atomics, so the results are deterministic. 16-bit inputs work in base 2 with one MUFU instruction
per transcendental and the in-tile key sums on the tensor cores (`_key_sums`). Tiles of spent
sticks (every A exactly 0 in fp32) are skipped, bit-equal to the dense walk (`_Static.spent`,
`_spent_bounds`). With RoPE each key tile is rotated once per kv head and shared (`keys`). The
options move the diagonal (`_Static.shift`) and mask and bound the walks (segment ids:
`_segment_inputs`); with none of them the kernels trace as without them.
Design and figures: docs/design/stick_breaking.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_attn.ops.common import padding, summation, triton_tiles as tiles, visit
from jax_attn.ops.common.rope import apply_rope
from attn_spec.tiles import check_launch_fields, pow2_at_least
from jax_attn.ops.common.spec import LOG2E, AttentionSpec, padded_head_dim
from jax_attn.ops.common.triton_tiles import rope_tables
from jax_attn.ops.stick_breaking import mosaic as stick_breaking_mosaic
from jax_attn.ops.stick_breaking.numerics import SP_CAP, SPENT, SPENT_FTZ


@dataclasses.dataclass(frozen=True)
class StickBreakingBlockSizes:
    """Tiles (the field vocabulary of `BlockSizes`): block_q rows (forward, dQ), block_k keys
    everywhere (the boundary arrays are per key block, so dQ and dK/dV share it), block_q_dkv rows
    per dK/dV step; num_stages_dkv for the dK/dV kernel (None: num_stages)."""

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_stages_dkv: int | None = None

    def __post_init__(self):
        check_launch_fields(self)

    def fitted(self, q_len: int, kv_len: int) -> "StickBreakingBlockSizes":
        """The tiles capped at the key length's power of two (the kernels pad both axes to one tile
        multiple; `BlockSizes.fitted`'s signature, so the autotuner treats both alike)."""
        cap = pow2_at_least(kv_len)
        return dataclasses.replace(self, block_q=min(self.block_q, cap), block_k=min(self.block_k, cap),
                                   block_q_dkv=min(self.block_q_dkv, cap))


def default_stick_breaking_block_sizes(head_dim: int, interpret: bool, dtype) -> StickBreakingBlockSizes:
    if interpret:
        return StickBreakingBlockSizes(16, 16, 16, 4, 1)
    if jnp.dtype(dtype) == jnp.float32 or head_dim > 128:
        return StickBreakingBlockSizes(32, 32, 32, 4, 2)
    # 32 rows per dK/dV step (it holds two [64, D] fp32 accumulators) and a third stage to hide its
    # loads (docs/design/stick_breaking.md, 'Where the time goes when nothing is spent')
    return StickBreakingBlockSizes(64, 64, 32, 4, 2, num_stages_dkv=3)


@dataclasses.dataclass(frozen=True)
class _Static:
    spec: AttentionSpec  # scale, rope, precision, has_segments, offset = Sk - Sq (causal is implied)
    blocks: StickBreakingBlockSizes
    interpret: bool
    dtype: jnp.dtype  # of q, k, v
    mosaic: bool = False  # the forward on the Mosaic GPU kernel (`stick_breaking_mosaic`)
    skip: bool = True  # skip the tiles of spent sticks (`spent`; False: the tests' dense walk)
    attend_current: bool = False  # keys j <= i (the diagonal's stick included), else j < i

    @property
    def shift(self) -> int:
        """A query row at local index r sees the keys j < r + shift (offset + attend_current)."""
        return self.spec.offset + int(self.attend_current)

    def visible(self, rows, cols, q_seg, kv_seg, masked: bool):
        """The element mask of a tile (rows: the queries' key positions, broadcast against cols),
        None where every pair is visible: causal where `masked` (the tiles at the diagonal), the
        segment ids' everywhere they are given."""
        valid = None
        if masked:
            valid = cols <= rows if self.attend_current else cols < rows
        if q_seg is not None:
            same = q_seg == kv_seg
            valid = same if valid is None else valid & same
        return valid

    @property
    def fast(self) -> bool:  # 16-bit inputs: base-2 logs with single-MUFU exp2/log2 (see `_stick`)
        return self.dtype.itemsize == 2

    @property
    def ptx(self) -> bool:  # the MUFU instructions themselves (`_approx`); the interpreter has none
        return self.fast and not self.interpret

    @property
    def spent(self) -> float:
        """The softplus sum (in the kernel's log units) from which a row's stick is spent: every A
        left of it is exactly 0 in fp32 (`spec.SPENT`; SPENT_FTZ where A is ex2.approx.ftz, as in
        the Mosaic forward too), so its tiles add exactly nothing."""
        if not self.skip:
            return float("inf")
        if self.ptx:
            return SPENT_FTZ
        return SPENT if self.fast else SPENT / LOG2E

    @property
    def sum_terms(self) -> str:
        """The terms of the in-tile key sums (`_key_sums`: A's softplus suffix, dz's g prefix):
        fp32 for fp32 inputs; fp16 for bf16, whose own rounding (2^-8) is 8x coarser than the
        terms' (2^-11), with the key's own term kept in fp32 (strict sums): one tensor-core
        product instead of two; hi + lo for fp16, whose decay gradient needs the second product
        (docs/design/stick_breaking.md, '16-bit inputs')."""
        if self.dtype == jnp.float32:
            return "fp32"
        return "fp16" if self.dtype == jnp.bfloat16 else "split"


# ----------------------------------------------------------------------------------------------
# Tile math
# ----------------------------------------------------------------------------------------------


def _logits(q_parts, k_parts, spec, lam, rows, cols, fast: bool, *, k_major=False):
    """z = scale * q.k - decay * (i - j) in fp32, in log2 units (z log2 e) when `fast`;
    [block_q, block_k] or, k_major, [block_k, block_q]."""
    pairs = zip(k_parts, q_parts) if k_major else zip(q_parts, k_parts)
    raw = sum(tiles.dot(a, b, spec, trans_b=True) for a, b in pairs)
    unit = LOG2E if fast else 1.0
    return raw * (spec.scale * unit) - (lam * unit) * (rows - cols).astype(jnp.float32)


def _approx(op: str, x):
    """One MUFU instruction per element (`ex2` or `lg2`, .approx.ftz.f32): jnp.log2 lowers to
    libdevice's exact logf, a long ALU sequence, which would bound these kernels."""
    [y] = plgpu.elementwise_inline_asm(f"{op}.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return y


def _exp(x, st: _Static):
    """exp in the kernel's log units: 2^x for 16-bit inputs, e^x for fp32."""
    if st.ptx:
        return _approx("ex2", x)
    return jnp.exp2(x) if st.fast else jnp.exp(x)


def _log2(x, st: _Static):
    return _approx("lg2", x) if st.ptx else jnp.log2(x)


def _stick(z, valid, c, axis, st: _Static, tris):
    """softplus, sigma and A of one tile; `axis` is the key axis, c the softplus sum to the right.
    Returns (sp, sigma, a), sp and a zero where not valid (valid None: all valid).

    Exact (fp32 inputs): natural logs, softplus = max(z, 0) + log1p(exp(-|z|)), which keeps the
    tiny terms of strongly negative logits. `fast` (16-bit inputs; few instructions per score):
    logs in base 2, log2(1 + 2^-|z|) by the approximate ex2 and lg2 instructions; lg2.approx
    errs <= 2^-22.6 absolute on [1, 2] and rounding 1 + x <= 2^-24, per key, far below what a
    16-bit output resolves. On query-major tiles (`axis` 1: forward, dQ)
    log sigmoid(z) = z - sp; the k-major dK/dV tile runs faster with min(z, 0) - t.
    A = exp(log sigmoid(z) - c - sum_{m>j} sp): the key's own term in fp32, the
    strict suffix on the tensor cores, its 16-bit terms capped at SP_CAP (fp16 overflows at 65504:
    the logits of 16-bit inputs can pass that, and inf times the matrix's zeros is NaN; a term of
    SP_CAP already makes every A left of it 2^-256, zero in fp32, so the cap changes nothing;
    hence the strict suffix, not an inclusive one, which would need the key's own term uncapped)."""
    if st.fast:
        t = _log2(1.0 + _exp(-jnp.abs(z), st), st)
    else:
        t = jnp.log1p(jnp.exp(-jnp.abs(z)))
    sp = jnp.maximum(z, 0.0) + t  # softplus(z) (/ ln 2 when fast)
    if valid is not None:
        sp = jnp.where(valid, sp, 0.0)
    log_beta = z - sp if st.fast and axis == 1 else jnp.minimum(z, 0.0) - t  # log sigmoid(z)
    summed = sp if st.sum_terms == "fp32" else jnp.minimum(sp, SP_CAP)
    a = _exp(log_beta - c - _key_sums(summed, axis, keys="after", terms=st.sum_terms, tris=tris), st)
    if valid is not None:
        a = jnp.where(valid, a, 0.0)
    return sp, _exp(log_beta, st), a


def _key_sums(x, axis, *, keys: str, terms: str, tris):
    """Per key j of a tile, the sum of x over the keys m along the key axis `axis` with m <= j
    (`keys="up_to"`) or m < j ("before"; both for dz), or m > j ("after", for A).

    As products with a triangular 0/1 matrix: the lowering has no reverse cumsum, and rowsum -
    cumsum errs by eps * rowsum (most where A is largest, at the diagonal; several times the
    reference's error in fp32). `terms`: "fp32" (fp32 inputs: the suffix in fp32, the prefix a
    cumsum); on the tensor cores, "split" x into fp16 hi + lo (22 bits) or "fp16" x rounded to
    fp16 (one product; `_Static.sum_terms` says where). Scans cost more, in every kernel
    (docs/design/stick_breaking.md, '16-bit inputs'). `tris`: the kernel's matrices
    (`_triangles`), loaded from memory."""
    if terms == "fp32" and keys == "up_to":
        return jnp.cumsum(x, axis=axis)
    if terms == "fp32":
        parts, precision = (x,), jax.lax.Precision.HIGHEST
    else:
        hi = x.astype(jnp.float16)
        parts, precision = (hi,), None
        if terms == "split":
            parts += ((x - hi.astype(x.dtype)).astype(jnp.float16),)
    dims = (((1,), (0,)), ((), ()))
    dot = lambda a, b: jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
    if axis == 1:  # [rows, keys] @ [m, j]
        return sum(dot(part, tris[keys]) for part in parts)
    return sum(dot(tris[keys], part) for part in parts)  # [j, m] @ [keys, rows]


def _dz(a, da, sigma, valid, g_left, axis, st: _Static, tris):
    """(dz, g) of one tile: g = A dA, dz = g - sigma (g_left + g summed up to the key, inclusive),
    where g_left holds drem rem + the g of the keys left of the tile."""
    g = a * da
    if st.sum_terms == "fp16":  # the key's own term in fp32
        up_to = g + _key_sums(g, axis, keys="before", terms="fp16", tris=tris)
    else:
        up_to = _key_sums(g, axis, keys="up_to", terms=st.sum_terms, tris=tris)
    dz = g - sigma * (g_left + up_to)
    if valid is not None:
        dz = jnp.where(valid, dz, 0.0)
    return dz, g


TRI_KEYS = ("up_to", "before", "after")


def _triangles(block_k: int, st: _Static, k_major: bool) -> np.ndarray:
    """The 0/1 matrices of `_key_sums` [len(TRI_KEYS), block_k, block_k] ([m, j]: key m counts for
    key j; transposed for the k-major tiles, where they are the left operand), a kernel input:
    built in the kernel from iotas, Triton hoists them into registers and the dK/dV kernel
    spills; as loads they sit in shared memory."""
    return _triangle_constants(block_k, "float32" if st.sum_terms == "fp32" else "float16", k_major)


@functools.cache
def _triangle_constants(block_k: int, dtype: str, k_major: bool) -> np.ndarray:
    """NumPy, built once per shape: a constant of the trace, no per-call ops."""
    m, j = np.arange(block_k)[:, None], np.arange(block_k)[None, :]
    counts = {"up_to": m <= j, "before": m < j, "after": m > j}
    mats = np.stack([counts[name].T if k_major else counts[name] for name in TRI_KEYS]).astype(dtype)
    mats.setflags(write=False)  # shared by every call
    return mats


def _load_triangles(tri_ref):
    """`_key_sums`'s matrices by name (the unused loads are dropped)."""
    return {name: tri_ref[i] for i, name in enumerate(TRI_KEYS)}


def _barrier(st: _Static):
    """All threads of the program (bar.sync); the interpreter runs a program as one thread."""
    if not st.interpret:
        plgpu.debug_barrier()


# Key blocks the forward walks between its checks for spent sticks: fewer slow the walk where
# nothing is spent, more miss spent sticks (docs/design/stick_breaking.md, 'Spent sticks')
WALK_CHUNK = 8


def _row_walk(body, carry, row_block: int, block_k: int, *, leftwards: bool, between=None,
              stop=lambda carry: False, first=0, st: _Static | None = None, num_blocks=None, lo=None):
    """Walk the key blocks a query block sees (keys j < its last row) in order, leftwards from the
    diagonal or rightwards to it; the diagonal tiles evaluate the mask j < i, the others do not.
    `body(block, carry, masked)`. Leftwards, `between(full)` runs after the diagonal tiles and
    returns the number of blocks [0, full) to walk then (= full), and the walk ends early once
    `stop(carry)` (the rows' sticks are spent) or at block `lo` (segment ids: no row sees a key
    left of it): -> (carry, the number of blocks left unwalked). Rightwards it starts at block
    `first` (those left of it are spent). `st.shift` moves the diagonal: row r sees keys
    j < r + shift (Sq < Sk, attend_current); then the walk stays within the `num_blocks` key
    blocks (padded query rows lie past the keys)."""
    first_row = pl.program_id(0) * row_block
    shift = 0 if st is None else st.shift
    if shift:  # the rows' last visible key + 1 is their index + shift
        first_row = first_row + shift
        hi = jnp.minimum((first_row + row_block - 1 + block_k - 1) // block_k, num_blocks)
        full = jnp.minimum(first_row // block_k, hi)
    else:
        hi = (first_row + row_block - 1 + block_k - 1) // block_k  # blocks holding some j < last row
        full = first_row // block_k  # blocks with every j < first row
    masked = functools.partial(body, masked=True)
    unmasked = functools.partial(body, masked=False)
    if leftwards:
        carry = jax.lax.fori_loop(0, hi - full, lambda t, c: masked(hi - 1 - t, c), carry)
        if between is not None:
            full = between(full)
        bound = full if lo is None else full - lo  # the blocks to walk from full leftwards
        walking = lambda state: (state[0] < bound) & jnp.logical_not(stop(state[1]))

        def chunk(state):  # a pipelined loop (a while loop per block is not: a slower forward)
            walked, carry = state
            n = jnp.minimum(WALK_CHUNK, bound - walked)
            return walked + n, jax.lax.fori_loop(0, n, lambda t, c: unmasked(full - 1 - walked - t, c), carry)

        walked, carry = jax.lax.while_loop(walking, chunk, (jnp.int32(0), carry))
        return carry, full - walked
    carry = jax.lax.fori_loop(first, full, unmasked, carry)
    return jax.lax.fori_loop(full, hi, masked, carry)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, decay_ref, tri_ref, *refs, st: _Static, save_sums: bool, group: int):
    spec = st.spec
    tris = _load_triangles(tri_ref)
    q_info, kv_info, tables, refs = tiles.unpack(refs, spec)
    lo = None
    if spec.has_segments:  # the first key block a row of this block sees (read outside the loops)
        lo_ref, *refs = refs
        lo = lo_ref[pl.program_id(0)]
    rope = spec.rope is not None
    if rope:  # (the flags' input ref, aliased to the output ref used here)
        _, o_ref, rem_ref, *saved, q_rot_ref, k_rot_ref, flags_ref = refs
    else:
        o_ref, rem_ref, *saved = refs
    c_ref, spent_ref, *v_rows_ref = saved if save_sums else (None, None)
    block_q, head_dim = q_ref.shape
    block_k = st.blocks.block_k
    lam = decay_ref[pl.program_id(2)]
    q = tiles.load_parts(q_ref, (slice(None),), spec, head_dim)
    q_whole = []  # with RoPE, after the diagonal tiles: q rotated, read back whole (`after_diagonal`)
    if rope:
        q = tiles.rotate(q, tiles.rope_cos_sin(tables[0]), q_ref.dtype)
        tiles.store_parts(q_rot_ref, q, spec, head_dim)
        _barrier(st)
    rows = (pl.program_id(0) * block_q + jnp.arange(block_q))[:, None]
    if spec.offset:  # the queries' key positions
        rows = rows + spec.offset
    q_seg = q_info.get("seg")
    q_seg = None if q_seg is None else q_seg[:, None]
    # under GQA the kv head's first query head publishes (read outside the loops: the interpreter
    # has no program id inside them)
    publisher = pl.program_id(2) % group == 0 if group > 1 else None

    def keys(tile, block, masked):
        """(q, k) of a tile. With RoPE each key tile is rotated once per query head, not once per
        query block: the programs whose diagonal holds it rotate it (in feature parts), the kv
        head's first query head publishes it to k_rot (stores, barrier, flag: a split-K
        semaphore's release); the tiles left of the diagonal are read from k_rot whole, after
        `after_diagonal`."""
        if not rope:
            return q, (k_ref[tile, :],)
        if not masked:
            return tuple(q_whole), (k_rot_ref[tile, :],)
        # cos/sin rows loaded, not composed by `tiles.rope_cos_sin`'s angle addition: this code is
        # ALU-bound (docs/design/stick_breaking.md, 'RoPE')
        k = tiles.rotate(tiles.load_parts(k_ref, (tile,), spec, head_dim), tiles.rope_cos_sin(tables[1], tile), k_ref.dtype)

        def publish():
            tiles.store_parts(k_rot_ref, k, spec, head_dim, tile)
            _barrier(st)  # every thread's stores precede the flag
            _publish(flags_ref, block, st)

        if publisher is None:
            publish()
        else:  # the group's other query heads would store the same bytes
            pl.when(publisher)(publish)
        return q, k

    def after_diagonal(full):
        """q rotated, read back whole from q_rot for the products with shared key tiles (not
        before: the diagonal tiles hold q in feature parts, and holding both is costly;
        docs/design/stick_breaking.md, 'RoPE'). Then polls the flags until key blocks [0, full)
        are published, and one acquire read: its value (> 0) bounds the loop over them, so none
        of their loads is issued before it (nor an iteration early by Triton's software
        pipeliner). A program publishes before it waits, and those it waits for precede it in the
        launch order (query blocks vary fastest, query heads slowest: a kv head's first query head
        comes first). The interpreter runs the programs one after another: published."""
        q_whole.append(q_rot_ref[...])
        if st.interpret:
            return full
        needed = jnp.arange(flags_ref.shape[0]) < full
        poll = lambda *_: plgpu.load(flags_ref, volatile=True)
        pending = lambda flags: jnp.max(jnp.where(needed & (flags == 0), 1, 0)) > 0
        jax.lax.while_loop(pending, poll, poll())
        acquired = plgpu.atomic_add(flags_ref, (jnp.maximum(full - 1, 0),), jnp.int32(0))
        return jnp.where(acquired > 0, full, 0)

    def body(block, carry, masked):
        c, acc, *spent = carry
        if save_sums:  # the softplus sum right of this key block, for the backward
            c_ref[block, :] = c
            spent = [spent[0] + (c >= st.spent).astype(jnp.int32)]
        start = pl.multiple_of(block * block_k, block_k)
        tile = pl.ds(start, block_k)
        q_parts, k = keys(tile, block, masked)
        v = v_ref[tile, :]
        cols = (start + jnp.arange(block_k))[None, :]
        z = _logits(q_parts, k, spec, lam, rows, cols, st.fast)
        kv_seg = None if q_seg is None else kv_info.get("seg", tile)[None, :]
        valid = st.visible(rows, cols, q_seg, kv_seg, masked)
        sp, _, a = _stick(z, valid, c[:, None], 1, st, tris)
        acc = acc + tiles.dot(a.astype(v.dtype), v, spec)
        return c + sp.sum(axis=1), acc, *spent

    carry = (jnp.zeros((block_q,), jnp.float32), jnp.zeros((block_q, head_dim), jnp.float32))
    carry += (jnp.zeros((block_q,), jnp.int32),) * save_sums
    (c, acc, *spent), unwalked = _row_walk(body, carry, block_q, block_k, leftwards=True,
                                           between=after_diagonal if rope else None,
                                           stop=lambda carry: jnp.min(carry[0]) >= st.spent, st=st,
                                           num_blocks=k_ref.shape[0] // block_k, lo=lo)
    o_ref[...] = acc.astype(o_ref.dtype)
    rem_ref[...] = _exp(-c, st)  # (exactly 0 once spent, as the whole sum would give)
    if save_sums:  # the blocks left unwalked: spent for every row, their sums >= `spent` (A = 0)
        spent_ref[...] = spent[0] + unwalked
        _fill_blocks(c_ref, unwalked, c)
    if v_rows_ref:  # max |v| of the key rows at this block's positions (all programs: every key)
        v = v_ref[pl.ds(pl.multiple_of(pl.program_id(0) * block_q, block_q), block_q), :]
        v_rows_ref[0][...] = jnp.max(jnp.abs(v.astype(jnp.float32)), axis=1)


def _fill_blocks(ref, count, row):
    """ref[block, :] = row for the key blocks [0, count): the boundary sums of the blocks a walk
    skipped, which the dK/dV kernel may still read (its tiles there add exactly 0)."""

    def store(block, nothing):
        ref[block, :] = row
        return nothing

    jax.lax.fori_loop(0, count, store, None)


def _publish(flags_ref, index, st: _Static):
    """flags[index] = 1 by an atomic (release: after the stores of every thread, see `_barrier`)."""
    if st.interpret:  # (which cannot discharge atomics inside loops)
        flags_ref[index] = jnp.int32(1)
    else:
        plgpu.atomic_max(flags_ref, (index,), jnp.int32(1))


def _fwd_call(st: _Static, q, k, v, decay, table, seg=None, *, save_sums: bool):
    """-> out, rem, when save_sums the softplus sums at the key-block boundaries, per row the
    number of key blocks its stick is spent on (from key 0; int32 [B, H, Sq]) and, for 16-bit
    inputs, max |v| per (batch, kv head) (fp32 [B, Hkv], for the gradient units; else None) and,
    with RoPE, q and k rotated (the key tiles shared by the programs of a kv head, see `keys`).
    seg: the segment ids' inputs (`_segment_inputs`) or None."""
    batch, seq_pad, num_heads, head_dim = q.shape
    kv_pad = k.shape[1]
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    v_rows = save_sums and st.fast  # the Triton forward reports max |v| per key row
    if st.mosaic:
        outs = stick_breaking_mosaic.stick_breaking_forward(q, k, v, decay, st.spec, save_sums=save_sums,
                                                            spent=st.spent, attend_current=st.attend_current)
        if not save_sums:
            return outs
        v_max = jnp.abs(v).max(axis=(1, 3)).astype(jnp.float32) if v_rows else None  # (a read of v, XLA)
        return (*outs, v_max)
    v_xla = v_rows and kv_pad != seq_pad  # the query blocks do not cover every key row: max |v| by XLA
    v_rows = v_rows and not v_xla
    bq = st.blocks.block_q
    num_k_blocks = kv_pad // st.blocks.block_k
    q_info, kv_info, lo = (None, None, None) if seg is None else seg[:3]
    side_specs, side_args = tiles.side_specs_and_args((q_info, kv_info, table, table), bq, lambda i, b, h: i,
                                                      kv_pad, lambda *_: 0)
    if lo is not None:  # the first key block each query block sees
        side_specs.append(pl.BlockSpec((None, lo.shape[1]), lambda i, b, h: (b, 0)))
        side_args.append(lo)
    kv_spec = pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    sums_spec = pl.BlockSpec((None, None, num_k_blocks, bq), lambda i, b, h: (b, h, 0, i))
    q_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
    tris = _triangles(st.blocks.block_k, st, k_major=False)
    in_specs = [q_spec, kv_spec, kv_spec, pl.BlockSpec(decay.shape, lambda *_: (0,)),
                pl.BlockSpec(tris.shape, lambda *_: (0, 0, 0)), *side_specs]
    row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    out_specs = [q_spec, row_spec] + [sums_spec, row_spec] * save_sums + [row_spec] * v_rows
    rows = jax.ShapeDtypeStruct((batch, num_heads, seq_pad), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), rows]
    out_shape += [jax.ShapeDtypeStruct((batch, num_heads, num_k_blocks, seq_pad), jnp.float32),
                  jax.ShapeDtypeStruct((batch, num_heads, seq_pad), jnp.int32)] * save_sums + [rows] * v_rows
    args = [q, k, v, decay, tris, *side_args]
    aliases = {}
    if st.spec.rope is not None:  # + q, k rotated and the flags of the published key blocks
        flags = jnp.zeros((batch, num_kv_heads, num_k_blocks), jnp.int32)
        flags_spec = pl.BlockSpec((None, None, num_k_blocks), lambda i, b, h: (b, h // group, 0))
        aliases = {len(args): len(out_shape) + 2}
        args.append(flags)
        in_specs.append(flags_spec)
        out_specs += [q_spec, kv_spec, flags_spec]
        out_shape += [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                      jax.ShapeDtypeStruct(flags.shape, flags.dtype)]
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, st=st, save_sums=save_sums, group=group),
        grid=(seq_pad // bq, batch, num_heads),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=st.blocks.num_warps,
                                             num_stages=st.blocks.num_stages),
        interpret=st.interpret,
        name="stick_breaking_fwd",
    )(*args)
    out, rem, *rest = outs[:-1] if aliases else outs  # (without the flags)
    if not save_sums:
        return [out, rem, *rest]
    c_sums, spent, *rest = rest
    v_max = rest.pop(0).reshape(batch, num_kv_heads, group * seq_pad).max(axis=2) if v_rows else None
    if v_xla:
        v_max = jnp.abs(v).max(axis=(1, 3)).astype(jnp.float32)
    return [out, rem, c_sums, spent, v_max, *rest]


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def _dq_kernel(q_ref, k_ref, v_ref, decay_ref, v_max_ref, do_ref, g0_ref, c_ref, first_ref, tri_ref, *refs,
               st: _Static):
    """dQ and the per-row decay gradient; stores the g sums at every key-block boundary. The key
    blocks left of `first` (every row's stick spent) add exactly 0 and are not walked: their A are
    0, so are their g, and g0 = drem rem = 0; their g sums are g0 (read by dK/dV). For 16-bit
    inputs A, and so every g, dz and g sum, is in the program's gradient unit (`_gradient_unit`,
    from its rows' bounds, which it stores for the dK/dV kernel's unit); the g sums are stored
    scaled back."""
    spec = st.spec
    tris = _load_triangles(tri_ref)
    q_info, kv_info, tables, (dq_ref, ddecay_ref, g_ref, *bound_ref) = tiles.unpack(refs, spec)
    block_q, head_dim = q_ref.shape
    block_k = st.blocks.block_k
    lam = decay_ref[pl.program_id(2)]
    q = q_ref[...]  # q, k rotated already: the products take them whole, not in feature parts
    do = do_ref[...]
    g0 = g0_ref[...]
    shift, up, down = 0.0, 1.0, 1.0
    if st.fast:  # per row: |dA| <= D max|dO_i| max|v| and |g0_i|
        do_max = jnp.max(jnp.abs(do.astype(jnp.float32)), axis=1)
        bound = head_dim * do_max * v_max_ref[pl.program_id(2)] + jnp.abs(g0)
        bound_ref[0][...] = bound
        shift, up, down = _gradient_unit(jnp.max(bound))
    rows = (pl.program_id(0) * block_q + jnp.arange(block_q))[:, None]
    if spec.offset:  # the queries' key positions
        rows = rows + spec.offset
    q_seg = q_info.get("seg")
    q_seg = None if q_seg is None else q_seg[:, None]

    def body(block, carry, masked):
        g_left, ddecay, dq = carry
        g_ref[block, :] = g_left * up
        start = pl.multiple_of(block * block_k, block_k)
        tile = pl.ds(start, block_k)
        k = k_ref[tile, :]
        v = v_ref[tile, :]
        cols = (start + jnp.arange(block_k))[None, :]
        z = _logits((q,), (k,), spec, lam, rows, cols, st.fast)
        kv_seg = None if q_seg is None else kv_info.get("seg", tile)[None, :]
        valid = st.visible(rows, cols, q_seg, kv_seg, masked)
        _, sigma, a = _stick(z, valid, c_ref[block, :][:, None] + shift, 1, st, tris)  # A 2^-shift
        da = tiles.dot(do, v, spec, trans_b=True)
        dz, g = _dz(a, da, sigma, valid, g_left[:, None], 1, st, tris)
        ddecay = ddecay - jnp.sum(dz * (rows - cols).astype(jnp.float32), axis=1)
        dq = dq + tiles.dot(dz.astype(k_ref.dtype), k, spec)
        return g_left + g.sum(axis=1), ddecay, dq

    first = first_ref[pl.program_id(0)]
    _fill_blocks(g_ref, first, g0)
    carry = (g0 * down, jnp.zeros((block_q,), jnp.float32), jnp.zeros((block_q, head_dim), jnp.float32))
    _, ddecay, dq = _row_walk(body, carry, block_q, block_k, leftwards=False, first=first, st=st,
                              num_blocks=k_ref.shape[0] // block_k)
    tiles.store_rotated_back(dq_ref, dq * (spec.scale * up), spec, head_dim,
                        None if tables is None else tiles.rope_cos_sin(tables[0]))
    ddecay_ref[...] = ddecay * up


def _dkdv_kernel(q_ref, k_ref, v_ref, decay_ref, bound_ref, do_ref, c_ref, g_ref, bounds_ref, extras_ref, tri_ref,
                 *refs, st: _Static):
    """One program per (key block, batch, kv head); loops over the steps (query block, group head)
    whose rows see its keys: the diagonal's, then on up to the first step whose sticks are all
    spent left of this key block (its tile adds exactly 0), then only the steps past that one with
    a stick still unspent there, from a list (`_spent_bounds`). For 16-bit inputs A is in the kv
    head's gradient unit (from the bound of its rows in the dQ kernel), as are the dQ kernel's g
    sums once read; dk and dv are scaled back."""
    spec = st.spec
    tris = _load_triangles(tri_ref)
    q_info, kv_info, tables, (dk_ref, dv_ref) = tiles.unpack(refs, spec)
    block_k, head_dim = k_ref.shape
    group = q_ref.shape[1]
    block_q = st.blocks.block_q_dkv
    num_q_blocks = q_ref.shape[0] // block_q
    k = k_ref[...]  # q, k rotated already: the products take them whole, not in feature parts
    first_col = pl.program_id(0) * block_k
    first_head = pl.program_id(2) * group
    shift, up, down = _gradient_unit(bound_ref[first_head]) if st.fast else (0.0, 1.0, 1.0)
    v = v_ref[...]
    cols = (first_col + jnp.arange(block_k))[:, None]
    kv_seg = kv_info.get("seg")
    kv_seg = None if kv_seg is None else kv_seg[:, None]

    def body(step, carry, masked):
        dk, dv = carry
        i, g = step // group, step % group
        start = pl.multiple_of(i * block_q, block_q)
        tile = pl.ds(start, block_q)
        q = q_ref[tile, g, :]
        do = do_ref[tile, g, :]
        lam = decay_ref[first_head + g]
        rows = (start + jnp.arange(block_q))[None, :]
        if spec.offset:  # the queries' key positions
            rows = rows + spec.offset
        z = _logits((q,), (k,), spec, lam, rows, cols, st.fast, k_major=True)  # [block_k, block_q]
        # dA next to the logits' product, before the tile math: faster here, not in the dQ kernel
        # (docs/design/stick_breaking.md, 'Where the time goes when nothing is spent')
        da = tiles.dot(v, do, spec, trans_b=True)
        q_seg = None if kv_seg is None else q_info.get("seg", tile)[None, :]
        valid = st.visible(rows, cols, q_seg, kv_seg, masked)
        _, sigma, a = _stick(z, valid, c_ref[g, tile][None, :] + shift, 0, st, tris)  # A 2^-shift
        dz, _ = _dz(a, da, sigma, valid, g_ref[g, tile][None, :] * down, 0, st, tris)
        dv = dv + tiles.dot(a.astype(do.dtype), do, spec)
        dk = dk + tiles.dot(dz.astype(q_ref.dtype), q, spec)
        return dk, dv

    lo = _first_query_block(first_col, block_q, st.shift)
    full = jnp.minimum(_full_query_block(first_col, block_k, block_q, st.shift), num_q_blocks)
    near, num_extras = bounds_ref[0, pl.program_id(0)], bounds_ref[1, pl.program_id(0)]
    carry = (jnp.zeros((block_k, head_dim), jnp.float32),) * 2
    unmasked = functools.partial(body, masked=False)
    carry = jax.lax.fori_loop(lo * group, full * group, functools.partial(body, masked=True), carry)
    carry = jax.lax.fori_loop(full * group, near, unmasked, carry)
    dk, dv = jax.lax.fori_loop(0, num_extras, lambda t, c: unmasked(extras_ref[t], c), carry)
    tiles.store_rotated_back(dk_ref, dk * (spec.scale * up), spec, head_dim,
                        None if tables is None else tiles.rope_cos_sin(tables[1]))
    dv_ref[...] = (dv * up).astype(dv_ref.dtype)


def _first_query_block(first_col, block_q: int, shift: int):
    """The first query block of block_q rows with a row that sees the key `first_col` (row r sees
    the keys j < r + shift)."""
    if shift:
        return jnp.maximum(first_col + 1 - shift, 0) // block_q
    return (first_col + 1) // block_q  # first query block with a row > the first key


def _full_query_block(first_col, block_k: int, block_q: int, shift: int):
    """The first query block from which every row sees all keys of the key block from `first_col`."""
    if shift:
        return (jnp.maximum(first_col + block_k - shift, 0) + block_q - 1) // block_q
    return (first_col + block_k - 1) // block_q + 1  # from here every row > every key


def _spent_bounds(spent, block_q: int, block_q_dkv: int, group: int, block_k: int, *,
                  num_k_blocks: int | None = None, shift: int = 0):
    """From the rows' spent key blocks (the forward's, [B, H, S]; a row needs key block j iff
    spent <= j):
    - per dQ query block the first key block to walk (its rows' least), [B, H, query blocks];
    - per key block j the dK/dV walk over steps s = (query block of block_q_dkv rows) * group +
      (group head), past the diagonal's (from full_j * group on): bounds [B, Hkv, 2, key blocks]
      holds `near`, the first of those steps whose rows are all spent at j (the walk's
      contiguous part ends there; every step when none is), and the number of steps past it
      that still need j; extras [B, Hkv, key blocks, steps] lists those in order. The steps
      left out add exactly 0 (their A, g and g0 are 0). Where some rows never spend their
      sticks (0.2 % of them at the benchmark's decay) the list holds their few query blocks,
      not every query block up to the last of them.
    Last axes padded to powers of two (Triton). num_k_blocks: of the keys (None: as many keys as
    rows); shift: row r sees the keys j < r + shift (`_Static.shift`)."""
    batch, num_heads, seq_pad = spent.shape
    num_q_blocks = seq_pad // block_q_dkv
    num_k_blocks = seq_pad // block_k if num_k_blocks is None else num_k_blocks
    first = spent.reshape(batch, num_heads, seq_pad // block_q, block_q).min(axis=3)
    needs = spent.reshape(batch, num_heads // group, group, num_q_blocks, block_q_dkv).min(axis=4)
    needs = jnp.swapaxes(needs, 2, 3).reshape(batch, num_heads // group, 1, num_q_blocks * group)
    key_block = jnp.arange(num_k_blocks)[None, None, :, None]  # [1, 1, key blocks, 1] against steps
    full = jnp.minimum(_full_query_block(key_block * block_k, block_k, block_q_dkv, shift), num_q_blocks) * group
    near, count, extras = visit.block_lists(needs <= key_block, full, pow2_at_least(num_q_blocks * group),
                                            xp=jnp)
    bounds = jnp.stack([near, count], axis=2).astype(jnp.int32)
    return (padding.pad_axis(first, 2, pow2_at_least(first.shape[2])), padding.pad_axis(bounds, 3, pow2_at_least(num_k_blocks)),
            extras)


def _bwd_call(st: _Static, q, k, v, decay, table, do, g0, v_max, c_sums, spent, seg=None):
    """g0 [B, H, Sq] = drem * rem; v_max [B, Hkv]: max |v| (16-bit inputs; None for fp32, whose
    sums need no gradient units); c_sums, spent: the forward's softplus sums at key-block
    boundaries and the rows' spent key blocks. With RoPE q and k are rotated already (the
    forward's outputs); dQ and dK are rotated back. seg: the segment ids' inputs
    (`_segment_inputs`) or None: a row counts the key blocks left of its first visible key as
    spent (they add nothing to it), so that no walk visits them for it."""
    batch, seq_pad, num_heads, head_dim = q.shape
    kv_pad = k.shape[1]
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    blocks = st.blocks
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    dkdv_params = plgpu.CompilerParams(num_warps=blocks.num_warps,
                                       num_stages=blocks.num_stages_dkv or blocks.num_stages)
    bq, bk = blocks.block_q, blocks.block_k
    num_k_blocks = kv_pad // bk
    decay_spec = pl.BlockSpec(decay.shape, lambda *_: (0,))
    per_head = lambda x: padding.pad_axis(jnp.repeat(x, group, axis=1), 1, decay.shape[0], mode="edge")
    head_spec = pl.BlockSpec((None, decay.shape[0]), lambda _, b, h: (b, 0))  # [B, H (padded)] per program
    tris = [_triangles(bk, st, k_major) for k_major in (False, True)]
    tri_spec = pl.BlockSpec(tris[0].shape, lambda *_: (0, 0, 0))
    q_info, kv_info = (None, None) if seg is None else seg[:2]
    if seg is not None:
        spent = jnp.maximum(spent, seg[3][:, None, :])
    first, bounds, extras = _spent_bounds(spent, bq, blocks.block_q_dkv, group, bk, num_k_blocks=num_k_blocks,
                                          shift=st.shift)

    # dQ (+ the per-row decay gradient, + the g sums at each key-block boundary)
    q_block_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
    kv_full_spec = pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    boundary_spec = pl.BlockSpec((None, None, num_k_blocks, bq), lambda i, b, h: (b, h, 0, i))
    side = (q_info, kv_info, table, table)
    side_specs, side_args = tiles.side_specs_and_args(side, bq, lambda i, b, h: i, kv_pad, lambda *_: 0)
    boundary = jax.ShapeDtypeStruct((batch, num_heads, num_k_blocks, seq_pad), jnp.float32)
    rows = jax.ShapeDtypeStruct((batch, num_heads, seq_pad), jnp.float32)
    zeros = jnp.zeros((batch, num_kv_heads), jnp.float32)
    dq, ddecay, g_sums, *row_bounds = pl.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid=(seq_pad // bq, batch, num_heads),
        in_specs=[q_block_spec, kv_full_spec, kv_full_spec, decay_spec, head_spec, q_block_spec, row_spec,
                  boundary_spec, pl.BlockSpec((None, None, first.shape[2]), lambda i, b, h: (b, h, 0)),
                  tri_spec, *side_specs],
        out_specs=[q_block_spec, row_spec, boundary_spec] + [row_spec] * st.fast,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), rows, boundary] + [rows] * st.fast,
        compiler_params=params, interpret=st.interpret, name="stick_breaking_bwd_dq",
    )(q, k, v, decay, per_head(v_max if st.fast else zeros), do, g0, c_sums, first, tris[0], *side_args)
    # the dK/dV unit: from the bounds of every row of the kv head's group
    bound = row_bounds[0].reshape(batch, num_kv_heads, group * seq_pad).max(axis=2) if st.fast else zeros

    # dK/dV: query-side arrays viewed per kv head
    q_group_spec = pl.BlockSpec((None, seq_pad, None, group, head_dim), lambda j, b, h: (b, 0, h, 0, 0))
    boundary_group_spec = pl.BlockSpec((None, None, group, None, seq_pad), lambda j, b, h: (b, h, 0, j, 0))
    kv_block_spec = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0))
    side_specs, side_args = tiles.side_specs_and_args(side, seq_pad, lambda *_: 0, bk, lambda j, b, h: j)
    as_groups = lambda x: x.reshape(batch, seq_pad, num_kv_heads, group, head_dim)
    rows_as_groups = lambda x: x.reshape(batch, num_kv_heads, group, *x.shape[2:])
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st),
        grid=(num_k_blocks, batch, num_kv_heads),
        in_specs=[q_group_spec, kv_block_spec, kv_block_spec, decay_spec, head_spec, q_group_spec,
                  boundary_group_spec, boundary_group_spec,
                  pl.BlockSpec((None, None, *bounds.shape[2:]), lambda j, b, h: (b, h, 0, 0)),
                  pl.BlockSpec((None, None, None, extras.shape[3]), lambda j, b, h: (b, h, j, 0)),
                  tri_spec, *side_specs],
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=dkdv_params, interpret=st.interpret, name="stick_breaking_bwd_dkdv",
    )(as_groups(q), k, v, decay, per_head(bound), as_groups(do), rows_as_groups(c_sums), rows_as_groups(g_sums),
      bounds, extras, tris[1], *side_args)
    return dq, dk, dv, ddecay


# ----------------------------------------------------------------------------------------------
# custom_vjp wiring (on tile-padded arrays) and the entry point
# ----------------------------------------------------------------------------------------------


def _per_head(decay, num_heads: int):
    """decay () or [Hq] fp32 -> [Hq] padded to a power of two (the kernels' block of heads)."""
    return padding.pad_axis(jnp.broadcast_to(decay, (num_heads,)), 0, pow2_at_least(num_heads))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stick_breaking(st, q, k, v, decay, table, seg=None):
    out, rem, *_ = _fwd_call(st, q, k, v, _per_head(decay, q.shape[2]), table, seg, save_sums=False)
    return out, rem  # (_fwd_call returns q, k rotated too)


def _stick_breaking_fwd(st, q, k, v, decay, table, seg=None):
    out, rem, c_sums, spent, v_max, *rotated = _fwd_call(st, q, k, v, _per_head(decay, q.shape[2]), table, seg,
                                                         save_sums=True)
    q, k = rotated or (q, k)  # with RoPE the backward needs q, k only rotated
    return (out, rem), (q, k, v, decay, table, rem, c_sums, spent, v_max, seg)


# A program's gradient unit keeps its dA and dz below 2^(UNIT_BITS + 1) (`_gradient_unit`)
UNIT_BITS = 14


def _gradient_unit(bound):
    """(s, 2^s, 2^-s), fp32, for a bound >= 0 on a program's |dA| and |g0|: s >= 0 takes it below
    2^UNIT_BITS (0 where it is inf or NaN, which then propagate), from its exponent bits: exact
    powers of two, the same in XLA and in the kernels. For 16-bit inputs the backward kernels
    compute A 2^-s (their row sums c + s, no instruction more per score), and so g, dz and the g
    sums 2^-s, and scale dq, dk, dv, d decay (and the g sums the dQ kernel stores) back by 2^s.

    The in-tile g sums take their terms in fp16 on the tensor cores (`_key_sums`) and dz is
    rounded to the inputs' dtype for the dq, dk products: past 65504 they would be inf and the
    gradients NaN (fp16 loss scaling, say, multiplies dO by 2^15). With |g| <= |dA| <= D max|dO_i|
    max|v| and |dz| <= |g| + |g0_i| + max |dA| (sum A <= 1), s takes D max|dO_i| max|v| + |g0_i|
    below 2^UNIT_BITS over the rows i a program sees: a dQ program its block's, a dK/dV program its
    kv head's (from the bounds the dQ programs store; max |v| from the forward). Usually s = 0:
    bit for bit as without. fp32 inputs (fp32 sums) need none. Where s > 0, fp16 inputs' dv loses
    the A below 2^(s - 24) (the product takes A in fp16), as the cotangents' own range costs them."""
    biased = (jax.lax.bitcast_convert_type(bound.astype(jnp.float32), jnp.int32) >> 23) & 0xFF
    shift = jnp.where(biased == 255, 0, jnp.clip(biased - 126 - UNIT_BITS, 0, 100))  # bound < 2^(biased - 126)
    power = lambda e: jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)
    return shift.astype(jnp.float32), power(shift), power(-shift)


def _stick_breaking_bwd(st, residuals, cotangents):
    q, k, v, decay, table, rem, c_sums, spent, v_max, seg = residuals
    do, drem = cotangents
    dq, dk, dv, ddecay = _bwd_call(st, q, k, v, _per_head(decay, q.shape[2]), table, do.astype(q.dtype), drem * rem,
                                   v_max, c_sums, spent, seg)
    # per head, or for a decay all heads share over every head at once: a plain sum over the
    # heads after the compensated ones would round again
    ddecay = summation.sum_compensated(jnp.moveaxis(ddecay, 1, 0).reshape(decay.size, -1)).reshape(decay.shape)
    return dq, dk, dv, ddecay, None, None


_stick_breaking.defvjp(_stick_breaking_fwd, _stick_breaking_bwd)


def _segment_inputs(q_ids, kv_ids, seq_pad: int, kv_pad: int, blocks: StickBreakingBlockSizes):
    """The kernels' segment inputs: (q ids [B, 1, Sq padded], kv ids [B, 1, Sk padded] int32 (the
    side info of `tiles.unpack`), per forward query block the first key block one of its rows
    sees [B, query blocks padded to a power of two], per row that of its own [B, Sq padded]).
    Padded rows see no key block (their first is the number of key blocks); padded keys lie
    right of every real row."""
    num_k_blocks = kv_pad // blocks.block_k
    first = visit.first_visible_keys(q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32))
    first = first // blocks.block_k
    first = jnp.pad(first, ((0, 0), (0, seq_pad - first.shape[1])), constant_values=num_k_blocks)
    lo = first.reshape(first.shape[0], seq_pad // blocks.block_q, blocks.block_q).min(axis=2)
    lo = padding.pad_axis(lo, 1, pow2_at_least(lo.shape[1]))
    info = lambda ids, n: padding.pad_axis(ids.astype(jnp.int32), 1, n)[:, None, :]
    return info(q_ids, seq_pad), info(kv_ids, kv_pad), lo.astype(jnp.int32), first.astype(jnp.int32)


def stick_breaking_pallas(q, k, v, decay, spec: AttentionSpec, *, pos=None, kv_pos=None, q_ids=None, kv_ids=None,
                          attend_current: bool = False, blocks: StickBreakingBlockSizes | None = None,
                          interpret: bool | None = None, forward: str = "pallas_triton", skip_spent: bool = True):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (Sq <= Sk, spec.offset = Sk - Sq: query i at key
    position i + offset), decay () or [Hq] fp32 (validated) -> (out, rem [B, Hq, Sq]).

    pos [B, S] int32 RoPE positions when spec.rope (None: arange); with kv_pos (the keys' own) or
    Sq != Sk, q and k are rotated by XLA (`apply_rope`) and the kernels run without RoPE (their
    in-kernel rotation reads one table for q and k rows alike). q_ids [B, Sq], kv_ids [B, Sk]:
    segment ids (spec.has_segments). attend_current: keys j <= i. Pads D to a power of two and S
    to a tile multiple with zeros: padded keys sit right of every real row (never seen), padded
    rows are sliced off and, with zero cotangents, add exactly zero to dK/dV.
    `forward="mosaic_gpu"`: the forward on the Hopper kernel (`stick_breaking_mosaic`, which says
    what it serves), the backward here (its tiles then keep block_k = 64, the forward's key-block
    boundaries). `skip_spent=False` walks the tiles of spent sticks too (`_Static.spent`): the
    same results, bit for bit (the tests hold the skipping to that).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    batch, seq_len, _, head_dim = q.shape
    kv_len = k.shape[1]
    if forward not in ("pallas_triton", "mosaic_gpu"):
        raise ValueError(f"forward must be 'pallas_triton' or 'mosaic_gpu', got {forward!r}")
    if spec.offset != kv_len - seq_len or spec.has_segments != (q_ids is not None):
        raise ValueError(f"{spec.offset=} must be Sk - Sq ({kv_len} - {seq_len}) and {spec.has_segments=} must say "
                         f"whether segment ids are given")
    mosaic = forward == "mosaic_gpu"
    if mosaic and (reason := stick_breaking_mosaic.unsupported_reason(spec, head_dim, q.dtype)):
        raise NotImplementedError(f"implementation='mosaic' cannot serve this call: {reason}")
    if spec.rope is not None and (kv_pos is not None or spec.offset):  # rotated by XLA
        q_pos = pos
        if q_pos is None:
            q_pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32) + spec.offset, (batch, seq_len))
        q, k = apply_rope(q, q_pos, spec.rope), apply_rope(k, kv_pos, spec.rope)
        spec, pos = dataclasses.replace(spec, rope=None), None
    head_pad = padded_head_dim(spec, head_dim)
    if blocks is None:
        blocks = default_stick_breaking_block_sizes(head_pad, interpret, q.dtype)
    if mosaic:  # S is padded to the forward's tile instead of fitting the tiles to S
        if blocks.block_k != stick_breaking_mosaic.BLOCK:
            raise ValueError(f"the Mosaic GPU forward stores its sums per {stick_breaking_mosaic.BLOCK} keys: "
                             f"blocks.block_k must be {stick_breaking_mosaic.BLOCK}, got {blocks.block_k}")
        tile = max(blocks.block_q, blocks.block_q_dkv, 2 * stick_breaking_mosaic.BLOCK)
    else:
        blocks = blocks.fitted(seq_len, kv_len)
        tile = max(blocks.block_q, blocks.block_k, blocks.block_q_dkv)
    seq_pad = pl.cdiv(seq_len, tile) * tile
    kv_pad = pl.cdiv(kv_len, tile) * tile
    qp = padding.pad_axis(padding.pad_head_dim(q, spec, head_pad, True), 1, seq_pad)
    kp = padding.pad_axis(padding.pad_head_dim(k, spec, head_pad, True), 1, kv_pad)
    vp = padding.pad_axis(padding.pad_head_dim(v, spec, head_pad, False), 1, kv_pad)
    table = None if spec.rope is None else rope_tables(pos, spec.rope, head_dim, head_pad, seq_pad, batch)
    st = _Static(spec, blocks, interpret, jnp.dtype(q.dtype), mosaic=mosaic, skip=skip_spent,
                 attend_current=attend_current)
    seg = None if q_ids is None else _segment_inputs(q_ids, kv_ids, seq_pad, kv_pad, blocks)
    out, rem = _stick_breaking(st, qp, kp, vp, decay.astype(jnp.float32), table, seg)
    return out[:, :seq_len, :, :head_dim], rem[:, :, :seq_len]
