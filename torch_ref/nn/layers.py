"""PyTorch twins of `jax_attn.nn.layers`: `MultiHeadSelfAttention` and `EncoderBlock`.

Same constructor arguments (torch dtypes and a `device` instead of `rngs`), same submodule names
(`q_proj`, `k_proj`, `v_proj`, `out_proj` as nn.Linear; `attn`, `ln1`, `ln2`, `mlp_in`, `mlp_out`),
same computation, on `torch_ref.flash_attention` (attention="softmax") or
`torch_ref.stick_breaking_attention` (attention="stick_breaking"). The attention kinds, the
position schemes ("none", "absolute", "rope") and the argument checks are those of
`attn_spec.layers`; `rope` is the shared `Rope` config (`torch_ref.Rope` is `jax_attn.Rope`).
Parameters come from the Flax layers through `parity.bridge` (torch's own initialisation differs
from nnx's and is never compared).

`dtype` is the compute dtype and `param_dtype` the parameter dtype, as in flax: projections cast
their input, weight and bias to `dtype` (the parameters themselves, and so their gradients, stay
in `param_dtype`). LayerNorm normalises in float32 or wider and returns `dtype`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attn_spec.layers import (LAYER_NORM_EPS, check_layer_args, check_positions_shape, feed_forward_width,
                              inverse_softplus)

from ..api import flash_attention, stick_breaking_attention
from ..ops.common.rope import Rope
from .positions import sinusoidal_at, sinusoidal_positions

ATTENTION_FUNCTIONS = {"softmax": flash_attention, "stick_breaking": stick_breaking_attention}


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
    """Twin of `jax_attn.nn.layers.MultiHeadSelfAttention` (see there for the arguments)."""

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None, attention: str = "softmax",
                 position: str = "none", rope: Rope = Rope(), causal: bool = False, window=None, softcap=None,
                 decay: float = 0.0, learn_decay: bool = False, implementation: str | None = None,
                 use_bias: bool = True, dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self.spec = check_layer_args(d_model, num_heads, num_kv_heads, attention=attention, position=position,
                                     rope=rope, causal=causal, window=window, softcap=softcap, decay=decay,
                                     learn_decay=learn_decay)
        self.implementation, self.dtype = implementation, dtype
        for name, (n_in, n_out) in self.spec.projections().items():
            self.add_module(name, nn.Linear(n_in, n_out, bias=use_bias, dtype=param_dtype, device=device))
        if learn_decay:
            initial = torch.full((num_heads,), inverse_softplus(decay), dtype=param_dtype, device=device)
            self.decay_logit = nn.Parameter(initial)

    def forward(self, x: torch.Tensor, *, segment_ids=None, positions=None) -> torch.Tensor:
        """x [B, S, d_model] -> [B, S, d_model]; segment_ids / positions int [B, S]."""
        spec = self.spec
        batch, length = spec.check_call(tuple(x.shape), segment_ids=segment_ids, positions=positions)
        if spec.position == "absolute" and positions is None:
            x = x + sinusoidal_positions(length, spec.d_model, x.dtype, device=x.device)[None]
        elif spec.position == "absolute":
            _check_positions(positions, batch, length)
            x = x + sinusoidal_at(positions, spec.d_model, x.dtype)
        heads = spec.qkv_heads()
        q, k, v = (_linear(getattr(self, name), x, self.dtype).reshape(batch, length, h, spec.head_dim)
                   for name, h in zip(("q_proj", "k_proj", "v_proj"), heads))
        decay = F.softplus(self.decay_logit) if spec.learn_decay else None
        kwargs = spec.attention_kwargs(segment_ids=segment_ids, positions=positions, decay=decay)
        out = ATTENTION_FUNCTIONS[spec.attention](q, k, v, implementation=self.implementation, **kwargs)
        return _linear(self.out_proj, out.reshape(batch, length, spec.num_heads * spec.head_dim), self.dtype)


def _check_positions(positions, batch, length):
    if (not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype.is_complex
            or positions.dtype == torch.bool):
        raise TypeError(f"positions must be an integer torch.Tensor, got "
                        f"{getattr(positions, 'dtype', type(positions).__name__)}")
    check_positions_shape(positions.shape, batch, length)


class EncoderBlock(nn.Module):
    """Twin of `jax_attn.nn.layers.EncoderBlock`: h = ln1(x + attn(x)); y = ln2(h + mlp_out(gelu_tanh(mlp_in(h))))."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, *, num_kv_heads: int | None = None,
                 attention: str = "softmax", position: str = "none", rope: Rope = Rope(), causal: bool = False,
                 window=None, softcap=None, decay: float = 0.0, learn_decay: bool = False,
                 implementation: str | None = None, use_bias: bool = True, dtype: torch.dtype = torch.float32,
                 param_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        d_ff = feed_forward_width(d_model, d_ff)
        self.attn = MultiHeadSelfAttention(
            d_model, num_heads, num_kv_heads=num_kv_heads, attention=attention, position=position, rope=rope,
            causal=causal, window=window, softcap=softcap, decay=decay, learn_decay=learn_decay,
            implementation=implementation, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, device=device)
        self.dtype = dtype
        factory = dict(dtype=param_dtype, device=device)
        self.ln1 = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS, **factory)
        self.ln2 = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS, **factory)
        self.mlp_in = nn.Linear(d_model, d_ff, bias=use_bias, **factory)
        self.mlp_out = nn.Linear(d_ff, d_model, bias=use_bias, **factory)

    def forward(self, x: torch.Tensor, *, segment_ids=None, positions=None) -> torch.Tensor:
        dt = self.dtype
        h = _layer_norm(self.ln1, x + self.attn(x, segment_ids=segment_ids, positions=positions), dt)
        m = _linear(self.mlp_out, F.gelu(_linear(self.mlp_in, h, dt), approximate="tanh"), dt)
        return _layer_norm(self.ln2, h + m, dt)
