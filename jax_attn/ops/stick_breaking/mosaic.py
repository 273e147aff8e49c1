"""The stick-breaking (ExpoSB) forward as a Pallas Mosaic GPU kernel for Hopper (sm90), in the frame
of the softmax kernels (`ops/common/mosaic_frame.py`): two compute warpgroups of 64 query rows each, one producer
warpgroup streaming the kv head's key blocks by TMA, the products on wgmma.

Each warpgroup walks its key blocks from the diagonal leftwards, as the Triton forward
(`ops/stick_breaking/triton.py`) does, in base-2 log space:
  z = scale2 q.k - decay2 (i - j),  sp = softplus2(z) = max(z, 0) + log2(1 + 2^-|z|),
  A = 2^((z - sp) - c - sum_{m>j} sp)   (c: the softplus sum of the keys right of the block),
  o += A V,  c += rowsum(sp),  and at the end rem = 2^-c.
The transcendentals are the approximate MUFU instructions (`approx_math`; lg2 directly, `_log2`).
With `save_sums` it stores c at every key-block boundary and counts per row the spent key blocks,
in the layout the Triton backward (`ops/stick_breaking/triton.py`, `_bwd_call`) reads: the backward is the
Triton engine's. It walks every tile (ending a walk early would need the producer told too), so it
is not the default.

The in-tile suffix sums are one product with a triangular 0/1 matrix on the tensor cores, of sp
rounded to fp16, for fp16 inputs too (a second product for the remainder spills registers). Rounding
errs by at most 2^-11 of each term, so a suffix sum S by at most 2^-11 S, and A's relative error is
at most ln 2 2^-11 S = 3.4e-4 S, where A <= 2^-S (the strict suffix: the key's own term stays in
fp32, in z - sp): at most 1.8e-4 of the stick. The terms are capped at SP_CAP before the rounding
(fp16 overflows at 65504, and inf times the matrix's zeros is NaN); one capped term makes every A
left of it 2^-256, zero in fp32, so the cap changes nothing. Figures: docs/design/stick_breaking.md.

Serves 16-bit inputs, padded head dim 64 or 128, no RoPE, no segment ids, Sq == Sk, attend_current
either way (`unsupported_reason`). No interpreter
runs it on CPU: the tests lower it for CUDA there and run it on the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.ops.common import mosaic_frame as frame
from jax_attn.ops.common.spec import LOG2E, AttentionSpec
from jax_attn.ops.softmax import mosaic as mg
from jax_attn.ops.stick_breaking.numerics import SP_CAP

BLOCK = frame.WGMMA_ROWS  # query rows per compute warpgroup = keys per step = the backward's block_k
STAGES = 3  # K, V slots in flight (a step is a quarter of the softmax forward's 128-key step)


def unsupported_reason(spec: AttentionSpec, head_dim: int, dtype) -> str | None:
    """Why the Mosaic GPU stick-breaking forward cannot serve this call, or None if it can."""
    if spec.rope is not None:
        return "the Mosaic GPU stick-breaking forward does not serve RoPE"
    if spec.has_segments:  # its key stream and walk are the causal frame's: no per-row key ranges
        return ("the Mosaic GPU stick-breaking forward does not serve segment ids (packed sequences): its warpgroups "
                "walk the causal frame's key blocks with no per-row mask; use implementation='triton'")
    if spec.offset:
        return ("the Mosaic GPU stick-breaking forward needs Sq == Sk (its frame pairs each query block with the "
                "diagonal key block of the same index); use implementation='triton'")
    softmax_spec = AttentionSpec(scale=spec.scale, causal=True)
    return mg.unsupported_reason(softmax_spec, head_dim, dtype)


def _log2(x):
    """lg2.approx per element (jnp.log2 lowers to log / log 2: an approximate log, a division)."""
    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout))
    def op(_, a):
        return a.log2(approx=True)

    return op(x)


def _forward_kernel(q_ref, k_ref, v_ref, decay_ref, *refs, spec: AttentionSpec, group: int, spent: float,
                    attend_current: bool):
    *outputs, own, ring = refs
    o_ref, rem_ref, *sums_ref = outputs  # (+ the sums and the spent key blocks)
    (q_smem, tri_smem), own_ready = own
    scale2 = spec.scale * LOG2E
    rows_layout = plgpu.Layout.WGMMA.reduce(1)

    def compute(batch, head, wg, first, own_blocks, stream, ring):
        stream_hi = stream[1]
        q_tile, tri = q_smem.at[wg], tri_smem.at[wg]
        rows = pl.ds(first, BLOCK)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_tile, own_ready.at[wg])
        # tri[m, j] = (m > j): (x @ tri)[i, j] = sum_{m>j} x[i, m], the strict suffix sum
        tri[...] = jnp.where(frame.iota((BLOCK, BLOCK), 0) > frame.iota((BLOCK, BLOCK), 1), 1.0, 0.0).astype(jnp.float16)
        plgpu.commit_smem()
        decay2 = frame.load_gmem(decay_ref.at[head], rows_layout)  # decay_h log2(e), on every row
        plgpu.barrier_wait(own_ready.at[wg])

        def step(block, carry, masked: bool):
            c, acc, *spent_blocks = carry
            if sums_ref:  # the softplus sum right of this key block, for the backward
                sums_ref[0].at[batch, head, block, rows][...] = c
                spent_blocks = [spent_blocks[0] + jnp.where(c >= spent, 1.0, 0.0)]
            u = stream_hi - 1 - block  # the ring's step (it streams leftwards)
            s = frame.matmul((BLOCK, BLOCK), q_tile, ring.wait(u, 0).transpose((1, 0)))
            ring.release(u, 0)
            distance = (first - block * BLOCK + frame.iota(s.shape, 0) - frame.iota(s.shape, 1)).astype(jnp.float32)
            z = s * scale2 - lax.broadcast_in_dim(decay2, s.shape, [0]) * distance
            sp = jnp.maximum(z, 0.0) + _log2(1.0 + jnp.exp2(-jnp.abs(z)))
            if masked:  # the diagonal block: keys j < i only (j <= i with attend_current)
                valid = distance >= 0.0 if attend_current else distance > 0.0
                sp = jnp.where(valid, sp, 0.0)
            # fp16 terms, capped at SP_CAP (see the module doc)
            suffix = frame.matmul((BLOCK, BLOCK), jnp.minimum(sp, SP_CAP).astype(jnp.float16), tri)
            a = jnp.exp2((z - sp) - lax.broadcast_in_dim(c, s.shape, [0]) - suffix)  # z - sp = log2 sigmoid(z)
            if masked:
                a = jnp.where(valid, a, 0.0)
            acc = frame.matmul_add(acc, a.astype(v_ref.dtype), ring.wait(u, 1))
            ring.release(u, 1)
            return c + sp.sum(axis=1), acc, *spent_blocks

        ring.follow(0, stream_hi - own_blocks[3])  # the other warpgroup's diagonal block
        carry = (frame.zeros((BLOCK,), rows_layout), frame.zeros((BLOCK, q_ref.shape[3])))
        carry += (frame.zeros((BLOCK,), rows_layout),) * bool(sums_ref)
        c, acc, *spent_blocks = frame.walk(step, carry, own_blocks, leftwards=True)
        rem_ref.at[batch, head, rows][...] = jnp.exp2(-c)
        if sums_ref:
            sums_ref[1].at[batch, head, rows][...] = spent_blocks[0]
        frame.store_tiles([(acc, q_tile, o_ref.at[batch, rows, head])])

    frame.query_major(compute, q_ref, k_ref, v_ref, ring, bq=BLOCK, bkv=BLOCK, stages=STAGES,
                    spec=AttentionSpec(scale=spec.scale, causal=True), kv_len=k_ref.shape[1], group=group,
                    leftwards=True)


def stick_breaking_forward(q, k, v, decay, spec: AttentionSpec, *, save_sums: bool, spent: float,
                           attend_current: bool = False):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] padded to multiples of 2 * BLOCK rows and D in
    `mosaic_frame.HEAD_DIMS`, decay [>= Hq] fp32 -> (out, rem [B, Hq, S] fp32[, the softplus sums
    at the key-block boundaries [B, Hq, S / BLOCK, S] fp32, base 2, and per row the number of key
    blocks from key 0 whose sums reach `spent`, int32 [B, Hq, S]]), as
    the Triton `_fwd_call` with block_k = BLOCK. attend_current: keys j <= i (the diagonal
    block's mask; the blocks walked are the same). It walks every tile (the Triton
    forward ends a walk where the sticks are spent; the backward skips them after either)."""
    batch, seq_pad, num_heads, head_dim = q.shape
    if seq_pad % (2 * BLOCK) or head_dim not in frame.HEAD_DIMS:
        raise ValueError(f"stick_breaking_forward needs S a multiple of {2 * BLOCK} and D in "
                         f"{frame.HEAD_DIMS}, got {q.shape}")
    decay2 = jnp.broadcast_to((decay[:num_heads] * LOG2E)[:, None], (num_heads, BLOCK))  # a [BLOCK] row per head
    kernel = functools.partial(_forward_kernel, spec=spec, group=num_heads // k.shape[2], spent=spent,
                               attend_current=attend_current)
    out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, num_heads, seq_pad), jnp.float32))
    if save_sums:
        out_type += (jax.ShapeDtypeStruct((batch, num_heads, seq_pad // BLOCK, seq_pad), jnp.float32),
                     jax.ShapeDtypeStruct((batch, num_heads, seq_pad), jnp.float32))  # (counted in fp32)
    own = ((frame.smem((2, BLOCK, head_dim), q.dtype), frame.smem((2, BLOCK, BLOCK), jnp.float16)),
           plgpu.Barrier(num_barriers=2))
    sizes = dict(heads=num_heads, q_tiles=seq_pad // (2 * BLOCK), batch=batch)
    outs = frame.launch(kernel, (q, k, v, decay2), out_type, tuple(sizes[n] for n in frame.FORWARD_GRID),
                      frame.FORWARD_GRID, own, frame.ring_scratch(STAGES, BLOCK, head_dim, k.dtype))
    return (*outs[:3], outs[3].astype(jnp.int32)) if save_sums else outs
