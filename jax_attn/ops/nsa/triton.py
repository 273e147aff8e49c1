"""NSA's selection attention as Pallas kernels (Triton lowering): forward, dQ, dK/dV.

Reads top to bottom: config, the token's key walk shared by the kernels, forward, backward, the
`custom_vjp` wiring and the entry point that lays the arrays out for the kernels.

Group-centric (Yuan et al. 2025, Sec. 3.4 "Kernel design"): the query heads of one kv head share
their selection, so they form the ROWS of a tile. A forward program takes (T query tokens, batch,
kv head); its rows are the T tokens x the group's heads, and it walks the union of its tokens'
key blocks (`plan.tile_union`, each block once, a bit per token saying who selected it), loading
each block of keys once at a dynamic start (`pl.ds`), with an online softmax in fp32 and the
membership, causal and segment element mask. The ranges form takes one token per program and
walks the key tiles of its disjoint ranges (`plan.disjoint_ranges`). A tile of fewer than 16 rows
(the smallest dot) is padded in registers: its rows are repeated to 16 (the same dot a
zero-padded tile costs, no copy of q in memory), and the copies are folded back before the store.

Visiting by blocks (`NSABlockSizes.visit`, the default at small groups): the forward takes the
dK/dV kernel's plan below instead, one program per (key block, chunk of the tokens that chose it),
gathering several tokens' group rows a step; it writes every (token, block) pair's normalised
output and lse, which XLA merges per token.

Backward (FlashAttention-2 Alg. 2, recomputing P from the saved row max and 1 / row sum):
- dQ: the forward's tiles and walk; visiting by blocks, every pair's dS^T K written by the dK/dV
  kernel, summed per token.
- dK/dV, lists: the TRANSPOSE plan (`plan.transpose_plan`: for every key block the query tokens
  that selected it, from a stable sort of (block, token) pairs in XLA), cut into work items of at
  most `chunk_dkdv` tokens of one block (block 0, which every token selects, would otherwise be
  one program walking the whole sequence). One program per item loads its key block once and
  walks its tokens, gathering each token's group rows (or several tokens' rows into one tile),
  and writes a partial dK/dV; a second kernel sums every block's partials in item order. No
  atomics: deterministic.
- dK/dV, ranges: one program per (key tile, batch, kv head) walks the query tokens that can see
  it (causal: from the tile on) and skips, on a scalar test, the tokens none of whose ranges meet
  the tile (O(S) scalar work per tile: the ranges form serves the original project's calls, the
  block lists the NSA hot path).
Design: docs/design/nsa.md.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attn_spec import nsa as nsa_spec
from attn_spec.tiles import MIN_BLOCK, check_launch_fields, pow2_at_least
from jax_attn.ops.common import padding
from jax_attn.ops.common.spec import LOG2E
from jax_attn.ops.nsa import plan

warnings.filterwarnings(
    "ignore", message=r"The Pallas Triton backend is deprecated and will be removed in a future JAX version",
    category=DeprecationWarning)


MAX_TOKENS = 16  # tokens of a forward / dQ tile: one bit each in the union's int32 masks
SCAN_ROWS = 64  # rows of a ranges tile scanning its tokens' key tiles (GPU)
DKDV_ROWS = 64  # rows of a block-list dK/dV step gathering its tokens' group rows (GPU default)
RANGES_DKDV_PROGRAMS = 256  # the ranges dK/dV splits its token walk until about this many programs
BLOCKS_VISIT_GROUP = 4  # groups up to this many query heads visit the pairs by blocks by default


@dataclasses.dataclass(frozen=True)
class NSABlockSizes:
    """Tiles and launch parameters of the selection kernels.

    tokens / tokens_dq: query tokens per forward / dQ program, at most 16: the tile's rows are
    these tokens x the group's heads and the program walks the union of their blocks once, so
    neighbours that share blocks share their loads (None: the group decides, tiles of 16 rows:
    tokens whose blocks differ make a wider union cost more than a fuller dot gains). Ranges:
    T > 1 tokens scan the key tiles from their lowest start to their highest end, skipping those
    no range meets; one token walks only its own ranges (None: the group decides, about 64 rows
    on a GPU, up to `RANGES_SCAN_KEYS` tokens, one token beyond). block_k_ranges: the key tile
    of the ranges form (the block lists walk blocks of `block_size`). The backward kernels launch
    with num_warps_bwd, num_stages_bwd. dK/dV of the block lists: a program takes at most
    chunk_dkdv of a block's tokens (a block every token selects, block 0, becomes many programs:
    no program walks the whole sequence), tokens_dkdv of them per step (> 1: their group rows
    gathered into one tile, tokens_dkdv * G >= 16 rows; 1: one token's rows per step, repeated to
    16 rows when the group is smaller; None: the group decides, about 64 rows). dK/dV of ranges:
    steps of tokens_dkdv consecutive tokens (1 or None: the group decides), at least 16 rows.
    Powers of two. visit: how the forward and dQ of block lists meet the (token, block) pairs:
    "tokens" (a program per tile of tokens walks their blocks, the softmax online in registers)
    or "blocks" (the dK/dV plan: a program per work item walks the tokens that chose its block,
    tokens_dkdv x G >= 16 rows a dot; the forward writes each pair's normalised output and lse in
    fp32, combined per token after, and the dK/dV kernel writes each pair's dQ, summed per token:
    no tile is padded at a small group, for n partials a row in memory); None: the group decides
    ("blocks" up to `BLOCKS_VISIT_GROUP` query heads a kv head)."""

    tokens: int | None = None
    tokens_dq: int | None = None
    block_k_ranges: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2
    tokens_dkdv: int | None = None
    chunk_dkdv: int = 512
    visit: str | None = None

    def __post_init__(self):
        check_launch_fields(self, choices=("visit",))
        if self.visit not in (None, "tokens", "blocks"):
            raise ValueError(f'NSABlockSizes.visit={self.visit!r} must be None, "tokens" or "blocks"')
        for name, most in (("tokens", MAX_TOKENS), ("tokens_dq", MAX_TOKENS), ("tokens_dkdv", None),
                           ("chunk_dkdv", None)):
            value = getattr(self, name)
            if value is None and name != "chunk_dkdv":  # chosen by the group size
                continue
            if value < 1 or value & (value - 1) or (most is not None and value > most):
                limit = f" and <= {most}" if most is not None else ""
                raise ValueError(f"NSABlockSizes.{name}={value} must be a power of two >= 1{limit}")


def default_block_sizes(head_dim: int, interpret: bool, dtype=jnp.bfloat16) -> NSABlockSizes:
    """Interpret mode: small tiles (short CPU runs). GPU: tokens per program by the group
    (`tokens_for_group`); 4 warps for tiles of 16 to 64 rows; dK/dV in items of 512 tokens, bf16
    and fp16 up to head dim 128 gathering about 64 rows per step (fp32 and wider heads one token's
    rows: a gathered tile of 64 fp32 rows was never measured)."""
    if interpret:
        return NSABlockSizes(None, None, 16, 4, 1, 4, 1, 1, 8)
    if jnp.dtype(dtype) == jnp.float32 or head_dim > 128:
        return NSABlockSizes(None, None, 64, 4, 1, 4, 1, 1, 512)
    return NSABlockSizes(None, None, 64, 4, 2, 4, 2, None, 512)


def tokens_for_group(group: int, rows: int, most: int | None = MAX_TOKENS) -> int:
    """Tokens of a tile of about `rows` rows (tokens x the padded group) when the config leaves
    them open: at least one, at most `most`."""
    return max(1, min(most or rows, rows // group))


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one laid-out call."""

    scale: float
    causal: bool
    has_segments: bool
    precision: jax.lax.Precision
    seq_len: int  # real length (arrays padded to `length`)
    length: int
    block_size: int  # lists: the selection block; ranges: the key tile
    ranges: bool
    group: int  # padded group (a power of two)
    blocks: NSABlockSizes
    interpret: bool

    @property
    def rows(self) -> int:
        """Rows of a tile: the padded group, at least the smallest dot."""
        return max(MIN_BLOCK, self.group)

    @property
    def by_blocks(self) -> bool:
        """Do the forward and dQ visit the pairs by key blocks (`NSABlockSizes.visit`)?"""
        return not self.ranges and self.blocks.visit == "blocks"


