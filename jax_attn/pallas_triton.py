"""The flash-attention engine as Pallas kernels (Triton lowering): forward, dK/dV, dQ.

Reads top to bottom: block config, the shared tile math, forward kernel, backward kernels, the
`custom_vjp` wiring and the entry point that pads to the kernels' tile grid.

Algorithm: FlashAttention-2 (Dao 2023, arXiv 2307.08691), Alg. 1 (forward with online softmax,
row statistics saved) and Alg. 2 (backward recomputing P), with the backward split into a dK/dV
kernel (one program per key block and kv head, looping over the query heads of its GQA group, so
dK/dV need no atomics and stay deterministic) and a dQ kernel (one program per query block).

Which tiles are visited is a parameter: for each query block an int32 range of key blocks
(lo, full_lo, full_hi, hi) built in `spec.block_ranges`; [full_lo, full_hi) needs no element mask,
the rest of [lo, hi) is masked with `spec.visible`, everything outside is skipped.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_attn.spec import AttentionSpec, block_ranges, visible

LOG2E = math.log2(math.e)
MIN_BLOCK = 16  # smallest tile side a Triton dot accepts

# jax 0.11 deprecates the Pallas Triton backend with a warning at every lowering; this library is
# built on it on purpose, so that one message (and only that one) is silenced.
warnings.filterwarnings("ignore", message=r"The Triton backend is deprecated")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sides and launch parameters of the three kernels (static; see `default_block_sizes`)."""

    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 64
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 8
    num_stages_bwd: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("block_") and (value < MIN_BLOCK or value & (value - 1)):
                raise ValueError(f"BlockSizes.{f.name}={value} must be a power of two >= {MIN_BLOCK}")

    def fitted(self, q_len: int, kv_len: int) -> "BlockSizes":
        """Shrink tiles that exceed the (power-of-two rounded) sequence they tile."""
        cap_q, cap_k = _pow2_at_least(q_len), _pow2_at_least(kv_len)
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, cap_q), block_k=min(self.block_k, cap_k),
            block_q_dkv=min(self.block_q_dkv, cap_q), block_k_dkv=min(self.block_k_dkv, cap_k),
            block_q_dq=min(self.block_q_dq, cap_q), block_k_dq=min(self.block_k_dq, cap_k))


def _pow2_at_least(n: int) -> int:
    return max(MIN_BLOCK, 1 << max(0, n - 1).bit_length())


