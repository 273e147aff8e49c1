"""PyTorch twins of `jax_attn.nn.layers`: `MultiHeadSelfAttention`, `EncoderBlock`, `DilatedAttention`,
`MultiheadDilatedAttention`, `NativeSparseAttention` and its `CompressMLP`.

Same constructor arguments (torch dtypes and a `device` instead of `rngs`), same submodule names
(`q_proj`, `k_proj`, `v_proj`, `out_proj` as nn.Linear; `attn`, `ln1`, `ln2`, `mlp_in`, `mlp_out`),
same computation, on `torch_ref.flash_attention` (attention="softmax"),
`torch_ref.stick_breaking_attention` (attention="stick_breaking"), `torch_ref.dilated_attention`
(attention="dilated" and the dilated layers) or `torch_ref.nsa_attention` (`NativeSparseAttention`,
EncoderBlock(attention="nsa")). The attention kinds, the
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
from attn_spec.nsa import CompressParams

from ..api import dilated_attention, flash_attention, nsa_attention, stick_breaking_attention
from ..ops.common.rope import Rope, apply_rope
from .positions import sinusoidal_at, sinusoidal_positions

ATTENTION_FUNCTIONS = {"softmax": flash_attention, "stick_breaking": stick_breaking_attention,
                       "dilated": dilated_attention, "nsa": nsa_attention}
NSA_LAYER = ("attention='nsa' has parameters of its own (gates, compression maps): use NativeSparseAttention "
             "(EncoderBlock(attention='nsa') holds one)")


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
        if attention == "nsa":
            raise ValueError(NSA_LAYER)
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
    kwargs = spec.attention_kwargs(segment_ids=segment_ids, positions=positions, decay=decay, seq_len=length)
    if spec.attention == "nsa":  # gates from the attention input (positions added), as q, k, v
        kwargs.update(gates=module.gates(inputs[0]), compress_params=module.compress_params())
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


class CompressMLP(nn.Module):
    """Twin of `jax_attn.nn.layers.CompressMLP`: `pos [block, D]`, `w1 [block * D, hidden]`, `b1 [hidden]`,
    `w2 [hidden, D]`, `b2 [D]` (the layouts of `attn_spec.nsa.CompressParams`, the same as in Flax)."""

    def __init__(self, block: int, head_dim: int, hidden: int, *, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.pos = nn.Parameter(0.02 * torch.randn(block, head_dim, **factory))
        self.w1 = nn.Parameter(torch.randn(block * head_dim, hidden, **factory) * (block * head_dim) ** -0.5)
        self.b1 = nn.Parameter(torch.zeros(hidden, **factory))
        self.w2 = nn.Parameter(torch.randn(hidden, head_dim, **factory) * hidden ** -0.5)
        self.b2 = nn.Parameter(torch.zeros(head_dim, **factory))

    def params(self, dtype: torch.dtype) -> CompressParams:
        """The parameters as a `CompressParams` in the compute dtype (gradients reach the parameters)."""
        return CompressParams(*(getattr(self, f).to(dtype) for f in CompressParams._fields))


class NativeSparseAttention(nn.Module):
    """Twin of `jax_attn.nn.layers.NativeSparseAttention` (see there for the arguments; torch dtypes
    and a `device` instead of `rngs`): q/k/v/out projections, the gates (`gate_proj`, or `gate_in` ->
    GELU (tanh) -> `gate_out`; sigmoid), `compress_k` / `compress_v` (`CompressMLP`, compress="mlp"),
    and `torch_ref.nsa_attention`."""

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None, compress_block: int = 32,
                 compress_stride: int = 16, select_block: int = 64, num_selected: int = 16, window: int = 512,
                 compress: str = "mlp", compress_hidden: int | None = None, gate_hidden: int | None = None,
                 position: str = "none", rope: Rope = Rope(), implementation: str | None = None,
                 use_bias: bool = True, dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self.spec = check_layer_args(d_model, num_heads, num_kv_heads, attention="nsa", position=position, rope=rope,
                                     causal=True, window=window, compress_block=compress_block,
                                     compress_stride=compress_stride, select_block=select_block,
                                     num_selected=num_selected, compress=compress, compress_hidden=compress_hidden,
                                     gate_hidden=gate_hidden)
        self.implementation, self.dtype, self.dropout_rate = implementation, dtype, 0.0
        _add_projections(self, bias=use_bias, dtype=param_dtype, device=device)
        for name, (n_in, n_out) in self.spec.nsa.gate_layers(d_model, num_heads).items():
            self.add_module(name, nn.Linear(n_in, n_out, bias=use_bias, dtype=param_dtype, device=device))
        cfg = self.spec.nsa
        if cfg.compress == "mlp":
            make = lambda: CompressMLP(cfg.compress_block, self.spec.head_dim, cfg.compress_hidden, dtype=param_dtype,
                                       device=device)
            self.compress_k, self.compress_v = make(), make()

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, d_model] -> sigmoid gates [B, S, num_heads, 3] (compression, selection, window)."""
        if self.spec.nsa.gate_hidden is None:
            logits = _linear(self.gate_proj, x, self.dtype)
        else:
            logits = _linear(self.gate_out, F.gelu(_linear(self.gate_in, x, self.dtype), approximate="tanh"),
                             self.dtype)
        return torch.sigmoid(logits).reshape(*x.shape[:2], self.spec.num_heads, 3)

    def compress_params(self):
        """(CompressParams for k, for v) in the compute dtype, or None (mean pooling)."""
        if self.spec.nsa.compress != "mlp":
            return None
        return self.compress_k.params(self.dtype), self.compress_v.params(self.dtype)

    def forward(self, x: torch.Tensor, *, segment_ids=None, positions=None) -> torch.Tensor:
        """x [B, S, d_model] -> [B, S, d_model]; segment_ids / positions int [B, S]."""
        return _project_attend(self, (x, x, x), ("x",), segment_ids=segment_ids, positions=positions)


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
                 dilation_rates=None, merge: str = "lse", dropout_rate: float = 0.0, compress_block=None,
                 compress_stride=None, select_block=None, num_selected=None, compress=None, compress_hidden=None,
                 gate_hidden=None, ordering: str | None = None, grid=None,
                 implementation: str | None = None, use_bias: bool = True,
                 dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        d_ff = feed_forward_width(d_model, d_ff)
        nsa_args = dict(compress_block=compress_block, compress_stride=compress_stride, select_block=select_block,
                        num_selected=num_selected, compress=compress, compress_hidden=compress_hidden,
                        gate_hidden=gate_hidden)
        # every argument checked here (those the attention kind does not take must stay neutral: the
        # NSA ones never reach MultiHeadSelfAttention)
        spec = check_layer_args(d_model, num_heads, num_kv_heads, attention=attention, position=position, rope=rope,
                                causal=causal, window=window, softcap=softcap, decay=decay, learn_decay=learn_decay,
                                segment_lengths=segment_lengths, dilation_rates=dilation_rates, merge=merge,
                                dropout_rate=dropout_rate, ordering=ordering, grid=grid, **nsa_args)
        if attention == "nsa":
            nsa_args = {name: getattr(spec.nsa, name) for name in nsa_args}
            self.attn = NativeSparseAttention(
                d_model, num_heads, num_kv_heads=num_kv_heads, window=spec.nsa.window, position=position, rope=rope,
                implementation=implementation, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, device=device,
                **nsa_args)
        else:
            self.attn = MultiHeadSelfAttention(
                d_model, num_heads, num_kv_heads=num_kv_heads, attention=attention, position=position, rope=rope,
                causal=causal, window=window, softcap=softcap, decay=decay, learn_decay=learn_decay,
                segment_lengths=segment_lengths, dilation_rates=dilation_rates, merge=merge,
                dropout_rate=dropout_rate, ordering=ordering, grid=grid, implementation=implementation,
                use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, device=device)
        self.dtype, self.dropout_rate = dtype, self.attn.dropout_rate
        factory = dict(dtype=param_dtype, device=device)
        self.ln1 = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS, **factory)
        self.ln2 = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS, **factory)
        self.mlp_in = nn.Linear(d_model, d_ff, bias=use_bias, **factory)
        self.mlp_out = nn.Linear(d_ff, d_model, bias=use_bias, **factory)

    def forward(self, x: torch.Tensor, *, segment_ids=None, positions=None, dropout_seed=None) -> torch.Tensor:
        """x [B, S, d_model] -> [B, S, d_model]; segment_ids / positions / dropout_seed as in the attention."""
        dt = self.dtype
        if isinstance(self.attn, NativeSparseAttention):
            attended = self.attn(x, segment_ids=segment_ids, positions=positions)
        else:
            attended = self.attn(x, segment_ids=segment_ids, positions=positions, dropout_seed=dropout_seed)
        h = _layer_norm(self.ln1, x + attended, dt)
        m = _linear(self.mlp_out, F.gelu(_linear(self.mlp_in, h, dt), approximate="tanh"), dt)
        return _layer_norm(self.ln2, h + m, dt)
