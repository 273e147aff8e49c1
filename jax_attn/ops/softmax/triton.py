"""The flash-attention engine as Pallas kernels (Triton lowering): forward, dK/dV, dQ.

Reads top to bottom: block config, the shared tile math, forward kernel, backward kernels, the
`custom_vjp` wiring and the entry point that pads to the kernels' tile grid.

Algorithm: FlashAttention-2 (Dao 2023, arXiv 2307.08691), Alg. 1 (forward with online softmax,
row statistics saved) and Alg. 2 (backward recomputing P), with the backward split into a dK/dV
kernel (one program per key block and kv head, looping over the query heads of its GQA group, so
dK/dV need no atomics and stay deterministic) and a dQ kernel (one program per query block).

Which tiles are visited is a parameter: for each query block an int32 range of key blocks
(lo, full_lo, full_hi, hi) built in `visit.block_ranges`; [full_lo, full_hi) needs no element mask,
the rest of [lo, hi) is masked with `spec.visible`, everything outside is skipped.
Design and figures: docs/design/softmax.md.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_attn.ops.common import dropout, padding, triton_tiles as tiles
from attn_spec.dilation import RowMap
from attn_spec.tiles import BlockSizes, pow2_at_least
from jax_attn.ops.common.spec import LOG2E, AttentionSpec, padded_head_dim, visible
from jax_attn.ops.common.triton_tiles import rope_tables
from jax_attn.ops.common.visit import block_ranges
from jax_attn.ops.softmax import mosaic as mosaic_gpu


# jax 0.11 deprecates the Pallas Triton backend with a DeprecationWarning at every lowering; this
# library is built on it on purpose, so that one message, and only that one, is silenced.
warnings.filterwarnings(
    "ignore", message=r"The Pallas Triton backend is deprecated and will be removed in a future JAX version",
    category=DeprecationWarning)


def default_block_sizes(head_dim: int, interpret: bool, dtype=jnp.bfloat16, rope: bool = False,
                        rope_positions: bool = False) -> BlockSizes:
    """Tiles per padded head dim and dtype. Interpret mode: small tiles keep the CPU run short.

    16-bit, D <= 128: the fastest of `benchmarks/sweep_blocks.py` (docs/design/softmax.md, 'The
    Triton engine'). fp32: exact fp32 dots run on FMA units, whose code grows with the tile, and
    fp32 tiles take twice the shared memory: smaller tiles. RoPE (`sweep_blocks.py --rope`;
    docs/design/rope.md, 'The Triton engine'): the backward loops rotate nothing (q, k arrive
    rotated), so the backward keeps the plain tiles; the forward at positions arange takes 128x64
    in 3 stages, and with positions given 128x64 in 2 (its fp32 cos/sin rows would overflow shared
    memory at 128x128 in 3 stages)."""
    if interpret:
        return BlockSizes(32, 32, 32, 32, 32, 32, 4, 1, 4, 1)
    if jnp.dtype(dtype) == jnp.float32:
        return BlockSizes(64, 32, 32, 64, 64, 32, 4, 2, 4, 2)
    if head_dim <= 64:
        return BlockSizes(64, 64, 32, 64, 64, 32, 4, 3, 4, 3)
    if head_dim <= 128 and rope:
        return BlockSizes(128, 64, 64, 64, 64, 64, 8, 2 if rope_positions else 3, 4, 2)
    if head_dim <= 128:
        return BlockSizes(128, 128, 64, 64, 64, 64, 8, 3, 4, 2)
    return BlockSizes(64, 32, 32, 64, 64, 32, 4, 2, 8, 1)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one padded call."""

    spec: AttentionSpec
    blocks: BlockSizes
    q_len: int  # real lengths (the arrays are padded to tile multiples)
    kv_len: int
    interpret: bool
    rope_arange: bool = False  # RoPE at positions arange: tile cos/sin by angle addition
    mosaic: mosaic_gpu.MosaicBlockSizes | None = None  # run the Mosaic GPU kernels instead
    rows: RowMap | None = None  # read heads through a row map (a view's head slots); None: identity
    # Under an ordering (spec.ordered) the q, k, v, dO refs span a head's whole original sequence and
    # a tile's rows are gathered at their original positions (side field "orig"). scatter: the
    # outputs and row statistics are in the original order too, stored at those rows; else they
    # are written compact, in the ordered tile layout (row-mapped calls). batch_div: grid batch
    # rows per row of q, k, v (a row map's virtual sequences per sequence).
    scatter: bool = False
    batch_div: int = 1


def _head_maps(st: _Static, group: int):
    """(q head, kv head, batch row) that grid program (b, h) reads: the identity (kv head h // group
    of GQA, batch row b), or the row map's head slots and per-(batch, offset) row. Outputs are
    always written at the program's own head h. Under an ordering with a row map the rows are
    gathered from the unviewed arrays: the q head is the global head, its kv head the GQA one."""
    if st.rows is None:
        return (lambda h: h), (lambda h: h // group), (lambda b, h: b)
    if st.spec.ordered:
        rm = st.rows
        return ((lambda h: rm.head_base + h), (lambda h: (rm.head_base + h) // (rm.heads // rm.kv_heads)),
                rm.side_row)
    return st.rows.q_slot, st.rows.kv_slot, st.rows.side_row


def _source_batch(st: _Static):
    """The row of q, k, v that grid batch row b reads."""
    return (lambda b: b // st.batch_div) if st.batch_div > 1 else (lambda b: b)


def _gathered_rows(info, ref, idx=slice(None)):
    """Under an ordering: the rows of `ref` (a whole sequence) holding a tile's tokens, its side
    field "orig" clamped into the array (padding rows carry positions past its end); else None."""
    orig = info.get("orig", idx)
    return None if orig is None else jnp.minimum(orig, ref.shape[0] - 1)


def _put(ref, rows, x):
    """Store a tile: whole, or scattered to `rows` of a whole-sequence ref (under an ordering)."""
    if rows is None:
        ref[...] = x.astype(ref.dtype)
    else:
        ref[(rows,) + (slice(None),) * (ref.ndim - 1)] = x.astype(ref.dtype)


# ----------------------------------------------------------------------------------------------
# Tile math shared by the three kernels.
#
# Feature "parts": without RoPE a q/k tile is one part, [rows, D]. With RoPE it is two parts,
# the two members of every rotated pair ([rows, D/2] each: columns [0, D/2) and [D/2, D) for
# style "half", even and odd columns for "interleaved"), rotated in registers after the load;
# the forward's scores are the sum of the parts' dots. The backward kernels get q, k rotated and
# take them whole (one dot, one dQ/dK accumulator); dQ/dK are split into the parts only to rotate
# back (R^T) before the store. Without RoPE the code is exactly the plain kernel.
# ----------------------------------------------------------------------------------------------


def _scores(q_parts, k_parts, spec, *, k_major=False):
    """Scores in log2 units, s2 = log2(e) * s, and tanh(raw * scale / cap) when soft-capped.

    k_major=False gives [block_q, block_k] (q @ k.T); True gives [block_k, block_q] (k @ q.T).
    """
    pairs = zip(k_parts, q_parts) if k_major else zip(q_parts, k_parts)
    raw = sum(tiles.dot(a, b, spec, trans_b=True) for a, b in pairs)
    if spec.softcap is None:
        return raw * (spec.scale * LOG2E), None
    t = jnp.tanh(raw * (spec.scale / spec.softcap))
    return t * (spec.softcap * LOG2E), t


def _alibi(spec, slope, rows, cols, base):
    """ALiBi in log2 units: -slope * |i + offset - j| * log2(e), for rows and cols broadcast. Both
    positions are taken relative to `base`, a position of the tile, and converted to float before
    the subtract: per element a float subtract instead of an integer abs and an int-to-float
    conversion; exact while positions lie within 2^24 of the tile. Under an ordering the distance
    is the tokens' original one: rows and cols are the gathered original positions, base 0."""
    rows = rows + spec.offset - base if spec.offset else rows - base
    return jnp.abs(rows.astype(jnp.float32) - (cols - base).astype(jnp.float32)) * (-slope * LOG2E)


def _mask(spec, st: _Static, s, rows, cols, q_seg, kv_seg, q_orig=None, kv_orig=None):
    """Set scores of invisible (row, col) pairs to -inf; also return the mask. Under an ordering
    rows, cols are ordered positions and q_orig, kv_orig the original ones (for causality)."""
    mask = visible(spec, rows, cols, st.kv_len, q_seg, kv_seg, q_orig, kv_orig)
    return jnp.where(mask, s, -jnp.inf), mask


def _needs_mask(st: _Static, block_k: int) -> bool:
    """Whether any visited tile can need an element mask (else the masked loops vanish)."""
    return st.spec.has_position_mask or st.spec.has_segments or st.kv_len % block_k != 0


def _dropout_inputs(rest, spec):
    """(row bits, column bits, the kept elements' factor read once) popped from `rest`, or Nones."""
    if not spec.dropout:
        return None, None, None
    return rest.pop(0), rest.pop(0), rest.pop(0)[0]


def _visit(ranges_ref, body, carry, needs_mask: bool, stride: int = 1):
    """Run `body(j, carry, masked)` over the visited blocks: masked edges, mask-free middle.

    stride > 1 visits every block `stride` times (step j covers block j // stride)."""
    lo, full_lo, full_hi, hi = (ranges_ref[n] * stride for n in range(4))
    if not needs_mask:
        return jax.lax.fori_loop(lo, hi, functools.partial(body, masked=False), carry)
    carry = jax.lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
    carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    return jax.lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)


# ----------------------------------------------------------------------------------------------
# Forward: one program per (query block, batch, query head). FA2 Alg. 1.
# ----------------------------------------------------------------------------------------------


def _fwd_kernel(ranges_ref, q_ref, k_ref, v_ref, *refs, st: _Static):
    spec = st.spec
    q_info, kv_info, tables, rest = tiles.unpack(refs, spec)
    slope = rest.pop(0)[pl.program_id(2)] if spec.alibi else None
    drop_rows_ref, drop_cols_ref, drop_scale = _dropout_inputs(rest, spec)
    o_ref, lse_ref, m2_ref, inv_l_ref, *q_rot_ref = rest
    block_q, head_dim = st.blocks.block_q, q_ref.shape[-1]
    block_k = st.blocks.block_k
    rope = spec.rope is not None
    q_cs = tiles.rope_cos_sin(tables[0]) if rope else None
    q_rows = _gathered_rows(q_info, q_ref)  # under an ordering: the tile's rows in q
    q_orig = q_info.get("orig")
    q_orig = None if q_orig is None else q_orig[:, None]
    q = tiles.rotate(tiles.load_parts(q_ref, (slice(None) if q_rows is None else q_rows,), spec, head_dim), q_cs,
                     q_ref.dtype)
    if q_rot_ref:  # the rotated q, for the backward (whose loops then rotate nothing)
        tiles.store_parts(q_rot_ref[0], q, spec, head_dim)
    rows = pl.program_id(0) * block_q + jnp.arange(block_q)
    q_seg = q_info.get("seg")
    q_seg = None if q_seg is None else q_seg[:, None]
    k_delta = tiles.rope_delta(st, tables, 1, block_k)
    if spec.dropout:
        row_bits = drop_rows_ref[pl.program_id(1), pl.program_id(2), pl.ds(pl.program_id(0) * block_q, block_q)]
        row_bits = row_bits[:, None]

    def body(j, carry, masked):
        m, l, acc = carry
        start = pl.multiple_of(j * block_k, block_k)
        tile = pl.ds(start, block_k)
        k_cs = tiles.rope_cos_sin(tables[1], tile, k_delta) if rope else None
        kv_rows = _gathered_rows(kv_info, k_ref, tile)
        kv_at = tile if kv_rows is None else kv_rows
        k = tiles.rotate(tiles.load_parts(k_ref, (kv_at,), spec, head_dim), k_cs, k_ref.dtype)
        v = v_ref[kv_at, :]
        s, _ = _scores(q, k, spec)
        if spec.alibi and kv_rows is not None:
            s = s + _alibi(spec, slope, q_orig, kv_info.get("orig", tile)[None, :], 0)
        elif spec.alibi:
            s = s + _alibi(spec, slope, rows[:, None], (start + jnp.arange(block_k))[None, :], start)
        if masked:
            cols = start + jnp.arange(block_k)
            kv_seg = kv_info.get("seg", tile)
            kv_seg = None if kv_seg is None else kv_seg[None, :]
            kv_orig = None if kv_rows is None else kv_info.get("orig", tile)[None, :]
            s, _ = _mask(spec, st, s, rows[:, None], cols[None, :], q_seg, kv_seg, q_orig, kv_orig)
        # online softmax update; a row that has seen only masked keys keeps m = -inf, so the
        # exponent uses 0 in its place and every p of that row is exp2(-inf) = 0, never NaN.
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l = l * alpha + p.sum(axis=1)
        if spec.dropout:  # the sum l is the softmax's; dropout acts on the probabilities after it
            keep = dropout.keep(row_bits, drop_cols_ref[tile][None, :], spec.dropout)
            p = jnp.where(keep, p, 0.0)  # 1 / (1 - rate): once a row, below
        acc = acc * alpha[:, None] + tiles.dot(p.astype(v.dtype), v, spec)
        return m_new, l, acc

    carry = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
             jnp.zeros((block_q, head_dim), jnp.float32))
    m, l, acc = _visit(ranges_ref, body, carry, _needs_mask(st, block_k))
    empty = l == 0.0  # no visible key: output 0, lse -inf
    l_safe = jnp.where(empty, 1.0, l)
    inv_l = 1.0 / l_safe
    o_scale = inv_l * drop_scale if spec.dropout else inv_l
    out_rows = q_rows if st.scatter else None  # under an ordering: scattered back to the original rows
    _put(o_ref, out_rows, acc * o_scale[:, None])
    _put(lse_ref, out_rows, jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) / LOG2E))
    # For the backward: P = exp2(s2 - m2) * inv_l. Recomputing P from lse instead would put
    # ulp(lse) of absolute error into every exponent, too much for fp32 gradients. Rows with no
    # visible key store m2 = +inf, inv_l = 0, so their P is 0.
    _put(m2_ref, out_rows, jnp.where(empty, jnp.inf, m))
    _put(inv_l_ref, out_rows, jnp.where(empty, 0.0, inv_l))


