"""Public entry point: `flash_attention`, its input validation and the implementation registry."""
from __future__ import annotations

import functools
import math
import numbers
from typing import Callable

import jax
import jax.numpy as jnp

from jax_attn import mosaic_gpu, pallas_triton, xla
from jax_attn.device import pallas_triton_unsupported_reason
from jax_attn.rope import Rope
from jax_attn.spec import AttentionSpec

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)

# name -> fn(q, k, v, q_seg, kv_seg, spec, *, q_pos, kv_pos) -> (out, lse). Adding a backend = one entry.
IMPLEMENTATIONS: dict[str, Callable] = {
    "pallas_triton": pallas_triton.flash_attention_pallas,
    # the Hopper kernels (`mosaic_gpu`), wired through the engine's padding and custom_vjp
    "mosaic_gpu": functools.partial(pallas_triton.flash_attention_pallas, kernels="mosaic_gpu"),
    "xla": xla.attention_reference,
}


def default_implementation(spec: AttentionSpec | None = None, head_dim: int | None = None,
                           dtype=None, positions: bool = False) -> str:
    """The rule for implementation=None: the Pallas engine wherever Pallas Triton runs — compiled
    on NVIDIA sm80+ GPUs, through the interpreter on CPU; "xla" anywhere else (e.g. TPU). Given
    the call (spec, head dim, dtype, whether RoPE positions are given), "mosaic_gpu" where its
    Hopper kernels serve it (faster than the Triton engine on an H100; `benchmarks/`)."""
    if pallas_triton_unsupported_reason() is not None:
        return "xla"
    if spec is not None and mosaic_gpu.unsupported_reason(spec, head_dim, dtype, positions) is None:
        return "mosaic_gpu"
    return "pallas_triton"