def _dot(a, b, st, *, trans_b=False):
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=st.precision, preferred_element_type=jnp.float32)


def _spread(x, rows: int):
    """A tile's real rows [R0, ...] -> [rows, ...], repeated (row r holds real row r % R0): the
    rows a dot needs (16) when there are fewer."""
    copies = rows // x.shape[0]
    if copies == 1:
        return x
    return jnp.broadcast_to(x[None], (copies, *x.shape)).reshape(rows, *x.shape[1:])


def _fold(x, real: int):
    """The inverse of `_spread` on rows that hold equal copies: [rows, ...] -> [real, ...]."""
    copies = x.shape[0] // real
    if copies == 1:
        return x
    return x.reshape(copies, real, *x.shape[1:]).max(axis=0)


def _mask(st, pos, cols, q_seg, kv_seg, lo=None, hi=None):
    """Keys `cols` a query at `pos` sees: inside the sequence, causal, in its segment, in [lo, hi)
    (operands broadcast: [rows, 1] against [1, keys], or the transpose)."""
    mask = cols < st.seq_len
    if st.causal:
        mask &= cols <= pos
    if st.has_segments:
        mask &= kv_seg == q_seg
    if lo is not None:
        mask &= (cols >= lo) & (cols < hi)
    return mask


class _Tile:
    """The rows of a forward / dQ program: its T tokens x the padded group (row r = token
    r // G, head r % G), repeated to at least 16 rows."""

    def __init__(self, st, tokens: int, seg_ref):
        self.real = tokens * st.group
        self.rows = max(MIN_BLOCK, self.real)
        self.tokens = tokens
        base = pl.program_id(0) * tokens
        token = jnp.arange(self.rows) % self.real // st.group
        self.token = token  # the row's token within the program (its bit in the union's masks)
        self.pos = (base + token)[:, None]
        self.q_seg = None
        if st.has_segments:
            self.q_seg = _spread(jnp.broadcast_to(seg_ref[pl.ds(base, tokens)][:, None], (tokens, st.group))
                                 .reshape(self.real), self.rows)[:, None]

    def load(self, ref):
        """A [T, G, ...] block -> the tile's [rows, ...]."""
        x = ref[...]
        return _spread(x.reshape(self.real, *x.shape[2:]), self.rows)

    def store(self, ref, x):
        """The tile's [rows, ...] -> a [T, G, ...] block (copies folded)."""
        x = _fold(x, self.real)
        ref[...] = x.reshape(ref.shape).astype(ref.dtype)


def _range_bounds(ranges_ref, tokens):
    """[(start, end)] of each range slot of `tokens` (a slice of the ref's rows: vectors)."""
    return [(ranges_ref[tokens, r, 0], ranges_ref[tokens, r, 1]) for r in range(ranges_ref.shape[1])]


def _inside(cols, bounds):
    """Keys `cols` inside some range of `bounds` (operands broadcast against cols)."""
    return functools.reduce(jnp.logical_or, [(cols >= lo) & (cols < hi) for lo, hi in bounds])


def _meets_any(bounds, start, width):
    """Does some non-empty range of `bounds` (vectors) overlap the keys [start, start + width)?"""
    meets = [(lo < start + width) & (hi > start) & (hi > lo) for lo, hi in bounds]
    return functools.reduce(jnp.logical_or, meets).astype(jnp.int32).max() > 0