def _fwd_call(st: _Static, q, k, v, side, ranges, *, differentiated: bool, out_dtype=None):
    """-> out, lse, m2, inv_l and, differentiated with RoPE, q rotated (for the backward)."""
    batch, q_pad, num_heads, head_dim = q.shape
    kv_pad, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    q_head, kv_head, row = _head_maps(st, group)
    src = _source_batch(st)
    programs = num_heads if st.rows is None else st.rows.programs
    bq = st.blocks.block_q
    ordered = st.spec.ordered
    if ordered:  # q, k, v whole per head (rows gathered); the tile grid is the ordered sequence's
        batch, q_pad, kv_pad = batch * st.batch_div, side[0].shape[2], side[1].shape[2]
    rb = ranges.shape[0]  # 1 (static ranges, broadcast) or batch rows (segment ids)
    side_specs, side_args = tiles.side_specs_and_args(side, bq, lambda i, b, h: i, kv_pad, lambda *_: 0,
                                                      lambda i, b, h: row(b, h))
    q_in = (pl.BlockSpec((None, q.shape[1], None, head_dim), lambda i, b, h: (src(b), 0, q_head(h), 0)) if ordered
            else pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, q_head(h), 0)))
    kv_spec = pl.BlockSpec((None, k.shape[1], None, head_dim), lambda i, b, h: (src(b), 0, kv_head(h), 0))
    in_specs = [
        pl.BlockSpec((None, None, 4), lambda i, b, h: (row(b, h) if rb > 1 else 0, i, 0)),
        q_in, kv_spec, kv_spec,
        *side_specs,
    ]
    if st.scatter:  # the tile's rows are scattered over the whole sequence
        q_spec = pl.BlockSpec((None, q_pad, None, head_dim), lambda i, b, h: (b, 0, h, 0))
        stat_spec = pl.BlockSpec((None, None, q_pad), lambda i, b, h: (b, h, 0))
    else:
        q_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
        stat_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    rotated = differentiated and st.spec.rope is not None
    out_shape = (batch, q_pad, programs, head_dim)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, st=st),
        grid=(q_pad // bq, batch, programs),  # query blocks fastest: neighbours share K/V in L2
        in_specs=in_specs,
        out_specs=[q_spec] + [stat_spec] * 3
        + [q_spec] * rotated,
        out_shape=[jax.ShapeDtypeStruct(out_shape, out_dtype or q.dtype)]
        + [jax.ShapeDtypeStruct((batch, programs, q_pad), jnp.float32)] * 3  # lse, m2, inv_l
        + [jax.ShapeDtypeStruct(out_shape, q.dtype)] * rotated,  # q rotated
        compiler_params=plgpu.CompilerParams(num_warps=st.blocks.num_warps,
                                             num_stages=st.blocks.num_stages),
        interpret=st.interpret,
        name="flash_fwd",
    )(ranges, q, k, v, *side_args)


