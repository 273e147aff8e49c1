"""NSA's selection attention as Pallas kernels (Triton lowering): forward, dQ, dK/dV.

Reads top to bottom: config, the token's key walk shared by the kernels, forward, backward, the
`custom_vjp` wiring and the entry point that lays the arrays out for the kernels.

Group-centric (Yuan et al. 2025, Sec. 3.4 "Kernel design"): the query heads of one kv head share
their selection, so they form the ROWS of a tile. A program takes (a few query tokens, batch, kv
head) and, token by token, walks the token's key blocks (lists: the canonical selected blocks of
`plan.canonical_blocks`; ranges: key tiles over the disjoint ranges of `plan.disjoint_ranges`),
loading each block of keys at a dynamic start (`pl.ds`), with an online softmax in fp32 and the
causal and segment element mask. A group smaller than the smallest dot (16 rows) is padded in
registers: its rows are repeated to 16 (the same dot a zero-padded tile costs, no copy of q in
memory), and the repeated rows are folded back before the store.

Backward (FlashAttention-2 Alg. 2, recomputing P from the saved row max and 1 / row sum):
- dQ: the forward's walk, per token.
- dK/dV, lists: one program per (key block, batch, kv head) walks the TRANSPOSE plan
  (`plan.transpose_plan`: the query tokens that selected this block, from a stable sort of
  (block, token) pairs in XLA), gathering each token's group rows. No atomics: deterministic.
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

from attn_spec.tiles import MIN_BLOCK, check_launch_fields, pow2_at_least
from jax_attn.ops.common import padding
from jax_attn.ops.common.spec import LOG2E
from jax_attn.ops.nsa import plan

warnings.filterwarnings(
    "ignore", message=r"The Pallas Triton backend is deprecated and will be removed in a future JAX version",
    category=DeprecationWarning)


@dataclasses.dataclass(frozen=True)
class NSABlockSizes:
    """Tiles and launch parameters of the selection kernels.

    tokens / tokens_dq: query tokens per forward / dQ program (walked one after the other; more
    tokens per program, fewer programs). block_k_ranges: the key tile of the ranges form (the
    block lists walk blocks of `block_size`). The backward kernels launch with num_warps_bwd,
    num_stages_bwd."""

    tokens: int = 1
    tokens_dq: int = 1
    block_k_ranges: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2

    def __post_init__(self):
        check_launch_fields(self)
        for name in ("tokens", "tokens_dq"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"NSABlockSizes.{name}={value} must be a power of two >= 1")


def default_block_sizes(head_dim: int, interpret: bool, dtype=jnp.bfloat16) -> NSABlockSizes:
    """Interpret mode: one token per program, small key tiles (short CPU runs). GPU: the group's
    rows are one small tile whatever the tokens per program, so a program takes 4 tokens to
    amortise its launch and its prologue; 4 warps fit the 16-row dots."""
    if interpret:
        return NSABlockSizes(1, 1, 16, 4, 1, 4, 1)
    if jnp.dtype(dtype) == jnp.float32 or head_dim > 128:
        return NSABlockSizes(2, 2, 64, 4, 1, 4, 1)
    return NSABlockSizes(4, 4, 64, 4, 2, 4, 2)


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


def _dot(a, b, st, *, trans_b=False):
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=st.precision, preferred_element_type=jnp.float32)


def _spread(x, st):
    """A token's group rows [G, ...] -> the tile's [rows, ...]: repeated (row r is head r % G)."""
    copies = st.rows // st.group
    if copies == 1:
        return x
    return jnp.broadcast_to(x[None], (copies, *x.shape)).reshape(st.rows, *x.shape[1:])


def _fold(x, st):
    """The inverse of `_spread` on rows that hold equal copies: [rows, ...] -> [G, ...]."""
    copies = st.rows // st.group
    if copies == 1:
        return x
    return x.reshape(copies, st.group, *x.shape[1:]).max(axis=0)


def _mask(st, pos, cols, q_seg, kv_seg, lo=None, hi=None):
    """Keys `cols` a query at `pos` sees: inside the sequence, causal, in its segment, in [lo, hi)."""
    mask = cols < st.seq_len
    if st.causal:
        mask &= cols <= pos
    if st.has_segments:
        mask &= kv_seg == q_seg
    if lo is not None:
        mask &= (cols >= lo) & (cols < hi)
    return mask


def _walk(st, t, sel, body, carry):
    """Run `body(start, lo, hi, carry)` over the key tiles of token row t (of this program's
    selection refs): lists, each canonical block (lo = hi = None: the whole block); ranges, the
    tiles of each disjoint range [lo, hi) (masked to it)."""
    width = st.block_size
    if not st.ranges:
        blocks_ref, counts_ref = sel

        def block(j, c):
            return body(pl.multiple_of(blocks_ref[t, j] * width, width), None, None, c)

        return jax.lax.fori_loop(0, counts_ref[t], block, carry)
    (ranges_ref,) = sel

    def one_range(r, c):
        lo, hi = ranges_ref[t, r, 0], ranges_ref[t, r, 1]
        first = lo // width
        last = jnp.where(hi > lo, (hi + width - 1) // width, first)  # an empty range walks nothing

        def tile(j, c2):
            return body(pl.multiple_of(j * width, width), lo, hi, c2)

        return jax.lax.fori_loop(first, last, tile, c)

    return jax.lax.fori_loop(0, ranges_ref.shape[1], one_range, carry)


def _split_refs(refs, st):
    """(selection refs, segment ids ref or None, the rest) of a kernel's trailing refs."""
    refs = list(refs)
    sel = [refs.pop(0)] if st.ranges else [refs.pop(0), refs.pop(0)]
    seg = refs.pop(0) if st.has_segments else None
    return sel, seg, refs