def default_block_sizes(head_dim: int, interpret: bool, dtype=jnp.bfloat16) -> BlockSizes:
    """Heuristic tiles per padded head dim and dtype. Interpret mode: small tiles keep the CPU run
    short. fp32: exact fp32 dots run on FMA units, whose code grows with the tile (a 128x64 tile
    compiled for ~100 s on an H200), and fp32 tiles take twice the shared memory: smaller tiles."""
    if interpret:
        return BlockSizes(32, 32, 32, 32, 32, 32, 4, 1, 4, 1)
    if jnp.dtype(dtype) == jnp.float32:
        return BlockSizes(64, 32, 32, 64, 64, 32, 4, 2, 4, 2)
    if head_dim <= 64:
        return BlockSizes(128, 64, 64, 128, 128, 64, 4, 3, 4, 2)
    if head_dim <= 128:
        return BlockSizes(128, 64, 64, 128, 128, 64, 8, 3, 8, 2)
    return BlockSizes(64, 32, 32, 64, 64, 32, 4, 2, 8, 1)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one padded call."""

    spec: AttentionSpec
    blocks: BlockSizes
    q_len: int  # real lengths (the arrays are padded to tile multiples)
    kv_len: int
    interpret: bool


# ----------------------------------------------------------------------------------------------
# Tile math shared by the three kernels.
# ----------------------------------------------------------------------------------------------


def _dot(a, b, spec, *, trans_b=False):
    """a @ b (or a @ b.T) with fp32 accumulation; fp32 operands follow spec.precision."""
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=spec.precision,
                               preferred_element_type=jnp.float32)


def _scores(q, k, spec, *, k_major=False):
    """Scores in log2 units, s2 = log2(e) * s, and tanh(raw * scale / cap) when soft-capped.

    k_major=False gives [block_q, block_k] (q @ k.T); True gives [block_k, block_q] (k @ q.T).
    """
    raw = _dot(k, q, spec, trans_b=True) if k_major else _dot(q, k, spec, trans_b=True)
    if spec.softcap is None:
        return raw * (spec.scale * LOG2E), None
    t = jnp.tanh(raw * (spec.scale / spec.softcap))
    return t * (spec.softcap * LOG2E), t


def _mask(spec, st: _Static, s, rows, cols, q_seg, kv_seg):
    """Set scores of invisible (row, col) pairs to -inf; also return the mask."""
    mask = visible(spec, rows, cols, st.kv_len, q_seg, kv_seg)
    return jnp.where(mask, s, -jnp.inf), mask


def _needs_mask(st: _Static, block_k: int) -> bool:
    """Whether any visited tile can need an element mask (else the masked loops vanish)."""
    return st.spec.has_position_mask or st.spec.has_segments or st.kv_len % block_k != 0


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
    if spec.has_segments:
        q_seg_ref, kv_seg_ref, o_ref, lse_ref, m2_ref, inv_l_ref = refs
    else:
        o_ref, lse_ref, m2_ref, inv_l_ref = refs
    block_q, head_dim = q_ref.shape
    block_k = st.blocks.block_k
    q = q_ref[...]
    rows = pl.program_id(0) * block_q + jnp.arange(block_q)
    q_seg = q_seg_ref[...][:, None] if spec.has_segments else None

    def body(j, carry, masked):
        m, l, acc = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s, _ = _scores(q, k, spec)
        if masked:
            cols = start + jnp.arange(block_k)
            kv_seg = kv_seg_ref[pl.ds(start, block_k)][None, :] if spec.has_segments else None
            s, _ = _mask(spec, st, s, rows[:, None], cols[None, :], q_seg, kv_seg)
        # online softmax update; a row that has seen only masked keys keeps m = -inf, so the
        # exponent uses 0 in its place and every p of that row is exp2(-inf) = 0, never NaN.
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, spec)
        return m_new, l, acc

    carry = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
             jnp.zeros((block_q, head_dim), jnp.float32))
    m, l, acc = _visit(ranges_ref, body, carry, _needs_mask(st, block_k))
    empty = l == 0.0  # no visible key: output 0, lse -inf
    l_safe = jnp.where(empty, 1.0, l)
    inv_l = 1.0 / l_safe
    o_ref[...] = (acc * inv_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) / LOG2E)
    # For the backward: P = exp2(s2 - m2) * inv_l. Recomputing P from lse instead would put
    # ulp(lse) of absolute error into every exponent, too much for fp32 gradients. Rows with no
    # visible key store m2 = +inf, inv_l = 0, so their P is 0.
    m2_ref[...] = jnp.where(empty, jnp.inf, m)
    inv_l_ref[...] = jnp.where(empty, 0.0, inv_l)


def _fwd_call(st: _Static, q, k, v, q_seg, kv_seg, ranges):
    batch, q_pad, num_heads, head_dim = q.shape
    kv_pad, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    bq = st.blocks.block_q
    rb = ranges.shape[0]  # 1 (static ranges, broadcast) or batch (segment ids)
    in_specs = [
        pl.BlockSpec((None, None, 4), lambda i, b, h: (b if rb > 1 else 0, i, 0)),
        pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, b, h: (b, 0, h // group, 0)),
    ]
    args = [ranges, q, k, v]
    if st.spec.has_segments:
        in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, kv_pad), lambda i, b, h: (b, 0))]
        args += [q_seg, kv_seg]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, st=st),
        grid=(q_pad // bq, batch, num_heads),  # query blocks fastest: neighbours share K/V in L2
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))]
        + [pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))] * 3,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)]
        + [jax.ShapeDtypeStruct((batch, num_heads, q_pad), jnp.float32)] * 3,  # lse, m2, inv_l
        compiler_params=plgpu.CompilerParams(num_warps=st.blocks.num_warps,
                                             num_stages=st.blocks.num_stages),
        interpret=st.interpret,
        name="flash_fwd",
    )(*args)


# ----------------------------------------------------------------------------------------------
# Backward. Inputs beside q, k, v, dO: the forward's row statistics m2, inv_l (P = exp2(s2 - m2)
# * inv_l) and delta = rowsum(dO * O) - dlse (FA2 Alg. 2 line 4; subtracting dlse makes the lse
# output differentiable: d lse_i / d s_ij = p_ij).
# ----------------------------------------------------------------------------------------------


def _dkdv_kernel(ranges_ref, q_ref, k_ref, v_ref, do_ref, m2_ref, inv_l_ref, delta_ref, *refs,
                 st: _Static):
    """One program per (key block, batch, kv head); loops over the group's query heads."""
    spec = st.spec
    if spec.has_segments:
        q_seg_ref, kv_seg_ref, dk_ref, dv_ref = refs
    else:
        dk_ref, dv_ref = refs
    block_k, head_dim = k_ref.shape
    group = q_ref.shape[1]
    block_q = st.blocks.block_q_dkv
    k = k_ref[...]
    v = v_ref[...]
    cols = (pl.program_id(0) * block_k + jnp.arange(block_k))[:, None]
    kv_seg = kv_seg_ref[...][:, None] if spec.has_segments else None

    def body(step, carry, masked):
        # One flat loop over (query block, head of the group): no nested loops, so the compiler
        # pipelines one loop per masked/unmasked segment.
        dk, dv = carry
        i, g = step // group, step % group
        start = pl.multiple_of(i * block_q, block_q)
        q = q_ref[pl.ds(start, block_q), g, :]
        do = do_ref[pl.ds(start, block_q), g, :]
        m2 = m2_ref[g, pl.ds(start, block_q)]
        inv_l = inv_l_ref[g, pl.ds(start, block_q)]
        delta = delta_ref[g, pl.ds(start, block_q)]
        s, t = _scores(q, k, spec, k_major=True)  # [block_k, block_q]
        if masked:
            rows = (start + jnp.arange(block_q))[None, :]
            q_seg = q_seg_ref[pl.ds(start, block_q)][None, :] if spec.has_segments else None
            s, mask = _mask(spec, st, s, rows, cols, q_seg, kv_seg)
        p = jnp.exp2(s - m2[None, :]) * inv_l[None, :]
        dv = dv + _dot(p.astype(do.dtype), do, spec)
        dp = _dot(v, do, spec, trans_b=True)
        ds = p * (dp - delta[None, :])
        if t is not None:  # soft cap: d/draw [cap * tanh(raw * scale / cap)] = scale * (1 - t^2)
            ds = ds * (1.0 - t * t)
        if masked:  # p = 0 there, but dp may be inf (huge masked values): 0 * inf = NaN
            ds = jnp.where(mask, ds, 0.0)
        dk = dk + _dot(ds.astype(q.dtype), q, spec)
        return dk, dv

    zeros = jnp.zeros((block_k, head_dim), jnp.float32)
    dk, dv = _visit(ranges_ref, body, (zeros, zeros), _needs_mask(st, block_k), stride=group)
    dk_ref[...] = (dk * spec.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(ranges_ref, q_ref, k_ref, v_ref, do_ref, m2_ref, inv_l_ref, delta_ref, *refs,
               st: _Static):
    """One program per (query block, batch, query head); loops over its visible key blocks."""
    spec = st.spec
    if spec.has_segments:
        q_seg_ref, kv_seg_ref, dq_ref = refs
    else:
        (dq_ref,) = refs
    block_q, head_dim = q_ref.shape
    block_k = st.blocks.block_k_dq
    q = q_ref[...]
    do = do_ref[...]
    m2 = m2_ref[...][:, None]
    inv_l = inv_l_ref[...][:, None]
    delta = delta_ref[...][:, None]
    rows = (pl.program_id(0) * block_q + jnp.arange(block_q))[:, None]
    q_seg = q_seg_ref[...][:, None] if spec.has_segments else None

    def body(j, dq, masked):
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s, t = _scores(q, k, spec)
        if masked:
            cols = (start + jnp.arange(block_k))[None, :]
            kv_seg = kv_seg_ref[pl.ds(start, block_k)][None, :] if spec.has_segments else None
            s, mask = _mask(spec, st, s, rows, cols, q_seg, kv_seg)
        p = jnp.exp2(s - m2) * inv_l
        dp = _dot(do, v, spec, trans_b=True)
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        if masked:
            ds = jnp.where(mask, ds, 0.0)
        return dq + _dot(ds.astype(k.dtype), k, spec)

    dq = _visit(ranges_ref, body, jnp.zeros((block_q, head_dim), jnp.float32),
                _needs_mask(st, block_k))
    dq_ref[...] = (dq * spec.scale).astype(dq_ref.dtype)


def _bwd_call(st: _Static, q, k, v, q_seg, kv_seg, dq_ranges, dkdv_ranges, do, m2, inv_l, delta):
    batch, q_pad, num_heads, head_dim = q.shape
    kv_pad, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    blocks = st.blocks
    params = plgpu.CompilerParams(num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages_bwd)
    has_seg = st.spec.has_segments

    # dK/dV: query-side arrays viewed per kv head, [B, S, Hkv, G, D] and [B, Hkv, G, S].
    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    rb = dkdv_ranges.shape[0]
    q_group_spec = pl.BlockSpec((None, q_pad, None, group, head_dim), lambda j, b, h: (b, 0, h, 0, 0))
    row_group_spec = pl.BlockSpec((None, None, group, q_pad), lambda j, b, h: (b, h, 0, 0))
    kv_block_spec = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0))
    in_specs = [pl.BlockSpec((None, None, 4), lambda j, b, h: (b if rb > 1 else 0, j, 0)),
                q_group_spec, kv_block_spec, kv_block_spec, q_group_spec,
                row_group_spec, row_group_spec, row_group_spec]
    as_groups = lambda x: x.reshape(batch, q_pad, num_kv_heads, group, head_dim)
    rows_as_groups = lambda x: x.reshape(batch, num_kv_heads, group, q_pad)
    args = [dkdv_ranges, as_groups(q), k, v, as_groups(do), rows_as_groups(m2),
            rows_as_groups(inv_l), rows_as_groups(delta)]
    if has_seg:
        in_specs += [pl.BlockSpec((None, q_pad), lambda j, b, h: (b, 0)),
                     pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
        args += [q_seg, kv_seg]
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st),
        grid=(kv_pad // bk, batch, num_kv_heads),
        in_specs=in_specs,
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params, interpret=st.interpret, name="flash_bwd_dkdv",
    )(*args)

    # dQ: same tiling as the forward.
    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    rb = dq_ranges.shape[0]
    q_block_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
    kv_full_spec = pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    in_specs = [pl.BlockSpec((None, None, 4), lambda i, b, h: (b if rb > 1 else 0, i, 0)),
                q_block_spec, kv_full_spec, kv_full_spec, q_block_spec, row_spec, row_spec, row_spec]
    args = [dq_ranges, q, k, v, do, m2, inv_l, delta]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, kv_pad), lambda i, b, h: (b, 0))]
        args += [q_seg, kv_seg]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid=(q_pad // bq, batch, num_heads),
        in_specs=in_specs,
        out_specs=q_block_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params, interpret=st.interpret, name="flash_bwd_dq",
    )(*args)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# custom_vjp wiring (on tile-padded arrays) and the entry point.
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, q_seg, kv_seg, fwd_ranges, dq_ranges, dkdv_ranges):
    out, lse, _, _ = _fwd_call(st, q, k, v, q_seg, kv_seg, fwd_ranges)
    return out, lse