# ----------------------------------------------------------------------------------------------
# Backward. Inputs beside q, k, v, dO: the forward's row statistics m2, inv_l (P = exp2(s2 - m2)
# * inv_l) and delta = rowsum(dO * O) - dlse (FA2 Alg. 2 line 4; subtracting dlse makes the lse
# output differentiable: d lse_i / d s_ij = p_ij).
# With RoPE no loop rotates anything: q arrives rotated by the forward; the dK/dV kernel rotates
# its key block once and writes it out for the dQ kernel. Only dQ and dK are rotated back (R^T).
# ----------------------------------------------------------------------------------------------


def _dkdv_kernel(ranges_ref, q_ref, k_ref, v_ref, do_ref, m2_ref, inv_l_ref, delta_ref, *refs,
                 st: _Static):
    """One program per (key block, batch, kv head); loops over the group's query heads."""
    spec = st.spec
    q_info, kv_info, tables, rest = tiles.unpack(refs, spec)
    slopes_ref = rest.pop(0) if spec.alibi else None
    drop_rows_ref, drop_cols_ref, drop_scale = _dropout_inputs(rest, spec)
    dk_ref, dv_ref, *k_rot_ref = rest
    # the group's first query head (program ids are read outside the loops: the interpreter
    # cannot discharge them inside)
    first_head = pl.program_id(2) * q_ref.shape[1] if spec.alibi or spec.dropout else None
    if spec.dropout:
        batch_row = pl.program_id(1)
    block_k, head_dim = st.blocks.block_k_dkv, k_ref.shape[-1]
    group = q_ref.shape[1]
    block_q = st.blocks.block_q_dkv
    rope = spec.rope is not None
    k_cs = tiles.rope_cos_sin(tables[1]) if rope else None
    kv_rows = _gathered_rows(kv_info, k_ref)  # under an ordering: the tile's rows in k, v
    kv_at = slice(None) if kv_rows is None else kv_rows
    k = tiles.rotate(tiles.load_parts(k_ref, (kv_at,), spec, head_dim), k_cs, k_ref.dtype)
    if k_rot_ref:
        tiles.store_parts(k_rot_ref[0], k, spec, head_dim)
    k = tiles.join_parts(k, spec, head_dim)  # rotated: the products take q, k whole
    v = v_ref[...] if kv_rows is None else v_ref[kv_rows, :]
    cols = (pl.program_id(0) * block_k + jnp.arange(block_k))[:, None]
    if spec.dropout:
        col_bits = drop_cols_ref[pl.ds(pl.program_id(0) * block_k, block_k)][:, None]
    kv_seg = kv_info.get("seg")
    kv_seg = None if kv_seg is None else kv_seg[:, None]
    kv_orig = None if kv_rows is None else kv_info.get("orig")[:, None]
    stats_at = kv_rows is not None and st.scatter  # row statistics in the original order

    def body(step, carry, masked):
        # One flat loop over (query block, head of the group): no nested loops, so the compiler
        # pipelines one loop per masked/unmasked segment.
        dk, dv = carry
        i, g = step // group, step % group
        start = pl.multiple_of(i * block_q, block_q)
        tile = pl.ds(start, block_q)
        q_rows = _gathered_rows(q_info, q_ref, tile)
        q_at = tile if q_rows is None else q_rows
        q = q_ref[q_at, g, :]  # rotated already
        do = do_ref[q_at, g, :]
        stat_at = q_rows if stats_at else tile
        m2 = m2_ref[g, stat_at]
        inv_l = inv_l_ref[g, stat_at]
        delta = delta_ref[g, stat_at]
        s, t = _scores((q,), (k,), spec, k_major=True)  # [block_k, block_q]
        if spec.alibi:
            slope = slopes_ref[first_head + g]
            s = s + (_alibi(spec, slope, (start + jnp.arange(block_q))[None, :], cols, start) if kv_orig is None
                     else _alibi(spec, slope, q_info.get("orig", tile)[None, :], kv_orig, 0))
        if masked:
            rows = (start + jnp.arange(block_q))[None, :]
            q_seg = q_info.get("seg", tile)
            q_seg = None if q_seg is None else q_seg[None, :]
            q_orig = None if q_rows is None else q_info.get("orig", tile)[None, :]
            s, mask = _mask(spec, st, s, rows, cols, q_seg, kv_seg, q_orig, kv_orig)
        p = jnp.exp2(s - m2[None, :]) * inv_l[None, :]
        dp = tiles.dot(v, do, spec, trans_b=True)
        if spec.dropout:  # dV takes the kept probabilities, dP the same factor
            w = dropout.weight(dropout.keep(drop_rows_ref[batch_row, first_head + g, tile][None, :], col_bits,
                                            spec.dropout), drop_scale)
            dv = dv + tiles.dot((p * w).astype(do.dtype), do, spec)
            ds = p * (dp * w - delta[None, :])
        else:
            dv = dv + tiles.dot(p.astype(do.dtype), do, spec)
            ds = p * (dp - delta[None, :])
        if t is not None:  # soft cap: d/draw [cap * tanh(raw * scale / cap)] = scale * (1 - t^2)
            ds = ds * (1.0 - t * t)
        if masked:  # p = 0 there, but dp may be inf (huge masked values): 0 * inf = NaN
            ds = jnp.where(mask, ds, 0.0)
        dk = dk + tiles.dot(ds.astype(q_ref.dtype), q, spec)
        return dk, dv

    carry = (jnp.zeros((block_k, head_dim), jnp.float32),) * 2
    dk, dv = _visit(ranges_ref, body, carry, _needs_mask(st, block_k), stride=group)
    if st.scatter and kv_rows is not None:  # back to the original rows (no RoPE under an ordering)
        _put(dk_ref, kv_rows, dk * spec.scale)
        _put(dv_ref, kv_rows, dv)
        return
    tiles.store_rotated_back(dk_ref, dk * spec.scale, spec, head_dim, k_cs)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(ranges_ref, q_ref, k_ref, v_ref, do_ref, m2_ref, inv_l_ref, delta_ref, *refs,
               st: _Static):
    """One program per (query block, batch, query head); loops over its visible key blocks."""
    spec = st.spec
    q_info, kv_info, tables, rest = tiles.unpack(refs, spec)
    slope = rest.pop(0)[pl.program_id(2)] if spec.alibi else None
    drop_rows_ref, drop_cols_ref, drop_scale = _dropout_inputs(rest, spec)
    (dq_ref,) = rest
    block_q, head_dim = st.blocks.block_q_dq, q_ref.shape[-1]
    block_k = st.blocks.block_k_dq
    q_rows = _gathered_rows(q_info, q_ref)  # under an ordering: the tile's rows in q, dO
    q_at = ... if q_rows is None else (q_rows, slice(None))
    q = q_ref[q_at]  # q, k rotated already: the products take them whole
    do = do_ref[q_at]
    stat_at = q_rows if q_rows is not None and st.scatter else ...
    m2 = m2_ref[stat_at][:, None]
    inv_l = inv_l_ref[stat_at][:, None]
    delta = delta_ref[stat_at][:, None]
    rows = (pl.program_id(0) * block_q + jnp.arange(block_q))[:, None]
    q_seg = q_info.get("seg")
    q_seg = None if q_seg is None else q_seg[:, None]
    q_orig = q_info.get("orig")
    q_orig = None if q_orig is None else q_orig[:, None]
    if spec.dropout:
        row_bits = drop_rows_ref[pl.program_id(1), pl.program_id(2), pl.ds(pl.program_id(0) * block_q, block_q)]
        row_bits = row_bits[:, None]

    def body(j, dq, masked):
        start = pl.multiple_of(j * block_k, block_k)
        tile = pl.ds(start, block_k)
        kv_rows = _gathered_rows(kv_info, k_ref, tile)
        kv_at = tile if kv_rows is None else kv_rows
        k = k_ref[kv_at, :]
        v = v_ref[kv_at, :]
        s, t = _scores((q,), (k,), spec)
        if spec.alibi and q_orig is not None:
            s = s + _alibi(spec, slope, q_orig, kv_info.get("orig", tile)[None, :], 0)
        elif spec.alibi:
            s = s + _alibi(spec, slope, rows, (start + jnp.arange(block_k))[None, :], start)
        if masked:
            cols = (start + jnp.arange(block_k))[None, :]
            kv_seg = kv_info.get("seg", tile)
            kv_seg = None if kv_seg is None else kv_seg[None, :]
            kv_orig = None if kv_rows is None else kv_info.get("orig", tile)[None, :]
            s, mask = _mask(spec, st, s, rows, cols, q_seg, kv_seg, q_orig, kv_orig)
        p = jnp.exp2(s - m2) * inv_l
        dp = tiles.dot(do, v, spec, trans_b=True)
        if spec.dropout:
            w = dropout.weight(dropout.keep(row_bits, drop_cols_ref[tile][None, :], spec.dropout), drop_scale)
            ds = p * (dp * w - delta)
        else:
            ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        if masked:
            ds = jnp.where(mask, ds, 0.0)
        return dq + tiles.dot(ds.astype(k_ref.dtype), k, spec)

    dq = _visit(ranges_ref, body, jnp.zeros((block_q, head_dim), jnp.float32), _needs_mask(st, block_k))
    if st.scatter and q_rows is not None:  # back to the original rows (no RoPE under an ordering)
        _put(dq_ref, q_rows, dq * spec.scale)
        return
    tiles.store_rotated_back(dq_ref, dq * spec.scale, spec, head_dim,
                        None if tables is None else tiles.rope_cos_sin(tables[0]))


