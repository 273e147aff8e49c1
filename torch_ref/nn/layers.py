"""PyTorch twins of `jax_attn.nn.layers`: `MultiHeadSelfAttention`, `EncoderBlock`, `DilatedAttention`
and `MultiheadDilatedAttention`.

Same constructor arguments (torch dtypes and a `device` instead of `rngs`), same submodule names
(`q_proj`, `k_proj`, `v_proj`, `out_proj` as nn.Linear; `attn`, `ln1`, `ln2`, `mlp_in`, `mlp_out`),
same computation, on `torch_ref.flash_attention` (attention="softmax"),
`torch_ref.stick_breaking_attention` (attention="stick_breaking") or `torch_ref.dilated_attention`
(attention="dilated" and the dilated layers). The attention kinds, the
position schemes ("none", "absolute", "rope") and the argument checks are those of
`attn_spec.layers`; `rope` is the shared `Rope` config (`torch_ref.Rope` is `jax_attn.Rope`).
Parameters come from the Flax layers through `parity.bridge` (torch's own initialisation differs
from nnx's and is never compared).

Attention dropout (`dropout_rate`, attention="softmax" only) applies in training mode only
(`module.train()` / `module.eval()`); `forward(..., dropout_seed=s)` gives the mask of the Flax
layer's `dropout_key=jax.random.wrap_key_data(jnp.asarray(attn_spec.dropout.seed_words(s),
jnp.uint32))`, and dropout_seed=None draws a seed per call from torch's default generator (as
`torch_ref.flash_attention` does; `torch.manual_seed` makes it reproducible).

`dtype` is the compute dtype and `param_dtype` the parameter dtype, as in flax: projections cast
their input, weight and bias to `dtype` (the parameters themselves, and so their gradients, stay
in `param_dtype`). LayerNorm normalises in float32 or wider and returns `dtype`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attn_spec.layers import (LAYER_NORM_EPS, check_dilated_args, check_layer_args, check_multihead_args,
                              check_positions_shape, feed_forward_width, inverse_softplus)

from ..api import dilated_attention, flash_attention, stick_breaking_attention
from ..ops.common.rope import Rope, apply_rope
from .positions import sinusoidal_at, sinusoidal_positions

ATTENTION_FUNCTIONS = {"softmax": flash_attention, "stick_breaking": stick_breaking_attention,
                       "dilated": dilated_attention}


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
    """Twin of `jax_attn.nn.layers.MultiHeadSelfAttention` (see there for the arguments; torch
    dtypes and a `device` instead of `rngs`; dropout_rate applies in training mode, no
    `deterministic`)."""

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None, attention: str = "softmax",
                 position: str = "none", rope: Rope = Rope(), causal: bool = False, window=None, softcap=None,
                 decay: float = 0.0, learn_decay: bool = False, segment_lengths=None, dilation_rates=None,
                 merge: str = "lse", dropout_rate: float = 0.0, ordering: str | None = None, grid=None,
                 implementation: str | None = None,
                 use_bias: bool = True, dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self.spec = check_layer_args(d_model, num_heads, num_kv_heads, attention=attention, position=position,
                                     rope=rope, causal=causal, window=window, softcap=softcap, decay=decay,
                                     learn_decay=learn_decay, segment_lengths=segment_lengths,
                                     dilation_rates=dilation_rates, merge=merge, dropout_rate=dropout_rate,
                                     ordering=ordering, grid=grid)
        self.implementation, self.dtype, self.dropout_rate = implementation, dtype, self.spec.dropout_rate
        _add_projections(self, bias=use_bias, dtype=param_dtype, device=device)
        if learn_decay:
            initial = torch.full((num_heads,), inverse_softplus(decay), dtype=param_dtype, device=device)
            self.decay_logit = nn.Parameter(initial)

    def forward(self, x: torch.Tensor, *, segment_ids=None, positions=None, dropout_seed=None) -> torch.Tensor:
        """x [B, S, d_model] -> [B, S, d_model]; segment_ids / positions int [B, S]. dropout_seed:
        the dropout mask's seed (an int in [0, 2**64); None: drawn from torch's default generator
        by each call that drops), used in training mode with dropout_rate > 0 only."""
        decay = F.softplus(self.decay_logit) if self.spec.learn_decay else None
        dropout = {}
        if self.dropout_rate > 0:  # eval: rate 0 (no seed drawn)
            dropout = dict(dropout_rate=self.dropout_rate if self.training else 0.0, dropout_seed=dropout_seed)
        return _project_attend(self, (x, x, x), ("x",), segment_ids=segment_ids, positions=positions, decay=decay,
                               dropout=dropout)


def _add_projections(module: nn.Module, **linear_kwargs) -> None:
    """The q/k/v/out nn.Linear projections of `module.spec`."""
    for name, (n_in, n_out) in module.spec.projections().items():
        module.add_module(name, nn.Linear(n_in, n_out, **linear_kwargs))


def _distinct(fn, xs):
    """fn applied to each of xs, once per distinct object (self-attention passes x three times)."""
    done = {}
    for x in xs:
        if id(x) not in done:
            done[id(x)] = fn(x)
    return tuple(done[id(x)] for x in xs)


def _project_attend(module, inputs, names, *, segment_ids=None, positions=None, decay=None, config=None,
                    dropout=None):
    """Twin of `jax_attn.nn.layers._project_attend`: inputs (queries, keys, values) [B, S, d_model]
    -> [B, S, out_features]; dropout: the attention call's dropout keywords."""
    spec = module.spec
    batch, length = spec.check_call(tuple(inputs[0].shape), segment_ids=segment_ids, positions=positions,
                                    name=names[0])
    for name, x in zip(names[1:], inputs[1:]):
        spec.check_kv_input(name, x.shape, batch, length)
    if positions is not None and (spec.position == "absolute" or spec.rope_outside_kernel):
        _check_positions(positions, batch, length)
    x0 = inputs[0]
    if spec.position == "absolute":
        table = (sinusoidal_positions(length, spec.d_model, x0.dtype, device=x0.device)[None] if positions is None
                 else sinusoidal_at(positions, spec.d_model, x0.dtype))
        inputs = _distinct(lambda x: x + table, inputs)
    q, k, v = (_linear(getattr(module, name), x, module.dtype).reshape(batch, length, h, spec.head_dim)
               for name, x, h in zip(("q_proj", "k_proj", "v_proj"), inputs, spec.qkv_heads()))
    if spec.rope_outside_kernel:
        if positions is None:
            positions = torch.arange(length, device=x0.device).expand(batch, length)
        q, k = apply_rope(q, positions, spec.rope), apply_rope(k, positions, spec.rope)
    kwargs = spec.attention_kwargs(segment_ids=segment_ids, positions=positions, decay=decay)
    if config is not None:
        kwargs["config"] = config
    kwargs.update(dropout or {})
    out = ATTENTION_FUNCTIONS[spec.attention](q, k, v, implementation=module.implementation, **kwargs)
    return _linear(module.out_proj, out.reshape(batch, length, spec.num_heads * spec.head_dim), module.dtype)


