"""The layers' arguments, checked once for `jax_attn.nn.layers` and `torch_ref.nn.layers`.

A layer's attention kind and its position scheme are two separate arguments:

  attention="softmax":        `flash_attention` (causal, window, softcap, segment ids).
  attention="stick_breaking": `stick_breaking_attention` (Tan et al., arXiv 2410.17980), strictly
                              causal (needs causal=True; no window, softcap or segment ids), with
                              the distance decay `decay` (fixed) or, with learn_decay=True, a
                              learnable per-head decay softplus(decay_logit) started at decay (> 0).
  attention="dilated":        `dilated_attention` (LongNet, arXiv 2307.02486) with segment_lengths,
                              dilation_rates (both required), merge ("lse" | "head_groups") and
                              causal; no window, softcap, decay or segment ids.
  attention="nsa":           `nsa_attention` (Native Sparse Attention, Yuan et al., arXiv 2502.11089),
                              causal (needs causal=True), segment ids allowed; its configuration
                              compress_block, compress_stride, select_block, num_selected (None:
                              the `attn_spec.nsa.NSAConfig` defaults 32, 16, 64, 16), window (here
                              an int, the sliding branch's length; None: 512; 0: no window
                              branch), compress ("mlp": the paper's learnable map, one
                              `CompressParams` MLP of width compress_hidden (None: the head dim)
                              for k and one for v; "mean": mean pooling) and gate_hidden (None: the
                              gates are sigmoid(Linear(x)), one per head and branch; an int: a
                              Linear -> GELU (tanh) -> Linear MLP of that width, then the sigmoid).
                              The layer is `NativeSparseAttention` (gates and compression maps are
                              parameters of their own); EncoderBlock(attention="nsa") holds one.
  dropout_rate:               attention dropout (probabilities zeroed after the softmax, the rest
                              scaled by 1 / (1 - rate); the mask of `attn_spec.dropout`), a float in
                              [0, 1), attention="softmax" only. The layers apply it in training
                              only: Flax's `deterministic` (`model.train()` / `model.eval()`) with a
                              `dropout_key` or the layer's dropout stream, torch's `training` with a
                              `dropout_seed` or one drawn from torch's generator.
  ordering, grid:             a space-filling-curve ordering of the tokens (a name of
                              `attn_spec.orderings.ORDERINGS`, None for none) over a token grid
                              (rows, cols) or (depth, rows, cols) holding the sequence (None: the
                              near-square default): the window (softmax) or the dilated segments
                              are laid on the ordered sequence (image patches, video), causality and
                              segment ids keep the original order (see `flash_attention`);
                              attention="softmax" or "dilated" only.
  position="none":     no position information (permutation-equivariant unless causal / windowed).
  position="absolute": the sinusoidal table of `attn_spec.positions` is added to the attention
                       input before the q/k/v projections (at `positions` when given, else at
                       0 .. S-1); the residual of an encoder block carries x without it.
  position="rope":     q and k rotated by the `rope` config inside the attention kernel, at
                       `positions` (default 0 .. S-1); every attention kind takes it (dilated
                       attention has no fused RoPE: its layers rotate q and k before the call,
                       `LayerSpec.rope_outside_kernel`).

An argument that the chosen attention kind or position scheme does not use must keep its neutral
value (`UNUSED_BY`); anything else raises a ValueError that names it. `check_layer_args` returns a
frozen `LayerSpec` that both frameworks' layers keep and read; `check_multihead_args` the same for
the layers with `flax.nnx.MultiHeadAttention`'s width arguments (in_features, qkv_features,
out_features: `MultiheadDilatedAttention`); `check_dilated_args` the `DilatedSpec` of the weightless
`DilatedAttention` (and of the dilated multi-head layers). Imports neither jax nor torch.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from attn_spec import dilation, nsa, orderings
from attn_spec.rope import Rope

ATTENTIONS = ("softmax", "stick_breaking", "dilated", "nsa")
COMPRESSIONS = ("mlp", "mean")
POSITIONS = ("none", "absolute", "rope")
LAYER_NORM_EPS = 1e-5
_DILATED_ONLY = {"segment_lengths": None, "dilation_rates": None, "merge": "lse"}
_NSA_ONLY = {"compress_block": None, "compress_stride": None, "select_block": None, "num_selected": None,
             "compress": None, "compress_hidden": None, "gate_hidden": None}
# attention kind -> {argument it does not take: the neutral value that argument must keep}
UNUSED_BY = {
    "softmax": {"decay": 0.0, "learn_decay": False, **_DILATED_ONLY, **_NSA_ONLY},
    "stick_breaking": {"window": None, "softcap": None, "dropout_rate": 0.0, "ordering": None, "grid": None,
                       **_DILATED_ONLY, **_NSA_ONLY},
    "dilated": {"window": None, "softcap": None, "decay": 0.0, "learn_decay": False, "dropout_rate": 0.0,
                **_NSA_ONLY},
    "nsa": {"softcap": None, "decay": 0.0, "learn_decay": False, "dropout_rate": 0.0, "ordering": None,
            "grid": None, **_DILATED_ONLY},
}
# call arguments an attention kind refuses
CALL_ARGS_UNUSED_BY = {"stick_breaking": ("segment_ids",), "dilated": ("segment_ids",)}


def positive_int(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return int(value)


def feed_forward_width(d_model: int, d_ff) -> int:
    """The encoder block's MLP width: d_ff, by default 4 * d_model."""
    return 4 * d_model if d_ff is None else positive_int("d_ff", d_ff)


