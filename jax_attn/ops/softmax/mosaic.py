"""The softmax attention as Pallas Mosaic GPU kernels for Hopper (sm90): TMA loads, wgmma and warp
specialisation, after FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608). Forward, dQ, dK/dV.

Why a second implementation: the Triton lowering keeps one warpgroup doing loads, matmuls and the
softmax in turn. Here a CTA holds two compute warpgroups, each owning a 64-row block (query rows for
the forward and dQ, keys for dK/dV; matmuls on wgmma with P and dS from registers, base 2 with the
scale folded into one FMA), so one's softmax overlaps the other's matmuls (in the forward they
are made to alternate: `frame.PingPong`), and one producer
warpgroup streaming the other side's blocks by TMA through a ring of shared-memory slots
(`frame.Ring`). The backward mirrors the Triton engine's (dQ and dK/dV kernels, no atomics,
deterministic; P = exp2(s2 - lse2)). Each warpgroup walks only the blocks its rows can see
(`visit.partner_blocks`); `unsupported_reason` names what is not served. RoPE at positions arange:
each q tile and key block is rotated once and shared between CTAs through gmem (`_Rotary`,
`_SharedKeys`, `_NextHead`). Design and figures: docs/design/softmax.md, docs/design/rope.md.

No interpreter runs these kernels on CPU; the tests lower them there and run them on the GPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.device import device_info
from jax_attn.ops.common import mosaic_frame as frame, visit
from jax_attn.ops.common.mosaic_frame import FORWARD_GRID, HEAD_DIMS, WGMMA_ROWS
from jax_attn.ops.common.rope import Rope, inverse_frequencies
from jax_attn.ops.common.spec import LOG2E, AttentionSpec, padded_head_dim, visible


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
    """Tiles of the Mosaic GPU kernels, in the field vocabulary of `BlockSizes`: block_q rows per
    compute warpgroup (a CTA serves 2 * block_q), block_k keys per step, `num_stages` K/V slots in
    shared memory; the backward's block_q_bwd, block_k_bwd, num_stages_bwd likewise."""

    block_q: int = 64
    block_k: int = 128
    num_stages: int = 2
    block_q_bwd: int = 64  # backward: query rows per warpgroup (dQ) and per streamed block (dK/dV)
    block_k_bwd: int = 64  # keys per warpgroup (dK/dV) and per streamed block (dQ)
    num_stages_bwd: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), int) or isinstance(getattr(self, f.name), bool):
                raise TypeError(f"MosaicBlockSizes.{f.name}={getattr(self, f.name)!r} must be an int")
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            if getattr(self, name) < WGMMA_ROWS or getattr(self, name) % WGMMA_ROWS:
                raise ValueError(f"MosaicBlockSizes.{name}={getattr(self, name)} must be a multiple of "
                                 f"{WGMMA_ROWS}, at least {WGMMA_ROWS}")
        for name in ("num_stages", "num_stages_bwd"):
            if getattr(self, name) < 2:
                raise ValueError(f"MosaicBlockSizes.{name}={getattr(self, name)} must be >= 2 "
                                 f"(one slot loads while one computes)")

    @property
    def q_tile(self) -> int:
        return 2 * self.block_q

    @property
    def tiles(self) -> tuple[int, int]:
        """The multiples the query and key lengths are padded to."""
        return (max(self.q_tile, 2 * self.block_q_bwd),
                max(self.block_k, 2 * self.block_k_bwd))


def default_mosaic_block_sizes(head_dim: int) -> MosaicBlockSizes:
    """128-key steps in 2 stages fill 160 KB of shared memory at D=128 (256-key steps would not fit
    the H100's 227 KB); D=64 halves the slots, so it keeps 3 stages in flight."""
    return MosaicBlockSizes(64, 128, 2 if head_dim > 64 else 3)


def unsupported_reason(spec: AttentionSpec, head_dim: int, dtype, positions: bool = False) -> str | None:
    """Why the Mosaic GPU kernels cannot serve this call, or None if they can. `positions`: RoPE
    positions are given as an array (the kernels serve RoPE at positions arange only)."""
    features = [name for name, used in (
        ("softcap", spec.softcap is not None), ("segment_ids", spec.has_segments),
        ("RoPE positions arrays", spec.rope is not None and positions),
        ("q_offset != kv_offset", spec.offset != 0), ("ALiBi", spec.alibi), ("dropout", spec.dropout > 0)) if used]
    if features:
        return (f"the Mosaic GPU kernels serve causal and windowed attention (top-left aligned) and RoPE "
                f"at positions arange, not {', '.join(features)}")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return f"the Mosaic GPU kernels take float16 or bfloat16, not {jnp.dtype(dtype)}"
    if padded_head_dim(spec, head_dim) not in HEAD_DIMS:
        return f"the Mosaic GPU kernels serve head dims 33 to 128 (padded to {HEAD_DIMS}), got {head_dim}"
    info = device_info()
    if info.platform != "gpu" or not info.compute_capability or info.compute_capability[0] != 9:
        return (f"the Mosaic GPU kernels need a Hopper (sm90) GPU, this is {info.platform} "
                f"{info.name} (sm{info.compute_capability})")
    return None


# ----------------------------------------------------------------------------------------------
# RoPE at positions arange. A 64-row block b holds positions 64 b + r, r < 64; its cos/sin come by
# angle addition from one base row (b) and a delta table shared by every block, so a streamed key
# block costs one 1 KB base row of L2 traffic, not 64 KB of cos/sin (`rope_tables`).
# ----------------------------------------------------------------------------------------------

ROPE_ROWS = WGMMA_ROWS
ROPE_PIECE = 32  # pairs rotated at a time: one fp32 shared-memory tile row (128 bytes)