def _check_arrays(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got {name}.shape={x.shape}")
        if x.dtype not in SUPPORTED_DTYPES + (jnp.float64,):
            raise TypeError(f"{name}.dtype={x.dtype} is not supported; use float32, float16 or bfloat16")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape=} and {v.shape=}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: {q.shape=} and {k.shape=}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"{q.shape=} and {k.shape=} differ in head dim")
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[3]} exceeds the maximum {MAX_HEAD_DIM} (q.shape={q.shape})")
    if q.shape[1] == 0 or k.shape[1] == 0 or q.shape[3] == 0:
        raise ValueError(f"empty sequence or head dim: {q.shape=}, {k.shape=}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"number of heads in k/v ({k.shape[2]}) must divide heads in q ({q.shape[2]})")


def _check_pairable(name, value, batch, q_len, kv_len):
    """One int array [B, S] (Sq == Sk) or a pair ([B, Sq], [B, Sk]) -> (q side, kv side)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} as a pair must be (q_{name}, kv_{name}), got {len(value)} items")
        q_side, kv_side = value
    else:
        if q_len != kv_len:
            raise ValueError(
                f"a single {name} array needs Sq == Sk (got {q_len} and {kv_len}); "
                f"pass {name}=(q_{name}, kv_{name})")
        q_side = kv_side = value
    for side, arr, length in (("q", q_side, q_len), ("kv", kv_side, kv_len)):
        if not hasattr(arr, "dtype") or not jnp.issubdtype(arr.dtype, jnp.integer):
            raise TypeError(f"{side} {name} must be an integer array, got {getattr(arr, 'dtype', type(arr))}")
        if arr.shape != (batch, length):
            raise ValueError(f"{side} {name} must have shape {(batch, length)}, got {arr.shape}")
    return q_side, kv_side


def _check_segment_ids(segment_ids, batch, q_len, kv_len):
    """-> (q_ids [B, Sq], kv_ids [B, Sk]) or (None, None)."""
    if segment_ids is None:
        return None, None
    return _check_pairable("segment_ids", segment_ids, batch, q_len, kv_len)


def _check_rope(rope, positions, batch, q_len, kv_len, head_dim):
    """-> (q_pos [B, Sq], kv_pos [B, Sk]) int32, or (None, None): no RoPE, or RoPE at the default
    positions arange (which the kernels exploit: `pallas_triton._rope_cos_sin`)."""
    if rope is None:
        if positions is not None:
            raise ValueError("positions are given but rope is None; positions only drive RoPE")
        return None, None
    if not isinstance(rope, Rope):
        raise TypeError(f"rope must be a jax_attn.Rope or None, got {type(rope).__name__}")
    if head_dim % 2:
        raise ValueError(f"head dim must be even for RoPE, got D={head_dim}")
    if positions is None:
        return None, None
    q_pos, kv_pos = _check_pairable("positions", positions, batch, q_len, kv_len)
    return q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32)


def _check_window(window):
    if window is None:
        return None, None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise ValueError(f"window must be a pair of ints (left, right), got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < 0 or right < 0:
        raise ValueError(f"window sizes must be >= 0, got window={window!r}")
    return left, right


def _check_positive(name, value):
    if value is None:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):  # it shapes the kernels: static
        raise TypeError(f"{name} must be a Python number (static, not an array or a bool), got {name}={value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {name}={value!r}")
    return float(value)


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                    segment_ids=None, window: tuple[int, int] | None = None,
                    softcap: float | None = None, rope: Rope | None = None, positions=None,
                    return_lse: bool = False, implementation: str | None = None):
    """Multi-head attention, `softmax(scale * q k^T + mask) v`, FlashAttention-style.

    Args:
      q: [B, Sq, Hq, D] queries (float32, float16 or bfloat16; float64 with "xla" only, under
        jax.enable_x64, for golden references).
      k, v: [B, Sk, Hkv, D] keys and values, Hq % Hkv == 0 (query head h reads kv head
        h // (Hq // Hkv)). D <= 256; any Sq, Sk.
      causal: query i sees keys j <= i (top-left aligned when Sq != Sk).
      scale: score scale, default D ** -0.5.
      segment_ids: int [B, S] (Sq == Sk) or a pair (q_ids [B, Sq], kv_ids [B, Sk]); queries see
        only keys with the same id.
      window: (left, right) >= 0: query i sees keys i - left <= j <= i + right.
      softcap: c > 0: scores become c * tanh(s / c) before masking.
      rope: a `Rope(base, style)`: q and k are rotated inside the kernels after load (RoPE,
        pairs (2i, 2i+1) for style "interleaved", (i, i + D/2) for "half"); D must be even.
      positions: RoPE positions, int [B, S] (Sq == Sk) or a pair (q_pos [B, Sq], kv_pos [B, Sk]);
        default arange (per-token positions serve packed sequences).
      return_lse: also return lse [B, Hq, Sq] float32 (natural log; -inf on rows with no
        visible key). The lse output is differentiable.
      implementation: None (see `default_implementation`), "pallas_triton", "mosaic_gpu" (Hopper
        GPUs; 16-bit attention, causal and/or windowed, RoPE at the default positions, without
        softcap or segments, D <= 128: warp-specialised TMA/wgmma kernels, forward and backward;
        raises on anything else) or "xla".

    Float32 inputs use the matmul precision JAX is configured with
    (`jax.default_matmul_precision`): "highest"/"float32" gives exact fp32 dots, anything else
    lets the GPU use TF32, as XLA does.

    A row with no visible key returns 0 (lse -inf) and zero gradients, never NaN.

    Returns:
      out [B, Sq, Hq, D] in q.dtype, or (out, lse) when return_lse.
    """
    _check_arrays(q, k, v)
    batch, q_len, _, head_dim = q.shape
    kv_len = k.shape[1]
    q_ids, kv_ids = _check_segment_ids(segment_ids, batch, q_len, kv_len)
    left, right = _check_window(window)
    q_pos, kv_pos = _check_rope(rope, positions, batch, q_len, kv_len, head_dim)
    softcap = _check_positive("softcap", softcap)
    scale = _check_positive("scale", scale)
    spec = AttentionSpec(
        scale=head_dim ** -0.5 if scale is None else scale,
        causal=bool(causal), window_left=left, window_right=right, softcap=softcap,
        has_segments=q_ids is not None, precision=_fp32_precision(q.dtype), rope=rope)
    if implementation is None:
        implementation = default_implementation(spec, head_dim, q.dtype, positions=q_pos is not None)
    if implementation not in IMPLEMENTATIONS:
        raise NotImplementedError(
            f"unknown implementation={implementation!r}; choose one of {sorted(IMPLEMENTATIONS)} or None")
    if q.dtype == jnp.float64 and implementation != "xla":
        raise NotImplementedError(
            f"float64 inputs are served by implementation='xla' only (the golden reference), "
            f"not {implementation!r}")
    if implementation in ("pallas_triton", "mosaic_gpu") and (reason := pallas_triton_unsupported_reason()):
        raise NotImplementedError(f"implementation={implementation!r} cannot serve this call: {reason}")
    out, lse = IMPLEMENTATIONS[implementation](q, k, v, q_ids, kv_ids, spec, q_pos=q_pos, kv_pos=kv_pos)
    return (out, lse) if return_lse else out


def _fp32_precision(dtype) -> jax.lax.Precision:
    """Exact fp32 dots when JAX is configured for "highest"/"float32" precision, else DEFAULT."""
    configured = jax.config.jax_default_matmul_precision
    if dtype in (jnp.float32, jnp.float64) and configured is not None and str(configured).lower() in (
            "highest", "float32", "precision.highest", "fp32"):
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT
