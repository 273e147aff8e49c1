"""Flax NNX layers on the attention kernels, and an `attention_fn` adapter for flax.

* `MultiHeadSelfAttention`: q/k/v/out projections (`nnx.Linear`: `q_proj`, `k_proj`, `v_proj`,
  `out_proj`), heads in BSHD layout, `jax_attn.flash_attention`, heads merged, projected.
* `EncoderBlock`: BERT-style post-LN block, x = LN(x + attn(x)); x = LN(x + MLP(x)), MLP =
  Linear(d_model, d_ff) -> GELU (tanh approximation) -> Linear(d_ff, d_model).
* `make_attention_fn` / `attention_fn`: run `flax.nnx.MultiHeadAttention(attention_fn=...)` on the
  kernels.

Position schemes (`position=`):
  "none":     no position information (permutation-equivariant unless causal / windowed).
  "absolute": the sinusoidal table of `jax_attn.nn.positions` is added to the layer input before the
              q/k/v projections (at `positions` when given, else at 0 .. S-1). Only the attention
              input gets it: the residual of `EncoderBlock` carries x without it.
  "rope":     rotary embedding of q and k fused into the kernel: `flash_attention(..., rope=,
              positions=)` (positions None = 0 .. S-1).
  "exposb":   stick-breaking attention (`jax_attn.stick_breaking_attention`) on RoPE-rotated q, k
              (the `rope` config, `positions`), with the distance decay `decay` (fixed) or, with
              `learn_decay=True`, a learnable per-head decay softplus(decay_logit) started at
              `decay` (> 0). Strictly causal by definition: it needs causal=True and takes no
              window, softcap or segment ids.

The PyTorch twins live in `torch_ref.layers` (same arguments, same submodule names); parameters
move between them with `parity.bridge`.
"""
from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_attn.api import flash_attention, stick_breaking_attention
from jax_attn.nn.positions import sinusoidal_at, sinusoidal_positions
from jax_attn.ops.common.rope import Rope

POSITIONS = ("none", "absolute", "rope", "exposb")
LAYER_NORM_EPS = 1e-5


