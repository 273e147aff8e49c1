"""The layers' arguments, checked once for `jax_attn.nn.layers` and `torch_ref.nn.layers`.

A layer's attention kind and its position scheme are two separate arguments:

  attention="softmax":        `flash_attention` (causal, window, softcap, segment ids).
  attention="stick_breaking": `stick_breaking_attention` (Tan et al., arXiv 2410.17980), strictly
                              causal (needs causal=True; no window, softcap or segment ids), with
                              the distance decay `decay` (fixed) or, with learn_decay=True, a
                              learnable per-head decay softplus(decay_logit) started at decay (> 0).
  position="none":     no position information (permutation-equivariant unless causal / windowed).
  position="absolute": the sinusoidal table of `attn_spec.positions` is added to the attention
                       input before the q/k/v projections (at `positions` when given, else at
                       0 .. S-1); the residual of an encoder block carries x without it.
  position="rope":     q and k rotated by the `rope` config inside the attention kernel, at
                       `positions` (default 0 .. S-1); both attention kinds take it.

An argument that the chosen attention kind or position scheme does not use must keep its neutral
value (`UNUSED_BY`); anything else raises a ValueError that names it. `check_layer_args` returns a
frozen `LayerSpec` that both frameworks' layers keep and read. Imports neither jax nor torch.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from attn_spec.rope import Rope

ATTENTIONS = ("softmax", "stick_breaking")
POSITIONS = ("none", "absolute", "rope")
LAYER_NORM_EPS = 1e-5
# attention kind -> {argument it does not take: the neutral value that argument must keep}
UNUSED_BY = {
    "softmax": {"decay": 0.0, "learn_decay": False},
    "stick_breaking": {"window": None, "softcap": None},
}
CALL_ARGS_UNUSED_BY = {"stick_breaking": ("segment_ids",)}  # call arguments an attention kind refuses


def positive_int(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return int(value)


def feed_forward_width(d_model: int, d_ff) -> int:
    """The encoder block's MLP width: d_ff, by default 4 * d_model."""
    return 4 * d_model if d_ff is None else positive_int("d_ff", d_ff)


def inverse_softplus(y: float) -> float:
    """x with softplus(x) = y > 0 (the initial decay_logit)."""
    return float(y + math.log(-math.expm1(-y)))


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """The checked arguments of a self-attention layer (see `check_layer_args`)."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str
    position: str
    rope: Rope | None  # None unless position="rope"
    causal: bool
    window: tuple[int, int] | None
    softcap: float | None
    decay: float
    learn_decay: bool

    def projections(self) -> dict[str, tuple[int, int]]:
        """{projection name: (in features, out features)}, in creation order."""
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (self.d_model, q_width), "k_proj": (self.d_model, kv_width),
                "v_proj": (self.d_model, kv_width), "out_proj": (q_width, self.d_model)}

    def qkv_heads(self) -> tuple[int, int, int]:
        """The number of heads of q, k and v."""
        return self.num_heads, self.num_kv_heads, self.num_kv_heads

    def check_call(self, x_shape, *, segment_ids=None, positions=None) -> tuple[int, int]:
        """Check a call's x [B, S, d_model] and which optional inputs it gives; -> (B, S)."""
        if len(x_shape) != 3 or x_shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, seq, d_model={self.d_model}], got shape {tuple(x_shape)}")
        if positions is not None and self.position == "none":
            raise ValueError("positions were given but position='none' does not use them")
        given = dict(segment_ids=segment_ids)
        refused = [name for name in CALL_ARGS_UNUSED_BY.get(self.attention, ()) if given[name] is not None]
        if refused:
            raise ValueError(f"attention={self.attention!r} takes no {', '.join(refused)}")
        return x_shape[0], x_shape[1]

    def attention_kwargs(self, *, segment_ids=None, positions=None, decay=None) -> dict:
        """The keyword arguments of the attention function (`flash_attention` for "softmax",
        `stick_breaking_attention` for "stick_breaking"), `implementation` aside. decay: the
        decay to use (the learned one where learn_decay)."""
        kwargs = dict(rope=self.rope, positions=positions) if self.position == "rope" else {}
        if self.attention == "stick_breaking":
            return dict(kwargs, decay=self.decay if decay is None else decay)
        return dict(kwargs, causal=self.causal, window=self.window, softcap=self.softcap, segment_ids=segment_ids)


def check_positions_shape(shape, batch: int, length: int) -> None:
    if tuple(shape) != (batch, length):
        raise ValueError(f"positions must have shape {(batch, length)}, got {tuple(shape)}")


def check_layer_args(d_model, num_heads, num_kv_heads=None, *, attention="softmax", position="none",
                     rope=Rope(), causal=False, window=None, softcap=None, decay=0.0,
                     learn_decay=False) -> LayerSpec:
    """Validate a self-attention layer's arguments (with the layers' defaults); -> the `LayerSpec`.
    Where position != "rope", rope must be the default `Rope()` or None."""
    d_model = positive_int("d_model", d_model)
    num_heads = positive_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention={attention!r}; choose one of {ATTENTIONS}")
    if position not in POSITIONS:
        raise ValueError(f"unknown position={position!r}; choose one of {POSITIONS}")
    if d_model % num_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    head_dim = d_model // num_heads
    if position == "absolute" and d_model % 2:
        raise ValueError(f"position='absolute' needs an even d_model, got d_model={d_model}")
    if position == "rope":
        if not isinstance(rope, Rope):
            raise TypeError(f"rope must be a Rope (attn_spec.rope.Rope, exported as jax_attn.Rope and "
                            f"torch_ref.Rope), got {type(rope).__name__}")
        if head_dim % 2:
            raise ValueError(f"position='rope' needs an even head dim, got d_model / num_heads = {head_dim}")
    elif rope is not None and rope != Rope():
        raise ValueError(f"rope={rope!r} applies to position='rope' only, not position={position!r}")
    if not isinstance(decay, numbers.Real) or isinstance(decay, bool) or not 0 <= decay < math.inf:
        raise ValueError(f"decay must be a finite float >= 0, got decay={decay!r}")
    given = dict(window=window, softcap=softcap, decay=decay, learn_decay=learn_decay)
    unused = [f"{name}={given[name]!r}" for name, neutral in UNUSED_BY[attention].items() if given[name] != neutral]
    if unused:
        raise ValueError(f"attention={attention!r} does not take {', '.join(unused)}")
    if attention == "stick_breaking":
        if not causal:
            raise ValueError("attention='stick_breaking' is strictly causal: pass causal=True")
        if learn_decay and decay <= 0:
            raise ValueError("learn_decay=True needs decay > 0: the learned decay softplus(decay_logit) "
                             "starts at decay and can never be exactly 0")
    return LayerSpec(d_model, num_heads, num_kv_heads, head_dim, attention, position,
                     rope if position == "rope" else None, bool(causal), window, softcap, float(decay),
                     bool(learn_decay))
