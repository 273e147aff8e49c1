"""NSA's compression branch and block importance at scale (the "triton" implementation's).

Compression attention on the flash engine. Query t sees compressed block i iff
`i * stride + block - 1 <= t` (`attn_spec.nsa.compressed_end`). Write t = m * stride + o (slot o of
row m): the condition is `i <= m - c_o` with `c_o = ceil((block - 1 - o) / stride)`, which is
`block / stride` for every slot but the last and one less for the last. So the queries of a slot
are causal attention over the compressed keys with the queries c rows late: dropping a slot's
first c rows (they see no block) leaves plain top-left causal attention, row m - c against keys
<= m - c. The slots join the query heads of each kv head's GQA group (with segment ids, which differ
per slot, they go to the batch axis, the compressed keys repeated there), two engine calls
(`flash_attention`, causal, no offset: the fastest kernels of the device serve it) cover every
query, and the engine's backward gives the gradients. The engine skips the tiles beyond each row's
frontier, as for any causal call. Folding makes few, long dK/dV programs (one per 128 keys of a kv
head, walking the whole folded group); the slots are split into enough batch rows to fill the GPU
(`slot_parts`).

Importance for the top-n rule: `importance.py` sums the compression probabilities over each
group's heads per compressed key; `to_selection_blocks` maps them to selection blocks. Where
stride divides the selection block and the compression block (powers of two: whenever
stride <= select_block), selection block j overlaps compression blocks [j r - b + 1, (j + 1) r - 1]
(r = select_block / stride, b = block / stride): a reshape sum plus b - 1 shifted slices;
otherwise a product with `nsa.overlap_matrix`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_spec import nsa
from jax_attn.device import device_info
from jax_attn.ops.common import padding
from jax_attn.ops.nsa import reference


def slot_parts(slots: int, batch: int, kv_heads: int, count: int, sm_count: int | None) -> int:
    """How many parts the slots folded into the heads are split into (each part a batch row with its
    own copy of the compressed keys). The engine's dK/dV kernel gives each 128 keys of a kv head one
    program (the Mosaic kernels' two 64-key warpgroups) that walks the whole folded group: at 64k
    tokens, compression 64/64 and 4 kv heads, 32 programs each walking 63 x 16 query heads, on a GPU
    of 132 SMs. Parts make about twice as many programs as SMs (1 where the SM count is unknown)."""
    if not sm_count:
        return 1
    programs = batch * kv_heads * -(-count // 128)
    return max(1, min(slots, -(-2 * sm_count // programs)))


def compression_engine(q, k_cmp, v_cmp, *, block: int, stride: int, scale: float, q_ids=None, attention,
                       parts: int | None = None):
    """Block-causal attention over the compressed keys through `attention(q, k, v, segment_ids)`
    -> (out, lse) (the flash engine, causal, top-left) -> (out [B, S, Hq, D], lse [B, Hq, S]).
    parts: into how many batch rows the folded slots go (`slot_parts` of the device by default)."""
    batch, seq_len, num_heads, head_dim = q.shape
    count = k_cmp.shape[1]
    if count == 0:  # no complete block: every row sees nothing
        return jnp.zeros_like(q), jnp.full((batch, num_heads, seq_len), -jnp.inf, jnp.float32)
    rows = -(-seq_len // stride)
    qs = padding.pad_axis(q, 1, rows * stride).reshape(batch, rows, stride, num_heads, head_dim)
    qs = qs.transpose(2, 0, 1, 3, 4)  # [stride, B, M, Hq, D]: slot o's queries t = m * stride + o
    if q_ids is not None:
        ids = padding.pad_axis(q_ids.astype(jnp.int32), 1, rows * stride, mode="edge")
        ids = ids.reshape(batch, rows, stride).transpose(2, 0, 1)
        kc_ids, whole = reference.compressed_segment_ids(q_ids.astype(jnp.int32), block, stride)
        kc_ids = jnp.where(whole, kc_ids, ids.min() - 1)  # a block across segments: an id no query has
    c = block // stride
    outs, lses = [], []
    for lo, hi, offset in ((0, stride - 1, c), (stride - 1, stride, c - 1)):
        n = hi - lo
        if n == 0:
            continue
        late = rows - offset  # rows that see a block: m >= offset
        if late <= 0:
            outs.append(jnp.zeros((n, batch, rows, num_heads, head_dim), q.dtype))
            lses.append(jnp.full((n, batch, num_heads, rows), -jnp.inf, jnp.float32))
            continue
        if q_ids is None:
            out, lse = _folded_slots(qs[lo:hi, :, offset:], k_cmp, v_cmp, attention, parts)
        else:  # ids differ per slot: the slots go to the batch axis, with copies of the compressed keys
            qg = qs[lo:hi, :, offset:].reshape(n * batch, late, num_heads, head_dim)
            kg, vg = (_copies(x, n) for x in (k_cmp, v_cmp))
            seg = (ids[lo:hi, :, offset:].reshape(n * batch, late),
                   jnp.broadcast_to(kc_ids[None], (n, *kc_ids.shape)).reshape(n * batch, count))
            out, lse = attention(qg, kg, vg, seg)
            out, lse = out.reshape(n, batch, late, num_heads, head_dim), lse.reshape(n, batch, num_heads, late)
        out = jnp.pad(out, ((0, 0), (0, 0), (offset, 0), (0, 0), (0, 0)))
        lse = jnp.pad(lse, ((0, 0), (0, 0), (0, 0), (offset, 0)), constant_values=-jnp.inf)
        outs.append(out)
        lses.append(lse)
    out = jnp.concatenate(outs, axis=0).transpose(1, 2, 0, 3, 4).reshape(batch, rows * stride, num_heads, head_dim)
    lse = jnp.concatenate(lses, axis=0).transpose(1, 2, 3, 0).reshape(batch, num_heads, rows * stride)
    return out[:, :seq_len], lse[:, :, :seq_len]


def _copies(x, n: int):
    """n copies of x along the batch axis, made through fp32 so that their gradients add up in fp32."""
    return jnp.broadcast_to(x[None].astype(jnp.float32), (n, *x.shape)).reshape(n * x.shape[0], *x.shape[1:]) \
        .astype(x.dtype)


def _folded_slots(qs, k_cmp, v_cmp, attention, parts):
    """Slots qs [n, B, M, Hq, D] sharing one key offset -> (out [n, B, M, Hq, D], lse [n, B, Hq, M]).
    The slots join the query heads of each kv head's GQA group (head h * n + s reads kv head h // G),
    so the engine's dK/dV kernel sums a group in fp32, the compressed keys neither copied nor their
    gradient rounded once per slot; with `parts` > 1 the slots are split into that many batch rows
    (zero slots pad the last), whose dK/dV are rounded once each and added in fp32."""
    n, batch, late, num_heads, head_dim = qs.shape
    if parts is None:
        parts = slot_parts(n, batch, k_cmp.shape[2], k_cmp.shape[1], device_info().sm_count)
    parts = max(1, min(parts, n))
    per = -(-n // parts)
    qs = padding.pad_axis(qs, 0, parts * per).reshape(parts, per, batch, late, num_heads, head_dim)
    qg = qs.transpose(0, 2, 3, 4, 1, 5).reshape(parts * batch, late, num_heads * per, head_dim)
    if parts == 1:
        out, lse = attention(qg, k_cmp, v_cmp, None)
    else:
        out, lse = attention(qg, _copies(k_cmp, parts), _copies(v_cmp, parts), None)
    out = out.reshape(parts, batch, late, num_heads, per, head_dim).transpose(0, 4, 1, 2, 3, 5)
    lse = lse.reshape(parts, batch, num_heads, per, late).transpose(0, 3, 1, 2, 4)
    return (out.reshape(parts * per, batch, late, num_heads, head_dim)[:n],
            lse.reshape(parts * per, batch, num_heads, late)[:n])


def to_selection_blocks(p, seq_len: int, block: int, stride: int, select_block: int):
    """p [..., Nc] (per compression block) -> [..., Ns] (per selection block, summed over overlaps)."""
    count, num = p.shape[-1], nsa.selection_count(seq_len, select_block)
    if select_block % stride or block % stride:
        overlap = jnp.asarray(nsa.overlap_matrix(seq_len, block, stride, select_block), p.dtype)
        return jnp.einsum("...i,ij->...j", p, overlap, precision=jax.lax.Precision.HIGHEST)
    r, b = select_block // stride, block // stride
    lead = [(0, 0)] * (p.ndim - 1)
    # front: b - 1 zeros (blocks before 0); back: up to num * r entries
    padded = jnp.pad(p, lead + [(b - 1, max(0, num * r - count))])
    own = padded[..., b - 1:b - 1 + num * r].reshape(*p.shape[:-1], num, r).sum(-1)
    for shift in range(1, b):  # compression block j r - shift also overlaps selection block j
        own = own + padded[..., b - 1 - shift:b - 1 - shift + num * r:r]
    return own