def check_dropout_rate(dropout_rate) -> float:
    """Attention dropout's rate: a float in [0, 1)."""
    if (not isinstance(dropout_rate, numbers.Real) or isinstance(dropout_rate, bool)
            or not 0.0 <= dropout_rate < 1.0):
        raise ValueError(f"dropout_rate must be a float in [0, 1), got dropout_rate={dropout_rate!r}")
    return float(dropout_rate)


def check_ordering_args(ordering, grid):
    """A layer's ordering (a name of `orderings.ORDERINGS` or None) and token grid -> (ordering,
    grid as a tuple or None); the grid's size is checked against the sequence at the call."""
    if ordering is not None and (not isinstance(ordering, str) or ordering not in orderings.ORDERINGS):
        raise ValueError(f"ordering must be one of {orderings.ORDERINGS} or None, got ordering={ordering!r}")
    if grid is None:
        return ordering, None
    if ordering is None:
        raise ValueError(f"grid={grid!r} is given without an ordering (pass ordering='hilbert', ...)")
    if (isinstance(grid, (str, bytes)) or not hasattr(grid, "__len__") or len(grid) not in (2, 3)
            or any(isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 1 for g in grid)):
        raise ValueError(f"grid must be (rows, cols) or (depth, rows, cols) of positive ints, got grid={grid!r}")
    return ordering, tuple(int(g) for g in grid)


def inverse_softplus(y: float) -> float:
    """x with softplus(x) = y > 0 (the initial decay_logit)."""
    return float(y + math.log(-math.expm1(-y)))


@dataclasses.dataclass(frozen=True)
class DilatedSpec:
    """The checked dilated configuration (see `check_dilated_args`)."""

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    causal: bool
    merge: str
    scale: float | None  # None: D ** -0.5
    ordering: str | None = None  # segments cut from the sequence in this order (a name of ORDERINGS)
    grid: tuple[int, ...] | None = None

    def attention_kwargs(self) -> dict:
        """The keyword arguments of `dilated_attention` (implementation and config aside)."""
        return dict(segment_lengths=self.segment_lengths, dilation_rates=self.dilation_rates, causal=self.causal,
                    merge=self.merge, scale=self.scale, ordering=self.ordering, grid=self.grid)