def _bwd_call(st: _Static, q, k, v, side, dq_ranges, dkdv_ranges,
              do, m2, inv_l, delta, grad_dtype=None):
    """q is rotated already with RoPE (the forward's output), k is not. grad_dtype: the dtype of
    dq, dk, dv (default: q's, k's, v's). Under an ordering q, k, v, dO span whole sequences (rows
    gathered at the side field "orig"), and with st.scatter the row statistics are in the original
    order and dq, dk, dv are scattered back to it."""
    batch, q_pad, num_heads, head_dim = q.shape
    kv_pad, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    q_head, kv_head, row = _head_maps(st, group)
    src = _source_batch(st)
    ordered = st.spec.ordered
    q_len_in, kv_len_in = q_pad, kv_pad  # rows of the arrays read
    if ordered:
        batch, q_pad, kv_pad = batch * st.batch_div, side[0].shape[2], side[1].shape[2]
    blocks = st.blocks
    params = plgpu.CompilerParams(num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages_bwd)

    # dK/dV: query-side arrays viewed per kv head, [B, S, Hkv, G, D] and [B, Hkv, G, S]. Through a
    # row map the offset may differ within a GQA group: one program per query head instead, each
    # writing its own dK/dV (the caller sums them over the group).
    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    rb = dkdv_ranges.shape[0]
    if st.rows is None:
        programs, per_program = num_kv_heads, group
        q_group, kv_in = (lambda h: h), (lambda h: h)
    else:
        programs, per_program = st.rows.programs, 1
        q_group, kv_in = q_head, kv_head
    q_group_spec = pl.BlockSpec((None, q_len_in, None, per_program, head_dim),
                                lambda j, b, h: (src(b), 0, q_group(h), 0, 0))
    row_group_spec = pl.BlockSpec((None, None, per_program, q_pad), lambda j, b, h: (b, h, 0, 0))
    if ordered:
        kv_in_spec = pl.BlockSpec((None, kv_len_in, None, head_dim), lambda j, b, h: (src(b), 0, kv_in(h), 0))
    else:
        kv_in_spec = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, kv_in(h), 0))
    if st.scatter:
        kv_out_spec = pl.BlockSpec((None, kv_pad, None, head_dim), lambda j, b, h: (b, 0, h, 0))
    else:
        kv_out_spec = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0))
    side_specs, side_args = tiles.side_specs_and_args(side, q_pad, lambda *_: 0, bk, lambda j, b, h: j,
                                                      lambda j, b, h: row(b, h))
    in_specs = [pl.BlockSpec((None, None, 4), lambda j, b, h: (row(b, h) if rb > 1 else 0, j, 0)),
                q_group_spec, kv_in_spec, kv_in_spec, q_group_spec,
                row_group_spec, row_group_spec, row_group_spec, *side_specs]
    as_groups = lambda x: x.reshape(x.shape[0], x.shape[1], num_heads // per_program, per_program, head_dim)
    rows_as_groups = lambda x: x.reshape(batch, programs, per_program, q_pad)
    rotated = st.spec.rope is not None
    kv_shape = (batch, kv_pad, programs, head_dim)
    dk, dv, *k_rot = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st),
        grid=(kv_pad // bk, batch, programs),
        in_specs=in_specs,
        out_specs=[kv_out_spec] * (2 + rotated),
        out_shape=[jax.ShapeDtypeStruct(kv_shape, grad_dtype or k.dtype),
                   jax.ShapeDtypeStruct(kv_shape, grad_dtype or v.dtype)]
        + [jax.ShapeDtypeStruct(k.shape, k.dtype)] * rotated,  # k rotated, for the dQ kernel
        compiler_params=params, interpret=st.interpret, name="flash_bwd_dkdv",
    )(dkdv_ranges, as_groups(q), k, v, as_groups(do), rows_as_groups(m2),
      rows_as_groups(inv_l), rows_as_groups(delta), *side_args)

    # dQ: same tiling as the forward.
    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    rb = dq_ranges.shape[0]
    programs = num_heads if st.rows is None else st.rows.programs
    if ordered:
        q_block_spec = pl.BlockSpec((None, q_len_in, None, head_dim), lambda i, b, h: (src(b), 0, q_head(h), 0))
    else:
        q_block_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, q_head(h), 0))
    if st.scatter:
        dq_spec = pl.BlockSpec((None, q_pad, None, head_dim), lambda i, b, h: (b, 0, h, 0))
        row_spec = pl.BlockSpec((None, None, q_pad), lambda i, b, h: (b, h, 0))
    else:
        dq_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
        row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    kv_full_spec = pl.BlockSpec((None, kv_len_in, None, head_dim), lambda i, b, h: (src(b), 0, kv_head(h), 0))
    side_specs, side_args = tiles.side_specs_and_args(side, bq, lambda i, b, h: i, kv_pad, lambda *_: 0,
                                                      lambda i, b, h: row(b, h))
    in_specs = [pl.BlockSpec((None, None, 4), lambda i, b, h: (row(b, h) if rb > 1 else 0, i, 0)),
                q_block_spec, kv_full_spec, kv_full_spec, q_block_spec, row_spec, row_spec,
                row_spec, *side_specs]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid=(q_pad // bq, batch, programs),
        in_specs=in_specs,
        out_specs=dq_spec,
        out_shape=jax.ShapeDtypeStruct((batch, q_pad, programs, head_dim), grad_dtype or q.dtype),
        compiler_params=params, interpret=st.interpret, name="flash_bwd_dq",
    )(dq_ranges, q, *k_rot or [k], v, do, m2, inv_l, delta, *side_args)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# custom_vjp wiring (on tile-padded arrays) and the entry point.