def _walk(st, tile, sel, body, carry):
    """Run `body(start, extra_mask, carry)` over the key blocks of the program's tokens.
    Lists: the union of its tokens' canonical blocks (`plan.tile_union`), each once, with the
    rows of the tokens that selected it (extra_mask [rows, 1]). Ranges, one token a program: the
    key tiles of each disjoint range, masked to it (extra_mask [1, width]); T tokens: the key
    tiles from their lowest start to their highest end, skipping those no range meets, each
    masked to the ranges of every row's token (extra_mask [rows, width])."""
    width = st.block_size
    if not st.ranges:
        union_ref, member_ref, count_ref = sel

        def block(u, c):
            mine = (jnp.right_shift(member_ref[u], tile.token) & 1) == 1
            return body(pl.multiple_of(union_ref[u] * width, width), mine[:, None], c)

        return jax.lax.fori_loop(0, count_ref[pl.program_id(0)], block, carry)
    (ranges_ref,) = sel
    if tile.tokens > 1:
        return _walk_ranges_tokens(st, tile, ranges_ref, body, carry)

    def one_range(r, c):
        lo, hi = ranges_ref[0, r, 0], ranges_ref[0, r, 1]
        first = lo // width
        last = jnp.where(hi > lo, (hi + width - 1) // width, first)  # an empty range walks nothing

        def key_tile(j, c2):
            start = pl.multiple_of(j * width, width)
            cols = start + jnp.arange(width)
            return body(start, ((cols >= lo) & (cols < hi))[None, :], c2)

        return jax.lax.fori_loop(first, last, key_tile, c)

    return jax.lax.fori_loop(0, ranges_ref.shape[1], one_range, carry)


def _walk_ranges_tokens(st, tile, ranges_ref, body, carry):
    """`_walk` of a program of T > 1 tokens over their ranges (ranges_ref [T, R, 2])."""
    width = st.block_size
    bounds = _range_bounds(ranges_ref, slice(None))  # [T] vectors
    rows_of = lambda x: _spread(jnp.broadcast_to(x[:, None], (tile.tokens, st.group)).reshape(tile.real),
                                tile.rows)[:, None]
    row_bounds = [(rows_of(lo), rows_of(hi)) for lo, hi in bounds]  # [rows, 1]: each row's token's
    first = functools.reduce(jnp.minimum, [jnp.where(hi > lo, lo, st.length).min() for lo, hi in bounds])
    last = functools.reduce(jnp.maximum, [jnp.where(hi > lo, hi, 0).max() for lo, hi in bounds])

    def key_tile(j, c):
        start = pl.multiple_of(j * width, width)
        visit = lambda c2: body(start, _inside((start + jnp.arange(width))[None, :], row_bounds), c2)
        return jax.lax.cond(_meets_any(bounds, start, width), visit, lambda c2: c2, c)

    # no range at all: first = length > last = 0, an empty walk
    return jax.lax.fori_loop(first // width, (last + width - 1) // width, key_tile, carry)


def _split_refs(refs, st):
    """(selection refs, segment ids ref or None, the rest) of a forward / dQ kernel's trailing refs."""
    refs = list(refs)
    sel = [refs.pop(0)] if st.ranges else [refs.pop(0), refs.pop(0), refs.pop(0)]
    seg = refs.pop(0) if st.has_segments else None
    return sel, seg, refs


def _tile_mask(st, tile, start, extra, seg_ref):
    cols = (start + jnp.arange(st.block_size))[None, :]
    kv_seg = seg_ref[pl.ds(start, st.block_size)][None, :] if st.has_segments else None
    return _mask(st, tile.pos, cols, tile.q_seg, kv_seg) & extra


# ----------------------------------------------------------------------------------------------
# Forward: one program per (T query tokens, batch, kv head); the tile's rows are the tokens x the
# group's heads, and the walk visits every block some token selected once (FA2 Alg. 1 on a block
# list, online softmax; rows whose token did not select a block are masked there).
# ----------------------------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, st: _Static):
    sel, seg_ref, (o_ref, m2_ref, inv_l_ref, lse_ref) = _split_refs(refs, st)
    tile = _Tile(st, q_ref.shape[0], seg_ref)
    head_dim = q_ref.shape[-1]
    q = tile.load(q_ref)  # [rows, D]

    def body(start, extra, carry):
        m, l, acc = carry
        keys = pl.ds(start, st.block_size)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s = _dot(q, k, st, trans_b=True) * (st.scale * LOG2E)
        s = jnp.where(_tile_mask(st, tile, start, extra, seg_ref), s, -jnp.inf)
        # online softmax update; a row that has seen only masked keys keeps m = -inf and its
        # exponent uses 0 instead, so its p are exp2(-inf) = 0, never NaN
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, st)
        return m_new, l, acc

    carry = (jnp.full((tile.rows,), -jnp.inf, jnp.float32), jnp.zeros((tile.rows,), jnp.float32),
             jnp.zeros((tile.rows, head_dim), jnp.float32))
    m, l, acc = _walk(st, tile, sel, body, carry)
    empty = l == 0.0  # nothing visible: output 0, lse -inf
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    tile.store(o_ref, acc * inv_l[:, None])
    # for the backward: P = exp2(s2 - m2) * inv_l (m2 = +inf on empty rows: P = 0)
    tile.store(m2_ref, jnp.where(empty, jnp.inf, m))
    tile.store(inv_l_ref, inv_l)
    tile.store(lse_ref, jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) / LOG2E))


def _sel_args(st, sel, tokens):
    """(BlockSpecs, arrays) of the selection for a grid (token tile i, batch b, kv head h): the
    union of the tile's blocks (lists) or its token's ranges."""
    if st.ranges:
        r = sel[0].shape[3]
        return [pl.BlockSpec((None, tokens, None, r, 2), lambda i, b, h: (b, i, h, 0, 0))], list(sel)
    union, member, counts = plan.tile_union(sel[0], tokens)
    size, programs = union.shape[3], union.shape[1]
    list_spec = pl.BlockSpec((None, None, None, size), lambda i, b, h: (b, i, h, 0))
    return [list_spec, list_spec, pl.BlockSpec((None, None, programs), lambda i, b, h: (b, h, 0))], \
        [union, member, counts]


def _seg_specs(st, seg):
    if seg is None:
        return [], []
    return [pl.BlockSpec((None, st.length), lambda *g: (g[1], 0))], [seg]


def _fwd_call(st: _Static, q, k, v, sel, seg):
    """q [B, L, Hkv, G, D] -> out (same), m2, inv_l, lse [B, Hkv, L, G] fp32."""
    batch, length, kv_heads, group, head_dim = q.shape
    tokens = st.blocks.tokens
    seg_specs, seg_args = _seg_specs(st, seg)
    sel_specs, sel_args = _sel_args(st, sel, tokens)
    q_spec = pl.BlockSpec((None, tokens, None, group, head_dim), lambda i, b, h: (b, i, h, 0, 0))
    kv_spec = pl.BlockSpec((None, length, None, head_dim), lambda i, b, h: (b, 0, h, 0))
    stat_spec = pl.BlockSpec((None, None, tokens, group), lambda i, b, h: (b, h, i, 0))
    stat_shape = jax.ShapeDtypeStruct((batch, kv_heads, length, group), jnp.float32)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, st=st),
        grid=(length // tokens, batch, kv_heads),  # tokens fastest: neighbours share K/V in L2
        in_specs=[q_spec, kv_spec, kv_spec, *sel_specs, *seg_specs],
        out_specs=[q_spec, stat_spec, stat_spec, stat_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), stat_shape, stat_shape, stat_shape],
        compiler_params=plgpu.CompilerParams(num_warps=st.blocks.num_warps, num_stages=st.blocks.num_stages),
        interpret=st.interpret, name="nsa_selection_fwd",
    )(q, k, v, *sel_args, *seg_args)


def _places(first, size: int):
    """pl.ds(first, size) in the default int (the interpreter's masked store indexes the other axes
    with it, and needs one integer type under x64)."""
    return pl.ds(first.astype(jax.dtypes.canonicalize_dtype(jnp.int64)), size)


