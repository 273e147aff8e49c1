"""The warp-specialised Pallas Mosaic GPU frame (Hopper) the engine's Mosaic kernels share: two
compute warpgroups of query rows and a producer warpgroup streaming K, V blocks through a ring of
shared-memory slots (TMA), wgmma products, the visited key blocks and the launch."""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.ops.common.visit import partner_blocks, reach


HEAD_DIMS = (64, 128)  # padded head dims served (a 128-byte swizzle row holds 64 16-bit values)


WGMMA_ROWS = 64  # rows of one warpgroup's wgmma


class PingPong:
    """FlashAttention-3's ping-pong of the two compute warpgroups: a barrier of two arrivals that
    each passes twice a step (after issuing S = QK^T, and after its softmax, before PV), warpgroup 1
    once more before its first step and warpgroup 0 once more after its last. The n-th passage of
    one then pairs with the n-th of the other, so warpgroup 1's softmax starts when warpgroup 0's
    ends and the other way round: one's matmuls run while the other's softmax does. Both walk the
    whole stream (their own steps and `Ring.follow`'s), so the counts match."""

    def __init__(self, barrier):
        self.barrier = barrier

    def arrive(self):
        plgpu.barrier_arrive(self.barrier)

    def wait(self):
        plgpu.barrier_wait(self.barrier)

    def sync(self):
        self.arrive()
        self.wait()

    def begin(self, wg):
        pl.when(wg == 1)(self.sync)

    def end(self, wg):
        pl.when(wg == 0)(self.sync)


class Ring:
    """A stream of blocks through `stages` shared-memory slots, per streamed array: the producer
    warpgroup copies step t's blocks into slot t % stages (`ready[i]` fires when block i landed)
    and refills a slot once both compute warpgroups released it (`free[i]`, two arrivals). With
    `landed` (RoPE), array 0's copies land there instead and the producer prepares each block in
    place (rotates it) before it fires `ready[0]`. With `pingpong` (a `PingPong`'s barrier), the
    compute warpgroups alternate their softmaxes (`self.pingpong`)."""

    def __init__(self, slots, ready, free, stages: int, landed=None, pingpong=None):
        self.slots, self.ready, self.free, self.stages, self.landed = slots, ready, free, stages, landed
        self.pingpong = None if pingpong is None else PingPong(pingpong)

    def slot(self, t):
        return lax.rem(t, self.stages)

    def wait(self, t, i):
        plgpu.barrier_wait(self.ready[i].at[self.slot(t)])
        return self.slots[i].at[self.slot(t)]

    def release(self, t, i):
        plgpu.barrier_arrive(self.free[i].at[self.slot(t)])

    def follow(self, lo, hi):
        """Pass steps [lo, hi) without computing: the other warpgroup needs them (causal). Every
        slot's release must count both warpgroups in order; an early release would let the
        producer overwrite a slot the other warpgroup still reads."""
        @pl.loop(lo, hi)
        def _(t):
            for i in range(len(self.slots)):
                self.wait(t, i)
                self.release(t, i)
            if self.pingpong is not None:  # a step's two passages
                self.pingpong.sync()
                self.pingpong.sync()

    def produce(self, sources, steps, max_steps: int, prepare=None):
        """The producer warpgroup's loop; sources(t) -> the step's gmem blocks, one per array;
        steps (traced) <= max_steps (static). `prepare` (with `landed`; `_SharedKeys`) copies
        array 0's blocks itself (`prepare.copy`) and transforms each in shared memory once it
        landed (`prepare(t, slot)`), before the compute warpgroups see it; `start`, `publish`
        and `finish` are its hooks before the fills, after each step's `ready` and at the end;
        `idle(t)` runs after step t's refill, while the compute warpgroups work."""
        def copy(t, i, src):
            if prepare is not None and i == 0:
                prepare.copy(t, self.slots[0].at[self.slot(t)], self.landed.at[self.slot(t)])
            else:
                plgpu.copy_gmem_to_smem(src, self.slots[i].at[self.slot(t)], self.ready[i].at[self.slot(t)])

        def refill(t):
            for i, src in enumerate(sources(t)):
                plgpu.barrier_wait(self.free[i].at[self.slot(t)])
                copy(t, i, src)

        def fill(t):
            for i, src in enumerate(sources(t)):
                copy(t, i, src)

        if prepare is not None:
            prepare.start(steps, min(self.stages, max_steps))
        for t in range(min(self.stages, max_steps)):
            pl.when(t < steps)(functools.partial(fill, t))

        if prepare is None:
            pl.loop(self.stages, steps)(refill)
            return

        @pl.loop(0, steps)
        def _(t):
            slot = self.slots[0].at[self.slot(t)]
            plgpu.barrier_wait(self.landed.at[self.slot(t)])
            prepare(t, slot)
            plgpu.barrier_arrive(self.ready[0].at[self.slot(t)])
            prepare.publish(t, slot, steps)
            # refill the slot step t - 1 used: the compute warpgroups work on step t - 1 while
            # this warpgroup loads and prepares step t
            later = t - 1 + self.stages
            pl.when((t >= 1) & (later < steps))(lambda: refill(later))
            prepare.idle(t)

        prepare.finish(steps)