# ----------------------------------------------------------------------------------------------


def _forward(st: _Static, q, k, v, side, ranges, *, differentiated: bool):
    """The forward kernel the call asked for -> out, lse, m2, inv_l and (q, k) as that engine's
    backward reads them: with RoPE, q rotated (and, from the Mosaic forward, k rotated too; the
    Triton dK/dV kernel rotates its own key block). inv_l is None for the Mosaic kernels, whose
    backward recomputes P = exp2(s2 - m2) from m2 = lse2 alone."""
    if st.mosaic is None:
        out, lse, m2, inv_l, *q_rot = _fwd_call(st, q, k, v, side, ranges, differentiated=differentiated)
        return out, lse, m2, inv_l, (q_rot[0] if q_rot else q, k)
    out, lse2, *rotated = mosaic_gpu.flash_forward(q, k, v, st.spec, st.kv_len, st.mosaic, side[2],
                                                   rotated=differentiated and st.spec.rope is not None)
    lse, m2 = lse2 / LOG2E, jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)  # empty rows: P = 0
    return out, lse, m2, None, tuple(rotated) or (q, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, side, fwd_ranges, dq_ranges, dkdv_ranges):
    out, lse, *_ = _forward(st, q, k, v, side, fwd_ranges, differentiated=False)
    return out, lse


