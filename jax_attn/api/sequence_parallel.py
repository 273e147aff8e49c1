"""The public sequence-parallel functions: ring attention, all-gather context parallelism and
ring-dilated attention inside `jax.shard_map`, or on global arrays over a mesh."""
from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from attn_spec import dilation
from jax_attn import orderings, registry
from jax_attn.ops.common import validation
from jax_attn.ops.common.rope import Rope, apply_rope
from jax_attn.ops.ring import dilated as ring_dilated
from jax_attn.ops.ring import layout as ring_layout
from jax_attn.ops.ring import ring as ring_ops
from jax_attn.ops.ring.step import Step
from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.api.attention import dilated_attention


def _axis_size(axis_name) -> int:
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(f"axis_name={axis_name!r} is not a mesh axis bound here: call ring_attention inside "
                         f"jax.shard_map over a mesh with that axis (or use context_parallel_attention)") from e


def _step_backend(implementation, config, specs, head_dim, dtype):
    """One backend for every engine call of a sequence-parallel call: the explicit one (which must
    serve every case, else NotImplementedError), or for None "mosaic" where it serves them all,
    else the softmax rule's choice without it ("triton", or "xla" where Pallas Triton cannot run)."""
    calls = [registry.Call(s, head_dim, dtype) for s in specs]
    if implementation is None:
        names = {registry.choose("softmax", c) for c in calls}
        implementation = "mosaic" if names == {"mosaic"} else ("xla" if "xla" in names else "triton")
    entries = [registry.resolve("softmax", implementation, c) for c in calls]
    config = registry.check_config(entries[0], config, calls[0])
    return Step(entries[0].name, config)


def ring_attention(q, k, v, *, axis_name, causal: bool = False, segment_ids=None,
                   window: tuple[int, int] | None = None, softcap: float | None = None, rope: Rope | None = None,
                   positions=None, layout: str = "zigzag", strategy: str = "ring", scale: float | None = None,
                   return_lse: bool = False, implementation: str | None = None, config=None):
    """Sequence-parallel attention over the mesh axis `axis_name`, called inside `jax.shard_map` on
    sequence-sharded arrays: the attention of the whole (global) sequence, each shard's rows.

    Args:
      q: [B, L, Hq, D], this shard's queries; k, v: [B, L, Hkv, D], its keys and values (L = S / P
        rows of the global sequence of S rows, P the size of the axis). Hq % Hkv == 0; D <= 256;
        float32, float16, bfloat16.
      axis_name: the mesh axis the sequence is sharded over (bound by the enclosing shard_map).
      layout: which rows a shard holds. "zigzag" (default): the sequence is cut into 2P chunks and
        shard d holds chunks d and 2P - 1 - d, in that order (L even), which balances causal work;
        put a global array into that order with `jax_attn.to_zigzag` (and back with
        `from_zigzag`) before sharding it contiguously. "contiguous": shard d holds rows
        d L .. (d + 1) L - 1.
      strategy: "ring" (K/V travel the ring, P steps of `lax.ppermute` overlapped with the work;
        the backward sends dK/dV around with them) or "all_gather" (K/V all-gathered once, the
        gather overlapping the shard's own step; the backward gathers them again and sends dK/dV
        around the ring as "ring" does: 4x the K/V memory, fewer transfers).
      causal, window, softcap, scale: as `flash_attention`, on GLOBAL positions (the layout's).
      segment_ids: this shard's ids, int [B, L] (queries and keys) or a pair (q_ids, kv_ids).
      rope, positions: RoPE at global positions: this shard's positions int [B, L] or a pair;
        default the rows' global positions under the layout. q and k are rotated once here, before
        the keys travel.
      return_lse: also return lse [B, Hq, L] float32 (differentiable).
      implementation: the engine of every step: None ("mosaic" where its Hopper kernels serve every
        step, else "triton" where Pallas Triton runs, else "xla"), "triton", "mosaic" or "xla".
        One that cannot serve a step raises NotImplementedError.
      config: the implementation's tile config (`BlockSizes` / `MosaicBlockSizes`), None: default.

    The Pallas kernels ("triton", "mosaic") need the enclosing shard_map to run with
    check_vma=False (they carry no varying-axes types); otherwise a ValueError says so.
    Steps the mask leaves empty are skipped; statistics merge in fp32; the backward (dK/dV
    travelling with K/V) is deterministic. Returns out [B, L, Hq, D] (q.dtype), or (out, lse).
    """
    validation.check_arrays(q, k, v)
    batch, length, _, head_dim = q.shape
    if k.shape[1] != length:
        raise ValueError(f"sequence-parallel attention is self-attention: q and k shards need the same length, "
                         f"got {q.shape=} and {k.shape=}")
    num_shards = _axis_size(axis_name)
    layout = ring_layout.check_layout(layout)
    if strategy not in ring_ops.STRATEGIES:
        raise ValueError(f"strategy must be one of {ring_ops.STRATEGIES}, got strategy={strategy!r}")
    if length % ring_layout.chunks_per_shard(layout):
        raise ValueError(f"layout='zigzag' holds two chunks per shard: the shard length must be even, got L={length} "
                         f"(the global sequence must be a multiple of 2 * {num_shards})")
    q_ids, kv_ids = validation.check_segment_ids(segment_ids, batch, length, length)
    left, right = validation.check_window(window)
    q_pos, kv_pos = validation.check_rope(rope, positions, batch, length, length, head_dim)
    softcap = validation.check_positive("softcap", softcap)
    scale = validation.check_positive("scale", scale)
    if rope is not None:  # at global positions, once per shard: the keys travel rotated
        if q_pos is None:
            shard = jax.lax.axis_index(axis_name)
            q_pos = kv_pos = jnp.broadcast_to(ring_layout.shard_positions(layout, num_shards, shard, length),
                                              (batch, length))
        q, k = apply_rope(q, q_pos, rope), apply_rope(k, kv_pos, rope)
    spec = AttentionSpec(scale=head_dim ** -0.5 if scale is None else scale, causal=bool(causal), window_left=left,
                         window_right=right, softcap=softcap, has_segments=q_ids is not None,
                         precision=validation.fp32_precision(q.dtype))
    compute_layout = layout if spec.has_position_mask else "contiguous"  # no mask: one chunk, all visible
    st = ring_ops.Static(axis_name, num_shards, compute_layout, strategy, spec, None)
    st = dataclasses.replace(st, step=_step_backend(implementation, config, st.case_specs(length), head_dim, q.dtype))
    if st.step.implementation != "xla" and _varying_axes(q):
        raise ValueError(f"implementation={st.step.implementation!r}: the Pallas kernels carry no varying-axes "
                         f"(vma) types; call jax.shard_map with check_vma=False around ring_attention "
                         f"(context_parallel_attention does), or implementation='xla'")
    out, lse = ring_ops.sequence_parallel_attention(st, q, k, v, q_ids, kv_ids)
    return (out, lse) if return_lse else out


