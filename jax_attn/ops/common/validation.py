"""Input validation shared by the public functions: each check names the argument and its value."""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from attn_spec.rope import Rope
from jax_attn.ops.common import dropout


MAX_HEAD_DIM = 256


SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def check_arrays(q, k, v):
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


def check_pairable(name, value, batch, q_len, kv_len):
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


def check_segment_ids(segment_ids, batch, q_len, kv_len):
    """-> (q_ids [B, Sq], kv_ids [B, Sk]) or (None, None)."""
    if segment_ids is None:
        return None, None
    return check_pairable("segment_ids", segment_ids, batch, q_len, kv_len)


def check_rope(rope, positions, batch, q_len, kv_len, head_dim):
    """-> (q_pos [B, Sq], kv_pos [B, Sk]) int32, or (None, None): no RoPE, or RoPE at the default
    positions arange (which the kernels exploit: `tiles.rope_cos_sin`)."""
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
    q_pos, kv_pos = check_pairable("positions", positions, batch, q_len, kv_len)
    return q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32)


def check_window(window):
    if window is None:
        return None, None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise ValueError(f"window must be a pair of ints (left, right), got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < 0 or right < 0:
        raise ValueError(f"window sizes must be >= 0, got window={window!r}")
    return left, right


def check_offset(name, value) -> int:
    """A position offset: a Python int >= 0 (static: it shapes the visit plan)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a Python int >= 0 (static), got {name}={value!r}")
    return int(value)


def check_positive(name, value):
    if value is None:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):  # it shapes the kernels: static
        raise TypeError(f"{name} must be a Python number (static, not an array or a bool), got {name}={value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {name}={value!r}")
    return float(value)


def fp32_precision(dtype) -> jax.lax.Precision:
    """Exact fp32 dots when JAX is configured for "highest"/"float32" precision, else DEFAULT."""
    configured = jax.config.jax_default_matmul_precision
    if dtype in (jnp.float32, jnp.float64) and configured is not None and str(configured).lower() in (
            "highest", "float32", "precision.highest", "fp32"):
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


def check_decay(decay, num_heads, dtype):
    """-> decay () or [Hq] in the compute dtype (float32; float64 for the golden). A scalar stays
    one: the implementations sum its gradient over the heads in their own way (the Pallas
    kernels' compensated sum takes every head's terms at once)."""
    if isinstance(decay, numbers.Real) and not isinstance(decay, bool):
        decay = np.float64(decay)
    if not hasattr(decay, "shape") or not hasattr(decay, "dtype"):
        raise TypeError(f"decay must be a float or a float array, got {type(decay).__name__}")
    if not jnp.issubdtype(decay.dtype, jnp.floating):
        raise TypeError(f"decay must have a floating dtype, got decay.dtype={decay.dtype}")
    if decay.shape not in ((), (num_heads,)):
        raise ValueError(f"decay must be a scalar or have shape [Hq] = ({num_heads},), got {decay.shape}")
    values = concrete(decay)  # a traced (learnable) decay cannot be inspected here
    if values is not None and not (np.all(np.isfinite(values)) and np.all(values >= 0)):
        raise ValueError(f"decay must be finite and >= 0, got decay={values}")
    compute = jnp.float64 if dtype == jnp.float64 else jnp.float32
    return jnp.asarray(decay, compute)


def concrete(x):
    """x's values as a NumPy array, or None while tracing (then only its shape can be checked)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_slopes(slopes, num_heads: int, dtype):
    """ALiBi slopes: None, or a float array [Hq] (finite where its values are known) -> float32
    (float64 for the golden) [Hq] or None."""
    if slopes is None:
        return None
    if not hasattr(slopes, "shape") or not hasattr(slopes, "dtype") or not jnp.issubdtype(slopes.dtype, jnp.floating):
        raise TypeError(f"alibi_slopes must be a float array [Hq], got {getattr(slopes, 'dtype', type(slopes).__name__)}")
    if tuple(slopes.shape) != (num_heads,):
        raise ValueError(f"alibi_slopes must have shape [Hq] = ({num_heads},), got {tuple(slopes.shape)}")
    values = concrete(slopes)
    if values is not None and not np.all(np.isfinite(values)):
        raise ValueError(f"alibi_slopes must be finite, got {values}")
    return jnp.asarray(slopes, jnp.float64 if dtype == jnp.float64 else jnp.float32)


def check_dropout(rate, key):
    """Attention dropout: rate a float in [0, 1); with rate > 0 a PRNG key (typed, or raw uint32
    [2]) -> (rate as float, seed uint32 [2] or None)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be a float in [0, 1), got {rate!r}")
    if rate == 0.0:
        return 0.0, None
    if key is None:
        raise ValueError("dropout_rate > 0 needs dropout_key, a JAX PRNG key (jax.random.key(seed))")
    typed = hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not typed and (getattr(key, "dtype", None) != jnp.uint32 or tuple(getattr(key, "shape", ())) != (2,)):
        raise TypeError(f"dropout_key must be a JAX PRNG key (typed, or raw uint32 [2]), got "
                        f"{getattr(key, 'dtype', type(key).__name__)} {tuple(getattr(key, 'shape', ()))}")
    if typed and key.shape != ():
        raise ValueError(f"dropout_key must be one key, got shape {key.shape}")
    return float(rate), dropout.seed_words(key)


def _check_typed_array(name, x, shape, kind: str, dtype_class):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be {kind} array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, dtype_class):
        raise TypeError(f"{name} must be {kind} array, got {name}.dtype={x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {name}.shape={tuple(x.shape)}")
    return x


def check_int_array(name, x, shape=None):
    """An integer array (of the given shape, where given)."""
    return _check_typed_array(name, x, shape, "an integer", jnp.integer)


def check_float_array(name, x, shape=None):
    """A floating array (of the given shape, where given)."""
    return _check_typed_array(name, x, shape, "a float", jnp.floating)


def check_mesh(mesh, axis) -> None:
    """A `jax.sharding.Mesh` and the name of one of its axes (the sequence axis)."""
    if not hasattr(mesh, "axis_names") or not hasattr(mesh, "shape"):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh (axes {tuple(mesh.axis_names)})")