def _flash_fwd(st, q, k, v, side, fwd_ranges, dq_ranges, dkdv_ranges):
    out, lse, m2, inv_l, (q, k) = _forward(st, q, k, v, side, fwd_ranges, differentiated=True)
    return (out, lse), (q, k, v, side, dq_ranges, dkdv_ranges, out, m2, inv_l)


def _flash_bwd(st, residuals, cotangents):
    q, k, v, side, dq_ranges, dkdv_ranges, out, m2, inv_l = residuals
    do, dlse = cotangents
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
    delta = delta - dlse
    if st.mosaic is not None:
        dq, dk, dv = mosaic_gpu.flash_backward(q, k, v, do.astype(q.dtype), m2, delta, st.spec, st.kv_len,
                                                 st.mosaic, side[2])
    else:
        dq, dk, dv = _bwd_call(st, q, k, v, side, dq_ranges, dkdv_ranges,
                               do.astype(q.dtype), m2, inv_l, delta)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _side_info(fields, length, seg, orig=None):
    """[B, fields, length] int32, edge-padded (keeps each block's id interval unchanged)."""
    rows = [{"seg": seg, "orig": orig}[f].astype(jnp.int32) for f in fields]
    return padding.pad_axis(jnp.stack(rows, axis=1), 2, length, mode="edge")


