"""Argument checks of the NSA entry points (`torch_ref.selection_attention`, `compress_kv`,
`compression_attention`, `select_blocks`, `nsa_attention`). Errors name the argument and the value;
the tensor checks are flash_attention's (`torch_ref.ops.common.validation.validate`), the
configuration's `attn_spec.nsa`'s."""
from __future__ import annotations

import torch

from attn_spec import nsa as spec

from ..common.validation import FLOAT_DTYPES, validate


def _self_attention(q, k, v, scale, segment_ids, what: str):
    scale, q_ids, _, _, _ = validate(q, k, v, False, scale, None, None, None)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"{what} is self-attention: q and k/v need the same sequence length, got "
                         f"Sq={q.shape[1]} (q {list(q.shape)}), Sk={k.shape[1]} (k {list(k.shape)})")
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            raise TypeError(f"segment_ids must be one integer tensor [B, S] (self-attention), got a "
                            f"{type(segment_ids).__name__}")
        validate(q, k, v, False, scale, segment_ids, None, None)
    return scale


def validate_selection(q, k, v, block_indices, block_counts, ranges, block_size, causal, scale, segment_ids):
    """-> (scale, block_size). Exactly one of block_indices int [B, S, Hkv, n] (with optional
    block_counts int [B, S, Hkv]) and ranges int [B, S, Hkv, R, 2] (start <= end)."""
    scale = _self_attention(q, k, v, scale, segment_ids, "selection attention")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    block_size = spec.check_block("block_size", block_size)
    B, S, Hkv = k.shape[:3]
    if (block_indices is None) == (ranges is None):
        raise ValueError("pass exactly one of block_indices and ranges, got "
                         + ("both" if ranges is not None else "neither"))
    if ranges is not None:
        if block_counts is not None:
            raise ValueError("block_counts applies to block_indices, not to ranges")
        if not isinstance(ranges, torch.Tensor):
            raise TypeError(f"ranges must be an integer torch.Tensor [B, S, Hkv, R, 2], got {type(ranges).__name__}")
        if ranges.dtype.is_floating_point or ranges.dtype.is_complex or ranges.dtype == torch.bool:
            raise TypeError(f"ranges must have an integer dtype, got ranges.dtype={ranges.dtype}")
        if ranges.dim() != 5 or tuple(ranges.shape[:3]) != (B, S, Hkv) or ranges.shape[4] != 2 or ranges.shape[3] < 1:
            raise ValueError(f"ranges must have shape [B, S, Hkv, R, 2] = [{B}, {S}, {Hkv}, R >= 1, 2], "
                             f"got {list(ranges.shape)}")
        if ranges.device != q.device:
            raise ValueError(f"ranges is on {ranges.device} but q is on {q.device}")
        bad = ranges[..., 0] > ranges[..., 1]
        if bool(bad.any()):
            where = [int(i) for i in bad.nonzero()[0]]
            raise ValueError(f"ranges must have start <= end, got {ranges[tuple(where)].tolist()} at "
                             f"[b, t, h, r] = {where}")
        return scale, block_size
    if not isinstance(block_indices, torch.Tensor):
        raise TypeError(f"block_indices must be an integer torch.Tensor [B, S, Hkv, n], got "
                        f"{type(block_indices).__name__}")
    if block_indices.dtype.is_floating_point or block_indices.dtype.is_complex or block_indices.dtype == torch.bool:
        raise TypeError(f"block_indices must have an integer dtype, got block_indices.dtype={block_indices.dtype}")
    if block_indices.dim() != 4 or tuple(block_indices.shape[:3]) != (B, S, Hkv) or block_indices.shape[3] < 1:
        raise ValueError(f"block_indices must have shape [B, S, Hkv, n] = [{B}, {S}, {Hkv}, n >= 1], got "
                         f"{list(block_indices.shape)}")
    if block_indices.device != q.device:
        raise ValueError(f"block_indices is on {block_indices.device} but q is on {q.device}")
    if block_counts is not None:
        if not isinstance(block_counts, torch.Tensor) or block_counts.dtype.is_floating_point \
                or block_counts.dtype == torch.bool or block_counts.dtype.is_complex:
            raise TypeError(f"block_counts must be an integer torch.Tensor [B, S, Hkv], got "
                            f"{getattr(block_counts, 'dtype', type(block_counts).__name__)}")
        if tuple(block_counts.shape) != (B, S, Hkv):
            raise ValueError(f"block_counts must have shape [B, S, Hkv] = [{B}, {S}, {Hkv}], got "
                             f"{list(block_counts.shape)}")
        if block_counts.device != q.device:
            raise ValueError(f"block_counts is on {block_counts.device} but q is on {q.device}")
    return scale, block_size


