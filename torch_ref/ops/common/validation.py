"""Argument checks shared by every public function of torch_ref (both variants, every implementation).

`validate` checks q, k, v and the softmax options (causal, scale, segment ids, window, softcap) and
normalises them; `validate_rope` checks rope / positions; `validate_stick_breaking` (with
`validate_decay`) the stick-breaking arguments; `validate_dilated` the dilated ones; `validate_dropout`
attention dropout's rate and seed. `segment_pair_for_kernel` gives a pair of id
tensors one integer dtype for the Triton kernels. Errors name the argument and the value.
"""
from __future__ import annotations

import math
import numbers

import torch

from attn_spec.dilation import check_config as check_dilated_config
from attn_spec.dropout import seed_words
from attn_spec.rope import Rope
from attn_spec.visit import reach

from .dropout import draw_seed

MAX_HEAD_DIM = 256
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

__all__ = ["MAX_HEAD_DIM", "FLOAT_DTYPES", "is_int", "is_real", "check_ids", "validate", "validate_rope",
           "segment_pair_for_kernel", "validate_decay", "validate_stick_breaking", "validate_dilated",
           "validate_dropout"]


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_ids(ids, name: str, B: int, S: int, device) -> torch.Tensor:
    """An integer [B, S] tensor on `device` (segment ids, positions)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor of shape [{B}, {S}], got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
    if tuple(ids.shape) != (B, S):
        raise ValueError(f"{name} must have shape [B, S] = [{B}, {S}], got {list(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but q is on {device}")
    return ids


def validate(q, k, v, causal, scale, segment_ids, window, softcap):
    """Check the arguments; return (scale, q_ids, kv_ids, window) normalised."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, D], got shape {list(t.shape)} ({t.dim()}-D)")
    if q.dtype not in FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"q dtype must be float16, bfloat16 or float32 (float64: eager only), got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v dtypes must match, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v shapes must match, got k {list(k.shape)}, v {list(v.shape)}")
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"batch mismatch: q has batch {B}, k/v have {k.shape[0]}")
    if k.shape[3] != D:
        raise ValueError(f"head-dim mismatch: q has head dim {D}, k/v have {k.shape[3]}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{MAX_HEAD_DIM}, got {D}")
    Sk, Hkv = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"number of heads in k/v ({Hkv}) must divide heads in q ({Hq})")

    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if scale is None:
        scale = D ** -0.5
    elif not (is_real(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    scale = float(scale)

    if softcap is not None and not (is_real(softcap) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    softcap = None if softcap is None else float(softcap)

    if window is not None:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(is_int(w) and w >= 0 for w in window)):
            raise ValueError(f"window must be a pair (left, right) of non-negative ints, got {window!r}")
        window = (int(window[0]), int(window[1]))

    q_ids = kv_ids = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(f"segment_ids must be one [B, S] tensor or a pair (q_ids, kv_ids), "
                                 f"got a sequence of length {len(segment_ids)}")
            q_ids = check_ids(segment_ids[0], "segment_ids[0] (q_ids)", B, Sq, q.device)
            kv_ids = check_ids(segment_ids[1], "segment_ids[1] (kv_ids)", B, Sk, q.device)
        else:
            if Sq != Sk:
                raise ValueError(f"a single segment_ids tensor needs Sq == Sk (self-attention), got Sq={Sq}, "
                                 f"Sk={Sk}; pass a pair (q_ids, kv_ids)")
            q_ids = kv_ids = check_ids(segment_ids, "segment_ids", B, Sq, q.device)
    return scale, q_ids, kv_ids, window, softcap


def validate_offsets(causal, window, q_offset, kv_offset, Sq: int, Sk: int):
    """Check q_offset / kv_offset (ints >= 0, the absolute positions of the first query and key) and
    fold them into the mask: -> (causal, window) comparing local indices. With offset d =
    q_offset - kv_offset, query i sees key j where i + d - left <= j <= i + d + right (j <= i + d
    if causal): a window (before, after) of `attn_spec.visit.reach`, unbounded sides as wide as the
    sequences (the kernels take the window as ints; it may be negative)."""
    for name, value in (("q_offset", q_offset), ("kv_offset", kv_offset)):
        if not is_int(value) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {name}={value!r}")
    offset = int(q_offset) - int(kv_offset)
    if offset == 0:
        return causal, window
    before, after = reach(causal, *(window if window is not None else (None, None)), offset)
    if before is None and after is None:
        return False, None
    unbounded = Sq + Sk + abs(offset)
    return False, (unbounded if before is None else before, unbounded if after is None else after)


def validate_alibi(slopes, q, q_offset, kv_offset):
    """ALiBi slopes: None, or a float tensor [Hq] of finite values -> (slopes, q_offset - kv_offset)."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor) or not slopes.dtype.is_floating_point:
        raise TypeError(f"alibi_slopes must be a float tensor [Hq], got {getattr(slopes, 'dtype', type(slopes).__name__)}")
    if tuple(slopes.shape) != (q.shape[2],):
        raise ValueError(f"alibi_slopes must have shape [Hq] = ({q.shape[2]},), got {tuple(slopes.shape)}")
    if not bool(torch.isfinite(slopes).all()):
        raise ValueError(f"alibi_slopes must be finite, got {slopes.tolist()}")
    return slopes.detach(), int(q_offset) - int(kv_offset)


def validate_dropout(rate, seed, generator=None):
    """Attention dropout: rate a float in [0, 1); seed None or an int in [0, 2^64); generator None or
    a torch.Generator (for a drawn seed) -> None (rate 0: no dropout) or (rate, (s0, s1)), the seed
    words of `attn_spec.dropout`. With rate > 0 and no seed, the seed is drawn by
    `torch_ref.ops.common.dropout.draw_seed` from `generator` (default: torch's default CPU generator)."""
    if not (is_real(rate) and 0.0 <= rate < 1.0):
        raise ValueError(f"dropout_rate must be a float in [0, 1), got {rate!r}")
    if seed is not None and not is_int(seed):
        raise TypeError(f"dropout_seed must be None or an int in [0, 2**64), got {type(seed).__name__} {seed!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be None or a torch.Generator, got {type(generator).__name__}")
    if seed is not None and generator is not None:
        raise ValueError("pass dropout_seed or generator (the generator draws a seed), not both")
    words = None if seed is None else seed_words(seed)  # ValueError outside [0, 2**64)
    if rate == 0:
        return None
    if words is None:
        words = seed_words(draw_seed(generator))
    return float(rate), words


def validate_rope(q, k, rope, positions, q_offset: int = 0, kv_offset: int = 0):
    """Check rope / positions; return (q_pos [B, Sq], kv_pos [B, Sk]) (None, None without rope).

    positions None means q at q_offset + arange(Sq) and k at kv_offset + arange(Sk) (each batch row)."""
    if rope is not None and not isinstance(rope, Rope):
        raise TypeError(f"rope must be a torch_ref.Rope or None, got {type(rope).__name__}")
    if rope is None:
        if positions is not None:
            raise ValueError("positions given without rope: positions only apply with rope=torch_ref.Rope(...)")
        return None, None
    B, Sq, _, D = q.shape
    Sk = k.shape[1]
    if D % 2 != 0:
        raise ValueError(f"head dim must be even for RoPE, got D={D}")
    if positions is None:
        return (torch.arange(q_offset, q_offset + Sq, dtype=torch.int32, device=q.device).expand(B, Sq),
                torch.arange(kv_offset, kv_offset + Sk, dtype=torch.int32, device=q.device).expand(B, Sk))
    if isinstance(positions, (tuple, list)):
        if len(positions) != 2:
            raise ValueError(f"positions must be one [B, S] tensor or a pair (q_pos, kv_pos), "
                             f"got a sequence of length {len(positions)}")
        return (check_ids(positions[0], "positions[0] (q_pos)", B, Sq, q.device),
                check_ids(positions[1], "positions[1] (kv_pos)", B, Sk, q.device))
    if Sq != Sk:
        raise ValueError(f"a single positions tensor needs Sq == Sk (self-attention), got Sq={Sq}, Sk={Sk}; "
                         f"pass a pair (q_pos, kv_pos)")
    pos = check_ids(positions, "positions", B, Sq, q.device)
    return pos, pos


def segment_pair_for_kernel(q_ids, kv_ids):
    """One integer dtype for both (int32 unless a side is int64), so the kernel compares like types.
    Also used for the RoPE positions."""
    if q_ids is None:
        return None, None
    dt = torch.int64 if torch.int64 in (q_ids.dtype, kv_ids.dtype) else torch.int32
    return q_ids.to(dt), kv_ids.to(dt)


def validate_decay(decay, q: torch.Tensor):
    """decay: a real number >= 0 (-> float) or a floating tensor of shape [] or [Hq] with finite
    values >= 0 on q's device (-> the tensor itself, so that autograd can reach it)."""
    Hq = q.shape[2]
    if isinstance(decay, numbers.Real) and not isinstance(decay, bool):
        decay = float(decay)
        if not (math.isfinite(decay) and decay >= 0):
            raise ValueError(f"decay must be finite and >= 0, got decay={decay!r}")
        return decay
    if not isinstance(decay, torch.Tensor):
        raise TypeError(f"decay must be a float >= 0 or a floating torch.Tensor of shape [] or [Hq] = [{Hq}], "
                        f"got {type(decay).__name__}")
    if not decay.dtype.is_floating_point:
        raise TypeError(f"decay must have a floating dtype, got decay.dtype={decay.dtype}")
    if tuple(decay.shape) not in ((), (Hq,)):
        raise ValueError(f"decay must be a scalar or have shape [Hq] = [{Hq}], got {list(decay.shape)}")
    if decay.device != q.device:
        raise ValueError(f"decay is on {decay.device} but q is on {q.device}")
    concrete = decay.detach()
    if not bool((torch.isfinite(concrete) & (concrete >= 0)).all()):
        raise ValueError(f"decay must be finite and >= 0, got decay={concrete.cpu().tolist()}")
    return decay


def validate_stick_breaking(q, k, v, scale, decay, rope, positions, attend_current=False, segment_ids=None):
    """-> (scale, decay, q_pos, kv_pos, q_ids, kv_ids). The tensor checks are flash_attention's
    (shapes, dtypes, devices, heads, head dim, scale, segment ids: one [B, S] tensor for Sq == Sk
    or a pair), plus Sq <= Sk (the queries are the last Sq positions of the keys: RoPE positions
    default to Sk - Sq + arange(Sq) for q) and attend_current a bool; rope / positions likewise."""
    scale, q_ids, kv_ids = validate(q, k, v, False, scale, segment_ids, None, None)[:3]
    if k.shape[1] < q.shape[1]:
        raise ValueError(f"stick-breaking attention puts the queries at the last Sq positions of the keys: Sq <= Sk "
                         f"needed, got Sq={q.shape[1]} (q {list(q.shape)}), Sk={k.shape[1]} (k {list(k.shape)})")
    if not isinstance(attend_current, bool):
        raise TypeError(f"attend_current must be a bool, got attend_current={attend_current!r}")
    q_pos, kv_pos = validate_rope(q, k, rope, positions, q_offset=k.shape[1] - q.shape[1])
    decay = validate_decay(decay, q)
    return scale, decay, q_pos, kv_pos, q_ids, kv_ids


def validate_dilated(q, k, v, causal, scale, segment_lengths, dilation_rates, merge):
    """-> (scale, segment_lengths, dilation_rates) as int tuples. The tensor checks are
    flash_attention's (shapes, dtypes, devices, heads, head dim, causal, scale), plus Sq == Sk; the
    configuration's are `attn_spec.dilation.check_config`'s."""
    scale = validate(q, k, v, causal, scale, None, None, None)[0]
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"dilated attention is self-attention: q and k/v need the same sequence length, got "
                         f"Sq={q.shape[1]} (q {list(q.shape)}), Sk={k.shape[1]} (k {list(k.shape)})")
    lengths, rates = check_dilated_config(segment_lengths, dilation_rates, merge, q.shape[2])
    return scale, lengths, rates