def check_dilated_args(segment_lengths, dilation_rates, *, causal=False, merge="lse", scale=None,
                       num_heads=None, dropout_rate=0.0, ordering=None, grid=None) -> DilatedSpec:
    """Validate a dilated configuration -> `DilatedSpec`. With num_heads (a multi-head layer) the
    head count is checked against merge="head_groups" too; without (`DilatedAttention`, whose
    heads come with q) `dilated_attention` checks it at the call. dropout_rate must stay 0:
    dilated attention has no dropout."""
    if check_dropout_rate(dropout_rate):
        raise ValueError(f"dilated attention has no dropout: dropout_rate must be 0.0, "
                         f"got dropout_rate={dropout_rate!r}")
    missing = [name for name, value in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates))
               if value is None]
    if missing:
        raise ValueError(f"dilated attention needs {' and '.join(missing)} (one entry per branch)")
    lengths, rates = dilation.check_config(segment_lengths, dilation_rates, "lse", 1)  # the branches alone
    dilation.check_config(lengths, rates, merge, len(lengths) if num_heads is None else num_heads)
    try:
        is_bool = causal in (False, True)
    except (TypeError, ValueError):  # an array of several values
        is_bool = False
    if not is_bool:
        raise ValueError(f"causal must be a bool, got causal={causal!r}")
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)
                              or not 0 < scale < math.inf):
        raise ValueError(f"scale must be a finite float > 0 or None (D ** -0.5), got scale={scale!r}")
    ordering, grid = check_ordering_args(ordering, grid)
    return DilatedSpec(lengths, rates, bool(causal), merge, None if scale is None else float(scale), ordering, grid)


@dataclasses.dataclass(frozen=True)
class NSASpec:
    """The checked NSA configuration of a layer (see `check_nsa_args`)."""

    compress_block: int
    compress_stride: int
    select_block: int
    num_selected: int
    window: int
    compress: str  # "mlp" | "mean"
    compress_hidden: int | None  # the compression MLP's width ("mlp"), None for "mean"
    gate_hidden: int | None  # None: one Linear to the gates; else the width of the gate MLP

    def attention_kwargs(self, seq_len: int) -> dict:
        """The configuration keywords of `nsa_attention` for sequences of seq_len tokens.
        num_selected is capped at the sequence's selection blocks: where a sequence has fewer,
        every block a row can see is selected, which is what top-n gives with slots no block
        fills (`attn_spec.nsa`), and what `nsa_attention` refuses to be asked for explicitly."""
        return dict(compress_block=self.compress_block, compress_stride=self.compress_stride,
                    select_block=self.select_block, window=self.window,
                    num_selected=min(self.num_selected, nsa.selection_count(seq_len, self.select_block)))

    def compress_shapes(self, head_dim: int) -> dict[str, tuple[int, ...]]:
        """{field of `attn_spec.nsa.CompressParams`: shape} of one compression MLP ({} for "mean")."""
        if self.compress != "mlp":
            return {}
        block, hidden = self.compress_block, self.compress_hidden
        return {"pos": (block, head_dim), "w1": (block * head_dim, hidden), "b1": (hidden,),
                "w2": (hidden, head_dim), "b2": (head_dim,)}

    def gate_layers(self, d_model: int, num_heads: int) -> dict[str, tuple[int, int]]:
        """{name: (in, out)} of the gate's Linear layers: `gate_proj`, or `gate_in`, `gate_out`."""
        width = len(nsa.BRANCHES) * num_heads
        if self.gate_hidden is None:
            return {"gate_proj": (d_model, width)}
        return {"gate_in": (d_model, self.gate_hidden), "gate_out": (self.gate_hidden, width)}


def check_nsa_args(head_dim: int, *, compress_block=None, compress_stride=None, select_block=None,
                   num_selected=None, window=None, compress=None, compress_hidden=None, gate_hidden=None) -> NSASpec:
    """Validate an NSA layer configuration -> `NSASpec`; None picks the default (`nsa.NSAConfig`'s
    sizes, window 512, compress "mlp", compress_hidden = head_dim, a single-Linear gate). The
    check against the sequence length (num_selected) happens per call, where it is capped."""
    default = nsa.NSAConfig()
    pick = lambda value, name: getattr(default, name) if value is None else value
    block = nsa.check_block("compress_block", pick(compress_block, "compress_block"))
    stride = nsa.check_block("compress_stride", pick(compress_stride, "compress_stride"))
    if stride > block:
        raise ValueError(f"compress_stride ({stride}) must not exceed compress_block ({block}): blocks would "
                         f"leave keys out")
    select = nsa.check_block("select_block", pick(select_block, "select_block"))
    n = positive_int("num_selected", pick(num_selected, "num_selected"))
    window = pick(window, "window")
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
        raise ValueError(f"attention='nsa' takes window as an int >= 0 (the sliding branch's length; 0: off), "
                         f"got window={window!r}")
    compress = "mlp" if compress is None else compress
    if compress not in COMPRESSIONS:
        raise ValueError(f"unknown compress={compress!r}; choose one of {COMPRESSIONS}")
    if compress == "mean":
        if compress_hidden is not None:
            raise ValueError(f"compress_hidden={compress_hidden!r} applies to compress='mlp' only (mean pooling "
                             f"has no parameters)")
        hidden = None
    else:
        hidden = head_dim if compress_hidden is None else positive_int("compress_hidden", compress_hidden)
    gate = None if gate_hidden is None else positive_int("gate_hidden", gate_hidden)
    return NSASpec(block, stride, select, n, int(window), compress, hidden, gate)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """The checked arguments of a self-attention layer (see `check_layer_args` and
    `check_multihead_args`). d_model is the input width (`in_features` of the multi-head layers),
    qkv_features = num_heads * head_dim the width of q, out_features the output width."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str
    position: str
    rope: Rope | None  # None unless position="rope"
    causal: bool
    window: tuple[int, int] | int | None  # softmax: (left, right); nsa: the window branch's length
    softcap: float | None
    decay: float
    learn_decay: bool
    dilated: DilatedSpec | None  # None unless attention="dilated"
    qkv_features: int
    out_features: int
    width_name: str  # what the layer calls its input width: "d_model" or "in_features"
    dropout_rate: float = 0.0  # attention dropout in training (attention="softmax" only)
    ordering: str | None = None  # the tokens' space-filling-curve order (softmax, dilated)
    grid: tuple[int, ...] | None = None  # its token grid (None: the near-square default)
    nsa: NSASpec | None = None  # None unless attention="nsa"

    @property
    def rope_outside_kernel(self) -> bool:
        """position="rope" on an attention kind without fused RoPE (dilated, NSA): the layer rotates
        q and k (plain `apply_rope`) before the attention call."""
        return self.position == "rope" and self.attention in ("dilated", "nsa")

    def projections(self) -> dict[str, tuple[int, int]]:
        """{projection name: (in features, out features)}, in creation order."""
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (self.d_model, q_width), "k_proj": (self.d_model, kv_width),
                "v_proj": (self.d_model, kv_width), "out_proj": (q_width, self.out_features)}

    def qkv_heads(self) -> tuple[int, int, int]:
        """The number of heads of q, k and v."""
        return self.num_heads, self.num_kv_heads, self.num_kv_heads

    def check_call(self, x_shape, *, segment_ids=None, positions=None, name: str = "x") -> tuple[int, int]:
        """Check a call's input `name` [B, S, d_model] and which optional inputs it gives; -> (B, S)."""
        if len(x_shape) != 3 or x_shape[-1] != self.d_model:
            raise ValueError(f"{name} must be [batch, seq, {self.width_name}={self.d_model}], "
                             f"got shape {tuple(x_shape)}")
        if positions is not None and self.position == "none":
            raise ValueError("positions were given but position='none' does not use them")
        given = dict(segment_ids=segment_ids)
        refused = [name for name in CALL_ARGS_UNUSED_BY.get(self.attention, ()) if given[name] is not None]
        if refused:
            raise ValueError(f"attention={self.attention!r} takes no {', '.join(refused)}")
        return x_shape[0], x_shape[1]

    def check_kv_input(self, name: str, shape, batch: int, length: int) -> None:
        """Key/value inputs of the multi-head layers: [B, S, d_model] with the queries' B and S
        (dilated attention is self-attention: one sequence length)."""
        want = (batch, length, self.d_model)
        if tuple(shape) != want:
            raise ValueError(f"{name} must be [batch, seq, {self.width_name}] = {want} like inputs_q (dilated "
                             f"attention needs the same sequence for queries and keys), got shape {tuple(shape)}")

    def attention_kwargs(self, *, segment_ids=None, positions=None, decay=None, seq_len=None) -> dict:
        """The keyword arguments of the attention function (`flash_attention` for "softmax",
        `stick_breaking_attention` for "stick_breaking", `dilated_attention` for "dilated",
        `nsa_attention` for "nsa", whose gates and compression parameters the layer adds),
        `implementation` aside. decay: the decay to use (the learned one where learn_decay);
        seq_len: the sequence length (attention="nsa")."""
        if self.attention == "dilated":
            return self.dilated.attention_kwargs()
        if self.attention == "nsa":
            return dict(self.nsa.attention_kwargs(seq_len), segment_ids=segment_ids)
        kwargs = dict(rope=self.rope, positions=positions) if self.position == "rope" else {}
        if self.attention == "stick_breaking":
            return dict(kwargs, decay=self.decay if decay is None else decay)
        return dict(kwargs, causal=self.causal, window=self.window, softcap=self.softcap, segment_ids=segment_ids,
                    ordering=self.ordering, grid=self.grid)