def _fwd_blocks_kernel(item_block_ref, item_lo_ref, item_hi_ref, tokens_ref, q_ref, k_ref, v_ref, *refs,
                       st: _Static):
    """Visiting by blocks: one program per (work item, batch, kv head), the dK/dV plan's items; a
    step gathers T tokens' group rows (T x G >= 16) and attends to the item's block alone, writing
    each pair's normalised output and log2-sum-exp (fp32, -inf where the block shows the token
    nothing) at the pair's place in the plan."""
    seg_ref = refs[0] if st.has_segments else None
    o_ref, lse_ref = refs[-2:]
    width, head_dim = st.block_size, q_ref.shape[-1]
    w = pl.program_id(0)
    start = pl.multiple_of(item_block_ref[w] * width, width)
    k, v = k_ref[pl.ds(start, width), :], v_ref[pl.ds(start, width), :]
    cols = (start + jnp.arange(width))[None, :]
    kv_seg = seg_ref[pl.ds(start, width)][None, :] if st.has_segments else None
    lo, hi = item_lo_ref[w], item_hi_ref[w]
    step_tokens = st.blocks.tokens_dkdv
    rows = step_tokens * st.group
    spread = lambda x: jnp.broadcast_to(x[:, None], (step_tokens, st.group)).reshape(rows)

    def step(i, _):
        first = lo + i * step_tokens
        tok = tokens_ref[pl.ds(first, step_tokens)]  # the list is padded: never read past its end
        q = q_ref[tok].reshape(rows, head_dim)
        q_seg = spread(seg_ref[tok])[:, None] if st.has_segments else None
        s = _dot(q, k, st, trans_b=True) * (st.scale * LOG2E)
        s = jnp.where(_mask(st, spread(tok)[:, None], cols, q_seg, kv_seg), s, -jnp.inf)
        m = s.max(axis=1)
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # a row that sees nothing: p = 0, never NaN
        p = jnp.exp2(s - m_safe[:, None])
        l = p.sum(axis=1)
        empty = l == 0.0
        o = _dot(p.astype(v.dtype), v, st) * jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))[:, None]
        lse2 = jnp.where(empty, -jnp.inf, m_safe + jnp.log2(jnp.where(empty, 1.0, l)))
        live = first + jnp.arange(step_tokens) < hi
        places = _places(first, step_tokens)
        plgpu.store(o_ref.at[places], o.reshape(step_tokens, st.group, head_dim), mask=live[:, None, None])
        plgpu.store(lse_ref.at[places], lse2.reshape(step_tokens, st.group), mask=live[:, None])
        return _

    jax.lax.fori_loop(0, (hi - lo + step_tokens - 1) // step_tokens, step, 0)


@jax.tree_util.register_pytree_node_class
class _PairPlan:
    """The transpose plan cut into work items (shared by the block-visiting forward and dK/dV):
    the tokens of every key block (padded by a step so no step reads past the end), each pair's
    place in them, and the items' block, token bounds, first item and item count per block. A
    pytree: the block-visiting forward saves it for the backward."""

    _ARRAYS = ("tokens", "places", "item_block", "item_lo", "item_hi", "item_first", "item_count", "valid")

    def tree_flatten(self):
        return tuple(getattr(self, name) for name in self._ARRAYS), (self.num_blocks, self.num_items)

    @classmethod
    def tree_unflatten(cls, sizes, arrays):
        plan_ = object.__new__(cls)
        plan_.num_blocks, plan_.num_items = sizes
        for name, x in zip(cls._ARRAYS, arrays):
            setattr(plan_, name, x)
        return plan_

    def __init__(self, st: _Static, blocks):
        self.num_blocks = st.length // st.block_size
        tokens, offsets, self.places = plan.transpose_plan(blocks[:, :st.seq_len], self.num_blocks)
        self.tokens = padding.pad_axis(tokens, 2, tokens.shape[2] + st.blocks.tokens_dkdv)
        self.num_items = self.num_blocks + pl.cdiv(self.tokens.shape[2], st.blocks.chunk_dkdv)
        (self.item_block, self.item_lo, self.item_hi, self.item_first,
         self.item_count) = _work_items(offsets, self.num_blocks, st.blocks.chunk_dkdv, self.num_items)
        self.valid = blocks[:, :st.seq_len] >= 0  # [B, S, Hkv, n]

    def specs(self):
        """BlockSpecs of (item block, item lo, item hi, tokens) for a grid (item, batch, kv head)."""
        item_spec = pl.BlockSpec((None, None, self.num_items), lambda w, b, h: (b, h, 0))
        return [item_spec, item_spec, item_spec,
                pl.BlockSpec((None, None, self.tokens.shape[2]), lambda w, b, h: (b, h, 0))]

    def args(self):
        return [self.item_block, self.item_lo, self.item_hi, self.tokens]

    def by_token(self, x, st: _Static, fill):
        """Per-pair values in the plan's order [B, Hkv, P, G, ...] -> [B, L, Hkv, n, G, ...] by token
        and slot (`fill` where the slot holds no block, and on the padded tokens)."""
        batch, heads, _, *rest = x.shape
        n = self.valid.shape[3]
        idx = self.places.reshape(batch, heads, -1, *([1] * len(rest)))
        x = jnp.take_along_axis(x, idx, axis=2).reshape(batch, heads, st.seq_len, n, *rest)
        valid = self.valid.transpose(0, 2, 1, 3).reshape(batch, heads, st.seq_len, n, *([1] * len(rest)))
        x = jnp.moveaxis(jnp.where(valid, x, fill), 1, 2)
        return jnp.pad(x, [(0, 0), (0, st.length - st.seq_len)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)


def _fwd_blocks_call(st: _Static, q, k, v, pairs: _PairPlan, seg):
    """`_fwd_call` visiting by blocks: the pairs' partials, then per row their combination (the
    split-softmax merge: weights exp2(lse_i - max), in a fixed order)."""
    batch, length, kv_heads, group, head_dim = q.shape
    seg_specs, seg_args = _seg_specs(st, seg)
    width = pairs.tokens.shape[2]
    q_all = pl.BlockSpec((None, length, None, group, head_dim), lambda w, b, h: (b, 0, h, 0, 0))
    kv_all = pl.BlockSpec((None, length, None, head_dim), lambda w, b, h: (b, 0, h, 0))
    o_spec = pl.BlockSpec((None, None, width, group, head_dim), lambda w, b, h: (b, h, 0, 0, 0))
    lse_spec = pl.BlockSpec((None, None, width, group), lambda w, b, h: (b, h, 0, 0))
    o_part, lse_part = pl.pallas_call(
        functools.partial(_fwd_blocks_kernel, st=st),
        grid=(pairs.num_items, batch, kv_heads),
        in_specs=[*pairs.specs(), q_all, kv_all, kv_all, *seg_specs],
        out_specs=[o_spec, lse_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, width, group, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((batch, kv_heads, width, group), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=st.blocks.num_warps, num_stages=st.blocks.num_stages),
        interpret=st.interpret, name="nsa_selection_fwd_blocks",
    )(*pairs.args(), q, k, v, *seg_args)
    lse_pairs = pairs.by_token(lse_part, st, -jnp.inf)  # [B, L, Hkv, n, G]
    top = lse_pairs.max(axis=3)
    empty = top == -jnp.inf
    weight = jnp.exp2(lse_pairs - jnp.where(empty, 0.0, top)[:, :, :, None])
    total = weight.sum(axis=3)
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
    out = (weight[..., None] * pairs.by_token(o_part, st, 0.0)).sum(axis=3) * inv_l[..., None]  # no TF32 dot
    lse2 = jnp.where(empty, -jnp.inf, top + jnp.log2(jnp.where(empty, 1.0, total)))
    stat = lambda x: x.transpose(0, 2, 1, 3)  # [B, L, Hkv, G] -> [B, Hkv, L, G]
    # the backward's P = exp2(s2 - m2) * inv_l with m2 the row's whole log2-sum-exp (+inf: empty)
    return (out.astype(q.dtype), stat(jnp.where(empty, jnp.inf, lse2)), stat(jnp.where(empty, 0.0, 1.0)),
            stat(lse2 / LOG2E))


# ----------------------------------------------------------------------------------------------
# Backward. delta = rowsum(dO * O) - dlse (FA2 Alg. 2 line 4; minus dlse makes lse differentiable).
# ----------------------------------------------------------------------------------------------


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, m2_ref, inv_l_ref, delta_ref, *refs, st: _Static):
    """One program per (T query tokens, batch, kv head): the forward's walk, accumulating dQ."""
    sel, seg_ref, (dq_ref,) = _split_refs(refs, st)
    tile = _Tile(st, q_ref.shape[0], seg_ref)
    q, do = tile.load(q_ref), tile.load(do_ref)
    m2, inv_l, delta = (tile.load(r)[:, None] for r in (m2_ref, inv_l_ref, delta_ref))

    def body(start, extra, dq):
        keys = pl.ds(start, st.block_size)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s = _dot(q, k, st, trans_b=True) * (st.scale * LOG2E)
        p = jnp.where(_tile_mask(st, tile, start, extra, seg_ref), jnp.exp2(s - m2) * inv_l, 0.0)
        ds = p * (_dot(do, v, st, trans_b=True) - delta)
        return dq + _dot(ds.astype(k.dtype), k, st)

    dq = _walk(st, tile, sel, body, jnp.zeros((tile.rows, q_ref.shape[-1]), jnp.float32))
    tile.store(dq_ref, dq * st.scale)


def _add_tile(acc, part, exact: bool):
    """acc + part, a dot's tile. exact (fp32 inputs): part gets a zero that Triton's dot-add folding
    cannot see as one (acc * 0), so the tile's products are summed from zero and meet acc in one
    rounding; folded, the GPU's fp32 dot adds each product to acc in turn, an FMA chain as long as
    the rows visited (docs/design/nsa.md)."""
    return acc + (part + acc * 0.0) if exact else acc + part


def _dkdv_tile(st, k, v, q, do, m2, inv_l, delta, mask, carry, take_ds=None):
    """One (key tile, query token) step of dK/dV: s = k q^T [keys, rows]; rows beyond the group
    (repeated copies) carry inv_l = 0, so P = 0 there. take_ds(ds) receives the step's dS (for the
    pairs' dQ)."""
    dk, dv = carry
    s = _dot(k, q, st, trans_b=True) * (st.scale * LOG2E)
    p = jnp.where(mask, jnp.exp2(s - m2[None, :]) * inv_l[None, :], 0.0)
    exact = q.dtype == jnp.float32
    dv = _add_tile(dv, _dot(p.astype(do.dtype), do, st), exact)
    dp = _dot(v, do, st, trans_b=True)
    ds = p * (dp - delta[None, :])
    if take_ds is not None:
        take_ds(ds)
    return _add_tile(dk, _dot(ds.astype(q.dtype), q, st), exact), dv


def _token_rows(st, t, q_ref, do_ref, m2_ref, inv_l_ref, delta_ref):
    """Token t's group rows spread to the tile (the copies zeroed through inv_l)."""
    q, do = _spread(q_ref[t], st.rows), _spread(do_ref[t], st.rows)
    m2, inv_l, delta = (_spread(r[t], st.rows) for r in (m2_ref, inv_l_ref, delta_ref))
    if st.rows != st.group:
        inv_l = jnp.where(jnp.arange(st.rows) < st.group, inv_l, 0.0)
    return q, do, m2, inv_l, delta


def _dkdv_lists_kernel(item_block_ref, item_lo_ref, item_hi_ref, tokens_ref, q_ref, k_ref, v_ref, do_ref, m2_ref,
                       inv_l_ref, delta_ref, *refs, st: _Static):
    """One program per (work item, batch, kv head): an item is one key block and a chunk of the
    tokens that selected it (`_work_items`); writes the chunk's dK/dV (fp32) for `_sum_items` and,
    visiting by blocks, every pair's dQ (fp32) at its place in the plan."""
    seg_ref = refs[0] if st.has_segments else None
    dk_ref, dv_ref = refs[-2:]
    dq_ref = refs[-3] if st.by_blocks else None
    width, head_dim = dk_ref.shape
    w = pl.program_id(0)
    start = pl.multiple_of(item_block_ref[w] * width, width)
    tile = pl.ds(start, width)
    k, v = k_ref[tile, :], v_ref[tile, :]
    cols = start + jnp.arange(width)
    kv_seg = seg_ref[tile] if st.has_segments else None
    lo, hi = item_lo_ref[w], item_hi_ref[w]
    step_tokens = st.blocks.tokens_dkdv

    if step_tokens == 1 and not st.by_blocks:
        def step(i, carry):
            t = tokens_ref[lo + i]
            rows = _token_rows(st, t, q_ref, do_ref, m2_ref, inv_l_ref, delta_ref)
            q_seg = seg_ref[t] if st.has_segments else None
            mask = _mask(st, t, cols, q_seg, kv_seg)[:, None]
            return _dkdv_tile(st, k, v, *rows, mask, carry)
    else:
        rows = step_tokens * st.group
        spread = lambda x: jnp.broadcast_to(x[:, None], (step_tokens, st.group)).reshape(rows)

        def step(i, carry):  # tokens lo + i n .. lo + i n + n - 1 of the list, those from hi on masked
            first = lo + i * step_tokens
            tok = tokens_ref[pl.ds(first, step_tokens)]  # the list is padded: never read past its end
            q = q_ref[tok].reshape(rows, head_dim)  # the tokens' group rows, gathered
            do = do_ref[tok].reshape(rows, head_dim)
            m2, inv_l, delta = (r[tok].reshape(rows) for r in (m2_ref, inv_l_ref, delta_ref))
            inv_l = jnp.where(spread(first + jnp.arange(step_tokens) < hi), inv_l, 0.0)  # P = 0 there
            q_seg = spread(seg_ref[tok])[None, :] if st.has_segments else None
            mask = _mask(st, spread(tok)[None, :], cols[:, None], q_seg,
                         kv_seg[:, None] if st.has_segments else None)

            def take_ds(ds):  # the pairs' dQ = dS^T K, at their places (the list's order)
                dq = jax.lax.dot_general(ds.astype(k.dtype), k, (((0,), (0,)), ((), ())), precision=st.precision,
                                         preferred_element_type=jnp.float32) * st.scale
                live = first + jnp.arange(step_tokens) < hi
                plgpu.store(dq_ref.at[_places(first, step_tokens)], dq.reshape(step_tokens, st.group, head_dim),
                            mask=live[:, None, None])

            return _dkdv_tile(st, k, v, q, do, m2, inv_l, delta, mask, carry, take_ds if st.by_blocks else None)

    carry = (jnp.zeros((width, head_dim), jnp.float32),) * 2
    dk, dv = jax.lax.fori_loop(0, (hi - lo + step_tokens - 1) // step_tokens, step, carry)
    dk_ref[...] = dk * st.scale
    dv_ref[...] = dv


def _sum_items_kernel(item_start_ref, item_count_ref, dk_part_ref, dv_part_ref, dk_ref, dv_ref):
    """One program per (key block, batch, kv head): its items' dK/dV summed in item order
    (deterministic)."""
    j = pl.program_id(0)
    first = item_start_ref[j]

    def add(w, carry):
        return carry[0] + dk_part_ref[w], carry[1] + dv_part_ref[w]

    zero = jnp.zeros(dk_ref.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(first, first + item_count_ref[j], add, (zero, zero))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _sum_chunks_kernel(dk_parts_ref, dv_parts_ref, dk_ref, dv_ref):
    """One program per (16 key rows, batch, kv head): its chunks' dK/dV summed in chunk order."""
    def add(c, carry):
        return carry[0] + dk_parts_ref[c], carry[1] + dv_parts_ref[c]

    dk, dv = jax.lax.fori_loop(1, dk_parts_ref.shape[0], add, (dk_parts_ref[0], dv_parts_ref[0]))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _work_items(offsets, num_blocks: int, chunk: int, num_items: int):
    """Split every key block's token list (offsets [B, Hkv, nb + 1]) into chunks of at most
    `chunk` tokens, at least one per block -> (item block, item lo, item hi [B, Hkv, W]; first item
    and item count per block [B, Hkv, nb]); W = num_items bounds the count (items past the last
    are empty)."""
    counts = offsets[..., 1:] - offsets[..., :-1]
    per_block = jnp.maximum((counts + chunk - 1) // chunk, 1)
    first = jnp.cumsum(per_block, axis=-1, dtype=jnp.int32) - per_block
    items = jnp.arange(num_items, dtype=jnp.int32)
    search = jax.vmap(jax.vmap(lambda f: jnp.searchsorted(f, items, side="right")))
    block = jnp.clip(search(first).astype(jnp.int32) - 1, 0, num_blocks - 1)
    base = jnp.take_along_axis(offsets[..., :-1], block, -1)
    end = jnp.take_along_axis(offsets[..., 1:], block, -1)
    lo = jnp.minimum(base + (items[None, None, :] - jnp.take_along_axis(first, block, -1)) * chunk, end)
    hi = jnp.minimum(lo + chunk, end)
    return block, lo, hi, first, per_block


def _dkdv_ranges_kernel(ranges_ref, q_ref, k_ref, v_ref, do_ref, m2_ref, inv_l_ref, delta_ref, *refs,
                        st: _Static, chunks: int):
    """One program per (key tile, chunk of the token steps, batch, kv head): walks the tokens that
    may see the tile in steps of T consecutive tokens (`tokens_dkdv`; their group rows are one tile
    of T * G >= 16 rows), skipping the steps none of whose ranges meet the tile. With chunks > 1 it
    writes the chunk's dK/dV in fp32 (summed after)."""
    seg_ref = refs[0] if st.has_segments else None
    dk_ref, dv_ref = refs[-2:]
    width, head_dim = k_ref.shape
    chunk = pl.program_id(0) % chunks
    start = (pl.program_id(0) // chunks) * width
    k, v = k_ref[...], v_ref[...]
    cols = start + jnp.arange(width)
    kv_seg = seg_ref[pl.ds(start, width)] if st.has_segments else None
    step_tokens = st.blocks.tokens_dkdv
    rows = step_tokens * st.group
    spread = lambda x: jnp.broadcast_to(x[:, None], (step_tokens, st.group)).reshape(rows)

    def step(i, carry):
        tokens = pl.ds(pl.multiple_of(i * step_tokens, step_tokens), step_tokens)
        bounds = _range_bounds(ranges_ref, tokens)

        def visit(c):
            q = q_ref[tokens].reshape(rows, head_dim)  # the tokens' group rows, one tile
            do = do_ref[tokens].reshape(rows, head_dim)
            m2, inv_l, delta = (r[tokens].reshape(rows) for r in (m2_ref, inv_l_ref, delta_ref))
            inside = _inside(cols[:, None], [(spread(lo)[None, :], spread(hi)[None, :]) for lo, hi in bounds])
            pos = spread(i * step_tokens + jnp.arange(step_tokens))[None, :]
            q_seg = spread(seg_ref[tokens])[None, :] if st.has_segments else None
            mask = _mask(st, pos, cols[:, None], q_seg, kv_seg[:, None] if st.has_segments else None) & inside
            return _dkdv_tile(st, k, v, q, do, m2, inv_l, delta, mask, c)

        return jax.lax.cond(_meets_any(bounds, start, width), visit, lambda c: c, carry)

    # causal: the first step holds the tile's first key as a token (earlier tokens see none of it)
    first_step, steps = (start // step_tokens if st.causal else 0), st.length // step_tokens
    per_chunk = pl.cdiv(steps, chunks)
    carry = (jnp.zeros((width, head_dim), jnp.float32),) * 2
    dk, dv = jax.lax.fori_loop(jnp.maximum(first_step, chunk * per_chunk),
                               jnp.minimum(steps, (chunk + 1) * per_chunk), step, carry)
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_call(st: _Static, q, k, v, sel, seg, do, m2, inv_l, delta):
    """dQ on the forward's tiling (visiting by tokens)."""
    batch, length, kv_heads, group, head_dim = q.shape
    tokens = st.blocks.tokens_dq
    seg_specs, seg_args = _seg_specs(st, seg)
    sel_specs, sel_args = _sel_args(st, sel, tokens)
    q_spec = pl.BlockSpec((None, tokens, None, group, head_dim), lambda i, b, h: (b, i, h, 0, 0))
    kv_spec = pl.BlockSpec((None, length, None, head_dim), lambda i, b, h: (b, 0, h, 0))
    stat_spec = pl.BlockSpec((None, None, tokens, group), lambda i, b, h: (b, h, i, 0))
    return pl.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid=(length // tokens, batch, kv_heads),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec, stat_spec, *sel_specs, *seg_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=st.blocks.num_warps_bwd, num_stages=st.blocks.num_stages_bwd),
        interpret=st.interpret, name="nsa_selection_bwd_dq",
    )(q, k, v, do, m2, inv_l, delta, *sel_args, *seg_args)


def _bwd_call(st: _Static, q, k, v, sel, seg, do, m2, inv_l, delta, pairs: _PairPlan | None):
    batch, length, kv_heads, group, head_dim = q.shape
    width = st.block_size
    params = plgpu.CompilerParams(num_warps=st.blocks.num_warps_bwd, num_stages=st.blocks.num_stages_bwd)
    seg_specs, seg_args = _seg_specs(st, seg)

    dq = None if st.by_blocks else _dq_call(st, q, k, v, sel, seg, do, m2, inv_l, delta)

    q_all = pl.BlockSpec((None, length, None, group, head_dim), lambda j, b, h: (b, 0, h, 0, 0))
    stat_all = pl.BlockSpec((None, None, length, group), lambda j, b, h: (b, h, 0, 0))
    kv_block = pl.BlockSpec((None, width, None, head_dim), lambda j, b, h: (b, j, h, 0))
    kv_shapes = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if st.ranges:  # dK/dV: programs per key tile, each walking a chunk of the tokens that may see it
        r = sel[0].shape[3]
        tiles = length // width
        # short sequences have few key tiles: chunks of the token walk keep the GPU busy (a power
        # of two: a block of the partials' sum)
        chunks = max(1, min(length // st.blocks.tokens_dkdv, RANGES_DKDV_PROGRAMS // (tiles * batch * kv_heads)))
        chunks = 1 << (chunks.bit_length() - 1)
        ranges_spec = pl.BlockSpec((None, length, None, r, 2), lambda j, b, h: (b, 0, h, 0, 0))
        tile_of = lambda j, b, h: (b, j // chunks, h, 0)
        kv_tile = pl.BlockSpec((None, width, None, head_dim), tile_of)
        if chunks == 1:
            out_spec, out_shapes = kv_tile, kv_shapes
        else:  # [B, chunks, L, Hkv, D] fp32 partials, summed below in chunk order
            out_spec = pl.BlockSpec((None, None, width, None, head_dim),
                                    lambda j, b, h: (b, j % chunks, j // chunks, h, 0))
            out_shapes = [jax.ShapeDtypeStruct((batch, chunks, *x.shape[1:]), jnp.float32) for x in kv_shapes]
        dk, dv = pl.pallas_call(
            functools.partial(_dkdv_ranges_kernel, st=st, chunks=chunks),
            grid=(tiles * chunks, batch, kv_heads),
            in_specs=[ranges_spec, q_all, kv_tile, kv_tile, q_all, stat_all, stat_all, stat_all, *seg_specs],
            out_specs=[out_spec, out_spec], out_shape=out_shapes,
            compiler_params=params, interpret=st.interpret, name="nsa_selection_bwd_dkdv_ranges",
        )(*sel, q, k, v, do, m2, inv_l, delta, *seg_args)
        if chunks > 1:  # the partials added in chunk order (deterministic), 16 key rows a program
            parts_spec = pl.BlockSpec((None, chunks, MIN_BLOCK, None, head_dim), lambda j, b, h: (b, 0, j, h, 0))
            rows_spec = pl.BlockSpec((None, MIN_BLOCK, None, head_dim), lambda j, b, h: (b, j, h, 0))
            dk, dv = pl.pallas_call(
                _sum_chunks_kernel, grid=(length // MIN_BLOCK, batch, kv_heads), in_specs=[parts_spec, parts_spec],
                out_specs=[rows_spec, rows_spec], out_shape=kv_shapes,
                compiler_params=params, interpret=st.interpret, name="nsa_selection_bwd_dkdv_ranges_sum",
            )(dk, dv)
        return dq, dk, dv

    # dK/dV of the block lists: the transpose plan, cut into work items of at most chunk_dkdv
    # tokens; one program per item writes its partial dK/dV (and, visiting by blocks, its pairs'
    # dQ), a second kernel sums them per block
    pairs = _PairPlan(st, sel[0]) if pairs is None else pairs  # the forward's, visiting by blocks
    num_blocks, num_items = pairs.num_blocks, pairs.num_items
    kv_all = pl.BlockSpec((None, length, None, head_dim), lambda w, b, h: (b, 0, h, 0))
    part_spec = pl.BlockSpec((None, None, None, width, head_dim), lambda w, b, h: (b, h, w, 0, 0))
    part_shape = jax.ShapeDtypeStruct((batch, kv_heads, num_items, width, head_dim), jnp.float32)
    out_specs, out_shapes = [part_spec, part_spec], [part_shape, part_shape]
    if st.by_blocks:
        places = pairs.tokens.shape[2]
        out_specs.insert(0, pl.BlockSpec((None, None, places, group, head_dim), lambda w, b, h: (b, h, 0, 0, 0)))
        out_shapes.insert(0, jax.ShapeDtypeStruct((batch, kv_heads, places, group, head_dim), jnp.float32))
    parts = pl.pallas_call(
        functools.partial(_dkdv_lists_kernel, st=st),
        grid=(num_items, batch, kv_heads),
        in_specs=[*pairs.specs(), q_all, kv_all, kv_all, q_all, stat_all, stat_all, stat_all, *seg_specs],
        out_specs=out_specs, out_shape=out_shapes,
        compiler_params=params, interpret=st.interpret, name="nsa_selection_bwd_dkdv",
    )(*pairs.args(), q, k, v, do, m2, inv_l, delta, *seg_args)
    dk_part, dv_part = parts[-2:]
    if st.by_blocks:  # every token's pairs' dQ, summed over its slots in slot order
        dq = pairs.by_token(parts[0], st, 0.0).sum(axis=3).astype(q.dtype)
    block_spec = pl.BlockSpec((None, None, num_blocks), lambda j, b, h: (b, h, 0))
    parts_spec = pl.BlockSpec((None, None, num_items, width, head_dim), lambda j, b, h: (b, h, 0, 0, 0))
    dk, dv = pl.pallas_call(
        _sum_items_kernel,
        grid=(num_blocks, batch, kv_heads),
        in_specs=[block_spec, block_spec, parts_spec, parts_spec],
        out_specs=[kv_block, kv_block], out_shape=kv_shapes,
        compiler_params=params, interpret=st.interpret, name="nsa_selection_bwd_dkdv_sum",
    )(pairs.item_first, pairs.item_count, dk_part, dv_part)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# custom_vjp wiring (on the laid-out arrays) and the entry point.
# ----------------------------------------------------------------------------------------------


def _forward(st, q, k, v, sel, seg):
    """(out, m2, inv_l, lse, the pair plan visiting by blocks, else None)."""
    if not st.by_blocks:
        return *_fwd_call(st, q, k, v, sel, seg), None
    pairs = _PairPlan(st, sel[0])
    return *_fwd_blocks_call(st, q, k, v, pairs, seg), pairs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _selection(st, q, k, v, sel, seg):
    out, _, _, lse, _ = _forward(st, q, k, v, sel, seg)
    return out, lse


def _selection_fwd(st, q, k, v, sel, seg):
    out, m2, inv_l, lse, pairs = _forward(st, q, k, v, sel, seg)
    return (out, lse), (q, k, v, sel, seg, out, m2, inv_l, pairs)


def _selection_bwd(st, residuals, cotangents):
    q, k, v, sel, seg, out, m2, inv_l, pairs = residuals
    do, dlse = cotangents
    delta = jnp.einsum("blhgd,blhgd->bhlg", out.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    dq, dk, dv = _bwd_call(st, q, k, v, sel, seg, do.astype(q.dtype), m2, inv_l, delta, pairs)
    return dq, dk, dv, None, None


_selection.defvjp(_selection_fwd, _selection_bwd)


def selection_pallas(q, k, v, *, blocks=None, counts=None, ranges=None, q_ids=None, block_size: int,
                     causal: bool, scale: float, precision, config: NSABlockSizes | None = None,
                     interpret: bool | None = None):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] (validated); canonical blocks [B, S, Hkv, n] and counts
    [B, S, Hkv] (`plan.canonical_blocks`) or disjoint ranges [B, S, Hkv, R, 2]
    (`plan.disjoint_ranges`); segment ids [B, S] or None -> (out [B, S, Hq, D], lse [B, Hq, S]).

    Lays the arrays out for the kernels: q as [B, L, Hkv, G, D] (a free reshape; the group padded
    to a power of two only when it is not one), head dim padded to a power of two, sequence to L,
    a multiple of the tiles (padded keys are masked, padded rows sliced off)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    batch, seq_len, num_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = num_heads // kv_heads
    group_pad, head_pad = pow2_at_least(group, 1), pow2_at_least(head_dim)
    config = config or default_block_sizes(head_pad, interpret, q.dtype)
    # ranges (and lists of blocks under 16 keys, walked as their ranges)
    use_ranges = ranges is not None or block_size < MIN_BLOCK
    # forward / dQ tiles of block lists: 16 rows. Ranges: T tokens scan the key tiles between their
    # lowest start and highest end (about 64 rows on a GPU); on long sequences that scan costs more
    # than one token walking only its own ranges
    auto = tokens_for_group(group_pad, SCAN_ROWS if use_ranges and not interpret else MIN_BLOCK)
    auto_walk = 1 if use_ranges and seq_len > nsa_spec.RANGES_SCAN_KEYS else auto
    config = dataclasses.replace(config, tokens=config.tokens or auto_walk, tokens_dq=config.tokens_dq or auto_walk)
    if use_ranges and (config.tokens_dkdv or 1) == 1:  # the ranges dK/dV steps over several tokens' rows
        config = dataclasses.replace(config, tokens_dkdv=auto)
    elif config.tokens_dkdv is None:
        config = dataclasses.replace(config, tokens_dkdv=tokens_for_group(group_pad, DKDV_ROWS, most=None))
    visit = "tokens" if use_ranges else config.visit or ("blocks" if group_pad <= BLOCKS_VISIT_GROUP else "tokens")
    config = dataclasses.replace(config, visit=visit)
    if config.tokens_dkdv > 1 or visit == "blocks":  # gathered rows (every step, by blocks) fill a dot
        config = dataclasses.replace(config, tokens_dkdv=max(config.tokens_dkdv, MIN_BLOCK // group_pad))
    if ranges is None and block_size < MIN_BLOCK:
        # a dot needs 16 keys: lists of smaller blocks are walked as their ranges (disjoint: the
        # blocks are canonical), in tiles of block_k_ranges
        start = jnp.where(blocks >= 0, blocks * block_size, 0)
        ranges = plan.disjoint_ranges(jnp.stack([start, jnp.where(blocks >= 0, start + block_size, 0)], axis=-1),
                                      seq_len, causal)
    width = config.block_k_ranges if use_ranges else block_size
    tile = max(width, config.tokens, config.tokens_dq, config.tokens_dkdv if use_ranges else 1)
    length = pl.cdiv(seq_len, tile) * tile

    qg = q.reshape(batch, seq_len, kv_heads, group, head_dim)
    qg = padding.pad_axis(padding.pad_axis(padding.pad_axis(qg, 3, group_pad), 4, head_pad), 1, length)
    kp, vp = (padding.pad_axis(padding.pad_axis(x, 3, head_pad), 1, length) for x in (k, v))
    if use_ranges:
        sel = (padding.pad_axis(ranges.astype(jnp.int32), 1, length),)  # padded rows: empty ranges
    else:
        sel = (jnp.pad(blocks.astype(jnp.int32), ((0, 0), (0, length - seq_len), (0, 0), (0, 0)),
                       constant_values=-1), padding.pad_axis(counts.astype(jnp.int32), 1, length))
    seg = None if q_ids is None else padding.pad_axis(q_ids.astype(jnp.int32), 1, length, mode="edge")
    st = _Static(scale=scale, causal=causal, has_segments=q_ids is not None, precision=precision,
                 seq_len=seq_len, length=length, block_size=width, ranges=use_ranges, group=group_pad,
                 blocks=config, interpret=interpret)
    out, lse = _selection(st, qg, kp, vp, sel, seg)
    out = out[:, :seq_len, :, :group, :head_dim].reshape(batch, seq_len, num_heads, head_dim)
    lse = lse[:, :, :seq_len, :group].transpose(0, 1, 3, 2).reshape(batch, num_heads, seq_len)
    return out, lse