# ----------------------------------------------------------------------------------------------
# Forward: one program per (query tokens, batch, kv head); per token, the group's heads are the
# rows and the token's key blocks are walked with an online softmax (FA2 Alg. 1 on a block list).
# ----------------------------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, st: _Static):
    sel, seg_ref, (o_ref, m2_ref, inv_l_ref, lse_ref) = _split_refs(refs, st)
    tokens, head_dim = q_ref.shape[0], q_ref.shape[-1]
    width = st.block_size
    base = pl.program_id(0) * tokens

    def token(t, _):
        pos = base + t
        q = _spread(q_ref[t], st)  # [rows, D]
        q_seg = seg_ref[pos] if st.has_segments else None

        def body(start, lo, hi, carry):
            m, l, acc = carry
            tile = pl.ds(start, width)
            k, v = k_ref[tile, :], v_ref[tile, :]
            s = _dot(q, k, st, trans_b=True) * (st.scale * LOG2E)
            cols = start + jnp.arange(width)
            kv_seg = seg_ref[tile] if st.has_segments else None
            s = jnp.where(_mask(st, pos, cols, q_seg, kv_seg, lo, hi)[None, :], s, -jnp.inf)
            # online softmax update; a row that has seen only masked keys keeps m = -inf and its
            # exponent uses 0 instead, so its p are exp2(-inf) = 0, never NaN
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(s - m_safe[:, None])
            l = l * alpha + p.sum(axis=1)
            acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, st)
            return m_new, l, acc

        carry = (jnp.full((st.rows,), -jnp.inf, jnp.float32), jnp.zeros((st.rows,), jnp.float32),
                 jnp.zeros((st.rows, head_dim), jnp.float32))
        m, l, acc = _walk(st, t, sel, body, carry)
        empty = l == 0.0  # nothing visible: output 0, lse -inf
        inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
        o_ref[t] = _fold(acc * inv_l[:, None], st).astype(o_ref.dtype)
        # for the backward: P = exp2(s2 - m2) * inv_l (m2 = +inf on empty rows: P = 0)
        m2_ref[t] = _fold(jnp.where(empty, jnp.inf, m), st)
        inv_l_ref[t] = _fold(inv_l, st)
        lse_ref[t] = _fold(jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) / LOG2E), st)
        return 0

    jax.lax.fori_loop(0, tokens, token, 0)