class DilatedAttention(nn.Module):
    """Twin of `jax_attn.nn.layers.DilatedAttention`: no weights, `torch_ref.dilated_attention(q, k, v)`
    with the configuration given here (implementation "triton" | "eager" | None; dropout_rate must
    stay 0.0: dilated attention has no dropout)."""

    def __init__(self, segment_lengths, dilation_rates, *, causal: bool = False, merge: str = "lse",
                 scale: float | None = None, ordering: str | None = None, grid=None,
                 implementation: str | None = None, config=None, dropout_rate: float = 0.0):
        super().__init__()
        self.spec = check_dilated_args(segment_lengths, dilation_rates, causal=causal, merge=merge, scale=scale,
                                       dropout_rate=dropout_rate, ordering=ordering, grid=grid)
        self.implementation, self.config = implementation, config

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = False):
        """q [B, S, H, D], k, v [B, S, Hkv, D] -> out [B, S, H, D] (and lse [B, H, S] with return_lse)."""
        return dilated_attention(q, k, v, return_lse=return_lse, implementation=self.implementation,
                                 config=self.config, **self.spec.attention_kwargs())


class MultiheadDilatedAttention(nn.Module):
    """Twin of `jax_attn.nn.layers.MultiheadDilatedAttention` (see there for the arguments; torch
    dtypes and a `device` instead of `rngs`)."""

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None, *, segment_lengths,
                 dilation_rates, causal: bool = False, merge: str = "lse", position: str = "none",
                 rope: Rope = Rope(), ordering: str | None = None, grid=None, implementation: str | None = None,
                 config=None, use_bias: bool = True, dtype: torch.dtype = torch.float32,
                 param_dtype: torch.dtype = torch.float32, dropout_rate: float = 0.0, device=None):
        super().__init__()
        self.spec = check_multihead_args(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                                         attention="dilated", position=position, rope=rope, causal=causal,
                                         segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                                         merge=merge, dropout_rate=dropout_rate, ordering=ordering, grid=grid)
        self.implementation, self.config, self.dtype = implementation, config, dtype
        _add_projections(self, bias=use_bias, dtype=param_dtype, device=device)

    def forward(self, inputs_q: torch.Tensor, inputs_k: torch.Tensor | None = None,
                inputs_v: torch.Tensor | None = None, *, positions=None) -> torch.Tensor:
        """inputs_q [B, S, in_features] -> [B, S, out_features]; inputs_k (default inputs_q),
        inputs_v (default inputs_k) [B, S, in_features]; positions int [B, S]."""
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        return _project_attend(self, (inputs_q, inputs_k, inputs_v), ("inputs_q", "inputs_k", "inputs_v"),
                               positions=positions, config=self.config)