def validate_compress(k, v, block, stride, params):
    """-> (block, stride). k, v [B, S, Hkv, D] of one float dtype; params None or a pair of
    `attn_spec.nsa.CompressParams` (for k, for v) of torch tensors."""
    validate(k, k, v, False, None, None, None, None)
    block, stride = spec.check_compress_geometry(block, stride)
    if params is not None:
        if not isinstance(params, (tuple, list)) or isinstance(params, spec.CompressParams) or len(params) != 2:
            raise TypeError("params must be None or a pair (CompressParams for k, CompressParams for v), got "
                            f"{type(params).__name__}")
        for name, p in zip(("params[0] (k)", "params[1] (v)"), params):
            spec.check_compress_params(p, block, k.shape[3], name)
            for field in p._fields:
                t = getattr(p, field)
                if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                    raise TypeError(f"{name}.{field} must be a floating torch.Tensor, got "
                                    f"{getattr(t, 'dtype', type(t).__name__)}")
                if t.device != k.device:
                    raise ValueError(f"{name}.{field} is on {t.device} but k is on {k.device}")
    return block, stride


def validate_compression(q, k_cmp, v_cmp, block, stride, scale, segment_ids):
    """-> (scale, block, stride). k_cmp, v_cmp [B, Nc, Hkv, D] with Nc the compressed count of S."""
    scale, _, _, _, _ = validate(q, k_cmp, v_cmp, False, scale, None, None, None)
    block, stride = spec.check_compress_geometry(block, stride)
    nc = spec.compressed_count(q.shape[1], block, stride)
    if k_cmp.shape[1] != nc:
        raise ValueError(f"k_cmp must hold the {nc} compression blocks of a sequence of {q.shape[1]} (block "
                         f"{block}, stride {stride}), got Nc={k_cmp.shape[1]} (k_cmp {list(k_cmp.shape)})")
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            raise TypeError("segment_ids must be one integer tensor [B, S], got a sequence")
        validate(q, q, q, False, scale, segment_ids, None, None)
    return scale, block, stride


def validate_select(q, k_cmp, lse_cmp, block, stride, select_block, num_selected, scale):
    """-> (scale, NSAConfig). lse_cmp float [B, Hq, S] (compression_attention's)."""
    scale, block, stride = validate_compression(q, k_cmp, k_cmp, block, stride, scale, None)
    cfg = spec.check_config(q.shape[1], compress_block=block, compress_stride=stride, select_block=select_block,
                            num_selected=num_selected, window=0)
    B, S, Hq, _ = q.shape
    if not isinstance(lse_cmp, torch.Tensor) or not lse_cmp.dtype.is_floating_point:
        raise TypeError(f"lse_cmp must be a floating torch.Tensor [B, Hq, S], got "
                        f"{getattr(lse_cmp, 'dtype', type(lse_cmp).__name__)}")
    if tuple(lse_cmp.shape) != (B, Hq, S):
        raise ValueError(f"lse_cmp must have shape [B, Hq, S] = [{B}, {Hq}, {S}], got {list(lse_cmp.shape)}")
    if lse_cmp.device != q.device:
        raise ValueError(f"lse_cmp is on {lse_cmp.device} but q is on {q.device}")
    return scale, cfg


def validate_nsa(q, k, v, gates, compress_block, compress_stride, select_block, num_selected, window,
                 compress_params, scale, segment_ids):
    """-> (scale, NSAConfig)."""
    scale = _self_attention(q, k, v, scale, segment_ids, "NSA")
    cfg = spec.check_config(q.shape[1], compress_block=compress_block, compress_stride=compress_stride,
                            select_block=select_block, num_selected=num_selected, window=window)
    B, S, Hq, _ = q.shape
    if not isinstance(gates, torch.Tensor) or gates.dtype not in FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"gates must be a floating torch.Tensor [B, S, Hq, 3], got "
                        f"{getattr(gates, 'dtype', type(gates).__name__)}")
    if tuple(gates.shape) != (B, S, Hq, 3):
        raise ValueError(f"gates must have shape [B, S, Hq, 3] = [{B}, {S}, {Hq}, 3] (compression, selection, "
                         f"window), got {list(gates.shape)}")
    if gates.device != q.device:
        raise ValueError(f"gates is on {gates.device} but q is on {q.device}")
    validate_compress(k, v, cfg.compress_block, cfg.compress_stride, compress_params)
    return scale, cfg