def _sel_specs(st, sel, tokens):
    """BlockSpecs of the selection arrays for a grid (token tile i, batch b, kv head h)."""
    if st.ranges:
        r = sel[0].shape[3]
        return [pl.BlockSpec((None, tokens, None, r, 2), lambda i, b, h: (b, i, h, 0, 0))]
    n = sel[0].shape[3]
    return [pl.BlockSpec((None, tokens, None, n), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, tokens, None), lambda i, b, h: (b, i, h))]


def _seg_specs(st, seg):
    if seg is None:
        return [], []
    return [pl.BlockSpec((None, st.length), lambda *g: (g[1], 0))], [seg]


def _fwd_call(st: _Static, q, k, v, sel, seg):
    """q [B, L, Hkv, G, D] -> out (same), m2, inv_l, lse [B, Hkv, L, G] fp32."""
    batch, length, kv_heads, group, head_dim = q.shape
    tokens = st.blocks.tokens
    seg_specs, seg_args = _seg_specs(st, seg)
    q_spec = pl.BlockSpec((None, tokens, None, group, head_dim), lambda i, b, h: (b, i, h, 0, 0))
    kv_spec = pl.BlockSpec((None, length, None, head_dim), lambda i, b, h: (b, 0, h, 0))
    stat_spec = pl.BlockSpec((None, None, tokens, group), lambda i, b, h: (b, h, i, 0))
    stat_shape = jax.ShapeDtypeStruct((batch, kv_heads, length, group), jnp.float32)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, st=st),
        grid=(length // tokens, batch, kv_heads),  # tokens fastest: neighbours share K/V in L2
        in_specs=[q_spec, kv_spec, kv_spec, *_sel_specs(st, sel, tokens), *seg_specs],
        out_specs=[q_spec, stat_spec, stat_spec, stat_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), stat_shape, stat_shape, stat_shape],
        compiler_params=plgpu.CompilerParams(num_warps=st.blocks.num_warps, num_stages=st.blocks.num_stages),
        interpret=st.interpret, name="nsa_selection_fwd",
    )(q, k, v, *sel, *seg_args)


# ----------------------------------------------------------------------------------------------
# Backward. delta = rowsum(dO * O) - dlse (FA2 Alg. 2 line 4; minus dlse makes lse differentiable).
# ----------------------------------------------------------------------------------------------


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, m2_ref, inv_l_ref, delta_ref, *refs, st: _Static):
    """One program per (query tokens, batch, kv head): the forward's walk, accumulating dQ."""
    sel, seg_ref, (dq_ref,) = _split_refs(refs, st)
    tokens, head_dim = q_ref.shape[0], q_ref.shape[-1]
    width = st.block_size
    base = pl.program_id(0) * tokens

    def token(t, _):
        pos = base + t
        q, do = _spread(q_ref[t], st), _spread(do_ref[t], st)
        m2, inv_l, delta = (_spread(r[t], st)[:, None] for r in (m2_ref, inv_l_ref, delta_ref))
        q_seg = seg_ref[pos] if st.has_segments else None

        def body(start, lo, hi, dq):
            tile = pl.ds(start, width)
            k, v = k_ref[tile, :], v_ref[tile, :]
            s = _dot(q, k, st, trans_b=True) * (st.scale * LOG2E)
            cols = start + jnp.arange(width)
            kv_seg = seg_ref[tile] if st.has_segments else None
            mask = _mask(st, pos, cols, q_seg, kv_seg, lo, hi)[None, :]
            p = jnp.where(mask, jnp.exp2(s - m2) * inv_l, 0.0)
            dp = _dot(do, v, st, trans_b=True)
            ds = p * (dp - delta)
            return dq + _dot(ds.astype(k.dtype), k, st)

        dq = _walk(st, t, sel, body, jnp.zeros((st.rows, head_dim), jnp.float32))
        dq_ref[t] = _fold(dq * st.scale, st).astype(dq_ref.dtype)
        return 0

    jax.lax.fori_loop(0, tokens, token, 0)


