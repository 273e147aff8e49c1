"""The Pallas Triton tile toolkit every engine kernel family shares: dots at the call's precision,
q/k tiles as RoPE's pairs, in-kernel rotations from cos/sin tables, and the side inputs (segment
ids, RoPE tables) as block specs."""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_attn.ops.common import padding
from jax_attn.ops.common.rope import inverse_frequencies
from jax_attn.ops.common.spec import AttentionSpec




def dot(a, b, spec, *, trans_b=False):
    """a @ b (or a @ b.T) with fp32 accumulation; fp32 operands follow spec.precision."""
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=spec.precision,
                               preferred_element_type=jnp.float32)


def columns(spec: AttentionSpec, head_dim: int):
    """Column indexers of the feature parts of a padded head dim."""
    if spec.rope is None:
        return (slice(None),)
    half = head_dim // 2
    if spec.rope.style == "half":
        return pl.ds(0, half), pl.ds(half, half)
    return pl.ds(0, half, stride=2), pl.ds(1, half, stride=2)


def interleaved(spec: AttentionSpec) -> bool:
    return spec.rope is not None and spec.rope.style == "interleaved"


def load_parts(ref, prefix, spec, head_dim):
    # interleaved: one contiguous load, split in registers (stride-2 column loads are slow;
    # docs/design/rope.md)
    if interleaved(spec):
        return split_parts(ref[(*prefix, slice(None))], spec, head_dim)
    return tuple(ref[(*prefix, c)] for c in columns(spec, head_dim))