class HilbertDilatedAttention(MultiheadDilatedAttention):
    """Twin of `jax_attn.nn.layers.HilbertDilatedAttention`: `MultiheadDilatedAttention` with
    ordering="hilbert" over the token grid `grid` (see there; torch dtypes and a `device`)."""

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None, *, segment_lengths,
                 dilation_rates, grid=None, causal: bool = False, merge: str = "lse", position: str = "none",
                 rope: Rope = Rope(), implementation: str | None = None, config=None, use_bias: bool = True,
                 dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.float32,
                 dropout_rate: float = 0.0, device=None):
        super().__init__(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                         segment_lengths=segment_lengths, dilation_rates=dilation_rates, causal=causal, merge=merge,
                         position=position, rope=rope, ordering="hilbert", grid=grid, implementation=implementation,
                         config=config, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                         dropout_rate=dropout_rate, device=device)


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
                 window=None, softcap=None, decay: float = 0.0, learn_decay: bool = False, segment_lengths=None,
                 dilation_rates=None, merge: str = "lse", dropout_rate: float = 0.0, ordering: str | None = None,
                 grid=None, implementation: str | None = None, use_bias: bool = True, dtype: torch.dtype = torch.float32,
                 param_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        d_ff = feed_forward_width(d_model, d_ff)
        self.attn = MultiHeadSelfAttention(
            d_model, num_heads, num_kv_heads=num_kv_heads, attention=attention, position=position, rope=rope,
            causal=causal, window=window, softcap=softcap, decay=decay, learn_decay=learn_decay,
            segment_lengths=segment_lengths, dilation_rates=dilation_rates, merge=merge, dropout_rate=dropout_rate,
            ordering=ordering, grid=grid, implementation=implementation, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, device=device)
        self.dtype, self.dropout_rate = dtype, self.attn.dropout_rate
        factory = dict(dtype=param_dtype, device=device)
        self.ln1 = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS, **factory)
        self.ln2 = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS, **factory)
        self.mlp_in = nn.Linear(d_model, d_ff, bias=use_bias, **factory)
        self.mlp_out = nn.Linear(d_ff, d_model, bias=use_bias, **factory)

    def forward(self, x: torch.Tensor, *, segment_ids=None, positions=None, dropout_seed=None) -> torch.Tensor:
        """x [B, S, d_model] -> [B, S, d_model]; segment_ids / positions / dropout_seed as in the attention."""
        dt = self.dtype
        attended = self.attn(x, segment_ids=segment_ids, positions=positions, dropout_seed=dropout_seed)
        h = _layer_norm(self.ln1, x + attended, dt)
        m = _linear(self.mlp_out, F.gelu(_linear(self.mlp_in, h, dt), approximate="tanh"), dt)
        return _layer_norm(self.ln2, h + m, dt)
