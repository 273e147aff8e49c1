"""Flax NNX layers on the attention kernels, and an `attention_fn` adapter for flax.

* `MultiHeadSelfAttention`: q/k/v/out projections (`nnx.Linear`: `q_proj`, `k_proj`, `v_proj`,
  `out_proj`), heads in BSHD layout, the attention kernel, heads merged, projected.
* `DilatedAttention`: no weights; `dilated_attention` on q, k, v [B, S, H, D] with the layer's
  configuration (segment_lengths, dilation_rates, causal, merge, scale, implementation, config).
* `MultiheadDilatedAttention`: the projections of `MultiHeadSelfAttention` (same names) around
  `dilated_attention`, with `flax.nnx.MultiHeadAttention`'s arguments (num_heads, in_features,
  qkv_features, out_features, num_kv_heads; called on inputs_q[, inputs_k, inputs_v]).
* `HilbertDilatedAttention`: `MultiheadDilatedAttention` on Hilbert-ordered tokens (the segments
  cut from the Hilbert order over a token grid, so each is a compact 2-D patch region). Both take
  an optional `mesh` (and `axis`): then the attention runs sequence-parallel, the ordering within
  each device's band of the grid (`context_parallel_dilated_attention`).
* `NativeSparseAttention`: NSA (Yuan et al., arXiv 2502.11089) as a layer: the projections of
  `MultiHeadSelfAttention` (same names), the gates (`gate_proj`, or the MLP `gate_in` -> GELU ->
  `gate_out`; sigmoid, [B, S, Hq, 3]), the learnable compression maps (`compress_k`,
  `compress_v`: `CompressMLP`, the paper's MLP with an intra-block position embedding; none with
  compress="mean"), and `nsa_attention` with the layer's configuration.
* `EncoderBlock`: BERT-style post-LN block, x = LN(x + attn(x)); x = LN(x + MLP(x)), MLP =
  Linear(d_model, d_ff) -> GELU (tanh approximation) -> Linear(d_ff, d_model).
* `make_attention_fn` / `attention_fn`: run `flax.nnx.MultiHeadAttention(attention_fn=...)` on the
  kernels.

Attention dropout (`dropout_rate`, attention="softmax" only) follows `flax.nnx.MultiHeadAttention`:
the layer keeps `deterministic` (None, True or False; `model.train()` / `model.eval()` set it) and,
with dropout_rate > 0, a fork of the `dropout` stream of its `rngs` (`self.rngs`); a call's
`deterministic` wins over the attribute, and its key is the call's `dropout_key` if given, else one
drawn from the call's `rngs` or from `self.rngs`. The mask is that of `flash_attention(dropout_key=)`:
a torch twin called with `dropout_seed=s` drops the same elements as a call here with
`dropout_key=jax.random.wrap_key_data(jnp.asarray(attn_spec.dropout.seed_words(s), jnp.uint32))`.

The attention kind (`attention="softmax" | "stick_breaking" | "dilated" | "nsa"`: `jax_attn.flash_attention`,
`jax_attn.stick_breaking_attention`, `jax_attn.dilated_attention` or `jax_attn.nsa_attention`, the
last through `NativeSparseAttention`) and the position scheme
(`position="none" | "absolute" | "rope"`) are separate arguments; their meaning, which other
arguments each takes and the checks are those of `attn_spec.layers`, shared with the PyTorch twins
in `torch_ref.nn.layers` (same arguments, same submodule names). Parameters move between them with
`parity.bridge`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attn_spec.layers import (LAYER_NORM_EPS, check_dilated_args, check_layer_args, check_multihead_args,
                              check_positions_shape, feed_forward_width, inverse_softplus)
from attn_spec.nsa import CompressParams
from jax_attn.api import (context_parallel_dilated_attention, dilated_attention, flash_attention, nsa_attention,
                          stick_breaking_attention)
from jax_attn.nn.positions import sinusoidal_at, sinusoidal_positions
from jax_attn.ops.common import validation
from jax_attn.ops.common.rope import Rope, apply_rope

NO_DETERMINISTIC = ("No `deterministic` argument was provided to {name} as either a __call__ argument or "
                    "class attribute (needed with dropout_rate > 0: pass deterministic=, or call "
                    "model.train() / model.eval())")

ATTENTION_FUNCTIONS = {"softmax": flash_attention, "stick_breaking": stick_breaking_attention,
                       "dilated": dilated_attention, "nsa": nsa_attention}
NSA_LAYER = ("attention='nsa' has parameters of its own (gates, compression maps): use NativeSparseAttention "
             "(EncoderBlock(attention='nsa') holds one)")


class MultiHeadSelfAttention(nnx.Module):
    """Multi-head self-attention (GQA/MQA when num_kv_heads < num_heads).

    Args:
      d_model: model width; d_model % num_heads == 0, head dim = d_model // num_heads.
      num_heads: query heads. num_kv_heads: key/value heads (default num_heads), dividing num_heads.
      attention: "softmax" (`flash_attention`) | "stick_breaking" (`stick_breaking_attention`) |
        "dilated" (`dilated_attention`).
      position: "none" | "absolute" | "rope" (see `attn_spec.layers`).
      rope: the `Rope` config of position="rope".
      causal, window, softcap: the masks and score cap of attention="softmax"; stick-breaking
        needs causal=True and takes no window or softcap; dilated takes causal only.
      decay, learn_decay: the distance decay of attention="stick_breaking", fixed or learnable
        (a per-head `decay_logit` parameter, softplus(decay_logit) starts at decay > 0).
      segment_lengths, dilation_rates, merge: the configuration of attention="dilated" (see
        `dilated_attention`; merge "lse" or "head_groups").
      ordering, grid: a space-filling-curve ordering of the tokens (a name of
        `jax_attn.orderings.ORDERINGS`) over a token grid (rows, cols) or (depth, rows, cols)
        holding the sequence (None: the near-square default): the window / dilated segments are
        laid on the ordered sequence, causality and segment ids keep the original order
        (`flash_attention`'s ordering=; attention="softmax" or "dilated").
      dropout_rate: attention dropout in [0, 1) (attention="softmax" only), applied unless
        deterministic.
      deterministic: None, True (no dropout) or False (dropout); the call's argument wins.
        `model.train()` / `model.eval()` set it to False / True.
      implementation: passed to the attention function unchanged.
      use_bias: biases in the four projections.
      dtype: compute dtype of the projections and the attention; param_dtype: parameter dtype.
      rngs: `nnx.Rngs` for the initialisers (nnx.Linear defaults: lecun-normal kernels, zero biases);
        with dropout_rate > 0 its `dropout` stream (else "default") is forked into `self.rngs`,
        the dropout keys of calls that give neither `dropout_key` nor `rngs`.
    An argument the chosen attention or position does not use raises a ValueError naming it.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 attention: str = "softmax", position: str = "none", rope: Rope = Rope(),
                 causal: bool = False, window: tuple[int, int] | None = None,
                 softcap: float | None = None, decay: float = 0.0, learn_decay: bool = False,
                 segment_lengths=None, dilation_rates=None, merge: str = "lse", dropout_rate: float = 0.0,
                 ordering: str | None = None, grid=None, deterministic: bool | None = None,
                 implementation: str | None = None, use_bias: bool = True,
                 dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        if attention == "nsa":
            raise ValueError(NSA_LAYER)
        self.spec = check_layer_args(d_model, num_heads, num_kv_heads, attention=attention, position=position,
                                     rope=rope, causal=causal, window=window, softcap=softcap, decay=decay,
                                     learn_decay=learn_decay, segment_lengths=segment_lengths,
                                     dilation_rates=dilation_rates, merge=merge, dropout_rate=dropout_rate,
                                     ordering=ordering, grid=grid)
        self.implementation, self.dtype = implementation, dtype
        self.dropout_rate, self.deterministic = self.spec.dropout_rate, deterministic
        _add_projections(self, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if learn_decay:
            self.decay_logit = nnx.Param(jnp.full((num_heads,), inverse_softplus(decay), param_dtype))
        self.rngs = rngs.dropout.fork() if self.dropout_rate > 0 else None

    def __call__(self, x, *, segment_ids=None, positions=None, deterministic: bool | None = None,
                 rngs: nnx.Rngs | nnx.RngStream | None = None, dropout_key=None):
        """x [B, S, d_model] -> [B, S, d_model].

        segment_ids: int [B, S], attention stays within equal ids (packed sequences; softmax only).
        positions: int [B, S] token positions for "absolute" / "rope" (default 0 .. S-1);
          an error with position="none".
        deterministic: overrides the attribute (with dropout_rate > 0 one of them must be set).
        rngs: an `nnx.Rngs` (its dropout stream) or `nnx.RngStream` to draw the dropout key from
          instead of `self.rngs`.
        dropout_key: the dropout key itself (a JAX PRNG key; wins over rngs). Without dropout
          (dropout_rate 0 or deterministic) rngs and dropout_key are not used.
        """
        decay = jax.nn.softplus(self.decay_logit[...]) if self.spec.learn_decay else None
        dropout = _dropout(self, deterministic, rngs, dropout_key)
        return _project_attend(self, (x, x, x), ("x",), segment_ids=segment_ids, positions=positions, decay=decay,
                               dropout=dropout)


def _dropout(module, deterministic, rngs, dropout_key) -> dict:
    """The attention call's dropout keywords ({} without dropout): flax's rules (see the module
    docstring) on module.dropout_rate, module.deterministic and module.rngs."""
    if module.dropout_rate == 0.0:
        return {}
    deterministic = module.deterministic if deterministic is None else deterministic
    if deterministic is None:
        raise ValueError(NO_DETERMINISTIC.format(name=type(module).__name__))
    if deterministic:
        return {}
    if dropout_key is None:
        stream = module.rngs if rngs is None else rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs
        if stream is None:
            raise ValueError(f"{type(module).__name__}: dropout needs a key: pass dropout_key= or rngs= "
                             "(the layer's own stream, self.rngs, is None)")
        dropout_key = stream()
    return dict(dropout_rate=module.dropout_rate, dropout_key=dropout_key)


def _add_projections(module, **linear_kwargs) -> None:
    """The q/k/v/out `nnx.Linear` projections of `module.spec`."""
    for name, (n_in, n_out) in module.spec.projections().items():
        setattr(module, name, nnx.Linear(n_in, n_out, **linear_kwargs))


def _distinct(fn, xs):
    """fn applied to each of xs, once per distinct object (self-attention passes x three times)."""
    done = {}
    for x in xs:
        if id(x) not in done:
            done[id(x)] = fn(x)
    return tuple(done[id(x)] for x in xs)


def _project_attend(module, inputs, names, *, segment_ids=None, positions=None, decay=None, config=None,
                    dropout=None, attend=None):
    """The multi-head layers' computation on inputs (queries, keys, values) [B, S, d_model] (names:
    the call's names for them, checked): absolute positions added, projected, split into heads,
    RoPE outside the kernel where the attention has none fused, the attention (with the keywords
    `dropout`, from `_dropout`; `attend`, if given, instead of the spec's attention function),
    heads merged, out-projected."""
    spec = module.spec
    batch, length = spec.check_call(inputs[0].shape, segment_ids=segment_ids, positions=positions, name=names[0])
    for name, x in zip(names[1:], inputs[1:]):
        spec.check_kv_input(name, x.shape, batch, length)
    if positions is not None and (spec.position == "absolute" or spec.rope_outside_kernel):
        _check_positions(positions, batch, length)
    if spec.position == "absolute":
        table = (sinusoidal_positions(length, spec.d_model, inputs[0].dtype)[None] if positions is None
                 else sinusoidal_at(positions, spec.d_model, inputs[0].dtype))
        inputs = _distinct(lambda x: x + table, inputs)
    projections = (module.q_proj, module.k_proj, module.v_proj)
    q, k, v = (p(x).reshape(batch, length, h, spec.head_dim)
               for p, x, h in zip(projections, inputs, spec.qkv_heads()))
    if spec.rope_outside_kernel:
        q, k = apply_rope(q, positions, spec.rope), apply_rope(k, positions, spec.rope)
    kwargs = spec.attention_kwargs(segment_ids=segment_ids, positions=positions, decay=decay, seq_len=length)
    if spec.attention == "nsa":  # gates from the attention input (positions added), as q, k, v
        kwargs.update(gates=module.gates(inputs[0]), compress_params=module.compress_params())
    if config is not None:
        kwargs["config"] = config
    kwargs.update(dropout or {})
    out = (attend or ATTENTION_FUNCTIONS[spec.attention])(q, k, v, implementation=module.implementation, **kwargs)
    return module.out_proj(out.reshape(batch, length, spec.num_heads * spec.head_dim))


class DilatedAttention(nnx.Module):
    """Dilated attention (LongNet) as a module without weights: `dilated_attention(q, k, v)` with
    the configuration given here.

    Args: segment_lengths, dilation_rates (one entry per branch), causal, merge ("lse" |
    "head_groups"), scale (default D ** -0.5), ordering and grid (a space-filling-curve order of
    the tokens, the segments cut from it), implementation and config: those of
    `jax_attn.dilated_attention`, checked here (the head count against merge="head_groups" at
    the call, where q brings it). dropout_rate: must stay 0.0 (dilated attention has no dropout).
    """

    def __init__(self, segment_lengths, dilation_rates, *, causal: bool = False, merge: str = "lse",
                 scale: float | None = None, ordering: str | None = None, grid=None,
                 implementation: str | None = None, config=None, dropout_rate: float = 0.0):
        self.spec = check_dilated_args(segment_lengths, dilation_rates, causal=causal, merge=merge, scale=scale,
                                       dropout_rate=dropout_rate, ordering=ordering, grid=grid)
        self.implementation, self.config = implementation, config

    def __call__(self, q, k, v, *, return_lse: bool = False):
        """q [B, S, H, D], k, v [B, S, Hkv, D] -> out [B, S, H, D] (and lse [B, H, S] with return_lse)."""
        return dilated_attention(q, k, v, return_lse=return_lse, implementation=self.implementation,
                                 config=self.config, **self.spec.attention_kwargs())


class MultiheadDilatedAttention(nnx.Module):
    """Multi-head dilated attention (LongNet): q/k/v/out projections (`nnx.Linear`, named as in
    `MultiHeadSelfAttention`: `q_proj`, `k_proj`, `v_proj`, `out_proj`) around `dilated_attention`.

    Args (the first five as `flax.nnx.MultiHeadAttention`'s):
      num_heads: query heads; in_features: input width; qkv_features: width of q (default
        in_features; head dim = qkv_features // num_heads); out_features: output width (default
        in_features); num_kv_heads: key/value heads (default num_heads; GQA/MQA), dividing num_heads.
      segment_lengths, dilation_rates, causal, merge: the dilated configuration (see
        `dilated_attention`; merge="head_groups" needs num_heads a multiple of the branch count).
      position: "none" | "absolute" (sinusoidal table added to the inputs) | "rope" (q and k
        rotated by `rope` before the attention: the dilated kernels have no fused RoPE).
      ordering, grid: the segments cut from the tokens in a space-filling-curve order over a
        token grid (`dilated_attention`'s ordering=; positions stay the original ones).
      implementation, config: passed to `dilated_attention` unchanged.
      use_bias, dtype (compute), param_dtype, rngs: as in `MultiHeadSelfAttention`.
      dropout_rate: must stay 0.0 (nnx.MultiHeadAttention's argument; dilated attention has no
        dropout: anything else raises a ValueError naming it).
      mesh, axis: sequence parallelism (None: one device). With a `jax.sharding.Mesh`, the
        attention runs sharded over its axis `axis` (None: the mesh's only axis) through
        `context_parallel_dilated_attention`: shard d holds the d-th contiguous block of S / P
        tokens, and an ordering applies WITHIN each shard over its band of the grid (grid[0] / P
        leading rows; None: each shard's tokens on their own near-square default grid). Needs
        merge="lse" and no config; the projections run on the global arrays as placed (the
        parameters are those of the one-device layer).
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None, *, segment_lengths,
                 dilation_rates, causal: bool = False, merge: str = "lse", position: str = "none",
                 rope: Rope = Rope(), ordering: str | None = None, grid=None, implementation: str | None = None,
                 config=None, use_bias: bool = True, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 dropout_rate: float = 0.0, mesh=None, axis=None, rngs: nnx.Rngs):
        self.spec = check_multihead_args(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                                         attention="dilated", position=position, rope=rope, causal=causal,
                                         segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                                         merge=merge, dropout_rate=dropout_rate, ordering=ordering, grid=grid)
        self.implementation, self.config, self.dtype = implementation, config, dtype
        self.mesh, self.axis = _check_mesh(mesh, axis, merge, config)
        _add_projections(self, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, positions=None):
        """inputs_q [B, S, in_features] -> [B, S, out_features]. inputs_k (default inputs_q) and
        inputs_v (default inputs_k): [B, S, in_features], the same B and S. positions: int [B, S]
        for position="absolute" / "rope" (default 0 .. S-1), shared by all three inputs."""
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        return _project_attend(self, (inputs_q, inputs_k, inputs_v), ("inputs_q", "inputs_k", "inputs_v"),
                               positions=positions, config=self.config,
                               attend=None if self.mesh is None else self._sharded_attention)

    def _sharded_attention(self, q, k, v, *, merge, **kwargs):
        """The attention with a mesh (merge="lse", checked at construction)."""
        return context_parallel_dilated_attention(q, k, v, mesh=self.mesh, axis=self.axis, **kwargs)


def _check_mesh(mesh, axis, merge, config):
    """A dilated layer's mesh and axis -> (mesh, axis name) or (None, None) for one device."""
    if mesh is None:
        if axis is not None:
            raise ValueError(f"axis={axis!r} is given without a mesh (pass mesh=jax.sharding.Mesh(...))")
        return None, None
    if axis is None and len(getattr(mesh, "axis_names", ())) == 1:
        axis = mesh.axis_names[0]
    elif axis is None and hasattr(mesh, "axis_names"):
        raise ValueError(f"axis=None needs a mesh of one axis; this mesh has axes {tuple(mesh.axis_names)}: "
                         f"name the sequence axis")
    validation.check_mesh(mesh, axis)
    if merge != "lse":
        raise ValueError(f"the sequence-parallel dilated attention merges the branches by lse: merge must be "
                         f"'lse' with a mesh, got merge={merge!r}")
    if config is not None:
        raise ValueError("config (a tile config) is not taken with a mesh: the sharded call picks its own tiles")
    return mesh, axis


class HilbertDilatedAttention(MultiheadDilatedAttention):
    """Multi-head dilated attention on Hilbert-ordered tokens: `MultiheadDilatedAttention` with
    ordering="hilbert" over the token grid `grid` (rows, cols) or (depth, rows, cols) holding the
    sequence (image patches, video; None: the near-square default). The segments (and their
    dilation) are cut from the Hilbert order, so a segment of w tokens is a compact 2-D region of
    about sqrt(w) x sqrt(w) patches, not a strip of rows; causality keeps the original order. The
    kernels gather the rows through the permutation (no permuted copies). The same parameters as
    `MultiheadDilatedAttention` (q_proj, k_proj, v_proj, out_proj) and the same arguments, plus grid.

    With mesh (and axis), sequence-parallel: each device holds a contiguous band of grid[0] / P
    grid rows and the Hilbert order runs within that band (the sub-grid (rows / P, cols)), so
    grid[0] must be a multiple of P; the segments are cut from the shards' Hilbert orders
    concatenated (`ring_dilated_attention(ordering="hilbert")`). Segments inside a band need no
    traffic; longer ones (whole bands) exchange only their dilated rows.
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None, *, segment_lengths,
                 dilation_rates, grid=None, causal: bool = False, merge: str = "lse", position: str = "none",
                 rope: Rope = Rope(), implementation: str | None = None, config=None, use_bias: bool = True,
                 dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, dropout_rate: float = 0.0,
                 mesh=None, axis=None, rngs: nnx.Rngs):
        super().__init__(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                         segment_lengths=segment_lengths, dilation_rates=dilation_rates, causal=causal, merge=merge,
                         position=position, rope=rope, ordering="hilbert", grid=grid, implementation=implementation,
                         config=config, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                         dropout_rate=dropout_rate, mesh=mesh, axis=axis, rngs=rngs)


class CompressMLP(nnx.Module):
    """NSA's learnable compression map of one of k, v (the fields of `attn_spec.nsa.CompressParams`,
    same names and layouts in the torch twin): `pos [block, D]` (the intra-block position
    embedding), `w1 [block * D, hidden]`, `b1 [hidden]`, `w2 [hidden, D]`, `b2 [D]`;
    phi(x) = gelu((x + pos).reshape(block * D) @ w1 + b1) @ w2 + b2 (exact GELU, in `nsa_attention`).

    Initialisation: pos ~ N(0, 0.02^2), w1 and w2 lecun-normal (nnx.Linear's kernels), biases 0.
    """

    def __init__(self, block: int, head_dim: int, hidden: int, *, param_dtype: Any = jnp.float32,
                 rngs: nnx.Rngs):
        kernel = nnx.initializers.lecun_normal()
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (block, head_dim), param_dtype))
        self.w1 = nnx.Param(kernel(rngs.params(), (block * head_dim, hidden), param_dtype))
        self.b1 = nnx.Param(jnp.zeros((hidden,), param_dtype))
        self.w2 = nnx.Param(kernel(rngs.params(), (hidden, head_dim), param_dtype))
        self.b2 = nnx.Param(jnp.zeros((head_dim,), param_dtype))

    def params(self, dtype) -> CompressParams:
        """The parameters as a `CompressParams` in the compute dtype (flax's promote_dtype)."""
        return CompressParams(*(jnp.asarray(getattr(self, f)[...], dtype) for f in CompressParams._fields))


class NativeSparseAttention(nnx.Module):
    """Native Sparse Attention (Yuan et al. 2025, arXiv 2502.11089) as a self-attention layer:
    x [B, S, d_model] -> q (num_heads heads), k, v (num_kv_heads heads) -> `nsa_attention` with
    gates sigmoid(gate(x)) [B, S, num_heads, 3] (compression, selection, window) and the
    compression maps -> heads merged -> out_proj. Causal (every branch is).

    Args:
      d_model, num_heads, num_kv_heads (default num_heads, dividing it): as `MultiHeadSelfAttention`
        (head dim d_model // num_heads); the projections have its names (`q_proj`, `k_proj`,
        `v_proj`, `out_proj`).
      compress_block, compress_stride, select_block, num_selected, window: the NSA configuration of
        `nsa_attention` (defaults: `attn_spec.nsa.NSAConfig`). num_selected is capped per call at
        the sequence's number of selection blocks (every visible block is then selected).
      compress: "mlp" (`compress_k`, `compress_v`: `CompressMLP`s of width compress_hidden, default
        the head dim, shared by the kv heads, as the paper's phi) or "mean" (mean pooling, no
        parameters; fla-org's form).
      gate_hidden: None: `gate_proj = Linear(d_model, 3 * num_heads)` then a sigmoid (fla-org's
        gate); an int: the paper's MLP, `gate_in = Linear(d_model, gate_hidden)` -> GELU (tanh
        approximation) -> `gate_out = Linear(gate_hidden, 3 * num_heads)` -> sigmoid. The output's
        last axis is (head, branch), head-major.
      position: "none" | "absolute" | "rope" (q and k rotated before the call: `nsa_attention` has
        no fused RoPE); rope: its `Rope` config.
      implementation: `nsa_attention`'s ("triton" / "pallas_triton", "xla" or None).
      use_bias: biases in every Linear; dtype: compute dtype (projections, gates, compression
        parameters cast to it); param_dtype; rngs: as `MultiHeadSelfAttention` (nnx.Linear
        initialisers; `CompressMLP` for the compression maps).
    Errors (ValueError naming the argument) for a bad configuration; a sequence's own limits
    (lengths, segment ids) are checked by `nsa_attention`.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 compress_block: int = 32, compress_stride: int = 16, select_block: int = 64,
                 num_selected: int = 16, window: int = 512, compress: str = "mlp",
                 compress_hidden: int | None = None, gate_hidden: int | None = None, position: str = "none",
                 rope: Rope = Rope(), implementation: str | None = None, use_bias: bool = True,
                 dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.spec = check_layer_args(d_model, num_heads, num_kv_heads, attention="nsa", position=position, rope=rope,
                                     causal=True, window=window, compress_block=compress_block,
                                     compress_stride=compress_stride, select_block=select_block,
                                     num_selected=num_selected, compress=compress, compress_hidden=compress_hidden,
                                     gate_hidden=gate_hidden)
        self.implementation, self.dtype, self.dropout_rate = implementation, dtype, 0.0
        linear = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        _add_projections(self, **linear)
        for name, (n_in, n_out) in self.spec.nsa.gate_layers(d_model, num_heads).items():
            setattr(self, name, nnx.Linear(n_in, n_out, **linear))
        cfg = self.spec.nsa
        if cfg.compress == "mlp":
            make = lambda: CompressMLP(cfg.compress_block, self.spec.head_dim, cfg.compress_hidden,
                                       param_dtype=param_dtype, rngs=rngs)
            self.compress_k, self.compress_v = make(), make()

    def gates(self, x):
        """x [B, S, d_model] -> sigmoid gates [B, S, num_heads, 3] (compression, selection, window)."""
        if self.spec.nsa.gate_hidden is None:
            logits = self.gate_proj(x)
        else:
            logits = self.gate_out(jax.nn.gelu(self.gate_in(x), approximate=True))
        return jax.nn.sigmoid(logits).reshape(*x.shape[:2], self.spec.num_heads, 3)

    def compress_params(self):
        """(CompressParams for k, for v) in the compute dtype, or None (mean pooling)."""
        if self.spec.nsa.compress != "mlp":
            return None
        return self.compress_k.params(self.dtype), self.compress_v.params(self.dtype)

    def __call__(self, x, *, segment_ids=None, positions=None):
        """x [B, S, d_model] -> [B, S, d_model]. segment_ids: int [B, S] (packed sequences: every
        branch stays within its segment; sorted ids). positions: int [B, S] for "absolute" /
        "rope" (default 0 .. S-1)."""
        return _project_attend(self, (x, x, x), ("x",), segment_ids=segment_ids, positions=positions)


def _check_positions(positions, batch, length):
    if not hasattr(positions, "dtype") or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions must be an integer array, got {getattr(positions, 'dtype', type(positions))}")
    check_positions_shape(positions.shape, batch, length)


class EncoderBlock(nnx.Module):
    """BERT-style post-LN encoder block:

        h = ln1(x + attn(x));  y = ln2(h + mlp_out(gelu_tanh(mlp_in(h))))

    Args: d_model, num_heads; d_ff: MLP width (default 4 * d_model); the remaining keyword
    arguments are those of `MultiHeadSelfAttention` (attention="dilated" with segment_lengths,
    dilation_rates, merge: LongNet's dilated attention in the block; dropout_rate, deterministic:
    attention dropout, the attention's `rngs` stream drawing its keys). attention="nsa" (causal=True)
    makes `attn` a `NativeSparseAttention` with compress_block, compress_stride, select_block,
    num_selected, compress, compress_hidden, gate_hidden and window (an int here; None: the NSA
    defaults, see `attn_spec.layers`). LayerNorm eps 1e-5 (as torch's default).
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, *,
                 num_kv_heads: int | None = None, attention: str = "softmax", position: str = "none",
                 rope: Rope = Rope(), causal: bool = False, window: tuple[int, int] | None = None,
                 softcap: float | None = None, decay: float = 0.0, learn_decay: bool = False,
                 segment_lengths=None, dilation_rates=None, merge: str = "lse", dropout_rate: float = 0.0,
                 compress_block: int | None = None, compress_stride: int | None = None,
                 select_block: int | None = None, num_selected: int | None = None, compress: str | None = None,
                 compress_hidden: int | None = None, gate_hidden: int | None = None,
                 ordering: str | None = None, grid=None,
                 deterministic: bool | None = None, implementation: str | None = None, use_bias: bool = True,
                 dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
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
                implementation=implementation, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                **nsa_args)
        else:
            self.attn = MultiHeadSelfAttention(
                d_model, num_heads, num_kv_heads=num_kv_heads, attention=attention, position=position, rope=rope,
                causal=causal, window=window, softcap=softcap, decay=decay, learn_decay=learn_decay,
                segment_lengths=segment_lengths, dilation_rates=dilation_rates, merge=merge,
                dropout_rate=dropout_rate, ordering=ordering, grid=grid, deterministic=deterministic,
                implementation=implementation, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dropout_rate, self.deterministic = self.attn.dropout_rate, deterministic
        norm = dict(epsilon=LAYER_NORM_EPS, use_fast_variance=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d_model, **norm)
        self.ln2 = nnx.LayerNorm(d_model, **norm)
        self.mlp_in = nnx.Linear(d_model, d_ff, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp_out = nnx.Linear(d_ff, d_model, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, *, segment_ids=None, positions=None, deterministic: bool | None = None,
                 rngs: nnx.Rngs | nnx.RngStream | None = None, dropout_key=None):
        """x [B, S, d_model] -> [B, S, d_model]; segment_ids / positions / rngs / dropout_key as in
        the attention; deterministic: the call's, else the block's attribute, else the attention's."""
        deterministic = self.deterministic if deterministic is None else deterministic
        if isinstance(self.attn, NativeSparseAttention):  # no dropout: nothing to draw
            attended = self.attn(x, segment_ids=segment_ids, positions=positions)
        else:
            attended = self.attn(x, segment_ids=segment_ids, positions=positions, deterministic=deterministic,
                                 rngs=rngs, dropout_key=dropout_key)
        h = self.ln1(x + attended)
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
    and, with dropout_rate > 0 and deterministic=False, attention dropout with dropout_rng as
      `flash_attention`'s dropout_key (one mask per batch element and head, as flax's
      broadcast_dropout=False: build `nnx.MultiHeadAttention(..., broadcast_dropout=False)`; the
      mask differs from flax's own, drawn by jax.random.bernoulli).
    It raises NotImplementedError naming the argument for what the kernels cannot do: a bias, a
    mask array (arbitrary masks are never inspected: pass causal/window through this factory,
    e.g. `attention_fn=make_attention_fn(causal=True)`), dropout with broadcast_dropout=True (flax's
    default: one mask shared by every batch element and head), `module` (sow_weights=True needs
    the attention weights, which a flash kernel never materialises), another precision, or an
    unknown keyword.
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
        dropout = {}
        if dropout_rate > 0.0 and not deterministic:
            if broadcast_dropout:
                raise NotImplementedError(
                    f"jax_attn attention_fn: dropout_rate={dropout_rate} with broadcast_dropout=True is not "
                    "supported: flax's broadcast_dropout=True shares one mask across batch and heads, the kernels "
                    "draw one per batch element and head; build nnx.MultiHeadAttention(..., "
                    "broadcast_dropout=False) (or use dropout_rate=0 / deterministic=True)")
            dropout = dict(dropout_rate=dropout_rate, dropout_key=dropout_rng)
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
                                      window=window, softcap=softcap, implementation=implementation, **dropout)
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