def _varying_axes(x) -> frozenset:
    """The manual mesh axes x is typed as varying over (empty unless shard_map checks them)."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else getattr(x, "aval", None)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _shard_map(f, mesh, in_specs, out_specs):
    """`jax.shard_map` where it exists (jax >= 0.7), else `jax.experimental.shard_map.shard_map`;
    replication checks off (the Pallas kernels inside carry no replication rules)."""
    impl = getattr(jax, "shard_map", None)
    if impl is None:
        from jax.experimental.shard_map import shard_map as impl
    params = inspect.signature(impl).parameters
    check = {"check_vma": False} if "check_vma" in params else {"check_rep": False}
    return impl(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **check)


def _placed(x, mesh, spec):
    """x laid out as `spec` on `mesh` where the mesh's axes are Explicit (shard_map then requires
    it); Auto axes let shard_map move the rows itself."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    explicit = axis_type is not None and any(t == axis_type.Explicit for t in getattr(mesh, "axis_types", ()))
    return jax.reshard(x, jax.sharding.NamedSharding(mesh, spec)) if explicit and x is not None else x


def default_strategy(seq_len: int, num_shards: int, num_heads: int, num_kv_heads: int) -> str:
    """The rule for strategy=None (provisional: stated from the cost model, to be measured with
    benchmarks/ring.py on GPUs). "all_gather" when the gathered K/V are cheap next to the work:
    shards of at most 4096 rows (a ring step there is too short to hide its transfer and the P
    steps' launches add up), or GQA with at least 8 query heads per kv head (K/V 1/8 of Q or less,
    Llama 3's setting); otherwise "ring" (its transfers overlap the steps' work, and no shard holds
    the whole sequence's K/V)."""
    if num_shards == 1 or seq_len // num_shards <= 4096 or num_heads >= 8 * num_kv_heads:
        return "all_gather"
    return "ring"