def check_positions_shape(shape, batch: int, length: int) -> None:
    if tuple(shape) != (batch, length):
        raise ValueError(f"positions must have shape {(batch, length)}, got {tuple(shape)}")


def check_layer_args(d_model, num_heads, num_kv_heads=None, *, attention="softmax", position="none",
                     rope=Rope(), causal=False, window=None, softcap=None, decay=0.0,
                     learn_decay=False, segment_lengths=None, dilation_rates=None, merge="lse",
                     dropout_rate=0.0, ordering=None, grid=None, **nsa_args) -> LayerSpec:
    """Validate a self-attention layer's arguments (with the layers' defaults); -> the `LayerSpec`.
    Where position != "rope", rope must be the default `Rope()` or None. nsa_args: attention="nsa"'s
    compress_block, compress_stride, select_block, num_selected, compress, compress_hidden,
    gate_hidden (`check_nsa_args`; None elsewhere)."""
    d_model = positive_int("d_model", d_model)
    return _check(d_model, d_model, d_model, num_heads, num_kv_heads, ("d_model", "d_model"), attention=attention,
                  position=position, rope=rope, causal=causal, window=window, softcap=softcap, decay=decay,
                  learn_decay=learn_decay, segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                  merge=merge, dropout_rate=dropout_rate, ordering=ordering, grid=grid, **nsa_args)


def check_multihead_args(num_heads, in_features, qkv_features=None, out_features=None, num_kv_heads=None,
                         **kwargs) -> LayerSpec:
    """`check_layer_args` for the layers with flax.nnx.MultiHeadAttention's widths: inputs of
    in_features, q of qkv_features (default in_features; head dim qkv_features // num_heads, k
    and v num_kv_heads of them), output of out_features (default in_features). kwargs: the
    keyword arguments of `check_layer_args`."""
    in_features = positive_int("in_features", in_features)
    qkv = in_features if qkv_features is None else positive_int("qkv_features", qkv_features)
    out = in_features if out_features is None else positive_int("out_features", out_features)
    names = ("in_features", "in_features" if qkv_features is None else "qkv_features")
    return _check(in_features, qkv, out, num_heads, num_kv_heads, names, **kwargs)


