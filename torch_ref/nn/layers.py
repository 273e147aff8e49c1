"""PyTorch twins of `jax_attn.layers`: `MultiHeadSelfAttention` and `EncoderBlock`.

Same constructor arguments (torch dtypes and a `device` instead of `rngs`), same submodule names
(`q_proj`, `k_proj`, `v_proj`, `out_proj` as nn.Linear; `attn`, `ln1`, `ln2`, `mlp_in`, `mlp_out`),
same computation, on `torch_ref.flash_attention`. Parameters come from the Flax layers through
`parity.bridge` (torch's own initialisation differs from nnx's and is never compared).

`dtype` is the compute dtype and `param_dtype` the parameter dtype, as in flax: projections cast
their input, weight and bias to `dtype` (the parameters themselves, and so their gradients, stay
in `param_dtype`). LayerNorm normalises in float32 or wider and returns `dtype`.

Position schemes: see `jax_attn.layers` ("none", "absolute", "rope", "exposb": stick-breaking on
`torch_ref.stick_breaking_attention`, with a fixed `decay` or a learnable per-head
softplus(`decay_logit`)). `rope` is a `torch_ref.Rope` (the twin of `jax_attn.Rope`: same fields,
defaults and meaning).
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from ..api import flash_attention, stick_breaking_attention
from ..ops.common.rope import Rope
from .positions import sinusoidal_at, sinusoidal_positions

POSITIONS = ("none", "absolute", "rope", "exposb")
LAYER_NORM_EPS = 1e-5


def _positive_int(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return int(value)


def check_attention_args(d_model, num_heads, num_kv_heads, position, causal=False, window=None, softcap=None,
                         decay=0.0, learn_decay=False) -> tuple[int, int, int, int]:
    """Validate the shape/position arguments; -> (d_model, num_heads, num_kv_heads, head_dim).
    The same checks and messages as `jax_attn.layers.check_attention_args`."""
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
    """The same checks and messages as `jax_attn.layers.check_exposb_args`."""
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
    return float(y + math.log(-math.expm1(-y)))


def _linear(layer: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """nn.Linear in the compute dtype (flax's promote_dtype: input, weight and bias cast to it)."""
    bias = None if layer.bias is None else layer.bias.to(dtype)
    return F.linear(x.to(dtype), layer.weight.to(dtype), bias)


def _layer_norm(layer: nn.LayerNorm, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    bias = None if layer.bias is None else layer.bias.to(stat)
    y = F.layer_norm(x.to(stat), layer.normalized_shape, layer.weight.to(stat), bias, layer.eps)
    return y.to(dtype)


class MultiHeadSelfAttention(nn.Module):
    """Twin of `jax_attn.layers.MultiHeadSelfAttention` (see there for the arguments)."""

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 position: str = "none", rope: Rope = Rope(), causal: bool = False, window=None,
                 softcap=None, decay: float = 0.0, learn_decay: bool = False, implementation: str | None = None,
                 use_bias: bool = True, dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        d_model, num_heads, num_kv_heads, head_dim = check_attention_args(
            d_model, num_heads, num_kv_heads, position, causal, window, softcap, decay, learn_decay)
        if position in ("rope", "exposb") and not isinstance(rope, Rope):
            raise TypeError(f"rope must be a torch_ref.Rope, got {type(rope).__name__}")
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.position, self.rope = position, rope
        self.causal, self.window, self.softcap = bool(causal), window, softcap
        self.implementation = implementation
        self.dtype = dtype
        factory = dict(bias=use_bias, dtype=param_dtype, device=device)
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, **factory)
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, **factory)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, **factory)
        self.decay, self.learn_decay = float(decay), bool(learn_decay)
        if learn_decay:
            self.decay_logit = nn.Parameter(
                torch.full((num_heads,), inverse_softplus(decay), dtype=param_dtype, device=device))

    def forward(self, x: torch.Tensor, *, segment_ids=None, positions=None) -> torch.Tensor:
        """x [B, S, d_model] -> [B, S, d_model]; segment_ids / positions int [B, S]."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, seq, d_model={self.d_model}], got shape {tuple(x.shape)}")
        batch, length, _ = x.shape
        if positions is not None and self.position == "none":
            raise ValueError("positions were given but position='none' does not use them")
        if self.position == "absolute":
            if positions is None:
                pe = sinusoidal_positions(length, self.d_model, x.dtype, device=x.device)[None]
            else:
                _check_positions(positions, batch, length)
                pe = sinusoidal_at(positions, self.d_model, x.dtype)
            x = x + pe
        q = _linear(self.q_proj, x, self.dtype).reshape(batch, length, self.num_heads, self.head_dim)
        k = _linear(self.k_proj, x, self.dtype).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = _linear(self.v_proj, x, self.dtype).reshape(batch, length, self.num_kv_heads, self.head_dim)
        kwargs = dict(causal=self.causal, window=self.window, softcap=self.softcap,
                      segment_ids=segment_ids, implementation=self.implementation)
        if self.position == "exposb":
            if segment_ids is not None:
                raise ValueError("position='exposb' takes no segment_ids")
            decay = F.softplus(self.decay_logit) if self.learn_decay else self.decay
            out = stick_breaking_attention(q, k, v, decay=decay, rope=self.rope, positions=positions,
                                           implementation=self.implementation)
        else:
            if self.position == "rope":
                kwargs.update(rope=self.rope, positions=positions)
            out = flash_attention(q, k, v, **kwargs)
        return _linear(self.out_proj, out.reshape(batch, length, self.num_heads * self.head_dim), self.dtype)


def _check_positions(positions, batch, length):
    if (not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype.is_complex
            or positions.dtype == torch.bool):
        raise TypeError(f"positions must be an integer torch.Tensor, got "
                        f"{getattr(positions, 'dtype', type(positions).__name__)}")
    if tuple(positions.shape) != (batch, length):
        raise ValueError(f"positions must have shape {(batch, length)}, got {tuple(positions.shape)}")


class EncoderBlock(nn.Module):
    """Twin of `jax_attn.layers.EncoderBlock`: h = ln1(x + attn(x)); y = ln2(h + mlp_out(gelu_tanh(mlp_in(h))))."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, *,
                 num_kv_heads: int | None = None, position: str = "none", rope: Rope = Rope(), causal: bool = False,
                 window=None, softcap=None, decay: float = 0.0, learn_decay: bool = False,
                 implementation: str | None = None, use_bias: bool = True,
                 dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        d_ff = 4 * d_model if d_ff is None else _positive_int("d_ff", d_ff)
        self.attn = MultiHeadSelfAttention(
            d_model, num_heads, num_kv_heads=num_kv_heads, position=position, rope=rope, causal=causal,
            window=window, softcap=softcap, decay=decay, learn_decay=learn_decay, implementation=implementation, use_bias=use_bias, dtype=dtype,
            param_dtype=param_dtype, device=device)
        self.dtype = dtype
        self.ln1 = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS, dtype=param_dtype, device=device)
        self.ln2 = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS, dtype=param_dtype, device=device)
        self.mlp_in = nn.Linear(d_model, d_ff, bias=use_bias, dtype=param_dtype, device=device)
        self.mlp_out = nn.Linear(d_ff, d_model, bias=use_bias, dtype=param_dtype, device=device)

    def forward(self, x: torch.Tensor, *, segment_ids=None, positions=None) -> torch.Tensor:
        dt = self.dtype
        h = _layer_norm(self.ln1, x + self.attn(x, segment_ids=segment_ids, positions=positions), dt)
        m = _linear(self.mlp_out, F.gelu(_linear(self.mlp_in, h, dt), approximate="tanh"), dt)
        return _layer_norm(self.ln2, h + m, dt)