def context_parallel_attention(q, k, v, *, mesh, axis, strategy: str | None = None, layout: str = "zigzag",
                               causal: bool = False, segment_ids=None, window: tuple[int, int] | None = None,
                               softcap: float | None = None, rope: Rope | None = None, positions=None,
                               scale: float | None = None, return_lse: bool = False,
                               implementation: str | None = None, config=None):
    """Attention over a sequence sharded over the mesh axis `axis` (a `jax.sharding.Mesh`), on
    global arrays: `jax.shard_map` around `ring_attention`.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D], global arrays in sequence order (typically sharded
        with `NamedSharding(mesh, P(None, axis))`; any sharding works, XLA moves what is needed).
        S must be a multiple of P (the axis size), and of 2P for layout="zigzag".
      mesh, axis: the mesh and the name of the axis the sequence is sharded over.
      strategy: "ring", "all_gather" or None (`default_strategy`).
      layout: "zigzag" (balanced causal work; the arrays are permuted into zigzag order with
        `to_zigzag` and the outputs back, which moves rows between devices: a model that keeps its
        activations in zigzag order calls `ring_attention` under its own shard_map instead) or
        "contiguous".
      causal, segment_ids ([B, S] or a pair), window, softcap, rope, positions ([B, S] or a pair;
        default arange), scale, return_lse, implementation, config: as `flash_attention`.

    Returns out [B, S, Hq, D] (sharded over `axis` on S), or (out, lse [B, Hq, S]).
    """
    validation.check_arrays(q, k, v)
    validation.check_mesh(mesh, axis)
    batch, seq_len, num_heads, head_dim = q.shape
    if k.shape[1] != seq_len:
        raise ValueError(f"sequence-parallel attention is self-attention: q and k need the same length, got "
                         f"{q.shape=} and {k.shape=}")
    num_shards = int(mesh.shape[axis])
    layout = ring_layout.check_layout(layout)
    chunks = num_shards * ring_layout.chunks_per_shard(layout)
    if seq_len % chunks:
        raise ValueError(f"the sequence length S={seq_len} must be a multiple of {chunks} for layout={layout!r} "
                         f"over the {num_shards} devices of axis {axis!r}")
    if strategy is None:
        strategy = default_strategy(seq_len, num_shards, num_heads, k.shape[2])
    if strategy not in ring_ops.STRATEGIES:
        raise ValueError(f"strategy must be one of {ring_ops.STRATEGIES} or None, got strategy={strategy!r}")
    q_ids, kv_ids = validation.check_segment_ids(segment_ids, batch, seq_len, seq_len)
    q_pos, kv_pos = validation.check_rope(rope, positions, batch, seq_len, seq_len, head_dim)
    spec = jax.sharding.PartitionSpec(None, axis)
    rows = [_placed(x, mesh, spec) for x in (q, k, v, q_ids, kv_ids, q_pos, kv_pos)]
    zigzag = layout == "zigzag"

    def local(q, k, v, q_ids, kv_ids, q_pos, kv_pos):
        # the contiguous shards -> zigzag shards and back: ppermutes between the devices
        to = lambda x, axis=1: x if x is None or not zigzag else ring_layout.shard_to_zigzag(
            x, axis_name, num_shards, axis=axis)
        back = lambda x, axis=1: x if not zigzag else ring_layout.shard_to_zigzag(
            x, axis_name, num_shards, inverse=True, axis=axis)
        if rope is not None and q_pos is None:  # RoPE at the sequence positions
            shard = jax.lax.axis_index(axis_name)
            q_pos = kv_pos = jnp.broadcast_to(ring_layout.shard_positions("contiguous", num_shards, shard, q.shape[1]),
                                              (q.shape[0], q.shape[1]))
        out, lse = ring_attention(
            to(q), to(k), to(v), axis_name=axis, causal=causal, window=window, softcap=softcap, rope=rope,
            segment_ids=None if q_ids is None else (to(q_ids), to(kv_ids)),
            positions=None if q_pos is None else (to(q_pos), to(kv_pos)), layout=layout, strategy=strategy,
            scale=scale, return_lse=True, implementation=implementation, config=config)
        return back(out), back(lse, axis=2)

    axis_name = axis
    in_specs = tuple(None if x is None else spec for x in rows)
    out, lse = _shard_map(local, mesh, in_specs, (spec, jax.sharding.PartitionSpec(None, None, axis)))(*rows)
    return (out, lse) if return_lse else out


