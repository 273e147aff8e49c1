"""The softmax forward as a Pallas Mosaic GPU kernel for Hopper (sm90): TMA loads, wgmma, and
warp specialisation, after FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608).

Why a second forward: the Triton lowering keeps one warpgroup doing loads, matmuls and the
softmax in turn and reaches 0.73-0.78x cuDNN at head dim 128 on an H100. Here a CTA holds three
warpgroups:
  - two compute warpgroups, block_q query rows each: S = Q K^T and O += P V on wgmma (P from
    registers), the online softmax in registers in base 2 with the scale folded into one FMA.
    While one warpgroup does its softmax, the other's matmuls keep the tensor cores busy;
  - one producer warpgroup: TMA copies of the K and V blocks into a ring of `stages` shared
    memory slots; a slot is refilled once both compute warpgroups have released it.
It serves the plain softmax (causal or not, GQA, any scale, 16-bit, padded head dim 64 or 128);
`unsupported_reason` names what it does not. The backward stays the engine's (`pallas_triton`):
this kernel returns lse in base 2, from which the backward recomputes P = exp2(s2 - lse2), which
is exact enough for 16-bit gradients.

No interpreter runs this kernel on CPU (jax 0.10); it is lowered there by the tests and compiled
and checked on the GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.device import device_info
from jax_attn.spec import AttentionSpec

LOG2E = math.log2(math.e)
HEAD_DIMS = (64, 128)  # padded head dims served (a 128-byte swizzle row holds 64 16-bit values)
WGMMA_ROWS = 64  # rows of one warpgroup's wgmma


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    """block_q rows per compute warpgroup (a CTA serves 2 * block_q), block_kv keys per step,
    `stages` K/V slots in shared memory."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2

    def __post_init__(self):
        if self.block_q % WGMMA_ROWS or self.block_kv % WGMMA_ROWS:
            raise ValueError(f"MosaicBlocks block_q={self.block_q}, block_kv={self.block_kv} must be "
                             f"multiples of {WGMMA_ROWS}")
        if self.stages < 2:
            raise ValueError(f"MosaicBlocks.stages={self.stages} must be >= 2 (one slot loads while one computes)")

    @property
    def q_tile(self) -> int:
        return 2 * self.block_q


def default_mosaic_blocks(head_dim: int) -> MosaicBlocks:
    """128-key steps in 2 stages fill 160 KB of shared memory at D=128 (256-key steps would not fit
    the H100's 227 KB); D=64 halves the slots, so it keeps 3 stages in flight."""
    return MosaicBlocks(64, 128, 2 if head_dim > 64 else 3)


def padded_head_dim(head_dim: int) -> int:
    """The head dim the engine pads to without RoPE (a power of two >= 16)."""
    return max(16, 1 << max(0, head_dim - 1).bit_length())


def unsupported_reason(spec: AttentionSpec, head_dim: int, dtype) -> str | None:
    """Why the Mosaic GPU forward cannot serve this call, or None if it can."""
    features = [name for name, used in (
        ("window", spec.window_left is not None or spec.window_right is not None),
        ("softcap", spec.softcap is not None), ("segment_ids", spec.has_segments),
        ("rope", spec.rope is not None)) if used]
    if features:
        return f"the Mosaic GPU forward serves plain (causal or not) attention, not {', '.join(features)}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return f"the Mosaic GPU forward takes float16 or bfloat16, not {jnp.dtype(dtype)}"
    if padded_head_dim(head_dim) not in HEAD_DIMS:
        return f"the Mosaic GPU forward serves head dims 33 to 128 (padded to {HEAD_DIMS}), got {head_dim}"
    info = device_info()
    if info.platform != "gpu" or not info.compute_capability or info.compute_capability[0] != 9:
        return (f"the Mosaic GPU forward needs a Hopper (sm90) GPU, this is {info.platform} "
                f"{info.name} (sm{info.compute_capability})")
    return None