def _is_neutral(value, neutral) -> bool:
    return value is None if neutral is None else value is not None and value == neutral


def _check(d_model, qkv_features, out_features, num_heads, num_kv_heads, names, *, attention="softmax",
           position="none", rope=Rope(), causal=False, window=None, softcap=None, decay=0.0, learn_decay=False,
           segment_lengths=None, dilation_rates=None, merge="lse", dropout_rate=0.0, ordering=None,
           grid=None, compress_block=None, compress_stride=None, select_block=None, num_selected=None,
           compress=None, compress_hidden=None, gate_hidden=None) -> LayerSpec:
    """names: what the caller calls (the input width, the q width)."""
    width_name, qkv_name = names
    num_heads = positive_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention={attention!r}; choose one of {ATTENTIONS}")
    if position not in POSITIONS:
        raise ValueError(f"unknown position={position!r}; choose one of {POSITIONS}")
    if qkv_features % num_heads:
        raise ValueError(f"{qkv_name} ({qkv_features}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    head_dim = qkv_features // num_heads
    if position == "absolute" and d_model % 2:
        raise ValueError(f"position='absolute' needs an even {width_name}, got {width_name}={d_model}")
    if position == "rope":
        if not isinstance(rope, Rope):
            raise TypeError(f"rope must be a Rope (attn_spec.rope.Rope, exported as jax_attn.Rope and "
                            f"torch_ref.Rope), got {type(rope).__name__}")
        if head_dim % 2:
            raise ValueError(f"position='rope' needs an even head dim, got {qkv_name} / num_heads = {head_dim}")
    elif rope is not None and rope != Rope():
        raise ValueError(f"rope={rope!r} applies to position='rope' only, not position={position!r}")
    if not isinstance(decay, numbers.Real) or isinstance(decay, bool) or not 0 <= decay < math.inf:
        raise ValueError(f"decay must be a finite float >= 0, got decay={decay!r}")
    check_dropout_rate(dropout_rate)
    ordering, grid = check_ordering_args(ordering, grid)
    nsa_args = dict(compress_block=compress_block, compress_stride=compress_stride, select_block=select_block,
                    num_selected=num_selected, compress=compress, compress_hidden=compress_hidden,
                    gate_hidden=gate_hidden)
    given = dict(window=window, softcap=softcap, decay=decay, learn_decay=learn_decay,
                 segment_lengths=segment_lengths, dilation_rates=dilation_rates, merge=merge,
                 dropout_rate=dropout_rate, ordering=ordering, grid=grid, **nsa_args)
    unused = [f"{name}={given[name]!r}" for name, neutral in UNUSED_BY[attention].items()
              if not _is_neutral(given[name], neutral)]
    if unused:
        raise ValueError(f"attention={attention!r} does not take {', '.join(unused)}")
    if attention == "stick_breaking":
        if not causal:
            raise ValueError("attention='stick_breaking' is strictly causal: pass causal=True")
        if learn_decay and decay <= 0:
            raise ValueError("learn_decay=True needs decay > 0: the learned decay softplus(decay_logit) "
                             "starts at decay and can never be exactly 0")
    dilated = nsa_spec = None
    if attention == "dilated":
        dilated = check_dilated_args(segment_lengths, dilation_rates, causal=causal, merge=merge,
                                     num_heads=num_heads, ordering=ordering, grid=grid)
    if attention == "nsa":
        if causal is not True:
            raise ValueError("attention='nsa' is causal (every branch is): pass causal=True")
        nsa_spec = check_nsa_args(head_dim, window=window, **nsa_args)
        window = nsa_spec.window
    return LayerSpec(d_model, num_heads, num_kv_heads, head_dim, attention, position,
                     rope if position == "rope" else None, bool(causal), window, softcap, float(decay),
                     bool(learn_decay), dilated, qkv_features, out_features, width_name, float(dropout_rate),
                     ordering, grid, nsa_spec)