def _shard_order(ordering, grid, num_shards: int, length: int, axis_name):
    """The within-shard permutation of `ring_dilated_attention(ordering=, grid=)`: None (no
    ordering, or the identity) or int32 [L]. grid is the global token grid; each shard holds a
    band of its leading dimension, so the shard's sub-grid is (grid[0] / P, *grid[1:])."""
    local_grid = None
    if grid is not None and isinstance(ordering, str):
        is_int = lambda g: isinstance(g, (int, np.integer)) and not isinstance(g, bool)
        if not isinstance(grid, (tuple, list)) or not grid or not all(is_int(g) for g in grid):
            raise ValueError(f"grid must be (rows, cols) or (depth, rows, cols) of ints, got grid={grid!r}")
        if grid[0] % num_shards:
            raise ValueError(f"grid={tuple(grid)!r}: its leading dimension {grid[0]} must be a multiple of the "
                             f"{num_shards} shards of axis {axis_name!r} (each shard holds a band of "
                             f"{grid[0]} / {num_shards} of it)")
        if int(np.prod(grid)) != length * num_shards:
            raise ValueError(f"grid={tuple(grid)!r} has {int(np.prod(grid))} cells but the global sequence has "
                             f"{length * num_shards} tokens ({num_shards} shards of L={length})")
        local_grid = (int(grid[0]) // num_shards, *(int(g) for g in grid[1:]))
    return orderings.resolve(ordering, grid if local_grid is None else local_grid, length)


def ring_dilated_attention(q, k, v, *, axis_name, segment_lengths, dilation_rates, causal: bool = False,
                           scale: float | None = None, ordering=None, grid=None, return_lse: bool = False,
                           implementation: str | None = None):
    """`dilated_attention` (merge="lse") on a sequence sharded contiguously over the mesh axis
    `axis_name`, called inside `jax.shard_map`: each shard's rows of the global result.

    Args:
      q: [B, L, H, D], k, v: [B, L, Hkv, D]: shard d holds rows d L .. (d + 1) L - 1 of the global
        sequence of S = P L rows (layout "contiguous").
      segment_lengths, dilation_rates: as `dilated_attention`. Every rate must divide L; a segment
        (cut to S) either tiles the shards (L a multiple of it: the branch runs on each shard's own
        rows, no traffic) or is a multiple of L spanning a whole number of shards (its dilated rows,
        1 / r of the rows, travel a ring over those shards).
      causal, scale, return_lse: as `dilated_attention`. implementation: as `ring_attention` for the
        spanning branches, as `dilated_attention` for the local ones.
      ordering, grid: a space-filling-curve ordering applied WITHIN each shard. ordering: a name of
        `jax_attn.orderings.ORDERINGS` or a permutation array int [L] (the same on every shard).
        grid: the GLOBAL token grid (rows, cols) or (depth, rows, cols) of the S tokens; shard d
        holds a band of its leading dimension (for an image: rows/P whole grid rows), so its
        sub-grid is (rows / P, cols), and rows must be a multiple of P. None: each shard's L tokens
        on the near-square default grid of L. The global ordered sequence is the shards' ordered
        rows concatenated (the global permutation: d L + order, shard by shard); the segments and
        their dilation are cut from it, causality keeps comparing the original positions, out and
        lse come back in the original order: the result equals `dilated_attention(ordering=that
        global permutation)`. A segment inside a shard runs the local kernel with the shard's
        permutation as its index map; a spanning segment gathers its dilated rows from their ordered
        positions before they travel (causal: the shard's own keys go through the local kernel,
        which compares original positions; keys of earlier shards are all visible, later ones none).

    Returns out [B, L, H, D], or (out, lse [B, H, L]).
    """
    validation.check_arrays(q, k, v)
    batch, length, num_heads, head_dim = q.shape
    if k.shape[1] != length:
        raise ValueError(f"dilated attention is self-attention: q and k shards need the same length, got "
                         f"{q.shape=} and {k.shape=}")
    num_shards = _axis_size(axis_name)
    lengths, rates = dilation.check_config(segment_lengths, dilation_rates, "lse", num_heads)
    seq_len = length * num_shards
    scale = validation.check_positive("scale", scale)
    scale = head_dim ** -0.5 if scale is None else scale
    order = _shard_order(ordering, grid, num_shards, length, axis_name)
    local = functools.partial(dilated_attention, q, k, v, scale=scale, ordering=order, return_lse=True,
                              implementation=implementation)
    local_branches, spanning = [], []
    for w, r in zip(lengths, rates):
        if length % r:
            raise ValueError(f"dilation rate {r} must divide the shard length L={length}")
        w = min(w, -(-seq_len // r) * r)
        if w <= length:
            if length % w:
                raise ValueError(f"segment length {w} must divide the shard length L={length} (or be a multiple "
                                 f"of it spanning whole shards)")
            local_branches.append((w, r))
        elif w % length or num_shards % (w // length):
            raise ValueError(f"segment length {w} longer than the shard length L={length} must span a whole "
                             f"number of shards dividing the {num_shards} of axis {axis_name!r}")
        else:
            spanning.append((w, r))
    outs, lses = [], []
    if local_branches:  # no traffic: one fused call of every branch inside the shards, merged by lse
        out, lse = local(segment_lengths=tuple(w for w, _ in local_branches),
                         dilation_rates=tuple(r for _, r in local_branches), causal=causal)
        outs.append(out)
        lses.append(lse)
    for w, r in spanning:
        # causal under an ordering: the shard's own keys need original-position causality, which
        # the local kernel has; the ring skips them and brings the other shards' keys
        own_apart = bool(causal) and order is not None
        spec = AttentionSpec(scale=scale, causal=bool(causal), precision=validation.fp32_precision(q.dtype))
        st = ring_ops.Static(axis_name, num_shards, "contiguous", "ring", spec, None, group=w // length,
                             skip_own=own_apart)
        rows = length // r
        st = dataclasses.replace(st, step=_step_backend(implementation, None, st.case_specs(rows), head_dim,
                                                        q.dtype))
        out, lse = ring_ops.sequence_parallel_attention(st, *(ring_dilated.select(x, r, num_heads, order)
                                                              for x in (q, k, v)))
        out, lse = ring_dilated.scatter(out, lse, r, order)
        if own_apart:  # the shard as one segment, causal on original positions, merged by lse
            own, own_lse = local(segment_lengths=(length,), dilation_rates=(r,), causal=True)
            out, lse = ring_dilated.merge([own, out], [own_lse, lse], jnp.float32)  # rounded once, below
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return (outs[0].astype(q.dtype), lses[0]) if return_lse else outs[0].astype(q.dtype)
    out, lse = ring_dilated.merge(outs, lses, q.dtype)
    return (out, lse) if return_lse else out


def context_parallel_dilated_attention(q, k, v, *, mesh, axis, segment_lengths, dilation_rates,
                                       causal: bool = False, scale: float | None = None, ordering=None, grid=None,
                                       return_lse: bool = False, implementation: str | None = None):
    """`ring_dilated_attention` on global arrays: `jax.shard_map` over the mesh axis `axis` (a
    `jax.sharding.Mesh`) around it, the sequence sharded contiguously (shard d holds rows
    d S/P .. (d + 1) S/P - 1).

    Args:
      q: [B, S, H, D]; k, v: [B, S, Hkv, D], global arrays in sequence order (typically sharded with
        `NamedSharding(mesh, P(None, axis))`); S a multiple of P, the axis size.
      mesh, axis: the mesh and the name of the axis the sequence is sharded over.
      segment_lengths, dilation_rates, causal, scale, ordering, grid, return_lse, implementation:
        as `ring_dilated_attention` (ordering applied within each shard; grid the global grid).

    Returns out [B, S, H, D] (sharded over `axis` on S), or (out, lse [B, H, S]).
    """
    validation.check_arrays(q, k, v)
    validation.check_mesh(mesh, axis)
    seq_len, num_shards = q.shape[1], int(mesh.shape[axis])
    if k.shape[1] != seq_len:
        raise ValueError(f"dilated attention is self-attention: q and k need the same length, got "
                         f"{q.shape=} and {k.shape=}")
    if seq_len % num_shards:
        raise ValueError(f"the sequence length S={seq_len} must be a multiple of the {num_shards} devices of "
                         f"axis {axis!r}")
    spec = jax.sharding.PartitionSpec(None, axis)

    def local(q, k, v):
        return ring_dilated_attention(q, k, v, axis_name=axis, segment_lengths=segment_lengths,
                                      dilation_rates=dilation_rates, causal=causal, scale=scale, ordering=ordering,
                                      grid=grid, return_lse=True, implementation=implementation)

    rows = [_placed(x, mesh, spec) for x in (q, k, v)]
    out, lse = _shard_map(local, mesh, (spec,) * 3, (spec, jax.sharding.PartitionSpec(None, None, axis)))(*rows)
    return (out, lse) if return_lse else out