def _dkdv_tile(st, k, v, q, do, m2, inv_l, delta, mask, carry):
    """One (key tile, query token) step of dK/dV: s = k q^T [keys, rows]; rows beyond the group
    (repeated copies) carry inv_l = 0, so P = 0 there."""
    dk, dv = carry
    s = _dot(k, q, st, trans_b=True) * (st.scale * LOG2E)
    p = jnp.where(mask, jnp.exp2(s - m2[None, :]) * inv_l[None, :], 0.0)
    dv = dv + _dot(p.astype(do.dtype), do, st)
    dp = _dot(v, do, st, trans_b=True)
    ds = p * (dp - delta[None, :])
    return dk + _dot(ds.astype(q.dtype), q, st), dv


def _token_rows(st, t, q_ref, do_ref, m2_ref, inv_l_ref, delta_ref):
    """Token t's group rows spread to the tile (the copies zeroed through inv_l)."""
    q, do = _spread(q_ref[t], st), _spread(do_ref[t], st)
    m2, inv_l, delta = (_spread(r[t], st) for r in (m2_ref, inv_l_ref, delta_ref))
    if st.rows != st.group:
        inv_l = jnp.where(jnp.arange(st.rows) < st.group, inv_l, 0.0)
    return q, do, m2, inv_l, delta