def _positive_int(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return int(value)


def check_attention_args(d_model, num_heads, num_kv_heads, position, causal=False, window=None,
                         softcap=None, decay=0.0, learn_decay=False) -> tuple[int, int, int, int]:
    """Validate the shape/position arguments; -> (d_model, num_heads, num_kv_heads, head_dim).

    The same checks and messages as `torch_ref.layers` (kept in step by tests/test_layers.py).
    """
    d_model = _positive_int("d_model", d_model)
    num_heads = _positive_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
    if position not in POSITIONS:
        raise ValueError(f"unknown position={position!r}; choose one of {POSITIONS}")
    if d_model % num_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    head_dim = d_model // num_heads
    if position == "absolute" and d_model % 2:
        raise ValueError(f"position='absolute' needs an even d_model, got d_model={d_model}")
    if position in ("rope", "exposb") and head_dim % 2:
        raise ValueError(f"position={position!r} needs an even head dim, got d_model / num_heads = {head_dim}")
    check_exposb_args(position, causal, window, softcap, decay, learn_decay)
    return d_model, num_heads, num_kv_heads, head_dim


def check_exposb_args(position, causal, window, softcap, decay, learn_decay):
    if not isinstance(decay, numbers.Real) or isinstance(decay, bool) or not decay >= 0 or decay == float("inf"):
        raise ValueError(f"decay must be a finite float >= 0, got decay={decay!r}")
    if position != "exposb":
        if decay != 0.0 or learn_decay:
            raise ValueError(f"decay / learn_decay belong to position='exposb', not position={position!r}")
        return
    if not causal:
        raise ValueError("position='exposb' (stick-breaking) is strictly causal: pass causal=True")
    if window is not None or softcap is not None:
        raise ValueError("position='exposb' takes no window or softcap")
    if learn_decay and decay <= 0:
        raise ValueError("learn_decay=True needs decay > 0: the learned decay softplus(decay_logit) "
                         "starts at decay and can never be exactly 0")


def inverse_softplus(y: float) -> float:
    """x with softplus(x) = y > 0 (the initial decay_logit)."""
    return float(y + np.log(-np.expm1(-y)))


class MultiHeadSelfAttention(nnx.Module):
    """Multi-head self-attention (GQA/MQA when num_kv_heads < num_heads) on `flash_attention`.

    Args:
      d_model: model width; d_model % num_heads == 0, head dim = d_model // num_heads.
      num_heads: query heads. num_kv_heads: key/value heads (default num_heads), dividing num_heads.
      position: "none" | "absolute" | "rope" | "exposb" (see the module docstring).
      rope: the `Rope` config of position="rope" and "exposb" (ignored otherwise).
      decay, learn_decay: the stick-breaking distance decay of position="exposb".
      causal, window, softcap, implementation: passed to `flash_attention` unchanged.
      use_bias: biases in the four projections.
      dtype: compute dtype of the projections and the attention; param_dtype: parameter dtype.
      rngs: `nnx.Rngs` for the initialisers (nnx.Linear defaults: lecun-normal kernels, zero biases).
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 position: str = "none", rope: Rope = Rope(), causal: bool = False,
                 window: tuple[int, int] | None = None, softcap: float | None = None,
                 decay: float = 0.0, learn_decay: bool = False,
                 implementation: str | None = None, use_bias: bool = True,
                 dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        d_model, num_heads, num_kv_heads, head_dim = check_attention_args(
            d_model, num_heads, num_kv_heads, position, causal, window, softcap, decay, learn_decay)
        if position in ("rope", "exposb") and not isinstance(rope, Rope):
            raise TypeError(f"rope must be a jax_attn.Rope, got {type(rope).__name__}")
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.position, self.rope = position, rope
        self.causal, self.window, self.softcap = bool(causal), window, softcap
        self.implementation = implementation
        self.dtype = dtype

        def linear(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.q_proj = linear(d_model, num_heads * head_dim)
        self.k_proj = linear(d_model, num_kv_heads * head_dim)
        self.v_proj = linear(d_model, num_kv_heads * head_dim)
        self.out_proj = linear(num_heads * head_dim, d_model)
        self.decay, self.learn_decay = float(decay), bool(learn_decay)
        if learn_decay:
            self.decay_logit = nnx.Param(jnp.full((num_heads,), inverse_softplus(decay), param_dtype))

    def __call__(self, x, *, segment_ids=None, positions=None):
        """x [B, S, d_model] -> [B, S, d_model].

        segment_ids: int [B, S], attention stays within equal ids (packed sequences).
        positions: int [B, S] token positions for "absolute" / "rope" (default 0 .. S-1);
          an error with position="none".
        """
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, seq, d_model={self.d_model}], got shape {x.shape}")
        batch, length, _ = x.shape
        if positions is not None and self.position == "none":
            raise ValueError("positions were given but position='none' does not use them")
        if self.position == "absolute":
            if positions is None:
                pe = sinusoidal_positions(length, self.d_model, x.dtype)[None]
            else:
                _check_positions(positions, batch, length)
                pe = sinusoidal_at(positions, self.d_model, x.dtype)
            x = x + pe
        q = self.q_proj(x).reshape(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        kwargs = dict(causal=self.causal, window=self.window, softcap=self.softcap,
                      segment_ids=segment_ids, implementation=self.implementation)
        if self.position == "exposb":
            if segment_ids is not None:
                raise ValueError("position='exposb' takes no segment_ids")
            decay = jax.nn.softplus(self.decay_logit[...]) if self.learn_decay else self.decay
            out = stick_breaking_attention(q, k, v, decay=decay, rope=self.rope, positions=positions,
                                           implementation=self.implementation)
        else:
            if self.position == "rope":
                kwargs.update(rope=self.rope, positions=positions)
            out = flash_attention(q, k, v, **kwargs)
        return self.out_proj(out.reshape(batch, length, self.num_heads * self.head_dim))


def _check_positions(positions, batch, length):
    if not hasattr(positions, "dtype") or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions must be an integer array, got {getattr(positions, 'dtype', type(positions))}")
    if positions.shape != (batch, length):
        raise ValueError(f"positions must have shape {(batch, length)}, got {positions.shape}")


class EncoderBlock(nnx.Module):
    """BERT-style post-LN encoder block:

        h = ln1(x + attn(x));  y = ln2(h + mlp_out(gelu_tanh(mlp_in(h))))

    Args: d_model, num_heads; d_ff: MLP width (default 4 * d_model); the remaining keyword
    arguments are those of `MultiHeadSelfAttention`. LayerNorm eps 1e-5 (as torch's default).
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, *,
                 num_kv_heads: int | None = None, position: str = "none", rope: Rope = Rope(),
                 causal: bool = False, window: tuple[int, int] | None = None,
                 softcap: float | None = None, decay: float = 0.0, learn_decay: bool = False,
                 implementation: str | None = None,
                 use_bias: bool = True, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 rngs: nnx.Rngs):
        d_ff = 4 * d_model if d_ff is None else _positive_int("d_ff", d_ff)
        self.attn = MultiHeadSelfAttention(
            d_model, num_heads, num_kv_heads=num_kv_heads, position=position, rope=rope,
            causal=causal, window=window, softcap=softcap, decay=decay, learn_decay=learn_decay,
            implementation=implementation,
            use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(epsilon=LAYER_NORM_EPS, use_fast_variance=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d_model, **norm)
        self.ln2 = nnx.LayerNorm(d_model, **norm)
        self.mlp_in = nnx.Linear(d_model, d_ff, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp_out = nnx.Linear(d_ff, d_model, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, *, segment_ids=None, positions=None):
        """x [B, S, d_model] -> [B, S, d_model]; segment_ids / positions as in the attention."""
        h = self.ln1(x + self.attn(x, segment_ids=segment_ids, positions=positions))
        return self.ln2(h + self.mlp_out(jax.nn.gelu(self.mlp_in(h), approximate=True)))


# ------------------------------------------------------------------------------------------------
# attention_fn adapter for flax.nnx.MultiHeadAttention
# ------------------------------------------------------------------------------------------------
def _precision(precision):
    """None / DEFAULT -> None (JAX's configured matmul precision), HIGHEST -> HIGHEST; anything
    else (HIGH, a mixed pair) is returned as given, for the caller to refuse."""
    if isinstance(precision, (tuple, list)):
        levels = {_precision(p) for p in precision}
        return levels.pop() if len(levels) == 1 else tuple(precision)
    if precision is None:
        return None
    try:
        level = jax.lax.Precision(precision.lower() if isinstance(precision, str) else precision)
    except (ValueError, TypeError):
        return precision
    return None if level == jax.lax.Precision.DEFAULT else level


def make_attention_fn(*, causal: bool = False, window: tuple[int, int] | None = None,
                      softcap: float | None = None, implementation: str | None = None):
    """An `attention_fn` for `flax.nnx.MultiHeadAttention` that runs `flash_attention`.

    flax calls attention_fn(query, key, value, mask=, dropout_rng=, dropout_rate=,
    broadcast_dropout=, deterministic=, dtype=, precision=, module=, is_causal=) with query
    [batch..., Sq, Hq, D] and key/value [batch..., Sk, Hkv, D]. The adapter honours:
      mask=None (dense attention; masks go in as `causal` / `window` of this factory or
        `is_causal=True` of the flax call), dropout_rate=0 or deterministic=True (no dropout),
        dtype (q, k, v promoted to it; None: their common dtype, as flax does), precision None /
        DEFAULT (JAX's configured matmul precision) or HIGHEST (exact fp32 dots), any number of
        batch dimensions (flattened into one), GQA.
    and raises NotImplementedError naming the argument for what the kernels cannot do: a bias, a
    mask array (arbitrary masks are never inspected: pass causal/window through this factory,
    e.g. `attention_fn=make_attention_fn(causal=True)`), dropout (dropout_rate > 0 with
    deterministic=False), `module` (sow_weights=True needs the attention weights, which a flash
    kernel never materialises), another precision, or an unknown keyword.
    """

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                     dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                     dtype=None, precision=None, module=None, promote_dtype=None,
                     is_causal: bool = False, **unsupported):
        if unsupported:
            raise NotImplementedError(
                f"jax_attn attention_fn: unsupported keyword argument(s) {sorted(unsupported)}")
        if bias is not None:
            raise NotImplementedError("jax_attn attention_fn: bias is not supported (an additive score bias "
                                      "would have to be materialised)")
        if mask is not None:
            raise NotImplementedError(
                "jax_attn attention_fn: mask arrays are not supported; pass causal / window through "
                "jax_attn.make_attention_fn(causal=..., window=...) (or is_causal=True in the flax call) "
                "and leave mask=None")
        if dropout_rate > 0.0 and not deterministic:
            raise NotImplementedError(
                f"jax_attn attention_fn: dropout_rate={dropout_rate} with deterministic=False is not supported "
                "(attention dropout is not implemented in the kernels); use dropout_rate=0 or deterministic=True")
        if module is not None:
            raise NotImplementedError(
                "jax_attn attention_fn: module (sow_weights=True) is not supported: the flash kernels never "
                "materialise the attention weights")
        precision = _precision(precision)
        if precision not in (None, jax.lax.Precision.HIGHEST):
            raise NotImplementedError(
                f"jax_attn attention_fn: precision={precision!r} is not supported; use None/DEFAULT (JAX's "
                "configured matmul precision) or HIGHEST")
        if promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        else:
            target = jnp.result_type(query, key, value) if dtype is None else dtype
            query, key, value = (jnp.asarray(a, target) for a in (query, key, value))
        if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ValueError(f"query/key/value must be [batch..., length, heads, head_dim] with the same rank, "
                             f"got {query.shape}, {key.shape}, {value.shape}")
        batch_shape = query.shape[:-3]
        if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
            raise ValueError(f"batch dims differ: {query.shape}, {key.shape}, {value.shape}")
        flat = lambda a: a.reshape((-1,) + a.shape[-3:])
        run = lambda: flash_attention(flat(query), flat(key), flat(value), causal=bool(causal or is_causal),
                                      window=window, softcap=softcap, implementation=implementation)
        if precision == jax.lax.Precision.HIGHEST:
            with jax.default_matmul_precision("highest"):
                out = run()
        else:
            out = run()
        return out.reshape(batch_shape + out.shape[1:])

    return attention_fn


attention_fn = make_attention_fn()
attention_fn.__doc__ = ("Dense (non-causal) `flash_attention` with the default implementation as a "
                        "flax `attention_fn`; see `make_attention_fn`.")