def _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, smem, ready, free, *, blocks: MosaicBlocks,
            scale2: float, causal: bool, kv_len: int, group: int):
    q_smem, k_smem, v_smem, lse_smem = smem
    q_ready, k_ready, v_ready = ready
    k_free, v_free = free
    bq, bkv, stages = blocks.block_q, blocks.block_kv, blocks.stages
    num_kv = k_ref.shape[1] // bkv
    ragged = kv_len % bkv != 0  # the last key block holds padding: masked
    batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    tile = lax.axis_index("q_tiles")
    if causal:  # the last rows see the most keys: launch them first, the light tiles fill the tail
        tile = q_ref.shape[1] // blocks.q_tile - 1 - tile
    pair_first = tile * blocks.q_tile

    def steps_for(end_row):  # key blocks that rows < end_row see
        return jnp.minimum(pl.cdiv(end_row, bkv), num_kv) if causal else num_kv

    pair_steps = steps_for(pair_first + blocks.q_tile)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        first = pair_first + wg * bq
        steps = steps_for(first + bq)
        plain = num_kv - int(ragged)  # key blocks every row sees whole: no mask
        if causal:
            plain = jnp.minimum((first + 1) // bkv, plain)
        q_tile = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(first, bq), head], q_tile, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])

        def step(t, carry, masked: bool):
            m, l, acc = carry
            slot = lax.rem(t, stages)
            plgpu.barrier_wait(k_ready.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                rows = first + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                cols = t * bkv + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                keep = cols < kv_len
                if causal:
                    keep = keep & (cols <= rows)
                s = jnp.where(keep, s, -jnp.inf)
            # scale > 0: the row max of the raw scores, scaled, is the max of the scaled ones
            m_new = jnp.maximum(m, s.max(axis=1) * scale2)
            # a row that has seen only masked keys keeps m = -inf: exponents use 0 there (p = 0)
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_use, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(q_ref.dtype)
            plgpu.barrier_wait(v_ready.at[slot])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p, v_smem.at[slot])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return m_new, l, acc

        rows_layout = plgpu.Layout.WGMMA.reduce(1)
        carry = (plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), rows_layout),
                 plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), rows_layout),
                 plgpu.layout_cast(jnp.zeros((bq, q_ref.shape[3]), jnp.float32), plgpu.Layout.WGMMA))
        carry = lax.fori_loop(0, plain, functools.partial(step, masked=False), carry)
        m, l, acc = lax.fori_loop(plain, steps, functools.partial(step, masked=True), carry)

        # Causal: the other warpgroup's rows see more key blocks. Follow the ring through them
        # without computing, so every slot's release counts both warpgroups in order (an early
        # release would let the producer overwrite a slot the other warpgroup still reads).
        @pl.loop(steps, pair_steps)
        def _follow(t):
            slot = lax.rem(t, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])

        empty = l == 0.0  # no visible key: output 0, lse -inf (never NaN)
        l_safe = jnp.where(empty, 1.0, l)
        q_tile[...] = (acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])).astype(q_ref.dtype)
        lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe) * LOG2E)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, o_ref.at[batch, pl.ds(first, bq), head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(first, bq)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _produce():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.array(group, head.dtype))

        def load(t, slot):
            keys = (batch, pl.ds(t * bkv, bkv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_ready.at[slot])

        for t in range(stages):  # fill the ring
            pl.when(t < pair_steps)(functools.partial(load, t, t))

        @pl.loop(stages, pair_steps)
        def _refill(t):
            slot = lax.rem(t, stages)
            keys = (batch, pl.ds(t * bkv, bkv), kv_head)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_ready.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_ready.at[slot])


def flash_forward(q, k, v, spec: AttentionSpec, kv_len: int, blocks: MosaicBlocks):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], padded: Sq a multiple of blocks.q_tile, Sk of
    blocks.block_kv, D in HEAD_DIMS; keys >= kv_len are padding (masked).
    -> (out [B, Sq, Hq, D], lse2 [B, Hq, Sq] float32, base 2, of the scaled scores)."""
    batch, q_pad, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    bq, bkv, stages = blocks.block_q, blocks.block_kv, blocks.stages
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(q_ref, k_ref, v_ref, o_ref, lse_ref):
        smem = (plgpu.SMEM((2, bq, head_dim), q.dtype, transforms=swizzled),
                plgpu.SMEM((stages, bkv, head_dim), k.dtype, transforms=swizzled),
                plgpu.SMEM((stages, bkv, head_dim), v.dtype, transforms=swizzled),
                plgpu.SMEM((2, bq), jnp.float32))
        ready = (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=stages),
                 plgpu.Barrier(num_barriers=stages))
        free = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2  # one arrival per compute warpgroup
        kernel = functools.partial(_kernel, blocks=blocks, scale2=spec.scale * LOG2E, causal=spec.causal,
                                   kv_len=kv_len, group=group)
        pl.run_scoped(lambda *scratch: kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *scratch),
                      smem, ready, free, collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((batch, num_heads, q_pad), jnp.float32)),
        grid=(num_heads, q_pad // blocks.q_tile, batch),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v)
