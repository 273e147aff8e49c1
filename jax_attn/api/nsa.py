"""The public Native Sparse Attention functions (Yuan et al. 2025, arXiv 2502.11089); the
definitions are in attn_spec/nsa.py."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attn_spec import nsa
from jax_attn import registry
from jax_attn.ops.common import validation
from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.ops.nsa import branches as nsa_branches
from jax_attn.ops.nsa import importance as nsa_importance
from jax_attn.ops.nsa import plan as nsa_plan
from jax_attn.ops.nsa import reference as nsa_reference
from jax_attn.api.attention import flash_attention


def _nsa_call(q, scale, has_segments: bool):
    """(spec, registry call) of an NSA function on q [B, S, Hq, D]."""
    spec = AttentionSpec(scale=q.shape[3] ** -0.5 if scale is None else scale, causal=True,
                         has_segments=has_segments, precision=validation.fp32_precision(q.dtype))
    return spec, registry.Call(spec, q.shape[3], q.dtype)


def _self_attention_ids(q, k, segment_ids):
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"NSA is self-attention: q and k need the same length, got {q.shape=} and {k.shape=}")
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        raise ValueError("NSA takes one segment_ids array [B, S] (self-attention), not a pair")
    return validation.check_segment_ids(segment_ids, q.shape[0], q.shape[1], q.shape[1])[0]


def _check_ranges(ranges, shape):
    validation.check_int_array("ranges", ranges)
    if ranges.ndim != 5 or tuple(ranges.shape[:3]) != tuple(shape) or ranges.shape[4] != 2:
        raise ValueError(f"ranges must have shape [B, S, Hkv, R, 2] = {(*shape, 'R', 2)}, got {tuple(ranges.shape)}")
    values = validation.concrete(ranges)  # traced ranges cannot be inspected here
    if values is not None and (values[..., 0] > values[..., 1]).any():
        bad = np.argwhere(values[..., 0] > values[..., 1])[0]
        raise ValueError(f"ranges must have start <= end; ranges[{', '.join(map(str, bad))}] = "
                         f"{values[tuple(bad)].tolist()}")


def selection_attention(q, k, v, block_indices=None, block_counts=None, *, ranges=None, block_size: int = 64,
                        causal: bool = True, scale: float | None = None, segment_ids=None, return_lse: bool = False,
                        implementation: str | None = None, config=None):
    """NSA's selection branch: exact attention of every query token over its selected keys.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] (self-attention), Hq % Hkv == 0 (any ratio, 1 included);
        D <= 256. float32, float16, bfloat16 (float64 with "xla" only, under jax.enable_x64).
      block_indices: int [B, S, Hkv, n]: query t of kv head h's group sees the keys of blocks
        block_indices[b, t, h] (block j = keys [j * block_size, (j + 1) * block_size)). Entries
        that are -1 (or any other negative), past the sequence, beyond the causal frontier, past
        block_counts, or repeated are ignored: a key counts once.
      block_counts: int [B, S, Hkv] or None: only the first block_counts entries count.
      ranges: int [B, S, Hkv, R, 2] instead of block lists: [start, end) key ranges per row, their
        union (start > end is an error; empty ranges are ignored). Exactly one of block_indices
        and ranges.
      block_size: keys per block, a power of two.
      causal: key position <= query position.
      scale: score scale, default D ** -0.5.
      segment_ids: int [B, S]: a query sees keys of its own id only.
      return_lse: also return lse [B, Hq, S] float32 (-inf on rows with nothing visible, whose
        output is 0); differentiable.
      implementation: None (the registry's rule: "triton" where Pallas Triton runs, else "xla"),
        "triton" (the group-centric Pallas kernels, Triton lowering; interpreted on CPU) or "xla"
        (plain jnp, a dense [B, Hkv, S, S] mask). Errors as for `flash_attention`.
      config: an `NSABlockSizes` for "triton"; None: its default.

    Differentiable in q, k, v (and through the lse output). Returns out [B, S, Hq, D], or (out, lse).
    """
    validation.check_arrays(q, k, v)
    batch, seq_len, _, head_dim = q.shape
    q_ids = _self_attention_ids(q, k, segment_ids)
    block_size = nsa.check_block("block_size", block_size)
    if (block_indices is None) == (ranges is None):
        raise ValueError("pass exactly one of block_indices and ranges")
    rows = (batch, seq_len, k.shape[2])
    if ranges is not None:
        if block_counts is not None:
            raise ValueError("block_counts goes with block_indices, not with ranges")
        _check_ranges(ranges, rows)
    else:
        validation.check_int_array("block_indices", block_indices)
        if block_indices.ndim != 4 or tuple(block_indices.shape[:3]) != rows:
            raise ValueError(f"block_indices must have shape [B, S, Hkv, n] = {(*rows, 'n')}, got "
                             f"{tuple(block_indices.shape)}")
        if block_counts is not None:
            validation.check_int_array("block_counts", block_counts, rows)
    scale = validation.check_positive("scale", scale)
    spec, _ = _nsa_call(q, scale, q_ids is not None)
    spec = dataclasses.replace(spec, causal=bool(causal))
    call = registry.Call(spec, head_dim, q.dtype)
    entry = registry.resolve("nsa", implementation, call)
    config = registry.check_config(entry, config, call)
    if ranges is not None:
        sel = dict(ranges=nsa_plan.disjoint_ranges(ranges, seq_len, spec.causal))
    else:
        blocks, counts = nsa_plan.canonical_blocks(block_indices, block_counts, block_size, seq_len, spec.causal)
        sel = dict(blocks=blocks, counts=counts)
    out, lse = entry.fn(q, k, v, q_ids=q_ids, block_size=block_size, spec=spec, config=config, **sel)
    return (out, lse) if return_lse else out


def compress_kv(k, v, *, block: int = 32, stride: int = 16, params=None):
    """NSA's compressed keys and values: phi over every complete block i (keys [i * stride,
    i * stride + block)).

    Args:
      k, v: [B, S, Hkv, D] float.
      block, stride: powers of two, stride <= block.
      params: None (mean pooling, fla-org's form) or a pair (for k, for v) of
        `attn_spec.nsa.CompressParams` (the paper's MLP with an intra-block position embedding,
        `gelu((x + pos).reshape(block * D) @ w1 + b1) @ w2 + b2`, exact GELU).

    Differentiable in k, v and params. Returns (k_cmp, v_cmp) [B, Nc, Hkv, D],
    Nc = `attn_spec.nsa.compressed_count(S, block, stride)` (0 when S < block).
    """
    for name, x in (("k", k), ("v", v)):
        validation.check_float_array(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got {name}.shape={x.shape}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k and v must share shape and dtype, got {k.shape=} {k.dtype} and {v.shape=} {v.dtype}")
    block, stride = nsa.check_compress_geometry(block, stride)
    if params is not None:
        if not isinstance(params, (tuple, list)) or len(params) != 2 or isinstance(params, nsa.CompressParams):
            raise TypeError("params must be a pair (CompressParams for k, CompressParams for v) or None")
        for name, p in zip(("params[0]", "params[1]"), params):
            nsa.check_compress_params(p, block, k.shape[3], name)
    precision = validation.fp32_precision(k.dtype)
    pk, pv = (None, None) if params is None else params
    return (nsa_reference.compress_one(k, block, stride, pk, precision),
            nsa_reference.compress_one(v, block, stride, pv, precision))


def _check_compressed(q, k_cmp, v_cmp, block, stride):
    for name, x in (("q", q), ("k_cmp", k_cmp), ("v_cmp", v_cmp)):
        validation.check_float_array(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got {name}.shape={x.shape}")
    if not q.dtype == k_cmp.dtype == v_cmp.dtype:
        raise TypeError(f"q, k_cmp, v_cmp must share a dtype, got {q.dtype}, {k_cmp.dtype}, {v_cmp.dtype}")
    if k_cmp.shape[0] != q.shape[0] or k_cmp.shape[3] != q.shape[3] or q.shape[2] % k_cmp.shape[2]:
        raise ValueError(f"k_cmp must match q in batch and head dim, its heads dividing q's: {q.shape=}, "
                         f"{k_cmp.shape=}")
    count = nsa.compressed_count(q.shape[1], block, stride)
    if k_cmp.ndim != 4 or k_cmp.shape[1] != count:
        raise ValueError(f"k_cmp must have shape [B, Nc, Hkv, D] with Nc = {count} compressed blocks of "
                         f"{block} (stride {stride}) in {q.shape[1]} tokens, got {tuple(k_cmp.shape)}")
    if k_cmp.shape != v_cmp.shape:
        raise ValueError(f"k_cmp and v_cmp must have the same shape, got {k_cmp.shape} and {v_cmp.shape}")


def _compression(q, k_cmp, v_cmp, block, stride, spec, q_ids, fast: bool):
    if not fast:
        return nsa_reference.compression_reference(q, k_cmp, v_cmp, block=block, stride=stride, scale=spec.scale,
                                                   precision=spec.precision, q_ids=q_ids)

    def attention(qs, ks, vs, seg):  # the engine, causal, its own default implementation for the device
        return flash_attention(qs, ks, vs, causal=True, scale=spec.scale, segment_ids=seg, return_lse=True)

    return nsa_branches.compression_engine(q, k_cmp, v_cmp, block=block, stride=stride, scale=spec.scale,
                                           q_ids=q_ids, attention=attention)


def compression_attention(q, k_cmp, v_cmp, *, block: int = 32, stride: int = 16, scale: float | None = None,
                          segment_ids=None, return_lse: bool = False, implementation: str | None = None):
    """NSA's compression branch: block-causal attention over the compressed keys.

    Query t sees compressed block i iff the block is complete at t, `i * stride + block - 1 <= t`
    (`attn_spec.nsa.compressed_end`), and, with segment_ids, the whole block carries t's id.

    Args:
      q: [B, S, Hq, D]; k_cmp, v_cmp: [B, Nc, Hkv, D] (`compress_kv`), Nc = compressed_count(S).
      block, stride: the compression geometry (powers of two, stride <= block).
      scale: default D ** -0.5. segment_ids: int [B, S] or None.
      return_lse: also return lse [B, Hq, S] float32 (-inf on rows that see no block; output 0).
      implementation: None / "triton" (the flash engine: the queries of each slot t mod stride are
        causal attention with a key offset; its default kernels for the device) or "xla" (dense mask).

    Differentiable in q, k_cmp, v_cmp. Returns out [B, S, Hq, D], or (out, lse).
    """
    block, stride = nsa.check_compress_geometry(block, stride)
    _check_compressed(q, k_cmp, v_cmp, block, stride)
    q_ids = _self_attention_ids(q, q, segment_ids)
    spec, call = _nsa_call(q, validation.check_positive("scale", scale), q_ids is not None)
    entry = registry.resolve("nsa", implementation, call)
    out, lse = _compression(q, k_cmp, v_cmp, block, stride, spec, q_ids, entry.name != "xla")
    return (out, lse) if return_lse else out


def _select(q, k_cmp, lse_cmp, config, spec, q_ids, fast: bool):
    q, k_cmp, lse_cmp = (jax.lax.stop_gradient(x) for x in (q, k_cmp, lse_cmp))
    kw = dict(block=config.compress_block, stride=config.compress_stride, select_block=config.select_block,
              scale=spec.scale, precision=spec.precision, q_ids=q_ids)
    if fast:
        return nsa_importance.select_pallas(q, k_cmp, lse_cmp, num_selected=config.num_selected, **kw)
    imp = nsa_reference.importance_reference(q, k_cmp, lse_cmp, **kw)
    return nsa_reference.top_n(imp, config.select_block, config.num_selected)


def select_blocks(q, k_cmp, lse_cmp, *, block: int = 32, stride: int = 16, select_block: int = 64,
                  num_selected: int = 16, scale: float | None = None, implementation: str | None = None):
    """NSA's top-n block selection (the rule of `attn_spec.nsa`): importance of every selection
    block from the compression branch's probabilities (recomputed from q, k_cmp and its lse),
    summed over each kv head's query heads; block 0 and the two local blocks forced; beyond the
    causal frontier excluded; the rest by importance, ties to the lower index.

    Args:
      q: [B, S, Hq, D]; k_cmp: [B, Nc, Hkv, D]; lse_cmp: [B, Hq, S] (`compression_attention`'s).
      block, stride: the compression geometry; select_block: keys per selection block;
      num_selected: n, at most the number of selection blocks (powers of two for the sizes).
      implementation: None / "triton" (a Pallas kernel sums the probabilities over each group's
        heads without materialising [B, S, Hq, Nc]) or "xla" (dense).

    Not differentiated. Returns int32 [B, S, Hkv, num_selected]: ascending, -1 in the slots no
    block fills.
    """
    _check_compressed(q, k_cmp, k_cmp, *nsa.check_compress_geometry(block, stride))
    config = nsa.check_config(q.shape[1], compress_block=block, compress_stride=stride, select_block=select_block,
                              num_selected=num_selected, window=0)
    validation.check_float_array("lse_cmp", lse_cmp, (q.shape[0], q.shape[2], q.shape[1]))
    spec, call = _nsa_call(q, validation.check_positive("scale", scale), False)
    entry = registry.resolve("nsa", implementation, call)
    return _select(q, k_cmp, lse_cmp, config, spec, None, entry.name != "xla")


def nsa_attention(q, k, v, gates, *, compress_block: int = 32, compress_stride: int = 16, select_block: int = 64,
                  num_selected: int = 16, window: int = 512, compress_params=None, scale: float | None = None,
                  segment_ids=None, implementation: str | None = None):
    """Native Sparse Attention: `o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win` per query head.

    Compression (`compress_kv` + `compression_attention`), selection (`select_blocks` on the
    compression branch's probabilities + `selection_attention`, causal) and a sliding window over
    the last `window` keys (`flash_attention`, causal, window (window - 1, 0); window=0 turns it
    off). Definitions: attn_spec/nsa.py.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D]; gates: float [B, S, Hq, 3] (compression, selection,
        window), e.g. sigmoid outputs of the layer.
      compress_block, compress_stride, select_block, num_selected, window: `attn_spec.nsa.NSAConfig`.
      compress_params: None (mean pooling) or a pair of `CompressParams` (for k, for v).
      scale: default D ** -0.5. segment_ids: int [B, S] or None (every branch stays within its
        segment; importance counts only blocks inside it).
      implementation: None / "triton" (the selection and importance kernels, the flash engine for
        compression and window) or "xla" (plain jnp throughout).

    Differentiable in q, k, v, gates and compress_params (not through the selection's choice).
    Returns out [B, S, Hq, D] in q.dtype.
    """
    validation.check_arrays(q, k, v)
    q_ids = _self_attention_ids(q, k, segment_ids)
    config = nsa.check_config(q.shape[1], compress_block=compress_block, compress_stride=compress_stride,
                              select_block=select_block, num_selected=num_selected, window=window)
    validation.check_float_array("gates", gates, (*q.shape[:3], len(nsa.BRANCHES)))
    spec, call = _nsa_call(q, validation.check_positive("scale", scale), q_ids is not None)
    entry = registry.resolve("nsa", implementation, call)
    fast = entry.name != "xla"
    block, stride = config.compress_block, config.compress_stride
    k_cmp, v_cmp = compress_kv(k, v, block=block, stride=stride, params=compress_params)
    o_cmp, lse_cmp = _compression(q, k_cmp, v_cmp, block, stride, spec, q_ids, fast)
    blocks = _select(q, k_cmp, lse_cmp, config, spec, q_ids, fast)
    o_slc = selection_attention(q, k, v, blocks, scale=spec.scale, block_size=config.select_block,
                                segment_ids=q_ids, implementation=entry.name)
    branches = [o_cmp, o_slc]
    if config.window:
        branches.append(flash_attention(q, k, v, causal=True, window=(config.window - 1, 0), scale=spec.scale,
                                        segment_ids=q_ids, implementation=None if fast else "xla"))
    acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    out = sum(gates[..., i, None].astype(acc) * o.astype(acc) for i, o in enumerate(branches))
    return out.astype(q.dtype)