def _flash_fwd(st, q, k, v, q_seg, kv_seg, fwd_ranges, dq_ranges, dkdv_ranges):
    out, lse, m2, inv_l = _fwd_call(st, q, k, v, q_seg, kv_seg, fwd_ranges)
    return (out, lse), (q, k, v, q_seg, kv_seg, dq_ranges, dkdv_ranges, out, m2, inv_l)


def _flash_bwd(st, residuals, cotangents):
    q, k, v, q_seg, kv_seg, dq_ranges, dkdv_ranges, out, m2, inv_l = residuals
    do, dlse = cotangents
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
    delta = delta - dlse
    dq, dk, dv = _bwd_call(st, q, k, v, q_seg, kv_seg, dq_ranges, dkdv_ranges,
                           do.astype(q.dtype), m2, inv_l, delta)
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_axis(x, axis, size, mode="constant"):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, mode=mode)


def flash_attention_pallas(q, k, v, q_seg, kv_seg, spec: AttentionSpec,
                           blocks: BlockSizes | None = None, interpret: bool | None = None):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (validated) -> (out [B, Sq, Hq, D], lse [B, Hq, Sq]).

    Pads the head dim to a power of two and the sequences to tile multiples (zeros; padded keys
    are masked, padded rows sliced off), so any shape runs on one kernel family.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[3]
    head_pad = _pow2_at_least(head_dim)
    if blocks is None:
        blocks = default_block_sizes(head_pad, interpret, q.dtype)
    blocks = blocks.fitted(q_len, kv_len)
    tile_q = max(blocks.block_q, blocks.block_q_dkv, blocks.block_q_dq)
    tile_k = max(blocks.block_k, blocks.block_k_dkv, blocks.block_k_dq)
    q_pad, kv_pad = pl.cdiv(q_len, tile_q) * tile_q, pl.cdiv(kv_len, tile_k) * tile_k

    qp = _pad_axis(_pad_axis(q, 3, head_pad), 1, q_pad)
    kp = _pad_axis(_pad_axis(k, 3, head_pad), 1, kv_pad)
    vp = _pad_axis(_pad_axis(v, 3, head_pad), 1, kv_pad)
    if spec.has_segments:  # edge padding keeps each block's id interval unchanged
        q_seg = _pad_axis(q_seg.astype(jnp.int32), 1, q_pad, mode="edge")
        kv_seg = _pad_axis(kv_seg.astype(jnp.int32), 1, kv_pad, mode="edge")

    st = _Static(spec, blocks, q_len, kv_len, interpret)

    def ranges(bq, bk, key_major):
        return block_ranges(spec, q_len, kv_len, bq, bk, q_pad // bq, kv_pad // bk,
                            q_seg, kv_seg, key_major=key_major)

    out, lse = _flash(st, qp, kp, vp, q_seg, kv_seg,
                      ranges(blocks.block_q, blocks.block_k, False),
                      ranges(blocks.block_q_dq, blocks.block_k_dq, False),
                      ranges(blocks.block_q_dkv, blocks.block_k_dkv, True))
    return out[:, :q_len, :, :head_dim], lse[:, :, :q_len]