def flash_attention_pallas(q, k, v, q_seg, kv_seg, spec: AttentionSpec, *, q_pos=None, kv_pos=None,
                           blocks: BlockSizes | None = None, interpret: bool | None = None,
                           kernels: str = "triton", mosaic_blocks: mosaic_gpu.MosaicBlockSizes | None = None,
                           slopes=None, seed=None, order=None):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (validated) -> (out [B, Sq, Hq, D], lse [B, Hq, Sq]).

    Segment ids [B, Sq]/[B, Sk] when spec.has_segments; RoPE positions [B, Sq]/[B, Sk] when
    spec.rope; ALiBi slopes [Hq] fp32 when spec.alibi. Pads the head dim to a power of two and the sequences to tile multiples (zeros;
    padded keys are masked, padded rows sliced off), so any shape runs on one kernel family.
    kernels="mosaic_gpu" runs the Hopper kernels of `mosaic_gpu` instead, forward and backward
    (raises where they cannot serve the call).

    order: int32 [S] (Sq == Sk, with spec.ordered): the ordering pi, position t of the ordered
    sequence holding token pi[t]. The tiles are those of the ordered sequence (window and tile
    skipping on it); every kernel gathers a tile's q, k, v, dO rows at pi[tile] and scatters out,
    lse, dq, dk, dv back to those rows, so all arrays stay in the original order; causality
    compares pi values, segment ids are read per original token.
    """
    if kernels not in ("triton", "mosaic_gpu"):
        raise ValueError(f"kernels must be 'triton' or 'mosaic_gpu', got {kernels!r}")
    if spec.ordered != (order is not None):
        raise ValueError("an ordered spec needs its order, and an order an ordered spec")
    if spec.ordered and (kernels != "triton" or spec.rope is not None or spec.offset or q.shape[1] != k.shape[1]):
        raise NotImplementedError("orderings run on the Triton kernels, self-attention without in-kernel RoPE "
                                  "or offsets")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    batch, q_len, _, head_dim = q.shape
    kv_len = k.shape[1]
    head_pad = padded_head_dim(spec, head_dim)
    if blocks is None:
        blocks = default_block_sizes(head_pad, interpret, q.dtype, rope=spec.rope is not None,
                                     rope_positions=q_pos is not None)
    blocks = blocks.fitted(q_len, kv_len)
    tile_q = max(blocks.block_q, blocks.block_q_dkv, blocks.block_q_dq)
    tile_k = max(blocks.block_k, blocks.block_k_dkv, blocks.block_k_dq)
    if kernels == "mosaic_gpu":
        if reason := mosaic_gpu.unsupported_reason(spec, head_dim, q.dtype, positions=q_pos is not None):
            raise NotImplementedError(f"implementation='mosaic' cannot serve this call: {reason}")
        mosaic_blocks = mosaic_blocks or mosaic_gpu.default_mosaic_block_sizes(head_pad)
        tile_q, tile_k = max(tile_q, mosaic_blocks.tiles[0]), max(tile_k, mosaic_blocks.tiles[1])
    else:
        mosaic_blocks = None
    q_pad, kv_pad = pl.cdiv(q_len, tile_q) * tile_q, pl.cdiv(kv_len, tile_k) * tile_k

    qp = padding.pad_axis(padding.pad_head_dim(q, spec, head_pad, True), 1, q_pad)
    kp = padding.pad_axis(padding.pad_head_dim(k, spec, head_pad, True), 1, kv_pad)
    vp = padding.pad_axis(padding.pad_head_dim(v, spec, head_pad, False), 1, kv_pad)

    fields = tiles.info_fields(spec)
    # under an ordering: the token each row of the ordered sequence holds (padding rows: their own)
    tokens = lambda n: jnp.concatenate([order.astype(jnp.int32), jnp.arange(q_len, n, dtype=jnp.int32)])
    side = [None] * 4
    if fields and order is None:
        side[:2] = _side_info(fields, q_pad, q_seg), _side_info(fields, kv_pad, kv_seg)
    if spec.rope is not None and mosaic_blocks is not None:  # (positions arange: angle addition)
        side[2] = mosaic_gpu.rope_tables(spec.rope, head_dim, head_pad, max(q_pad, kv_pad))
    elif spec.rope is not None:
        side[2:] = (rope_tables(q_pos, spec.rope, head_dim, head_pad, q_pad, batch),
                    rope_tables(kv_pos, spec.rope, head_dim, head_pad, kv_pad, batch))
    if spec.alibi or spec.dropout:  # whole; slopes padded to a power of two (a Triton block)
        side.append(padding.pad_axis(slopes.astype(jnp.float32), 0, pow2_at_least(slopes.shape[0]))
                    if spec.alibi else None)
    if spec.dropout:  # every row's and key's bits, hashed once here rather than in every tile
        rows_bits, cols_bits = dropout.tables(seed, batch, q.shape[2], q_pad, kv_pad)
        if order is not None:  # an ordered row takes its token's bits: the mask of the unordered call
            rows_bits, cols_bits = jnp.take(rows_bits, tokens(q_pad), axis=2), jnp.take(cols_bits, tokens(kv_pad))
        side += [rows_bits, cols_bits, dropout.scale_input(spec.dropout)]
    if order is not None:  # the ordered sequence's side fields: ids of its tokens, their positions
        orig = jnp.broadcast_to(tokens(q_pad), (batch, q_pad))
        if spec.has_segments:
            q_seg, kv_seg = (jnp.take(x, order, axis=1) for x in (q_seg, kv_seg))
        seg = (lambda x: padding.pad_axis(x, 1, q_pad, mode="edge")) if spec.has_segments else (lambda x: None)
        side[:2] = _side_info(fields, q_pad, seg(q_seg), orig), _side_info(fields, kv_pad, seg(kv_seg), orig)
    side = tuple(side)
    if spec.has_segments:
        q_seg = padding.pad_axis(q_seg.astype(jnp.int32), 1, q_pad, mode="edge")
        kv_seg = padding.pad_axis(kv_seg.astype(jnp.int32), 1, kv_pad, mode="edge")

    st = _Static(spec, blocks, q_len, kv_len, interpret,
                 rope_arange=spec.rope is not None and q_pos is None, mosaic=mosaic_blocks,
                 scatter=order is not None)

    def ranges(bq, bk, key_major):  # the Triton kernels' tile walk (the Mosaic kernels derive theirs)
        if mosaic_blocks is not None:
            return None
        return block_ranges(spec, q_len, kv_len, bq, bk, q_pad // bq, kv_pad // bk,
                            q_seg, kv_seg, key_major=key_major)

    out, lse = _flash(st, qp, kp, vp, side,
                      ranges(blocks.block_q, blocks.block_k, False),
                      ranges(blocks.block_q_dq, blocks.block_k_dq, False),
                      ranges(blocks.block_q_dkv, blocks.block_k_dkv, True))
    return out[:, :q_len, :, :head_dim], lse[:, :, :q_len]


# ----------------------------------------------------------------------------------------------
# Row-mapped calls: the engine over a view whose heads are slots (dilated attention's branches,
# `attn_spec.dilation`), or over plain arrays (rows=None: ring attention's steps), forward and
# backward as separate steps, for a caller that merges the statistics of several calls before it
# differentiates them.
# ----------------------------------------------------------------------------------------------


def _mapped_setup(q, k, v, q_seg, kv_seg, spec: AttentionSpec, rows: RowMap | None, blocks, interpret,
                  mosaic_blocks, orig=None):
    """Pads the view to the tile grid -> (static, padded q, k, v, side inputs, ranges by kernel).
    Under an ordering q, k, v are the unviewed arrays (padded in the head dim only) and `orig`
    [B' * rate, L] the original row of each virtual sequence's rows (one array for both sides)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if spec.ordered != (orig is not None):
        raise ValueError("an ordered spec needs its rows' original positions, and those an ordered spec")
    if spec.ordered and (mosaic_blocks is not None or spec.rope is not None):
        raise NotImplementedError("orderings run on the Triton kernels, without RoPE")
    q_len, kv_len = (q.shape[1], k.shape[1]) if orig is None else (orig.shape[1],) * 2
    head_dim = q.shape[3]
    head_pad = padded_head_dim(spec, head_dim)
    blocks = (blocks or default_block_sizes(head_pad, interpret, q.dtype)).fitted(q_len, kv_len)
    tile = max(blocks.block_q, blocks.block_k, blocks.block_q_dkv, blocks.block_k_dkv,
               blocks.block_q_dq, blocks.block_k_dq, *(mosaic_blocks.tiles if mosaic_blocks else ()))
    q_pad, kv_pad = pl.cdiv(q_len, tile) * tile, pl.cdiv(kv_len, tile) * tile
    if orig is None:
        pad = lambda x, n: padding.pad_axis(padding.pad_axis(x, 3, head_pad), 1, n)
    else:  # rows gathered from the whole sequence: only the head dim is padded
        pad = lambda x, n: padding.pad_axis(x, 3, head_pad)
    side = [None] * 4
    fields = tiles.info_fields(spec)
    if orig is not None:  # ordered self-attention: one side array serves queries and keys
        seg = padding.pad_axis(q_seg.astype(jnp.int32), 1, q_pad, mode="edge") if spec.has_segments else None
        # padding rows: past the sequence's end (clamped when loaded, never seen)
        orig = jnp.pad(orig.astype(jnp.int32), ((0, 0), (0, q_pad - q_len)), constant_values=q.shape[1])
        side[:2] = (_side_info(fields, q_pad, seg, orig),) * 2
        q_seg = kv_seg = seg
    elif spec.has_segments:
        if kv_seg is q_seg and q_pad == kv_pad:  # one array serves both sides (a view's ids)
            q_seg = kv_seg = padding.pad_axis(q_seg.astype(jnp.int32), 1, q_pad, mode="edge")
            side[:2] = (_side_info(fields, q_pad, q_seg),) * 2
        else:
            q_seg = padding.pad_axis(q_seg.astype(jnp.int32), 1, q_pad, mode="edge")
            kv_seg = padding.pad_axis(kv_seg.astype(jnp.int32), 1, kv_pad, mode="edge")
            side[:2] = _side_info(fields, q_pad, q_seg), _side_info(fields, kv_pad, kv_seg)
    batch_div = 1 if orig is None else orig.shape[0] // (rows.rate * q.shape[0])
    st = _Static(spec, blocks, q_len, kv_len, interpret, rows=rows, mosaic=mosaic_blocks, batch_div=batch_div)

    def ranges(bq, bk, key_major):
        return block_ranges(spec, q_len, kv_len, bq, bk, q_pad // bq, kv_pad // bk, q_seg, kv_seg,
                            key_major=key_major)

    plans = (ranges(blocks.block_q, blocks.block_k, False), ranges(blocks.block_q_dq, blocks.block_k_dq, False),
             ranges(blocks.block_q_dkv, blocks.block_k_dkv, True))
    return st, pad(q, q_pad), pad(k, kv_pad), pad(v, kv_pad), tuple(side), plans


def mapped_forward(q, k, v, seg, spec: AttentionSpec, rows: RowMap | None, *, blocks: BlockSizes | None = None,
                   interpret: bool | None = None, out_dtype=None,
                   mosaic_blocks: mosaic_gpu.MosaicBlockSizes | None = None, kv_seg=None, orig=None):
    """Attention over a view read through `rows`: q [B', L, rate * H, D], k/v [B', L, rate * Hkv, D],
    segment ids seg [B' * rate, L] (row `rows.side_row(b, h)`) when spec.has_segments.
    -> out [B', L, P, D] (out_dtype, default q's), m2, inv_l [B', P, L] fp32 (P = rows.programs):
    P = exp2(s2 - m2) * inv_l; a row with no visible key has m2 = +inf, inv_l = 0. With
    `mosaic_blocks` the Hopper kernels run it (where `mosaic_gpu.unsupported_reason` allows; they
    write out in q's dtype and keep lse2 alone: m2 = lse2, inv_l = 1).
    rows=None: plain attention, q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (Sq and Sk may differ), seg
    the query ids [B, Sq] and kv_seg the keys' [B, Sk] (default seg); P = Hq.

    Under an ordering (spec.ordered): q [B, S, H, D], k/v [B, S, Hkv, D] unviewed, and orig int32
    [B' * rate, L] (row `rows.side_row(b, h)`, B' = B * n): the original row of each row of each
    virtual sequence. The kernels gather every tile's rows from q, k, v at those rows (no view,
    no permuted copy); causality compares them; the outputs are as above, compact."""
    st, qp, kp, vp, side, (fwd, _, _) = _mapped_setup(q, k, v, seg, seg if kv_seg is None else kv_seg, spec, rows,
                                                      blocks, interpret, mosaic_blocks, orig)
    if mosaic_blocks is not None:
        out, lse2 = mosaic_gpu.flash_forward(qp, kp, vp, spec, st.kv_len, mosaic_blocks, row_map=rows)
        empty = lse2 == -jnp.inf
        m2, inv_l = jnp.where(empty, jnp.inf, lse2), jnp.where(empty, 0.0, 1.0)
    else:
        out, _, m2, inv_l = _fwd_call(st, qp, kp, vp, side, fwd, differentiated=False, out_dtype=out_dtype)
    length, head_dim = st.q_len, q.shape[3]
    return out[:, :length, :, :head_dim], m2[:, :, :length], inv_l[:, :, :length]


def mapped_backward(q, k, v, seg, spec: AttentionSpec, rows: RowMap | None, do, m2, inv_l, delta, *,
                    blocks: BlockSizes | None = None, interpret: bool | None = None,
                    mosaic_blocks: mosaic_gpu.MosaicBlockSizes | None = None, kv_seg=None, grad_dtype=None,
                    orig=None):
    """The backward of `mapped_forward` at given row statistics (m2, inv_l, delta [B', P, L] fp32,
    P = exp2(s2 - m2) * inv_l; delta = rowsum(dO * O) - dlse), dO [B', L, rate * H, D] read through
    `rows` like q. -> dq, dk, dv [B', L, P, D], each program's own (dk, dv per query head).
    rows=None: plain attention as in `mapped_forward`; dk, dv [B, Sk, Hkv, D] (summed over each
    GQA group in the kernel). grad_dtype: the Triton kernels' gradient dtype (default the inputs').
    Under an ordering q, k, v and dO [B, S, H, D] are unviewed and gathered through `orig`, as in
    `mapped_forward`."""
    st, qp, kp, vp, side, (_, dq_plan, dkdv_plan) = _mapped_setup(q, k, v, seg, seg if kv_seg is None else kv_seg,
                                                                  spec, rows, blocks, interpret, mosaic_blocks, orig)
    padded = qp.shape[1] if orig is None else side[0].shape[2]
    dop = padding.pad_axis(do.astype(q.dtype), 3, qp.shape[3])
    if orig is None:
        dop = padding.pad_axis(dop, 1, padded)
    stat = lambda x, fill: jnp.pad(x, ((0, 0), (0, 0), (0, padded - x.shape[2])), constant_values=fill)
    # padded rows: P = exp2(s2 - inf) * 0 = 0
    if mosaic_blocks is not None:  # its P = exp2(s2 - lse2): fold 1 / inv_l into the exponent
        lse2 = jnp.where(inv_l > 0, m2 - jnp.log2(jnp.where(inv_l > 0, inv_l, 1.0)), jnp.inf)
        dq, dk, dv = mosaic_gpu.flash_backward(qp, kp, vp, dop, stat(lse2, jnp.inf), stat(delta, 0.0), spec,
                                               st.kv_len, mosaic_blocks, row_map=rows)
    else:
        dq, dk, dv = _bwd_call(st, qp, kp, vp, side, dq_plan, dkdv_plan, dop, stat(m2, jnp.inf),
                               stat(inv_l, 0.0), stat(delta, 0.0), grad_dtype=grad_dtype)
    q_len, kv_len, head_dim = st.q_len, st.kv_len, q.shape[3]
    return dq[:, :q_len, :, :head_dim], dk[:, :kv_len, :, :head_dim], dv[:, :kv_len, :, :head_dim]