def ring_scratch(stages: int, rows: int, head_dim: int, dtype, count: int = 2, prepared: bool = False,
                 pingpong: bool = False):
    """(slots, ready, free, landed, pingpong) scratch for `count` streamed arrays of [rows, head_dim]
    blocks; `prepared`: array 0 is prepared by the producer (`Ring.produce`), else landed is None;
    `pingpong`: the compute warpgroups' `PingPong` barrier, else None."""
    ready = (plgpu.Barrier(num_barriers=stages),) * count  # TMA arrivals, or the producer's
    free = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * count  # one per compute warpgroup
    landed = plgpu.Barrier(num_barriers=stages) if prepared else None
    return ((smem((stages, rows, head_dim), dtype),) * count, ready, free, landed,
            plgpu.Barrier(num_arrivals=2) if pingpong else None)


def smem(shape, dtype):
    """Shared memory in the layout wgmma reads: 8-row tiles of 128-byte swizzled rows."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
                                                plgpu.SwizzleTransform(128)))


def walk(step, carry, blocks, leftwards: bool = False):
    """Run step(t, carry, masked) over (lo, plain_lo, plain_hi, hi): masked edges, plain middle;
    `leftwards`: from hi - 1 down to lo."""
    lo, plain_lo, plain_hi, hi = blocks
    parts = ((lo, plain_lo, True), (plain_lo, plain_hi, False), (plain_hi, hi, True))
    if not leftwards:
        for a, b, masked in parts:
            carry = lax.fori_loop(a, b, functools.partial(step, masked=masked), carry)
        return carry
    for a, b, masked in parts[::-1]:
        carry = lax.fori_loop(0, b - a, lambda n, c, b=b, masked=masked: step(b - 1 - n, c, masked=masked), carry)
    return carry


# jax 0.10's plgpu.load requires an index argument; 0.11 makes it optional and deprecates it
LOAD_NEEDS_INDEX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def load_gmem(ref, layout):
    """An fp32 array from gmem into registers: a [rows] vector in the layout of a wgmma tile's rows
    or columns, or a [64, cols] tile in the WGMMA layout."""
    index = ((),) if LOAD_NEEDS_INDEX else ()
    return plgpu.load(ref, *index, layout=layout, optimized=False)


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


# The RoPE forward's producer rotates key blocks (the compute warpgroups keep the rest, 184); fewer
# registers make its rotations spill (docs/design/rope.md, 'The Hopper kernels').
ROPE_PRODUCER_REGISTERS = 128


def matmul(shape, a, b, issued=None):
    """a @ b on wgmma into a fresh fp32 accumulator of `shape`; `issued()` runs while it is in flight."""
    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        if issued is not None:
            issued()
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def matmul_add(acc, a, b):
    """acc + a @ b on wgmma (a from registers or shared memory)."""
    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
    return pl.run_state(run)(plgpu.ACC.init(acc))


def zeros(shape, layout=plgpu.Layout.WGMMA, value=0.0):
    return plgpu.layout_cast(jnp.full(shape, value, jnp.float32), layout)


def store_tiles(pairs):
    """Registers -> shared memory -> gmem (TMA), for [(value, smem tile, gmem block)]."""
    for value, tile, _ in pairs:
        tile[...] = value.astype(tile.dtype)
    plgpu.commit_smem()
    for _, tile, dst in pairs:
        plgpu.copy_smem_to_gmem(tile, dst)
    plgpu.wait_smem_to_gmem(0)


def register_split(producer: int) -> tuple[int, int]:
    """(producer, compute) registers per thread (multiples of 8). The CTA's 384 threads start with
    168 each (64K / 384, rounded down to 8) and setmaxnreg only moves registers between its
    warpgroups: a compute warpgroup's increase waits until the producer's decrease freed enough,
    so the split must fit 3 * 168 (FA3's 40 / 232 fills it exactly)."""
    return producer, (3 * 168 - producer) // 2 // 8 * 8


def stream_kv(ring: Ring, k_ref, v_ref, batch, kv_head, bkv: int, lo, hi, shared=None, leftwards=False):
    """The producer warpgroup of the forward and dQ kernels: the kv head's K, V blocks [lo, hi)
    (`leftwards`: from hi - 1 down); with `shared` (RoPE; `_SharedKeys` but for where this stream
    is), the K blocks come rotated, the delta table's copy awaited before the first this CTA
    rotates."""
    plgpu.set_max_registers(register_split(ROPE_PRODUCER_REGISTERS if shared else 40)[0], action="decrease")
    prepare = None
    if shared is not None:
        prepare = shared(ring=ring, batch=batch, kv_head=kv_head, bkv=bkv, lo=lo)
        prepare.rotary.fetch()
    keys = lambda u: (batch, pl.ds((hi - 1 - u if leftwards else lo + u) * bkv, bkv), kv_head)
    ring.produce(lambda u: (k_ref.at[keys(u)], v_ref.at[keys(u)]), hi - lo, k_ref.shape[1] // bkv, prepare)


def query_pair(q_ref, block_q: int, spec: AttentionSpec):
    """The CTA's first query row (two blocks of block_q: one per compute warpgroup). Causal grids
    launch the last rows first: they see the most keys, and the light tiles fill the tail."""
    tile = lax.axis_index("q_tiles")
    if spec.causal:
        tile = q_ref.shape[1] // (2 * block_q) - 1 - tile
    return tile * 2 * block_q


def query_major(compute, q_ref, k_ref, v_ref, ring, *, bq: int, bkv: int, stages: int,
                 spec: AttentionSpec, kv_len: int, group: int, shared=None, leftwards: bool = False,
                 rotators: bool = False, kv_head_of=None):
    """The frame of the forward and dQ kernels: two blocks of bq query rows per CTA (one per
    compute warpgroup) and the producer streaming the key blocks they see. Runs
    compute(batch, head, wg, first, own_blocks, stream, ring) in each compute warpgroup: its
    first row, its (lo, plain_lo, plain_hi, hi) and the pair's stream (stream_lo, stream_hi);
    key blocks of padding alone are skipped and the one holding kv_len is masked
    (`partner_blocks`'s `valid`). `shared` (RoPE): the streamed keys come rotated (`stream_kv`);
    `leftwards`: the stream runs from stream_hi - 1 down. `rotators`: the grid's head axis
    starts with a pseudo-head whose CTAs compute nothing and stream nothing (their producers only
    rotate for head 0: `_NextHead`). `kv_head_of(head)`: the kv head a grid head reads (default
    head // group; a row map's slot)."""
    ring = Ring(*ring[:3], stages, *ring[3:])
    batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    if rotators:
        head = head - 1
    pair_first = query_pair(q_ref, bq, spec)
    before, after = reach(spec)
    num_kv = k_ref.shape[1] // bkv
    ranges = [partner_blocks(pair_first + w * bq, bq, bkv, num_kv, before, after, valid=kv_len)
              for w in range(2)]
    stream = (ranges[0][0], ranges[1][3])
    if rotators:
        stream = (stream[0], jnp.where(head < 0, stream[0], stream[1]))

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(register_split(ROPE_PRODUCER_REGISTERS if shared else 40)[1], action="increase")
        first = pair_first + wg * bq
        own_blocks = [jnp.where(wg == 0, a, b) for a, b in zip(*ranges)]
        run = functools.partial(compute, batch, head, wg, first, own_blocks, stream, ring)
        if rotators:
            pl.when(head >= 0)(run)
        else:
            run()

    if kv_head_of is not None:
        kv_head = kv_head_of(head)
    else:
        kv_head = lax.div(jnp.maximum(head, 0) if rotators else head, jnp.array(group, head.dtype))
    pl.when(wg == 2)(functools.partial(stream_kv, ring, k_ref, v_ref, batch, kv_head, bkv, *stream, shared,
                                       leftwards))


def launch(kernel, args, out_type, grid, grid_names, own, ring):
    """One CTA: two compute warpgroups and one producer; scratch = own blocks (smem, barriers)
    and the ring (`ring_scratch`), shared by the three warpgroups. A Ref in args (the RoPE
    forward's flags) is read and written in place: `plgpu.kernel` (whose batching rule folds a
    vmapped axis into the grid) does not take Refs, `pl.kernel` does (and cannot be vmapped)."""
    def entry(*refs):
        pl.run_scoped(lambda own_smem, own_ready, *ring_refs: kernel(*refs, (own_smem, own_ready), ring_refs),
                      *own, *ring, collective_axes="wg")

    params = plgpu.CompilerParams(approx_math=True)
    if any(isinstance(a, jax.Ref) for a in args):
        mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=3, thread_name="wg")
        return pl.kernel(entry, out_type=out_type, mesh=mesh, compiler_params=params, name="entry")(*args)
    return plgpu.kernel(entry, out_type=out_type, grid=grid, grid_names=grid_names, num_threads=3,
                        thread_name="wg", compiler_params=params)(*args)


# The forward's grid; Pallas launches its last axis fastest (CUDA's x). Query tiles fastest: the
# tiles of one (head, batch row) run together and read its K, V from L2 once. With the batch
# fastest, a row's tiles ran B CTAs apart, and from B * 1 MB of K, V past the L2 (B = 64 rows of
# 2048 x 128, a dilated branch at 128k) the forward re-read them from HBM: 1.4x slower. Heads
# outermost (with RoPE, `_NextHead` rotates a head's q and keys while the head before runs).
FORWARD_GRID = ("heads", "batch", "q_tiles")