def split_parts(x, spec, head_dim):
    """A [rows, D] tile in registers -> its feature parts, as `load_parts` would load them."""
    if spec.rope is None:
        return (x,)
    if interleaved(spec):
        return tuple(jnp.unstack(x.reshape(*x.shape[:-1], head_dim // 2, 2), axis=-1))
    return tuple(jnp.split(x, 2, axis=1))


def join_parts(parts, spec, head_dim):
    """Feature parts in registers -> the [rows, D] tile they came from (`split_parts`'s inverse)."""
    if spec.rope is None:
        return parts[0]
    x = jnp.stack(parts, axis=-1)  # [rows, D/2, 2]: the pairs side by side
    if not interleaved(spec):
        x = x.transpose(0, 2, 1)  # [rows, 2, D/2]: the first members, then the second
    return x.reshape(x.shape[0], head_dim)


def store_parts(ref, parts, spec, head_dim, rows=slice(None)):
    if interleaved(spec):  # one contiguous store
        ref[rows, :] = join_parts(parts, spec, head_dim).astype(ref.dtype)
        return
    for c, x in zip(columns(spec, head_dim), parts):
        ref[rows, c] = x.astype(ref.dtype)


def rope_cos_sin(table_ref, rows=slice(None), delta=None):
    """cos, sin [rows, D/2] fp32 of one side's RoPE table [2, S, D/2] (`rope_tables`).

    Loaded, not computed: in-kernel sin/cos of angles up to S radians are slow, and a key tile
    would recompute them for every query block. But the rows of a tile cost twice the L2 traffic
    of the bf16 key tile itself (docs/design/rope.md, 'Tables, not transcendentals'). So at
    positions arange (`delta` = `rope_delta`: the table's first rows, loaded once per program),
    a tile starting at row n0 reads the single row n0 and applies the angle-addition rule,
    cos((n0 + d) t) = cos(n0 t) cos(d t) - sin(n0 t) sin(d t) (and likewise sin)."""
    if delta is None:
        return table_ref[0, rows, :], table_ref[1, rows, :]
    first = pl.ds(rows.start, 1)
    c0, s0 = table_ref[0, first, :], table_ref[1, first, :]
    cd, sd = delta
    return c0 * cd - s0 * sd, s0 * cd + c0 * sd


def rope_delta(st, tables, side: int, rows: int):
    """cos, sin of the angles d * theta, d in [0, rows), for `rope_cos_sin` at positions arange
    (rows 0..rows-1 of side `side`'s table); None when positions are given or there is no RoPE."""
    if tables is None or not st.rope_arange:
        return None
    return rope_cos_sin(tables[side], pl.ds(0, rows))


def rotate(parts, cos_sin, dtype, *, inverse=False):
    """(a, b) -> (a cos - b sin, a sin + b cos) in fp32; inverse applies R^T (for gradients)."""
    if cos_sin is None:
        return tuple(x.astype(dtype) for x in parts)
    cos, sin = cos_sin
    sin = -sin if inverse else sin
    a, b = (x.astype(jnp.float32) for x in parts)
    return (a * cos - b * sin).astype(dtype), (a * sin + b * cos).astype(dtype)


# Per-token side inputs: segment ids and, under an ordering, the rows' original positions ("orig":
# the rows the kernels gather and the positions causality compares) as one int32 array per side,
# [B, fields, S] (one ref per side whatever is switched on), and with RoPE one cos/sin table per
# side, [B, 2, S, D/2] fp32.
def info_fields(spec: AttentionSpec) -> tuple[str, ...]:
    return ("seg",) * spec.has_segments + ("orig",) * spec.ordered


class Side:
    """Reads one field of a side-info ref: `side.get("seg", pl.ds(...))`, None when absent."""

    def __init__(self, ref, spec):
        self.ref, self.fields = ref, info_fields(spec)

    def get(self, name, idx=slice(None)):
        if name not in self.fields:
            return None
        return self.ref[self.fields.index(name), idx]


def unpack(refs, spec):
    """(q side, kv side, (q table ref, kv table ref) or None, remaining refs) from a kernel's
    trailing refs."""
    refs = list(refs)
    has_info = bool(info_fields(spec))
    q_info = Side(refs.pop(0), spec) if has_info else Side(None, spec)
    kv_info = Side(refs.pop(0), spec) if has_info else Side(None, spec)
    tables = (refs.pop(0), refs.pop(0)) if spec.rope is not None else None
    return q_info, kv_info, tables, refs


def side_specs_and_args(side, q_rows, q_block, kv_rows, kv_block, batch_row=lambda *g: g[1]):
    """BlockSpecs and args of the optional side inputs, in the order `unpack` reads them.

    side = (q_info, kv_info, q_table, kv_table, *whole) (None where absent); q_rows / kv_rows:
    rows per block; q_block / kv_block map the grid ids to the block index along the sequence,
    batch_row to the row of the per-batch inputs (default: grid axis 1, the batch; a row map
    reads one row per batch and offset). The whole inputs (ALiBi's slopes [heads padded], dropout's
    row and column bits and its factor) come whole, after the tables: the refs after them in the kernel, in order."""
    q_info, kv_info, q_table, kv_table, *whole = side
    specs, args = [], []
    if q_info is not None:
        fields = q_info.shape[1]
        specs += [pl.BlockSpec((None, fields, q_rows), lambda *g: (batch_row(*g), 0, q_block(*g))),
                  pl.BlockSpec((None, fields, kv_rows), lambda *g: (batch_row(*g), 0, kv_block(*g)))]
        args += [q_info, kv_info]
    if q_table is not None:
        half = q_table.shape[-1]
        specs += [pl.BlockSpec((None, 2, q_rows, half), lambda *g: (g[1], 0, q_block(*g), 0)),
                  pl.BlockSpec((None, 2, kv_rows, half), lambda *g: (g[1], 0, kv_block(*g), 0))]
        args += [q_table, kv_table]
    for x in whole:
        if x is not None:
            specs.append(pl.BlockSpec(x.shape, lambda *g, ndim=x.ndim: (0,) * ndim))
            args.append(x)
    return specs, args


def rope_tables(pos, rope, head_dim: int, head_pad: int, length: int, batch: int):
    """cos, sin of pos * theta as [B, 2, length, head_pad / 2] fp32 (the angle computed as the
    reference computes it; theta zero on padded pairs; positions edge-padded to `length`; pos None
    means arange, continued over the padding)."""
    inv_freq = padding.pad_axis(inverse_frequencies(head_dim, rope.base), 0, head_pad // 2)
    if pos is None:
        pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    angle = padding.pad_axis(pos, 1, length, mode="edge").astype(jnp.float32)[:, :, None] * inv_freq[None, None]
    return jnp.stack([jnp.cos(angle), jnp.sin(angle)], axis=1)


def store_rotated_back(ref, x, spec, head_dim, cos_sin):
    """Store a gradient [rows, D] fp32 taken against rotated q or k; with RoPE rotated back (R^T,
    by the rows' `cos_sin`), in the feature parts it is split into for that, once per program."""
    if spec.rope is None:
        ref[...] = x.astype(ref.dtype)
        return
    store_parts(ref, rotate(split_parts(x, spec, head_dim), cos_sin, jnp.float32, inverse=True), spec, head_dim)
