"""NSA block importance as a Pallas kernel (Triton lowering): the compression branch's
probabilities recomputed from (q, k_cmp, lse) and summed over each kv head's query heads, without
materialising the [B, S, Hq, Nc] scores (Yuan et al. 2025, Eq. 9-10; `attn_spec.nsa`), then the
top-n rule, one chunk of query tokens at a time (so not even [B, S, Hkv, Nc] exists at once).

One program per (tile of query tokens, batch, kv head): the tile's rows are its tokens x the
group's heads ([tokens * G, D], a free reshape of q's [tokens, G, D] block), so the dot is full
size for any group; it walks the compressed keys up to the last token's frontier in tiles,
p = exp2(scale' s - lse2) under the block-causal (and segment) mask, sums the G heads of every
token and writes the group's probability per compressed key, [B, Hkv, C, Nc] fp32 for a chunk of C
tokens. XLA then maps compressed keys to selection blocks (`branches.to_selection_blocks`) and
marks the forced and the invisible blocks (`reference.selection_scores`); a second kernel picks each
row's top n (`_top_n_kernel`, in `lax.top_k`'s order; XLA's GPU `top_k` was a fifth of NSA's
forward+backward at 64k tokens: docs/design/nsa.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attn_spec import nsa
from attn_spec.tiles import pow2_at_least
from jax_attn.ops.common import padding
from jax_attn.ops.common.spec import LOG2E
from jax_attn.ops.nsa import branches, reference


def _tiles(interpret: bool, group: int):
    """(tokens per program, compressed keys per tile, num_warps, num_stages): 128 rows (16 in the
    interpreter), at least one token."""
    rows = 16 if interpret else 128
    return max(1, rows // group), 16 if interpret else 64, 4, 1 if interpret else 2


def _kernel(pos_ref, q_ref, kc_ref, lse_ref, *refs, block, stride, scale, precision, has_segments, width):
    if has_segments:
        q_seg_ref, kc_seg_ref, out_ref = refs
    else:
        (out_ref,) = refs
    tokens, group, head_dim = q_ref.shape
    rows = tokens * group
    q = q_ref[...].reshape(rows, head_dim)
    lse2 = lse_ref[...].reshape(rows) * LOG2E
    pos = jnp.broadcast_to(pos_ref[...][:, None], (tokens, group)).reshape(rows)
    finite = lse2 > -jnp.inf
    lse2 = jnp.where(finite, lse2, 0.0)
    if has_segments:
        q_seg = jnp.broadcast_to(q_seg_ref[...][:, None], (tokens, group)).reshape(rows)
    last = pos_ref[tokens - 1]  # the tile's last token sees the most compressed keys
    seen = jnp.maximum((last + 1 - block) // stride + 1, 0)
    visited = (seen + width - 1) // width
    total = kc_ref.shape[0] // width

    def visit(j, _):
        start = pl.multiple_of(j * width, width)
        kc = kc_ref[pl.ds(start, width), :]
        s = jax.lax.dot_general(q, kc, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
        ends = (start + jnp.arange(width)) * stride + (block - 1)  # nsa.compressed_end
        mask = (ends[None, :] <= pos[:, None]) & finite[:, None]
        if has_segments:
            mask &= kc_seg_ref[pl.ds(start, width)][None, :] == q_seg[:, None]
        p = jnp.where(mask, jnp.exp2(s * (scale * LOG2E) - lse2[:, None]), 0.0)
        out_ref[:, pl.ds(start, width)] = p.reshape(tokens, group, width).sum(axis=1)

    def clear(j, _):  # beyond the tile's frontier: nothing seen
        out_ref[:, pl.ds(pl.multiple_of(j * width, width), width)] = jnp.zeros((tokens, width), jnp.float32)

    # no carry (None): a literal carry is no MLIR value in the Triton lowering's loop yield
    jax.lax.fori_loop(0, visited, visit, None)
    jax.lax.fori_loop(visited, total, clear, None)


def group_probabilities(q, k_cmp, lse, positions, *, block: int, stride: int, scale: float, precision,
                        q_ids=None, kc_ids=None, interpret: bool):
    """q [B, C, Hkv, G, D] (G a power of two, D padded), k_cmp [B, Nc', Hkv, D] (Nc' a multiple of
    the key tile), lse [B, Hkv, C, G] fp32, positions int32 [C] (ascending) -> [B, Hkv, C, Nc'] fp32:
    the sum over the group's heads of exp(scale q.k_cmp - lse) where visible. Segment ids: q_ids
    [B, C], kc_ids [B, Nc'] (an id no query has on blocks across segments)."""
    batch, chunk, kv_heads, group, head_dim = q.shape
    count = k_cmp.shape[1]
    tokens, width, num_warps, num_stages = _tiles(interpret, group)
    in_specs = [pl.BlockSpec((tokens,), lambda i, b, h: (i,)),
                pl.BlockSpec((None, tokens, None, group, head_dim), lambda i, b, h: (b, i, h, 0, 0)),
                pl.BlockSpec((None, count, None, head_dim), lambda i, b, h: (b, 0, h, 0)),
                pl.BlockSpec((None, None, tokens, group), lambda i, b, h: (b, h, i, 0))]
    args = [positions, q, k_cmp, lse]
    if q_ids is not None:
        in_specs += [pl.BlockSpec((None, tokens), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, count), lambda i, b, h: (b, 0))]
        args += [q_ids, kc_ids]
    return pl.pallas_call(
        functools.partial(_kernel, block=block, stride=stride, scale=scale, precision=precision,
                          has_segments=q_ids is not None, width=width),
        grid=(chunk // tokens, batch, kv_heads),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, tokens, count), lambda i, b, h: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, chunk, count), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="nsa_importance",
    )(*args)


def _top_n_kernel(score_ref, out_ref, *, num_selected: int, width: int):
    """The indices of a tile of rows' n largest scores, larger first and ties to the lower index,
    never -inf (nor NaN), written ascending with -1 in the slots left empty. Pick t takes the best
    entry that ranks after pick t - 1 in that order, so no entry is marked and the row is only read."""
    rows, count = score_ref.shape
    slots = jnp.arange(out_ref.shape[1], dtype=jnp.int32)[None, :]
    cols = jnp.arange(width, dtype=jnp.int32)[None, :]
    none = jnp.int32(jnp.iinfo(jnp.int32).max)

    def pick(t, carry):
        value, index, picks = carry

        def scan(c, best):
            start = pl.multiple_of(c * width, width)
            x, j = score_ref[:, pl.ds(start, width)], start + cols
            after = (x < value[:, None]) | ((x == value[:, None]) & (j > index[:, None]))
            x = jnp.where(after, x, -jnp.inf)
            top = jnp.max(x, axis=1)
            at = jnp.min(jnp.where(x == top[:, None], j, none), axis=1)
            better = top > best[0]  # a later chunk wins only when strictly larger: ties to the lower index
            return jnp.where(better, top, best[0]), jnp.where(better, at, best[1])

        value, index = jax.lax.fori_loop(0, count // width, scan, (jnp.full((rows,), -jnp.inf, jnp.float32),
                                                                   jnp.full((rows,), none, jnp.int32)))
        picks = jnp.where(slots == t, jnp.where(value > -jnp.inf, index, none)[:, None], picks)
        return value, index, picks

    start = (jnp.full((rows,), jnp.inf, jnp.float32), jnp.full((rows,), -1, jnp.int32),
             jnp.full(out_ref.shape, none, jnp.int32))
    _, _, picks = jax.lax.fori_loop(0, num_selected, pick, start)

    def ascending(t, carry):
        last, out = carry
        least = jnp.min(jnp.where(picks > last[:, None], picks, none), axis=1)
        return least, jnp.where(slots == t, least[:, None], out)

    _, out = jax.lax.fori_loop(0, num_selected, ascending,
                               (jnp.full((rows,), -1, jnp.int32), jnp.full(out_ref.shape, none, jnp.int32)))
    out_ref[...] = jnp.where(out == none, -1, out)


def top_n_rows(score, num_selected: int, *, interpret: bool):
    """score [R, Ns] fp32 -> int32 [R, n]: each row's n best column indices as `reference.top_n`
    ranks them (larger first, ties to the lower index, never -inf), ascending, -1 where fewer than
    n entries are finite."""
    total, count = score.shape
    rows = 16
    width = min(256, pow2_at_least(count, 16))
    slots = pow2_at_least(num_selected, 16)
    score = jnp.pad(score, ((0, -score.shape[0] % rows), (0, -count % width)), constant_values=-jnp.inf)
    out = pl.pallas_call(
        functools.partial(_top_n_kernel, num_selected=num_selected, width=width),
        grid=(score.shape[0] // rows,),
        in_specs=[pl.BlockSpec((rows, score.shape[1]), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows, slots), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((score.shape[0], slots), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="nsa_top_n",
    )(score)
    return out[:total, :num_selected]


def select_pallas(q, k_cmp, lse, *, block: int, stride: int, select_block: int, num_selected: int, scale: float,
                  precision, q_ids=None, interpret: bool | None = None, max_bytes: int = 1 << 30):
    """The top-n blocks of every (token, kv head), int32 [B, S, Hkv, n] (`reference.top_n` of
    `reference.importance_reference`), one chunk of query tokens at a time: the group
    probabilities of a chunk ([B, Hkv, C, Nc] fp32, at most `max_bytes`) exist only inside it."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    batch, seq_len, num_heads, head_dim = q.shape
    count, kv_heads = k_cmp.shape[1], k_cmp.shape[2]
    num = nsa.selection_count(seq_len, select_block)
    if count == 0:
        imp = jnp.zeros((batch, seq_len, kv_heads, num), jnp.float32)
        return reference.top_n(imp, select_block, num_selected)
    group = num_heads // kv_heads
    group_pad, head_pad = pow2_at_least(group, 1), pow2_at_least(head_dim)
    tokens, width, _, _ = _tiles(interpret, group_pad)
    count_pad = pl.cdiv(count, width) * width
    chunk = max_bytes // (4 * batch * kv_heads * count_pad)
    chunk = max(tokens, min(1 << max(0, chunk.bit_length() - 1), pow2_at_least(seq_len, tokens)))
    chunks = pl.cdiv(seq_len, chunk)
    length = chunks * chunk

    qg = q.reshape(batch, seq_len, kv_heads, group, head_dim)
    qg = padding.pad_axis(padding.pad_axis(padding.pad_axis(qg, 3, group_pad), 4, head_pad), 1, length)
    kc = padding.pad_axis(padding.pad_axis(k_cmp, 3, head_pad), 1, count_pad)
    lg = lse.astype(jnp.float32).reshape(batch, kv_heads, group, seq_len).transpose(0, 1, 3, 2)
    lg = jnp.pad(lg, ((0, 0), (0, 0), (0, length - seq_len), (0, group_pad - group)), constant_values=-jnp.inf)
    ids = kc_ids = None
    if q_ids is not None:
        kc_ids, whole = reference.compressed_segment_ids(q_ids.astype(jnp.int32), block, stride)
        kc_ids = jnp.where(whole, kc_ids, q_ids.min().astype(jnp.int32) - 1)  # an id no query has
        kc_ids = padding.pad_axis(kc_ids, 1, count_pad, mode="edge")
        ids = padding.pad_axis(q_ids.astype(jnp.int32), 1, length, mode="edge")

    def one(c):
        first = c * chunk
        take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, first, chunk, axis)
        positions = first + jnp.arange(chunk, dtype=jnp.int32)
        p = group_probabilities(take(qg, 1), kc, take(lg, 2), positions, block=block, stride=stride, scale=scale,
                                precision=precision, q_ids=None if ids is None else take(ids, 1), kc_ids=kc_ids,
                                interpret=interpret)
        imp = branches.to_selection_blocks(p[..., :count], seq_len, block, stride, select_block)
        score = reference.selection_scores(imp, positions[None, None, :, None], select_block)  # [B, Hkv, C, Ns]
        picked = top_n_rows(score.reshape(-1, num), num_selected, interpret=interpret)
        return picked.reshape(batch, kv_heads, chunk, num_selected).transpose(0, 2, 1, 3)

    picked = jax.lax.map(one, jnp.arange(chunks, dtype=jnp.int32))  # [chunks, B, C, Hkv, n]
    return picked.transpose(1, 0, 2, 3, 4).reshape(batch, length, kv_heads, num_selected)[:, :seq_len]