def _pair_order(pairs: int) -> jnp.ndarray:
    """Style "interleaved": the order of the pair angles in the tables. In the WGMMA layout a
    thread's register holds one pair (columns 2i, 2i + 1) and a 64-column piece gives it the pairs
    a + 4 g (a = its lane % 4, g the register's 8-column group); a 32-column fp32 table piece loads
    as its registers g' = 0..3, elements e = 0, 1: storing pair a + 8 g' + 4 e there makes table
    element (g', e) the angle of register g = 2 g' + e (`_interleave`)."""
    local = np.arange(ROPE_PIECE)
    local = (local % 8) // 2 + 8 * (local // 8) + 4 * (local % 2)
    return jnp.asarray((np.arange(pairs) // ROPE_PIECE * ROPE_PIECE + np.tile(local, pairs // ROPE_PIECE)))


def rope_tables(rope: Rope, head_dim: int, head_pad: int, length: int):
    """-> (base [2, length / 64, head_pad / 2], delta [2, 64, head_pad / 2]) fp32: cos and sin of
    the angles 64 b theta_i and r theta_i per pair i (theta 0 on padded pairs; style "interleaved"
    in `_pair_order`). A row at position 64 b + r turns by their sum (angle addition)."""
    pairs = head_pad // 2
    theta = jnp.pad(inverse_frequencies(head_dim, rope.base), (0, pairs - head_dim // 2))
    if rope.style == "interleaved":
        theta = theta[_pair_order(pairs)]

    def table(positions):  # the angle as the reference computes it: fp32 position * theta
        angle = positions.astype(jnp.float32)[:, None] * theta[None]
        return jnp.stack([jnp.cos(angle), jnp.sin(angle)])

    return table(jnp.arange(0, length, ROPE_ROWS)), table(jnp.arange(ROPE_ROWS))


def _register_op(fn, parts, shape):
    """fn(registers of parts...) -> registers, for arrays in the WGMMA layout (a register: two
    adjacent columns; the register array's axis 1: 8-column groups); moves registers and the
    elements within them only. The result has `shape` and the parts' dtype."""
    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout,) * len(parts),
                       return_type=plgpu.ShapeDtypeStruct(shape, parts[0].dtype, layout))
    def op(_, *arrays):
        return mgpu.FragmentedArray(_registers=fn(*(a.registers for a in arrays)), _layout=arrays[0].layout,
                                    _is_signed=arrays[0].is_signed)

    return op(*parts)


def _element(register, e):
    return mgpu.utils.vector_slice(register, slice(e, e + 1))


def _swap_pairs(x):
    """[rows, cols] -> the pair partner of every element: a register holds a pair (2i, 2i + 1)."""
    swap = np.vectorize(lambda r: mgpu.utils.vector_concat([_element(r, 1), _element(r, 0)]), otypes=[object])
    return _register_op(swap, [x], x.shape)


def _interleave(first, second):
    """Table pieces [rows, 32] (`_pair_order`) -> [rows, 64] whose register g = 2 g' + e holds
    (first, second)[g'][e] as its pair: the per-pair angles spread over the pairs' columns."""
    def spread(a, b):
        out = np.empty((a.shape[0], 2 * a.shape[1], *a.shape[2:]), object)  # axis 1: 8-column groups
        for index in np.ndindex(a.shape):
            for e in range(2):
                out[(index[0], 2 * index[1] + e, *index[2:])] = mgpu.utils.vector_concat(
                    [_element(a[index], e), _element(b[index], e)])
        return out

    return _register_op(spread, [first, second], (first.shape[0], 2 * first.shape[1]))


def _join_columns(parts):
    """Concatenate [rows, c_i] arrays along the columns (registers only)."""
    shape = (parts[0].shape[0], sum(p.shape[1] for p in parts))
    return _register_op(lambda *r: np.concatenate(r, axis=1), parts, shape)


class _Rotary:
    """The RoPE rotation of 64-row blocks in registers, from tables in shared memory: the delta
    table copied once per CTA (`fetch`, then `ready` fires) and a block's base rows (for each
    compute warpgroup's own block: `prefetch`, then `own_base`), so a rotation waits on no gmem
    load. A block rotates 32 pairs at a time (bounded registers: the producer warpgroup rotates
    with few); cos and sin are computed once per pair (angle addition) and spread over its two
    columns by moving registers."""

    def __init__(self, style: str, base_ref, delta_ref, smem, barriers):
        """smem, barriers: what `scratch` allocated."""
        self.style, self.base_ref, self.delta_ref = style, base_ref, delta_ref
        (self.delta_smem, self.base_smem), (ready, self.base_ready) = smem, barriers
        self.ready = ready.at[0]

    @staticmethod
    def scratch(head_dim: int):
        """(delta table, the two compute warpgroups' base rows), their barriers."""
        return ((frame.smem((2, ROPE_ROWS, head_dim // 2), jnp.float32), plgpu.SMEM((2, 2, 1, head_dim // 2), jnp.float32)),
                (plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=2)))

    def fetch(self):
        plgpu.copy_gmem_to_smem(self.delta_ref, self.delta_smem, self.ready)

    def copy_base(self, block, dst, barrier):
        """The base rows of the 64-row blocks from `block` on ([2, blocks, D/2] `dst`), by TMA."""
        plgpu.copy_gmem_to_smem(self.base_ref.at[:, pl.ds(block, dst.shape[1])], dst, barrier)

    def prefetch(self, wg, block):
        """Warpgroup wg's base rows, of 64-row block `block`."""
        self.copy_base(block, self.base_smem.at[wg], self.base_ready.at[wg])

    def own_base(self, wg):
        """What `prefetch` copied, once it landed (with the delta table): `base` for a 64-row tile."""
        plgpu.barrier_wait(self.ready)
        plgpu.barrier_wait(self.base_ready.at[wg])
        return self.base_smem.at[wg]

    def pieces(self, columns, base, inverse: bool):
        """R x (R^T x if inverse) for x [64, D] given by columns(start, width) -> x[:, start:start +
        width] fp32 (WGMMA layout), at the positions of the 64-row block whose base rows [2, D/2]
        (shared memory) are `base`: -> the rotated column pieces, in order."""
        count = self.delta_ref.shape[-1] // ROPE_PIECE
        col = plgpu.Layout.WGMMA.reduce(0)
        shape = (ROPE_ROWS, ROPE_PIECE)
        firsts, seconds = [], []  # style "half": the pieces of the pairs' first and second columns
        for j in range(count):
            cols = pl.ds(j * ROPE_PIECE, ROPE_PIECE)
            c0, s0 = (lax.broadcast_in_dim(frame.load_gmem(base.at[i, cols], col), shape, [1]) for i in range(2))
            dc, ds = self.delta_smem[0, :, cols], self.delta_smem[1, :, cols]
            cos, sin = c0 * dc - s0 * ds, s0 * dc + c0 * ds
            if inverse:
                sin = -sin
            if self.style == "half":  # pairs (c, c + D/2): piece j and piece j + count
                a, b = columns(j * ROPE_PIECE, ROPE_PIECE), columns((j + count) * ROPE_PIECE, ROPE_PIECE)
                firsts.append(a * cos - b * sin)
                seconds.append(b * cos + a * sin)
            else:  # 32 pairs (2i, 2i + 1) span 64 columns: (a, b) -> (a cos - b sin, b cos + a sin)
                x = columns(2 * j * ROPE_PIECE, 2 * ROPE_PIECE)
                firsts.append(x * _interleave(cos, cos) + _swap_pairs(x) * _interleave(-sin, sin))
        return firsts + seconds

    def __call__(self, x, base, inverse: bool = False):
        """R x (R^T x if inverse) for x [64, D] fp32 (WGMMA layout); `base` as for `tile`."""
        return _join_columns(self.pieces(lambda start, width: x[:, start:start + width], base.at[:, 0], inverse))

    def tile(self, tile, base):
        """Rotate a [rows, D] tile in shared memory in place, 64 rows at a time, given its blocks'
        base rows [2, rows / 64, D/2] in shared memory; then commit it for the async proxy (wgmma,
        TMA)."""
        for c in range(tile.shape[0] // ROPE_ROWS):
            part = tile.at[pl.ds(c * ROPE_ROWS, ROPE_ROWS)]
            x = part[...]
            out = self.pieces(lambda start, width: x[:, start:start + width].astype(jnp.float32),
                              base.at[:, c], inverse=False)
            part[...] = _join_columns([o.astype(tile.dtype) for o in out])
        plgpu.commit_smem()


FLAG_WORDS = 32  # a block's published flag: one 128-byte record (TMA copies 16-byte multiples)


class _SharedKeys:
    """The RoPE forward's key blocks, rotated once and shared between CTAs through gmem.

    Every query CTA streams the key blocks it sees; rotating each one in every CTA would make the
    producer the bottleneck (docs/design/rope.md). Here the producer reads a block's
    flag before it loads the block: if another CTA published it, it loads the rotated copy
    (`k_rot`); if not, it loads the raw block, rotates it (`_Rotary.tile`), stores it to k_rot
    and, once that store completed, sets the flag. Several CTAs may rotate and publish one block
    at once: they write identical bytes, so a reader that sees the flag reads the right data,
    and no CTA ever waits for another (the launch order cannot deadlock). Flags start at zero
    per call (a fresh Ref). A flag is read one step ahead of its block's load (a stale 0 only
    costs a redundant rotation) and kept until the block's flag is published (`slots`)."""

    def __init__(self, rotary, k_ref, k_rot_ref, flags_ref, smem, barriers, ahead, *, ring: frame.Ring, batch,
                 kv_head, bkv: int, lo):
        """ahead: the CTA's rotations for the next head (`_NextHead`), done in this stream's idle
        time."""
        self.rotary, self.k, self.k_rot, self.flags, self.ahead = rotary, k_ref, k_rot_ref, flags_ref, ahead
        (self.flag_rows, self.ones, self.base), (self.flag_ready, self.base_ready) = smem, barriers
        self.ring, self.batch, self.kv_head, self.bkv, self.lo = ring, batch, kv_head, bkv, lo

    @staticmethod
    def slots(stages: int) -> int:
        """A flag is read at step t - stages and last used at step t + 1 (its publication)."""
        return stages + 2

    @classmethod
    def scratch(cls, stages: int, bkv: int, head_dim: int):
        """(flag records, a row of ones to publish from (128 words: the smallest warpgroup
        store), per ring slot the base rows of a block this CTA rotates), their barriers."""
        return ((plgpu.SMEM((cls.slots(stages), FLAG_WORDS), jnp.int32), plgpu.SMEM((128,), jnp.int32),
                 plgpu.SMEM((stages, 2, bkv // ROPE_ROWS, head_dim // 2), jnp.float32)),
                (plgpu.Barrier(num_barriers=cls.slots(stages)), plgpu.Barrier(num_barriers=stages)))

    def _slot(self, t):
        return lax.rem(t, self.slots(self.ring.stages))

    def _keys(self, t):
        return self.batch, pl.ds((self.lo + t) * self.bkv, self.bkv), self.kv_head

    def _flag(self, t):
        return self.flags.at[self.batch, self.kv_head, self.lo + t]

    def _request(self, t):
        plgpu.copy_gmem_to_smem(self._flag(t), self.flag_rows.at[self._slot(t)], self.flag_ready.at[self._slot(t)])

    def _local(self, t):
        """Step t's block was unpublished when this CTA loaded it: it rotates and publishes it."""
        return self.flag_rows[self._slot(t), 0] == 0

    def start(self, steps, first: int):
        """Before the ring's first `first` fills: their flags, and the row to publish from."""
        self.ones[...] = jnp.full((128,), 1, jnp.int32)
        plgpu.commit_smem()
        for t in range(first):
            pl.when(t < steps)(functools.partial(self._request, t))

    def _first_block(self, t):  # of the 64-row blocks step t's key block holds
        return (self.lo + t) * (self.bkv // ROPE_ROWS)

    def copy(self, t, dst, barrier):
        """Step t's key block, rotated (published) or raw with its base rows (to rotate)."""
        plgpu.barrier_wait(self.flag_ready.at[self._slot(t)])
        ring_slot = self.ring.slot(t)  # where the block's base rows land too

        @pl.when(self._local(t))
        def _():
            plgpu.copy_gmem_to_smem(self.k.at[self._keys(t)], dst, barrier)
            self.rotary.copy_base(self._first_block(t), self.base.at[ring_slot], self.base_ready.at[ring_slot])

        pl.when(~self._local(t))(lambda: plgpu.copy_gmem_to_smem(self.k_rot.at[self._keys(t)], dst, barrier))

    def __call__(self, t, slot):
        pl.when(t == 0)(lambda: plgpu.barrier_wait(self.rotary.ready))  # the delta table
        ring_slot = self.ring.slot(t)

        @pl.when(self._local(t))
        def _():
            plgpu.barrier_wait(self.base_ready.at[ring_slot])
            self.rotary.tile(slot, self.base.at[ring_slot])

    def _set(self, flag):
        plgpu.copy_smem_to_gmem(self.ones.at[pl.ds(0, FLAG_WORDS)], flag)

    def _publish(self, t, when):
        """Step t's flag (its block's store has completed), if `when` and step t rotated it."""
        t = jnp.maximum(t, 0)
        pl.when(when & self._local(t))(lambda: self._set(self._flag(t)))

    def publish(self, t, slot, steps):
        """After step t's block is ready: publish step t - 1's (its store has had a step to
        complete), store step t's, and read the flag of the block loaded next step."""
        plgpu.wait_smem_to_gmem(0)  # also lets the ring refill step t - 1's slot
        self._publish(t - 1, t >= 1)
        pl.when(self._local(t))(lambda: plgpu.copy_smem_to_gmem(slot, self.k_rot.at[self._keys(t)]))
        ahead = t + self.ring.stages
        pl.when(ahead < steps)(lambda: self._request(ahead))

    def idle(self, t):
        self.ahead.advance(t, self._set)

    def finish(self, steps):
        plgpu.wait_smem_to_gmem(0)
        self._publish(steps - 1, steps >= 1)
        pl.when(steps == 0)(lambda: plgpu.barrier_wait(self.rotary.ready))  # else step 0 waited
        self.ahead.finish(steps, self._set)
        plgpu.wait_smem_to_gmem(0)


class _NextHead:
    """The RoPE forward's rotations one head ahead. The grid runs heads outermost (`FORWARD_GRID`),
    so a head's CTAs run together and would all rotate the same key blocks at once; instead each CTA rotates, for the CTA at its place in the next head, that CTA's q
    tile and one key block of the next head (where it starts a new kv head), stores them to q
    rotated / k rotated and publishes their flags. Its producer does it in 64-row chunks in the
    stream's idle time (`_SharedKeys.idle`: a chunk loads at one step and is rotated at the next),
    a CTA with fewer steps finishes at its end. A pseudo-head of CTAs before head 0 does only
    this, for head 0. The next head's CTAs find the flags set and load q and keys rotated; an
    unset flag (a straggler) costs a rotation there: both write identical bytes."""

    CHUNKS = 4  # the q tile's two 64-row halves, then the key block's (their flags: after 1 and 3)

    def __init__(self, rotary, refs, smem, barriers, *, num_heads: int, group: int, q_first, bkv: int):
        """refs: q, k, q rotated, k rotated, q flags [B, Hq, q tiles], k flags [B, Hkv, key blocks]."""
        self.rotary = rotary
        self.q, self.k, self.q_rot, self.k_rot, self.q_flags, self.k_flags = refs
        (self.stage, self.base), self.landed = smem, barriers
        self.batch, self.q_first, self.bkv = lax.axis_index("batch"), q_first, bkv
        self.head = lax.axis_index("heads")  # the next head: the grid's head axis starts with the pseudo-head
        self.kv_head = lax.div(self.head, jnp.array(group, self.head.dtype))
        self.key_block = lax.axis_index("q_tiles")  # the first CTAs of a head take the first blocks
        self.has_next = self.head < num_heads
        self.keys = (self.has_next & (lax.rem(self.head, jnp.array(group, self.head.dtype)) == 0)
                     & (self.key_block < self.k.shape[1] // bkv))

    @staticmethod
    def scratch(head_dim: int, dtype):
        """(a 64-row stage, its base rows), (their barriers)."""
        return ((frame.smem((ROPE_ROWS, head_dim), dtype), plgpu.SMEM((2, 1, head_dim // 2), jnp.float32)),
                plgpu.Barrier(num_barriers=2))

    def _chunk(self, c: int):
        """(source, destination, 64-row block index) of chunk c."""
        if c < 2:
            first = self.q_first + c * ROPE_ROWS
            rows = (self.batch, pl.ds(first, ROPE_ROWS), self.head)
            return self.q.at[rows], self.q_rot.at[rows], first // ROPE_ROWS
        first = self.key_block * self.bkv + (c - 2) * ROPE_ROWS
        rows = (self.batch, pl.ds(first, ROPE_ROWS), self.kv_head)
        return self.k.at[rows], self.k_rot.at[rows], first // ROPE_ROWS

    def _enabled(self, c: int):
        return self.keys if c >= 2 else self.has_next

    def _load(self, c: int):
        src, _, block = self._chunk(c)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's store has read the stage
        plgpu.copy_gmem_to_smem(src, self.stage, self.landed.at[0])
        self.rotary.copy_base(block, self.base, self.landed.at[1])

    def _rotate(self, c: int):
        _, dst, _ = self._chunk(c)
        plgpu.barrier_wait(self.landed.at[0])
        plgpu.barrier_wait(self.landed.at[1])
        self.rotary.tile(self.stage, self.base)
        plgpu.copy_smem_to_gmem(self.stage, dst)

    @staticmethod
    def q_flag(q_flags, batch, head, row):
        """The flag of the query tile (2 x 64 rows, a CTA's) holding `row`."""
        return q_flags.at[batch, head, row // (2 * ROPE_ROWS)]

    def _flag(self, c: int):
        if c == 1:
            return self.q_flag(self.q_flags, self.batch, self.head, self.q_first)
        return self.k_flags.at[self.batch, self.kv_head, self.key_block]

    def advance(self, t, publish):
        """Step t of the schedule (it ends at CHUNKS + 1): publish what chunk t - 2 completed (its
        store has completed: the caller waited), rotate and store chunk t - 1, load chunk t."""
        for c in (1, 3):
            pl.when((t == c + 2) & self._enabled(c))(lambda c=c: publish(self._flag(c)))
        for c in range(self.CHUNKS):
            pl.when((t == c + 1) & self._enabled(c))(functools.partial(self._rotate, c))
        for c in range(self.CHUNKS):
            pl.when((t == c) & self._enabled(c))(functools.partial(self._load, c))

    def finish(self, steps, publish):
        """The schedule's steps the stream did not reach."""
        for t in range(self.CHUNKS + 2):
            @pl.when(t >= steps)
            def _():
                plgpu.wait_smem_to_gmem(0)
                self.advance(t, publish)


# The dK/dV compute warpgroups hold dK, dV and the step's S, dP, so they take all but the producer's
# few registers (docs/design/softmax.md, 'Registers').
DKDV_PRODUCER_REGISTERS = 24


def _slots(rows, head):
    """(q slot, kv slot) that grid head `head` reads through the row map `rows` (an
    `attn_spec.dilation.RowMap`), in lax integer ops on the traced scalar."""
    const = lambda x: jnp.array(x, head.dtype)
    g = head + const(rows.head_base)
    o = lax.rem(g, const(rows.rate)) if rows.offset is None else const(rows.offset)
    return o * const(rows.heads) + g, o * const(rows.kv_heads) + lax.div(g, const(rows.heads // rows.kv_heads))


def _split_tables(refs, spec: AttentionSpec):
    """A kernel's refs after its inputs -> (RoPE tables (base, delta) or (), its outputs)."""
    count = 2 if spec.rope is not None else 0
    return refs[:count], refs[count:]


def _forward_kernel(q_ref, k_ref, v_ref, *refs, blocks: MosaicBlockSizes, spec: AttentionSpec,
                    kv_len: int, group: int, row_map=None):
    """Outputs o, lse2 and, with RoPE (after the tables, the k and q flags come as input Refs), k
    rotated and q rotated (`_SharedKeys`, `_NextHead`; the backward reads them)."""
    *refs, own, ring = refs
    tables, outputs = _split_tables(tuple(refs), spec)
    rotary = shared = None
    bq, bkv = blocks.block_q, blocks.block_k
    if tables:
        k_flags, q_flags, o_ref, lse_ref, k_rot_ref, q_rot_ref = outputs
        (q_smem, rotary_smem, shared_smem, ahead_smem, q_flag_rows), \
            (own_ready, rotary_barriers, shared_barriers, ahead_barriers, q_flag_ready) = own
        rotary = _Rotary(spec.rope.style, *tables, rotary_smem, rotary_barriers)
        ahead = _NextHead(rotary, (q_ref, k_ref, q_rot_ref, k_rot_ref, q_flags, k_flags), ahead_smem, ahead_barriers,
                          num_heads=q_ref.shape[2], group=group, q_first=frame.query_pair(q_ref, bq, spec), bkv=bkv)
        shared = functools.partial(_SharedKeys, rotary, k_ref, k_rot_ref, k_flags, shared_smem, shared_barriers,
                                   ahead)
    else:
        (o_ref, lse_ref), ((q_smem,), own_ready) = outputs, own
    scale2 = spec.scale * LOG2E

    def load_rotated_q(batch, head, wg, rows, q_tile):
        """q rotated into q_tile: published by the CTA before (`_NextHead`), or rotated here."""
        flag = q_flag_rows.at[wg]
        plgpu.copy_gmem_to_smem(_NextHead.q_flag(q_flags, batch, head, rows.start), flag, q_flag_ready.at[wg])
        plgpu.barrier_wait(q_flag_ready.at[wg])
        published = flag[0] != 0
        pl.when(published)(lambda: plgpu.copy_gmem_to_smem(q_rot_ref.at[batch, rows, head], q_tile, own_ready.at[wg]))

        @pl.when(~published)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_tile, own_ready.at[wg])
            rotary.prefetch(wg, rows.start // ROPE_ROWS)

        plgpu.barrier_wait(own_ready.at[wg])

        @pl.when(~published)
        def _():
            rotary.tile(q_tile, rotary.own_base(wg))
            plgpu.copy_smem_to_gmem(q_tile, q_rot_ref.at[batch, rows, head])

    def compute(batch, head, wg, first, own_blocks, stream, ring):
        stream_lo, stream_hi = stream
        q_tile, rows = q_smem.at[wg], pl.ds(first, bq)
        if rotary is None:
            q_head = head if row_map is None else _slots(row_map, head)[0]
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, q_head], q_tile, own_ready.at[wg])
            plgpu.barrier_wait(own_ready.at[wg])
        else:
            load_rotated_q(batch, head, wg, rows, q_tile)

        pingpong = ring.pingpong

        def step(t, carry, masked: bool):
            m, l, acc = carry
            u = t - stream_lo  # the ring's step
            s = frame.matmul((bq, bkv), q_tile, ring.wait(u, 0).transpose((1, 0)), issued=pingpong.sync)
            ring.release(u, 0)
            if masked:
                keep = visible(spec, first + frame.iota(s.shape, 0), t * bkv + frame.iota(s.shape, 1), kv_len)
                s = jnp.where(keep, s, -jnp.inf)
            # scale > 0: the row max of the raw scores, scaled, is the max of the scaled ones
            m_new = jnp.maximum(m, s.max(axis=1) * scale2)
            # a row that has seen only masked keys keeps m = -inf: exponents use 0 there (p = 0)
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_use, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p = p.astype(q_ref.dtype)
            # the softmax ends here for the scheduler too: nothing of it moves past the passage
            m_new, l, acc, p = lax.optimization_barrier((m_new, l, acc, p))
            pingpong.arrive()  # done with the softmax; PV once the other's matmuls are issued
            v_tile = ring.wait(u, 1)
            pingpong.wait()
            acc = frame.matmul_add(acc, p, v_tile)
            ring.release(u, 1)
            return m_new, l, acc

        rows_layout = plgpu.Layout.WGMMA.reduce(1)
        carry = (frame.zeros((bq,), rows_layout, -jnp.inf), frame.zeros((bq,), rows_layout),
                 frame.zeros((bq, q_ref.shape[3])))
        pingpong.begin(wg)
        ring.follow(0, own_blocks[0] - stream_lo)  # blocks only the other warpgroup sees
        m, l, acc = frame.walk(step, carry, own_blocks)
        ring.follow(own_blocks[3] - stream_lo, stream_hi - stream_lo)
        pingpong.end(wg)

        empty = l == 0.0  # no visible key: output 0, lse -inf (never NaN)
        l_safe = jnp.where(empty, 1.0, l)
        if rotary is not None:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # q_tile is reused below
        # lse straight from registers (a [64] fp32 row is too small for a TMA's staging to pay)
        lse_ref.at[batch, head, rows][...] = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe) * LOG2E)
        frame.store_tiles([(acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0]), q_tile, o_ref.at[batch, rows, head])])

    frame.query_major(compute, q_ref, k_ref, v_ref, ring, bq=bq, bkv=bkv, stages=blocks.num_stages, spec=spec,
                 kv_len=kv_len, group=group, shared=shared, rotators=rotary is not None,
                 kv_head_of=None if row_map is None else (lambda h: _slots(row_map, h)[1]))


def _backward_own(own, tables, spec: AttentionSpec):
    """A backward kernel's own scratch -> (its two tiles, their barriers, the rotary or None)."""
    if not tables:
        return (*own, None)
    (*tiles, rotary_smem), (ready, rotary_barriers) = own
    return tiles, ready, _Rotary(spec.rope.style, *tables, rotary_smem, rotary_barriers)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, m2_ref, delta_ref, *refs, blocks: MosaicBlockSizes,
               spec: AttentionSpec, group: int, kv_len: int, row_map=None):
    """dQ = scale * dS K with dS = P (dO V^T - delta), P = exp2(s2 - m2); two query blocks per CTA
    (one per compute warpgroup) stream the key blocks, as the forward, and mask as it does. With
    RoPE q and k come rotated (the forward's) and dQ is rotated back."""
    *refs, own, ring = refs
    tables, (dq_ref,) = _split_tables(tuple(refs), spec)
    (q_smem, do_smem), own_ready, rotary = _backward_own(own, tables, spec)
    bq, bkv = blocks.block_q_bwd, blocks.block_k_bwd
    scale2 = spec.scale * LOG2E

    def compute(batch, head, wg, first, own_blocks, stream, ring):
        stream_lo, stream_hi = stream
        rows = pl.ds(first, bq)
        q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
        q_head = head if row_map is None else _slots(row_map, head)[0]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, q_head], q_tile, own_ready.at[2 * wg])
        plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, q_head], do_tile, own_ready.at[2 * wg + 1])
        if rotary is not None:  # the tables the final rotation reads
            pl.when(wg == 0)(rotary.fetch)
            rotary.prefetch(wg, first // ROPE_ROWS)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        m2, delta = (frame.load_gmem(x.at[batch, head, rows], row_layout) for x in (m2_ref, delta_ref))
        plgpu.barrier_wait(own_ready.at[2 * wg])
        plgpu.barrier_wait(own_ready.at[2 * wg + 1])

        def step(t, dq, masked: bool):
            u = t - stream_lo  # the ring's step
            k_tile = ring.wait(u, 0)
            s = frame.matmul((bq, bkv), q_tile, k_tile.transpose((1, 0)))
            dp = frame.matmul((bq, bkv), do_tile, ring.wait(u, 1).transpose((1, 0)))
            ring.release(u, 1)
            if masked:  # (padded keys are zero rows: s = 0 there, whose P could overflow)
                keep = visible(spec, first + frame.iota(s.shape, 0), t * bkv + frame.iota(s.shape, 1), kv_len)
                s = jnp.where(keep, s, -jnp.inf)
            p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m2, s.shape, [0]))
            ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))
            dq = frame.matmul_add(dq, ds.astype(q_ref.dtype), k_tile)
            ring.release(u, 0)
            return dq

        ring.follow(0, own_blocks[0] - stream_lo)
        dq = frame.walk(step, frame.zeros((bq, q_ref.shape[3])), own_blocks) * spec.scale
        ring.follow(own_blocks[3] - stream_lo, stream_hi - stream_lo)
        if rotary is not None:
            dq = rotary(dq, rotary.own_base(wg), inverse=True)
        frame.store_tiles([(dq, q_tile, dq_ref.at[batch, rows, head])])

    frame.query_major(compute, q_ref, k_ref, v_ref, ring, bq=bq, bkv=bkv, stages=blocks.num_stages_bwd, spec=spec,
                 kv_len=kv_len, group=group,
                 kv_head_of=None if row_map is None else (lambda h: _slots(row_map, h)[1]))


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, m2_ref, delta_ref, *refs, blocks: MosaicBlockSizes,
                 spec: AttentionSpec, group: int, kv_len: int, row_map=None):
    """dV = P^T dO, dK = scale * dS^T Q, summed over the kv head's query heads: two key blocks per
    CTA (one per compute warpgroup) stream the (query head, query block) pairs, computing the
    transposed tiles S^T = K Q^T directly. Padded query rows have dO = 0 and delta = 0: they add 0.
    With RoPE q and k come rotated (the forward's) and dK is rotated back."""
    *refs, own, ring = refs
    tables, (dk_ref, dv_ref) = _split_tables(tuple(refs), spec)
    (k_smem, v_smem), own_ready, rotary = _backward_own(own, tables, spec)
    bq, bkv = blocks.block_q_bwd, blocks.block_k_bwd
    scale2 = spec.scale * LOG2E
    ring = frame.Ring(*ring[:3], blocks.num_stages_bwd, *ring[3:])
    num_q = q_ref.shape[1] // bq
    batch, kv_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    # Through a row map the grid's heads are query heads (group 1), each reading its slots and
    # writing its own dK/dV (the caller sums a GQA group's).
    q_head_of = (lambda h: h) if row_map is None else (lambda h: _slots(row_map, h)[0])
    kv_in = kv_head if row_map is None else _slots(row_map, kv_head)[1]
    pair_first = lax.axis_index("k_tiles") * 2 * bkv  # causal: low keys see the most rows, launched first
    # key j is seen by rows i with j - after <= i <= j + before (none at all past the last row)
    before, after = visit.reach(spec)
    ranges = [visit.partner_blocks(pair_first + w * bkv, bkv, bq, num_q, after, before) for w in range(2)]
    stream_lo = ranges[0][0]
    per_head = jnp.maximum(ranges[1][3] - stream_lo, 0)  # stream steps per query head

    def at(t):  # stream step -> (query head, query block)
        return kv_head * group + t // per_head, stream_lo + lax.rem(t, per_head)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(frame.register_split(DKDV_PRODUCER_REGISTERS)[1], action="increase")
        first = pair_first + wg * bkv
        own_blocks = [jnp.where(wg == 0, a, b) for a, b in zip(*ranges)]
        keys = pl.ds(first, bkv)
        k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
        plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_in], k_tile, own_ready.at[2 * wg])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_in], v_tile, own_ready.at[2 * wg + 1])
        if rotary is not None:  # the tables the final rotation reads
            pl.when(wg == 0)(rotary.fetch)
            rotary.prefetch(wg, first // ROPE_ROWS)
        plgpu.barrier_wait(own_ready.at[2 * wg])
        plgpu.barrier_wait(own_ready.at[2 * wg + 1])
        col_layout = plgpu.Layout.WGMMA.reduce(0)

        def step(i, carry, g, masked: bool):
            dk, dv = carry
            t = g * per_head + i - stream_lo  # the ring's step
            head, qrows = kv_head * group + g, pl.ds(i * bq, bq)
            q_tile = ring.wait(t, 0)
            st = frame.matmul((bkv, bq), k_tile, q_tile.transpose((1, 0)))
            m2, delta = (frame.load_gmem(x.at[batch, head, qrows], col_layout) for x in (m2_ref, delta_ref))
            do_tile = ring.wait(t, 1)
            dpt = frame.matmul((bkv, bq), v_tile, do_tile.transpose((1, 0)))
            if masked:
                keep = visible(spec, i * bq + frame.iota(st.shape, 1), first + frame.iota(st.shape, 0), kv_len)
                st = jnp.where(keep, st, -jnp.inf)
            pt = jnp.exp2(st * scale2 - lax.broadcast_in_dim(m2, st.shape, [1]))
            dv = frame.matmul_add(dv, pt.astype(q_ref.dtype), do_tile)
            ring.release(t, 1)
            dst = pt * (dpt - lax.broadcast_in_dim(delta, st.shape, [1]))
            dk = frame.matmul_add(dk, dst.astype(q_ref.dtype), q_tile)
            ring.release(t, 0)
            return dk, dv

        def head_loop(g, carry):
            base = g * per_head - stream_lo
            ring.follow(base + stream_lo, base + own_blocks[0])  # query blocks only the other warpgroup sees
            carry = frame.walk(functools.partial(step, g=g), carry, own_blocks)
            ring.follow(base + own_blocks[3], (g + 1) * per_head)
            return carry

        zeros = frame.zeros((bkv, k_ref.shape[3]))
        dk, dv = lax.fori_loop(0, group, head_loop, (zeros, zeros))
        dk = dk * spec.scale
        if rotary is not None:
            dk = rotary(dk, rotary.own_base(wg), inverse=True)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # k_tile is reused below
        frame.store_tiles([(dk, k_tile, dk_ref.at[batch, keys, kv_head]), (dv, v_tile, dv_ref.at[batch, keys, kv_head])])

    @pl.when(wg == 2)
    def _produce():
        plgpu.set_max_registers(frame.register_split(DKDV_PRODUCER_REGISTERS)[0], action="decrease")

        def sources(t):
            head, i = at(t)
            rows = (batch, pl.ds(i * bq, bq), q_head_of(head))
            return q_ref.at[rows], do_ref.at[rows]

        ring.produce(sources, group * per_head, group * num_q)


def _check_rope_blocks(blocks: MosaicBlockSizes):
    """The rotation works on 64-row blocks (one per compute warpgroup)."""
    if reason := rope_blocks_reason(blocks):
        raise ValueError(reason)


def rope_blocks_reason(blocks: MosaicBlockSizes) -> str | None:
    """Why `blocks` cannot serve fused RoPE, or None."""
    if (blocks.block_q, blocks.block_q_bwd, blocks.block_k_bwd) != (ROPE_ROWS,) * 3 or blocks.block_k % ROPE_ROWS:
        return (f"RoPE on the Mosaic GPU kernels needs block_q = block_q_bwd = block_k_bwd = "
                f"{ROPE_ROWS} and block_k a multiple of it, got {blocks}")
    return None


def flash_forward(q, k, v, spec: AttentionSpec, kv_len: int, blocks: MosaicBlockSizes, rope=None,
                  rotated: bool = False, row_map=None):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], padded to `blocks.tiles`, D in HEAD_DIMS; keys >=
    kv_len are padding (masked). With spec.rope, `rope` = `rope_tables(...)` covering both lengths.
    -> (out [B, Sq, Hq, D], lse2 [B, Hq, Sq] float32, base 2, of the scaled scores
    [, q rotated, k rotated, if `rotated`: what the backward reads]). k rotated may hold garbage
    in key blocks no query sees (`_NextHead` rotates them where it reaches them); the backward
    never reads them. `row_map` (an `attn_spec.dilation.RowMap`; no RoPE): the grid's heads read
    q, k, v through it (a view's head slots) and out, lse2 are [.., row_map.programs, ..]."""
    launch = functools.partial(_forward_launch, spec=spec, kv_len=kv_len, blocks=blocks, rotated=rotated,
                               row_map=row_map)
    if spec.rope is None:
        return launch(q, k, v)
    _check_rope_blocks(blocks)
    try:
        return launch(q, k, v, *rope)
    except NotImplementedError as e:  # pl.kernel, which takes the flags Ref, has no batching rule
        if "batch" not in str(e):
            raise
        raise NotImplementedError(
            "fused RoPE on the Mosaic GPU kernels cannot be vmapped (its forward shares rotated keys "
            "between CTAs through a flags Ref); fold the vmapped axis into the batch axis, or pass "
            "implementation='triton'") from e


def _forward_launch(q, k, v, *rope, spec: AttentionSpec, kv_len: int, blocks: MosaicBlockSizes, rotated: bool,
                    row_map=None):
    batch, q_pad, num_heads, head_dim = q.shape
    kernel = functools.partial(_forward_kernel, blocks=blocks, spec=spec, kv_len=kv_len, group=num_heads // k.shape[2],
                               row_map=row_map)
    own_smem = (frame.smem((2, blocks.block_q, head_dim), q.dtype),)
    own_ready = plgpu.Barrier(num_barriers=2)  # each compute warpgroup's q tile
    if row_map is not None:
        num_heads = row_map.programs
    out_type = (jax.ShapeDtypeStruct((batch, q_pad, num_heads, head_dim), q.dtype),
                jax.ShapeDtypeStruct((batch, num_heads, q_pad), jnp.float32))
    args = (q, k, v)
    sizes = dict(heads=num_heads, q_tiles=q_pad // blocks.q_tile, batch=batch)
    if spec.rope is not None:  # flags: fresh zeros per call
        k_flags = jax.new_ref(jnp.zeros((batch, k.shape[2], k.shape[1] // blocks.block_k, FLAG_WORDS), jnp.int32))
        q_flags = jax.new_ref(jnp.zeros((batch, num_heads, sizes["q_tiles"], FLAG_WORDS), jnp.int32))
        args += (*rope, k_flags, q_flags)
        q_flag_rows = (plgpu.SMEM((2, FLAG_WORDS), jnp.int32), plgpu.Barrier(num_barriers=2))  # per compute warpgroup
        scratch = (_Rotary.scratch(head_dim), _SharedKeys.scratch(blocks.num_stages, blocks.block_k, head_dim),
                   _NextHead.scratch(head_dim, q.dtype), q_flag_rows)
        own_smem += tuple(smem for smem, _ in scratch)
        own_ready = (own_ready, *(barriers for _, barriers in scratch))
        out_type += (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(q.shape, q.dtype))
        sizes["heads"] += 1  # the pseudo-head first (`_NextHead`)
    out, lse, *k_q_rot = frame.launch(kernel, args, out_type, tuple(sizes[n] for n in FORWARD_GRID), FORWARD_GRID,
                                 (own_smem, own_ready),
                                 frame.ring_scratch(blocks.num_stages, blocks.block_k, head_dim, k.dtype,
                                               prepared=spec.rope is not None, pingpong=True))
    # k and q rotated are the CTAs' exchange; the backward reads them
    return (out, lse, *k_q_rot[::-1]) if rotated else (out, lse)


def flash_backward(q, k, v, do, m2, delta, spec: AttentionSpec, kv_len: int, blocks: MosaicBlockSizes, rope=None,
                   row_map=None):
    """The gradients from the forward's statistics: P = exp2(s2 - m2) (m2 = lse2; +inf on empty
    rows), delta = rowsum(dO * O) - dlse [B, Hq, Sq] fp32. Arrays padded as for `flash_forward`
    (with zeros); with spec.rope, q and k are the forward's rotated q and k and `rope` its tables.
    -> (dq, dk, dv) in the input dtype, dk/dv per kv head. `row_map` (no RoPE): q, dO, k, v are
    read through it, m2, delta and dq are [.., row_map.programs, ..], and dk, dv are per program
    (query head: the caller sums a GQA group's)."""
    batch, q_pad, num_heads, head_dim = q.shape
    kv_pad, num_kv_heads = k.shape[1], k.shape[2]
    bq, bkv = blocks.block_q_bwd, blocks.block_k_bwd
    options = dict(blocks=blocks, spec=spec, group=num_heads // num_kv_heads, kv_len=kv_len)
    dkdv_options, dkdv_heads, dq_heads = options, num_kv_heads, num_heads
    if row_map is not None:
        options = dict(options, row_map=row_map)
        dkdv_options, dkdv_heads, dq_heads = dict(options, group=1), row_map.programs, row_map.programs
    tables = ()
    if spec.rope is not None:
        _check_rope_blocks(blocks)
        tables = tuple(rope)
    def own(rows, dtype):  # each compute warpgroup's two tiles[, the rotary's tables]
        smem, ready = (frame.smem((2, rows, head_dim), dtype),) * 2, plgpu.Barrier(num_barriers=4)
        if not tables:
            return smem, ready
        rotary_smem, rotary_barriers = _Rotary.scratch(head_dim)
        return smem + (rotary_smem,), (ready, rotary_barriers)
    dk, dv = frame.launch(functools.partial(_dkdv_kernel, **dkdv_options), (q, k, v, do, m2, delta, *tables),
                     (jax.ShapeDtypeStruct((batch, kv_pad, dkdv_heads, head_dim), k.dtype),) * 2,
                     (dkdv_heads, batch, kv_pad // (2 * bkv)),
                     ("heads", "batch", "k_tiles"), own(bkv, k.dtype),
                     frame.ring_scratch(blocks.num_stages_bwd, bq, head_dim, q.dtype))
    dq = frame.launch(functools.partial(_dq_kernel, **options), (q, k, v, do, m2, delta, *tables),
                 jax.ShapeDtypeStruct((batch, q_pad, dq_heads, head_dim), q.dtype), (dq_heads, batch, q_pad // (2 * bq)),
                 ("heads", "batch", "q_tiles"), own(bq, q.dtype),
                 frame.ring_scratch(blocks.num_stages_bwd, bkv, head_dim, k.dtype))
    return dq, dk, dv