def _dkdv_lists_kernel(tokens_ref, offsets_ref, q_ref, k_ref, v_ref, do_ref, m2_ref, inv_l_ref, delta_ref,
                       *refs, st: _Static):
    """One program per (key block, batch, kv head): walks the tokens that selected the block."""
    seg_ref = refs[0] if st.has_segments else None
    dk_ref, dv_ref = refs[-2:]
    width, head_dim = k_ref.shape
    j = pl.program_id(0)
    start = j * width
    k, v = k_ref[...], v_ref[...]
    cols = (start + jnp.arange(width))
    kv_seg = seg_ref[pl.ds(start, width)] if st.has_segments else None

    def step(i, carry):
        t = tokens_ref[i]
        rows = _token_rows(st, t, q_ref, do_ref, m2_ref, inv_l_ref, delta_ref)
        q_seg = seg_ref[t] if st.has_segments else None
        mask = _mask(st, t, cols, q_seg, kv_seg)[:, None]
        return _dkdv_tile(st, k, v, *rows, mask, carry)

    carry = (jnp.zeros((width, head_dim), jnp.float32),) * 2
    dk, dv = jax.lax.fori_loop(offsets_ref[j], offsets_ref[j + 1], step, carry)
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkdv_ranges_kernel(ranges_ref, q_ref, k_ref, v_ref, do_ref, m2_ref, inv_l_ref, delta_ref, *refs,
                        st: _Static):
    """One program per (key tile, batch, kv head): walks the tokens that may see the tile, skipping
    those none of whose ranges meet it."""
    seg_ref = refs[0] if st.has_segments else None
    dk_ref, dv_ref = refs[-2:]
    width, head_dim = k_ref.shape
    start = pl.program_id(0) * width
    k, v = k_ref[...], v_ref[...]
    cols = start + jnp.arange(width)
    kv_seg = seg_ref[pl.ds(start, width)] if st.has_segments else None
    num_ranges = ranges_ref.shape[1]

    def step(t, carry):
        bounds = [(ranges_ref[t, r, 0], ranges_ref[t, r, 1]) for r in range(num_ranges)]
        touch = functools.reduce(jnp.logical_or, [(lo < start + width) & (hi > start) & (hi > lo)
                                                  for lo, hi in bounds])

        def visit(c):
            rows = _token_rows(st, t, q_ref, do_ref, m2_ref, inv_l_ref, delta_ref)
            inside = functools.reduce(jnp.logical_or, [(cols >= lo) & (cols < hi) for lo, hi in bounds])
            q_seg = seg_ref[t] if st.has_segments else None
            mask = (_mask(st, t, cols, q_seg, kv_seg) & inside)[:, None]
            return _dkdv_tile(st, k, v, *rows, mask, c)

        return jax.lax.cond(touch, visit, lambda c: c, carry)

    carry = (jnp.zeros((width, head_dim), jnp.float32),) * 2
    dk, dv = jax.lax.fori_loop(start if st.causal else 0, st.seq_len, step, carry)
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd_call(st: _Static, q, k, v, sel, seg, do, m2, inv_l, delta):
    batch, length, kv_heads, group, head_dim = q.shape
    width = st.block_size
    params = plgpu.CompilerParams(num_warps=st.blocks.num_warps_bwd, num_stages=st.blocks.num_stages_bwd)
    seg_specs, seg_args = _seg_specs(st, seg)

    # dQ: the forward's tiling
    tokens = st.blocks.tokens_dq
    q_spec = pl.BlockSpec((None, tokens, None, group, head_dim), lambda i, b, h: (b, i, h, 0, 0))
    kv_spec = pl.BlockSpec((None, length, None, head_dim), lambda i, b, h: (b, 0, h, 0))
    stat_spec = pl.BlockSpec((None, None, tokens, group), lambda i, b, h: (b, h, i, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid=(length // tokens, batch, kv_heads),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec, stat_spec,
                  *_sel_specs(st, sel, tokens), *seg_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params, interpret=st.interpret, name="nsa_selection_bwd_dq",
    )(q, k, v, do, m2, inv_l, delta, *sel, *seg_args)

    # dK/dV: one program per key block; the group rows of the whole sequence are gathered per token
    q_all = pl.BlockSpec((None, length, None, group, head_dim), lambda j, b, h: (b, 0, h, 0, 0))
    stat_all = pl.BlockSpec((None, None, length, group), lambda j, b, h: (b, h, 0, 0))
    kv_block = pl.BlockSpec((None, width, None, head_dim), lambda j, b, h: (b, j, h, 0))
    if st.ranges:
        r = sel[0].shape[3]
        plan_specs = [pl.BlockSpec((None, length, None, r, 2), lambda j, b, h: (b, 0, h, 0, 0))]
        plan_args = list(sel)
        kernel = _dkdv_ranges_kernel
    else:
        num_blocks = length // width
        tokens_list, offsets = plan.transpose_plan(sel[0][:, :st.seq_len], num_blocks)
        plan_specs = [pl.BlockSpec((None, None, tokens_list.shape[2]), lambda j, b, h: (b, h, 0)),
                      pl.BlockSpec((None, None, num_blocks + 1), lambda j, b, h: (b, h, 0))]
        plan_args = [tokens_list, offsets]
        kernel = _dkdv_lists_kernel
    kv_shape = jax.ShapeDtypeStruct(k.shape, k.dtype)
    dk, dv = pl.pallas_call(
        functools.partial(kernel, st=st),
        grid=(length // width, batch, kv_heads),
        in_specs=[*plan_specs, q_all, kv_block, kv_block, q_all, stat_all, stat_all, stat_all, *seg_specs],
        out_specs=[kv_block, kv_block],
        out_shape=[kv_shape, jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params, interpret=st.interpret, name="nsa_selection_bwd_dkdv",
    )(*plan_args, q, k, v, do, m2, inv_l, delta, *seg_args)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# custom_vjp wiring (on the laid-out arrays) and the entry point.
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _selection(st, q, k, v, sel, seg):
    out, _, _, lse = _fwd_call(st, q, k, v, sel, seg)
    return out, lse


def _selection_fwd(st, q, k, v, sel, seg):
    out, m2, inv_l, lse = _fwd_call(st, q, k, v, sel, seg)
    return (out, lse), (q, k, v, sel, seg, out, m2, inv_l)


def _selection_bwd(st, residuals, cotangents):
    q, k, v, sel, seg, out, m2, inv_l = residuals
    do, dlse = cotangents
    delta = jnp.einsum("blhgd,blhgd->bhlg", out.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    dq, dk, dv = _bwd_call(st, q, k, v, sel, seg, do.astype(q.dtype), m2, inv_l, delta)
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
    use_ranges = ranges is not None
    width = config.block_k_ranges if use_ranges else block_size
    tile = max(width, config.tokens, config.tokens_dq)
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
