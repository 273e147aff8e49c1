"""Layer-level parity: `jax_attn.nn.layers` against their `torch_ref.nn.layers` twins, and a training run.

Layer cases (`kind` "attention" = MultiHeadSelfAttention, "encoder" = EncoderBlock, "dilated_mha" =
MultiheadDilatedAttention, "hilbert_dilated" = HilbertDilatedAttention, "dilated" = DilatedAttention,
"nsa" = NativeSparseAttention), for the attention kinds "softmax", "stick_breaking", "dilated", "nsa"
and the position schemes "none", "absolute", "rope":
the Flax layer is built from the case's seed (every parameter then shifted by seeded noise, so
biases and LayerNorm parameters are not 0/1 and a swapped copy could not go unnoticed), copied to
the torch twin by `parity.bridge`; identical
NumPy input x and output cotangent go to both; compared are the output, dx and the gradient of
EVERY parameter (quantity "d <torch name>"), each with the tolerance rule of `parity.tolerance`
(the weightless DilatedAttention takes q, k, v [B, S, H(kv), D]: out, dq, dk, dv):
  golden = the torch twin in float64, implementation="eager" (weights copied as float64);
  naive  = the plain implementations in the compute dtype ("xla" / "eager"; for the kernels the
           larger of the two frameworks' errors, see `check_layer_case`);
  fast   = "jax pallas_triton" / "torch triton".
Attention dropout (cases with `dropout_rate` > 0, softmax only): every call of both frameworks
gets the same explicit seed (`LayerCase.dropout_seed`: the Flax layer `deterministic=False,
dropout_key=wrap_key_data(seed_words(s))`, the torch twin in training mode `dropout_seed=s`), so
every implementation, the float64 golden and the float64 JAX run drop the same elements; the
training run seeds every step and block anew.
fp32 throughout, with exact matmuls (`jax.default_matmul_precision("highest")` around the JAX
computations, torch TF32 off). A row "golden torch-f64 vs jax-f64" checks that the Flax layer in
float64 ("xla", weights from the torch golden through `torch_to_flax`) agrees with the golden to
1e-10: the cross-framework check of the layers' definitions (PE, RoPE, LayerNorm, GELU, heads).

The training cases ("train"): a tiny encoder (embedding-free: 2 EncoderBlocks + a linear head,
d_model 32, 4 heads, seq 16, batch 4, causal; softmax with absolute positions, stick-breaking
with RoPE and a learned per-head decay, dilated attention with absolute positions, or NSA with
absolute positions, the learnable compression and a gate MLP) regresses a synthetic target (the
running mean of the first input features, which needs attention) with plain SGD, 20 steps, the
same learning rate, identical initial weights (bridge) and identical batches in both frameworks;
the loss of every step must pass the rule (golden: the float64 torch eager run; one allowance for
the whole trajectory, see `_training_rows`), and the float64 JAX run must agree with the golden to
1e-10 at every step. A further training case (softmax, absolute positions)
trains with attention dropout 0.1, a fixed seed per step and block.

CPU cost (the kernels run through interpreters there): only cases with `cpu_kernels=True` -- eleven
layer cases -- run "jax pallas_triton" / "torch triton" on CPU; on a GPU every case runs them.
The training run on CPU uses the plain implementations only ("xla", "eager", plus the row
"jax xla (naive: torch eager)"): through the interpreter the Triton kernels need ~1 s per
attention call at these shapes (80 calls per run) and compiling the Pallas training step takes
~10 s; on a GPU all four train.

Entry points for `python -m parity.check`: `LAYER_CASES` and `check_layer_case(case, device)`,
which returns rows in the format of `parity.check.check_case`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import zlib
from typing import Any

import numpy as np
import torch

if not torch.cuda.is_available():  # the Triton interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from torch import nn  # noqa: E402

import jax_attn.nn.layers as jl  # noqa: E402
import torch_ref.nn.layers as tl  # noqa: E402
from attn_spec.dropout import seed_words  # noqa: E402
from attn_spec.rope import Rope  # noqa: E402
from parity import bridge  # noqa: E402
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare  # noqa: E402

GOLDEN_AGREEMENT = 1e-10
NP_DTYPES = {"float32": np.float32, "float64": np.float64}
JAX_DTYPES = {"float32": jnp.float32, "float64": jnp.float64}
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# implementation label (as in parity.check) -> (framework, `implementation=` argument)
IMPLEMENTATIONS = {
    "jax pallas_triton": ("jax", "pallas_triton"),
    "jax xla": ("jax", "xla"),
    "torch triton": ("torch", "triton"),
    "torch eager": ("torch", "eager"),
}
PLAIN = {"jax": "jax xla", "torch": "torch eager"}  # framework -> its plain implementation
PARAM_NOISE = 0.1


@dataclasses.dataclass(frozen=True)
class LayerCase:
    name: str
    kind: str  # "attention" | "encoder" | "train" | "dilated_mha" | "hilbert_dilated" | "dilated" | "nsa"
    position: str  # "none" | "absolute" | "rope"
    shape: tuple[int, int, int, int, int]  # batch, seq, d_model (in_features), num_heads, num_kv_heads
    attention: str = "softmax"  # "softmax" | "stick_breaking" | "dilated"
    d_ff: int = 64
    dtype: str = "float32"
    # causal / window / softcap / decay / learn_decay / segment_lengths / dilation_rates / merge;
    # qkv_features / out_features ("dilated_mha"); scale ("dilated"); the NSA configuration
    # (compress_block, ..., gate_hidden: "nsa", and attention="nsa" in "encoder" / "train")
    kwargs: tuple[tuple[str, Any], ...] = ()
    rope_style: str = "interleaved"  # position="rope": Rope(style=...) in both frameworks
    packed: bool = False  # segment ids + positions restarting in every segment
    cpu_kernels: bool = False  # run the fast (interpreted) implementations on CPU too
    num_blocks: int = 2  # "train" only
    steps: int = 20  # "train" only
    lr: float = 0.05  # "train" only
    d_out: int = 4  # "train" only
    dropout_rate: float = 0.0  # attention dropout (softmax), seeded per call by `dropout_seed`
    seed: int = 0
    variant: str = "layers"
    gpu: bool = False
    quick: bool = False

    def layer_kwargs(self) -> dict:
        """Constructor keywords of the twins (the same in both frameworks: `Rope` is shared)."""
        if self.kind == "dilated":
            return dict(self.kwargs)
        kwargs = dict(num_kv_heads=self.shape[4], position=self.position, **dict(self.kwargs))
        if self.kind not in ("dilated_mha", "hilbert_dilated", "nsa"):
            kwargs["attention"] = self.attention
        if self.position == "rope":
            kwargs["rope"] = Rope(style=self.rope_style)
        if self.dropout_rate:
            kwargs["dropout_rate"] = self.dropout_rate
        return kwargs

    def dropout_seed(self, call: int = 0) -> int:
        """The dropout seed of the case's call `call` (training: step * num_blocks + block), the same
        in both frameworks: the case's seed in the high word, the call in the low one."""
        return (self.seed << 32) | call

    def dropout_kwargs(self, framework: str, call: int = 0) -> dict:
        """The dropout keywords of a call of the case's layer or block ({} without dropout): JAX
        deterministic=False and the key of `dropout_seed(call)`, torch that seed."""
        if not self.dropout_rate:
            return {}
        seed = self.dropout_seed(call)
        if framework == "torch":
            return dict(dropout_seed=seed)
        key = jax.random.wrap_key_data(jnp.asarray(seed_words(seed), jnp.uint32))
        return dict(deterministic=False, dropout_key=key)

    def input_gradients(self) -> tuple[str, ...]:
        """The names of the input gradients compared."""
        return ("dq", "dk", "dv") if self.kind == "dilated" else ("dx",)

    def call_kwargs(self, segment_ids, positions) -> dict:
        """The keyword arguments of the layer's call."""
        if self.kind == "dilated":
            return {}
        if self.kind in ("dilated_mha", "hilbert_dilated"):
            return dict(positions=positions)
        return dict(segment_ids=segment_ids, positions=positions)


def _case(name, kind, position, shape, **kw) -> LayerCase:
    return LayerCase(name, kind, position, shape, seed=zlib.crc32(name.encode()), **kw)


LAYER_CASES: list[LayerCase] = [
    _case("layer_attention_none_gqa", "attention", "none", (2, 16, 32, 4, 2), cpu_kernels=True, quick=True),
    _case("layer_attention_absolute_causal", "attention", "absolute", (2, 16, 32, 4, 4), kwargs=(("causal", True),)),
    _case("layer_attention_rope_window", "attention", "rope", (2, 16, 32, 4, 1), kwargs=(("window", (5, 2)),)),
    _case("layer_encoder_none_softcap", "encoder", "none", (2, 16, 32, 4, 4), kwargs=(("softcap", 5.0),)),
    _case("layer_encoder_absolute_packed", "encoder", "absolute", (2, 16, 32, 4, 2), packed=True,
          kwargs=(("causal", True),)),
    _case("layer_encoder_rope_packed_half", "encoder", "rope", (2, 16, 32, 4, 2), packed=True, rope_style="half",
          kwargs=(("causal", True),), cpu_kernels=True, quick=True),
    _case("train_encoder_absolute", "train", "absolute", (4, 16, 32, 4, 4), kwargs=(("causal", True),),
          quick=True),
    _case("layer_attention_sb_rope_learned_decay", "attention", "rope", (2, 16, 32, 4, 2),
          attention="stick_breaking", kwargs=(("causal", True), ("decay", 0.05), ("learn_decay", True)),
          cpu_kernels=True, quick=True),
    _case("layer_encoder_sb_rope_half", "encoder", "rope", (2, 16, 32, 4, 4), attention="stick_breaking",
          rope_style="half", kwargs=(("causal", True), ("decay", 0.02))),
    _case("layer_attention_sb_none", "attention", "none", (2, 16, 32, 4, 2), attention="stick_breaking",
          kwargs=(("causal", True),)),
    _case("layer_encoder_sb_absolute", "encoder", "absolute", (2, 16, 32, 4, 1), attention="stick_breaking",
          kwargs=(("causal", True), ("decay", 0.03))),
    _case("train_encoder_sb_rope", "train", "rope", (4, 16, 32, 4, 2), attention="stick_breaking",
          kwargs=(("causal", True), ("decay", 0.1), ("learn_decay", True))),
    # dilated attention: the weightless layer, the multi-head layer, the encoder block, a training run
    _case("layer_dilated_lse_gqa", "dilated", "none", (2, 16, 32, 4, 2), attention="dilated",
          kwargs=(("segment_lengths", (4, 8)), ("dilation_rates", (1, 2))), cpu_kernels=True),
    _case("layer_dilated_head_groups_causal_odd", "dilated", "none", (2, 13, 32, 4, 1), attention="dilated",
          kwargs=(("segment_lengths", (4, 9)), ("dilation_rates", (1, 3)), ("merge", "head_groups"),
                  ("causal", True), ("scale", 0.3)), cpu_kernels=True),
    _case("layer_mdilated_lse_causal_odd", "dilated_mha", "absolute", (2, 15, 24, 4, 2), attention="dilated",
          kwargs=(("qkv_features", 32), ("out_features", 20), ("segment_lengths", (4, 8)),
                  ("dilation_rates", (1, 2)), ("causal", True)), cpu_kernels=True, quick=True),
    _case("layer_mdilated_head_groups_rope", "dilated_mha", "rope", (2, 16, 32, 4, 2), attention="dilated",
          kwargs=(("segment_lengths", (4, 16)), ("dilation_rates", (1, 2)), ("merge", "head_groups"))),
    _case("layer_encoder_dilated_head_groups_causal_odd", "encoder", "none", (2, 17, 32, 4, 2), attention="dilated",
          kwargs=(("segment_lengths", (8, 16)), ("dilation_rates", (2, 4)), ("merge", "head_groups"),
                  ("causal", True)), cpu_kernels=True),
    _case("layer_encoder_dilated_rope_half", "encoder", "rope", (2, 16, 32, 4, 1), attention="dilated",
          rope_style="half", kwargs=(("segment_lengths", (4, 8, 16)), ("dilation_rates", (1, 2, 4)))),
    _case("train_encoder_dilated", "train", "absolute", (4, 16, 32, 4, 2), attention="dilated",
          kwargs=(("causal", True), ("segment_lengths", (4, 16)), ("dilation_rates", (1, 2)))),
    # space-filling-curve orderings: a window over Hilbert-ordered patches; HilbertDilatedAttention
    _case("layer_attention_hilbert_window_causal", "attention", "none", (2, 16, 32, 4, 2),
          kwargs=(("ordering", "hilbert"), ("grid", (4, 4)), ("window", (3, 3)), ("causal", True)), cpu_kernels=True),
    _case("layer_hilbert_dilated_causal_gqa", "hilbert_dilated", "absolute", (2, 20, 32, 4, 2), attention="dilated",
          kwargs=(("grid", (4, 5)), ("segment_lengths", (4, 8)), ("dilation_rates", (1, 2)), ("causal", True)),
          cpu_kernels=True, quick=True),
    _case("layer_dilated_zorder_head_groups", "dilated", "none", (1, 16, 32, 4, 2), attention="dilated",
          kwargs=(("segment_lengths", (4, 8)), ("dilation_rates", (1, 2)), ("merge", "head_groups"),
                  ("ordering", "zorder"))),
    # attention dropout (rate 0.1; one explicit seed per call in both frameworks)
    _case("layer_attention_dropout_rope_gqa", "attention", "rope", (2, 16, 32, 4, 2), dropout_rate=0.1,
          kwargs=(("causal", True),), cpu_kernels=True),
    _case("layer_encoder_dropout_absolute_packed", "encoder", "absolute", (2, 16, 32, 4, 4), dropout_rate=0.1,
          packed=True, kwargs=(("window", (6, 3)),), quick=True),
    _case("train_encoder_dropout", "train", "absolute", (4, 16, 32, 4, 2), dropout_rate=0.1,
          kwargs=(("causal", True),)),
    # Native Sparse Attention: the layer (learnable compression or mean pooling, linear or MLP gates),
    # the encoder block, a training run; importance-driven selection (more blocks than slots)
    _case("layer_nsa_mlp_rope_gqa_odd", "nsa", "rope", (2, 37, 32, 4, 2), attention="nsa",
          kwargs=(("compress_block", 8), ("compress_stride", 4), ("select_block", 8), ("num_selected", 3),
                  ("window", 8), ("compress_hidden", 12)), cpu_kernels=True, quick=True),
    _case("layer_nsa_mean_gate_mlp_packed", "nsa", "absolute", (2, 33, 32, 4, 1), attention="nsa", packed=True,
          kwargs=(("compress_block", 8), ("compress_stride", 8), ("select_block", 8), ("num_selected", 2),
                  ("window", 6), ("compress", "mean"), ("gate_hidden", 16)), cpu_kernels=True),
    _case("layer_nsa_mha_none_d12", "nsa", "none", (1, 29, 24, 2, 2), attention="nsa",
          kwargs=(("compress_block", 4), ("compress_stride", 2), ("select_block", 4), ("num_selected", 4),
                  ("window", 0), ("gate_hidden", 8))),
    _case("layer_encoder_nsa_rope_half", "encoder", "rope", (2, 33, 32, 4, 2), attention="nsa", rope_style="half",
          kwargs=(("causal", True), ("compress_block", 8), ("compress_stride", 4), ("select_block", 8),
                  ("num_selected", 3), ("window", 8)), cpu_kernels=True),
    _case("train_encoder_nsa", "train", "absolute", (4, 16, 32, 4, 2), attention="nsa",
          kwargs=(("causal", True), ("compress_block", 4), ("compress_stride", 2), ("select_block", 4),
                  ("num_selected", 2), ("window", 4), ("compress_hidden", 8), ("gate_hidden", 8))),
]


# ------------------------------------------------------------------------------------------------
# Inputs and models
# ------------------------------------------------------------------------------------------------
def draw_inputs(case: LayerCase):
    """Seeded float64 inputs (a tuple: (x [B, S, d_model],), or (q, k, v) [B, S, H(kv), D] for
    kind "dilated"), the output cotangent, segment ids and positions (int32 [B, S] or None)."""
    rng = np.random.default_rng(case.seed)
    batch, seq, d_model, heads, kv_heads = case.shape
    if case.kind == "dilated":
        head_dim = d_model // heads
        qkv = tuple(rng.standard_normal((batch, seq, h, head_dim)) for h in (heads, kv_heads, kv_heads))
        return qkv, rng.standard_normal((batch, seq, heads, head_dim)), None, None
    x = rng.standard_normal((batch, seq, d_model))
    ct = rng.standard_normal((batch, seq, dict(case.kwargs).get("out_features", d_model)))
    seg = pos = None
    if case.packed:
        seg = np.zeros((batch, seq), np.int32)
        pos = np.zeros((batch, seq), np.int32)
        for b in range(batch):
            cuts = np.sort(rng.choice(np.arange(1, seq), size=2, replace=False))
            seg[b] = np.searchsorted(cuts, np.arange(seq), side="right")
            starts = np.concatenate([[0], cuts])[seg[b]]
            pos[b] = np.arange(seq) - starts
        if case.position == "none":
            pos = None  # position="none" takes no positions
    return (x,), ct, seg, pos


class FlaxTinyEncoder(nnx.Module):
    """`num_blocks` EncoderBlocks and a linear head: [B, S, d_model] -> [B, S, d_out]."""

    def __init__(self, case: LayerCase, *, implementation, dtype=jnp.float32, rngs):
        d_model, heads = case.shape[2], case.shape[3]
        self.blocks = nnx.List([
            jl.EncoderBlock(d_model, heads, case.d_ff, implementation=implementation, dtype=dtype,
                            param_dtype=dtype, rngs=rngs, **case.layer_kwargs())
            for _ in range(case.num_blocks)])
        self.head = nnx.Linear(d_model, case.d_out, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def __call__(self, x, dropout_keys=None):
        """dropout_keys: one dropout key per block (a key array [num_blocks]) or None (no dropout)."""
        for i, block in enumerate(self.blocks):
            x = block(x) if dropout_keys is None else block(x, deterministic=False, dropout_key=dropout_keys[i])
        return self.head(x)


class TorchTinyEncoder(nn.Module):
    """Twin of `FlaxTinyEncoder` (same names: blocks.<i>.*, head)."""

    def __init__(self, case: LayerCase, *, implementation, dtype=torch.float32, device=None):
        super().__init__()
        d_model, heads = case.shape[2], case.shape[3]
        self.blocks = nn.ModuleList([
            tl.EncoderBlock(d_model, heads, case.d_ff, implementation=implementation, dtype=dtype,
                            param_dtype=dtype, device=device, **case.layer_kwargs())
            for _ in range(case.num_blocks)])
        self.head = nn.Linear(d_model, case.d_out, dtype=dtype, device=device)

    def forward(self, x, dropout_seeds=None):
        """dropout_seeds: one dropout seed per block or None (no dropout)."""
        for i, block in enumerate(self.blocks):
            x = block(x) if dropout_seeds is None else block(x, dropout_seed=dropout_seeds[i])
        return self.head(x)


def build_flax(case: LayerCase, implementation: str, dtype: str = "float32"):
    d_model, heads = case.shape[2], case.shape[3]
    jdt, rngs = JAX_DTYPES[dtype], nnx.Rngs(case.seed)
    if case.kind == "train":
        return FlaxTinyEncoder(case, implementation=implementation, dtype=jdt, rngs=rngs)
    if case.kind == "encoder":
        return jl.EncoderBlock(d_model, heads, case.d_ff, implementation=implementation, dtype=jdt,
                               param_dtype=jdt, rngs=rngs, **case.layer_kwargs())
    if case.kind == "attention":
        return jl.MultiHeadSelfAttention(d_model, heads, implementation=implementation, dtype=jdt,
                                         param_dtype=jdt, rngs=rngs, **case.layer_kwargs())
    if case.kind == "dilated_mha":
        return jl.MultiheadDilatedAttention(heads, d_model, implementation=implementation, dtype=jdt,
                                            param_dtype=jdt, rngs=rngs, **case.layer_kwargs())
    if case.kind == "hilbert_dilated":
        return jl.HilbertDilatedAttention(heads, d_model, implementation=implementation, dtype=jdt,
                                          param_dtype=jdt, rngs=rngs, **case.layer_kwargs())
    if case.kind == "dilated":
        return jl.DilatedAttention(implementation=implementation, **case.layer_kwargs())
    if case.kind == "nsa":
        return jl.NativeSparseAttention(d_model, heads, implementation=implementation, dtype=jdt, param_dtype=jdt,
                                        rngs=rngs, **case.layer_kwargs())
    raise ValueError(f"unknown layer case kind={case.kind!r}")


def build_torch(case: LayerCase, implementation: str, dtype: str, device):
    d_model, heads = case.shape[2], case.shape[3]
    tdt = TORCH_DTYPES[dtype]
    if case.kind == "train":
        return TorchTinyEncoder(case, implementation=implementation, dtype=tdt, device=device)
    if case.kind == "encoder":
        return tl.EncoderBlock(d_model, heads, case.d_ff, implementation=implementation, dtype=tdt,
                               param_dtype=tdt, device=device, **case.layer_kwargs())
    if case.kind == "attention":
        return tl.MultiHeadSelfAttention(d_model, heads, implementation=implementation, dtype=tdt,
                                         param_dtype=tdt, device=device, **case.layer_kwargs())
    if case.kind == "dilated_mha":
        return tl.MultiheadDilatedAttention(heads, d_model, implementation=implementation, dtype=tdt,
                                            param_dtype=tdt, device=device, **case.layer_kwargs())
    if case.kind == "hilbert_dilated":
        return tl.HilbertDilatedAttention(heads, d_model, implementation=implementation, dtype=tdt,
                                          param_dtype=tdt, device=device, **case.layer_kwargs())
    if case.kind == "dilated":
        return tl.DilatedAttention(implementation=implementation, **case.layer_kwargs())
    if case.kind == "nsa":
        return tl.NativeSparseAttention(d_model, heads, implementation=implementation, dtype=tdt, param_dtype=tdt,
                                        device=device, **case.layer_kwargs())
    raise ValueError(f"unknown layer case kind={case.kind!r}")


def perturb(flax_module, seed: int, scale: float = PARAM_NOISE) -> None:
    """Add seeded N(0, scale^2) noise to every parameter (in path order), in place (in NumPy)."""
    rng = np.random.default_rng(seed)
    params = sorted(((p, v) for p, v in nnx.iter_graph(flax_module) if isinstance(v, nnx.Param)),
                    key=lambda item: tuple(map(str, item[0])))
    for _, param in params:
        value = np.asarray(param.get_value())
        param.set_value(jnp.asarray(value + scale * rng.standard_normal(value.shape).astype(value.dtype)))


def master_flax(case: LayerCase):
    """The case's reference weights: the fp32 Flax model from the seed, perturbed."""
    module = build_flax(case, "xla")
    perturb(module, case.seed + 1)
    return module


def flax_with_weights(case: LayerCase, implementation: str, master):
    """An fp32 Flax model for `implementation` holding the master's parameters."""
    module = build_flax(case, implementation)
    nnx.update(module, nnx.state(master, nnx.Param))
    return module


def torch_with_weights(case: LayerCase, implementation: str, dtype: str, master, device):
    module = build_torch(case, implementation, dtype, device)
    bridge.flax_to_torch(master, module)
    return module


@contextlib.contextmanager
def exact_fp32():
    """Exact fp32 matmuls: JAX "highest" precision, torch TF32 off (restored afterwards)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with jax.default_matmul_precision("highest"):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ------------------------------------------------------------------------------------------------
# One forward + backward
# ------------------------------------------------------------------------------------------------
def _np64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, np.float64)


def run_jax_layer(module, case: LayerCase, dtype: str, inputs) -> dict[str, np.ndarray]:
    """{"out", "dx" (or "dq", "dk", "dv"), "d <torch name>"...} (float64 NumPy) from a Flax layer:
    output and the vjp with the case's cotangent."""
    xs, ct, seg, pos = inputs
    jdt = JAX_DTYPES[dtype]
    call_kwargs = case.call_kwargs(None if seg is None else jnp.asarray(seg), None if pos is None else jnp.asarray(pos))
    call_kwargs.update(case.dropout_kwargs("jax"))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # rest: a dropout layer's RNG stream

    @jax.jit
    def fwd_bwd(params, rest, xs, ct):
        f = lambda params, *xs: nnx.merge(graphdef, params, rest)(*xs, **call_kwargs)
        out, vjp = jax.vjp(f, params, *xs)
        dstate, *dxs = vjp(ct)
        return out, dstate, dxs

    out, dstate, dxs = fwd_bwd(params, rest, tuple(jnp.asarray(x, jdt) for x in xs), jnp.asarray(ct, jdt))
    result = {"out": _np64(out), **{name: _np64(g) for name, g in zip(case.input_gradients(), dxs)}}
    result.update({f"d {name}": g for name, g in bridge.flax_tree_in_torch_layout(module, dstate).items()})
    return result


def run_torch_layer(module, case: LayerCase, dtype: str, inputs, device) -> dict[str, np.ndarray]:
    xs, ct, seg, pos = inputs
    tdt = TORCH_DTYPES[dtype]
    xts = tuple(torch.tensor(x, dtype=tdt, device=device, requires_grad=True) for x in xs)
    ids = lambda a: None if a is None else torch.tensor(a, dtype=torch.int32, device=device)
    out = module(*xts, **case.call_kwargs(ids(seg), ids(pos)), **case.dropout_kwargs("torch"))
    named = list(module.named_parameters())
    grads = torch.autograd.grad(out, (*xts, *(p for _, p in named)), torch.tensor(ct, dtype=tdt, device=device))
    result = {"out": _np64(out), **{name: _np64(g) for name, g in zip(case.input_gradients(), grads)}}
    result.update({f"d {name}": _np64(g) for (name, _), g in zip(named, grads[len(xts):])})
    return result


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------
def draw_training_data(case: LayerCase):
    """Seeded batches x [steps, B, S, d_model] and targets y [steps, B, S, d_out] (float64): y is
    the running mean over the sequence of x's first d_out features (needs attention)."""
    rng = np.random.default_rng(case.seed)
    batch, seq, d_model = case.shape[:3]
    x = rng.standard_normal((case.steps, batch, seq, d_model))
    counts = np.arange(1, seq + 1)[None, None, :, None]
    y = np.cumsum(x[..., :case.d_out], axis=2) / counts
    return x, y


def _step_seeds(case: LayerCase, step: int) -> list[int] | None:
    """The dropout seeds of one training step, one per block (None without dropout)."""
    if not case.dropout_rate:
        return None
    return [case.dropout_seed(step * case.num_blocks + block) for block in range(case.num_blocks)]


def train_jax(module, case: LayerCase, dtype: str, data) -> np.ndarray:
    """Per-step losses (before each update) of plain SGD on a Flax model."""
    xs, ys = data
    jdt = JAX_DTYPES[dtype]
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # rest: the dropout layers' RNG streams

    @jax.jit
    def step(params, x, y, words):
        keys = None if words is None else jax.random.wrap_key_data(words)
        loss_fn = lambda p: jnp.mean((nnx.merge(graphdef, p, rest)(x, keys) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return loss, jax.tree.map(lambda p, g: p - case.lr * g, params, grads)

    losses = []
    for t, (x, y) in enumerate(zip(xs, ys)):
        seeds = _step_seeds(case, t)
        words = None if seeds is None else jnp.asarray([seed_words(s) for s in seeds], jnp.uint32)
        loss, params = step(params, jnp.asarray(x, jdt), jnp.asarray(y, jdt), words)
        losses.append(float(loss))
    return np.asarray(losses)


def train_torch(module, case: LayerCase, dtype: str, data, device) -> np.ndarray:
    xs, ys = data
    tdt = TORCH_DTYPES[dtype]
    params = list(module.parameters())
    losses = []
    for t, (x, y) in enumerate(zip(xs, ys)):
        out = module(torch.tensor(x, dtype=tdt, device=device), _step_seeds(case, t))
        loss = torch.mean((out - torch.tensor(y, dtype=tdt, device=device)) ** 2)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(case.lr * g)
        losses.append(loss.item())
    return np.asarray(losses)


# ------------------------------------------------------------------------------------------------
# Rows
# ------------------------------------------------------------------------------------------------
def _row(case, impl, quantity, error, allowed, ok, reason="", **extra) -> dict:
    ratio = error / allowed if allowed > 0 else (0.0 if error == 0 else float("inf"))
    return dict(case=case.name, impl=impl, quantity=quantity, error=float(error), allowed=float(allowed),
                ratio=float(ratio), ok=bool(ok), reason=reason, **extra)


def _crash_row(case, impl, e) -> dict:
    return _row(case, impl, "all", float("inf"), 0.0, False, f"{type(e).__name__}: {e}"[:300])


def _agreement_row(case, golden: dict, golden_jax: dict) -> dict:
    impl = "golden torch-f64 vs jax-f64"
    if set(golden) != set(golden_jax):
        return _row(case, impl, "all", float("inf"), GOLDEN_AGREEMENT, False,
                    f"quantities differ: {sorted(set(golden) ^ set(golden_jax))}")
    err = max(float(np.max(np.abs(golden[k] - golden_jax[k]), initial=0.0)) for k in golden)
    return _row(case, impl, "all", err, GOLDEN_AGREEMENT, np.isfinite(err) and err <= GOLDEN_AGREEMENT)


def _layer_rows(case, impl, fast: dict, naive: dict, golden: dict, seconds: float) -> list[dict]:
    """The rule on out (forward factor), dx and every parameter gradient (gradient factor)."""
    rows = []
    for name in golden:
        if name not in fast:
            rows.append(_row(case, impl, name, float("inf"), 0.0, False, "missing", seconds=seconds))
            continue
        factor = FORWARD_FACTOR if name == "out" else GRADIENT_FACTOR
        v = compare(fast[name], naive[name], golden[name], NP_DTYPES[case.dtype], factor)
        rows.append(_row(case, impl, name, v.error, v.allowed, v.ok, v.reason, seconds=seconds))
    return rows


def _training_rows(case, impl, fast: dict, naive: dict, golden: dict, seconds: float) -> list[dict]:
    """The rule over the loss trajectory: the loss of EVERY step must lie within
    FORWARD_FACTOR * max_t |naive_t - golden_t| + floor(golden losses) of the golden loss. (The
    trajectory is held to one allowance, as an output array is: a single scalar's own naive error
    and floor are too noisy -- often exactly 0 -- to bound another scalar's error.) The row
    (quantity "loss") reports the worst step ("worst_step") and the failing steps, if any."""
    f, g = fast["loss"], golden["loss"]
    v = compare(f, naive["loss"], g, NP_DTYPES[case.dtype], FORWARD_FACTOR)
    if v.reason:
        return [_row(case, impl, "loss", v.error, v.allowed, False, v.reason, seconds=seconds, steps=len(g))]
    err = np.abs(f - g)
    failed = np.flatnonzero(err > v.allowed).tolist()
    return [_row(case, impl, "loss", v.error, v.allowed, v.ok, f"fails at steps {failed}" if failed else "",
                 seconds=seconds, steps=len(g), worst_step=int(np.argmax(err)))]


def _implementations(case: LayerCase, device) -> list[str]:
    """Plain implementations always; the kernels on a GPU, on CPU only where case.cpu_kernels."""
    if torch.device(device).type == "cuda" or case.cpu_kernels:
        return ["jax xla", "torch eager", "jax pallas_triton", "torch triton"]
    return ["jax xla", "torch eager"]


def _larger_naive(plain: list[dict], golden: dict) -> dict:
    """Per quantity, the plain result farther from the golden (max abs error over finite entries)."""
    def err(result, name):
        g, n = golden[name], result[name]
        finite = np.isfinite(g) & np.isfinite(n)
        return float(np.max(np.abs(n[finite] - g[finite]), initial=0.0))

    return {name: max(plain, key=lambda r: err(r, name))[name] for name in golden if all(name in r for r in plain)}


def check_layer_case(case: LayerCase, device) -> list[dict]:
    """Rows of the report for one layer case, in the format of `parity.check.check_case`.

    - "golden torch-f64 vs jax-f64": the Flax model in float64 ("xla", weights from the torch
      golden by `torch_to_flax`) agrees with the golden to 1e-10 (the definitions match).
    - "jax xla", "torch eager": the plain fp32 runs, naive = themselves (they pass by
      construction; kept as in `check_case`, they show the size of the plain error).
    - "jax pallas_triton", "torch triton": the kernels; naive error = the LARGER of the two
      frameworks' plain fp32 errors, per quantity. Both plain runs are equally valid fp32
      references, and at these small shapes a single one is a noisy yardstick: a 16-element bias
      gradient's plain error can come out 3x smaller than the other framework's by luck (seen
      once: ratio 1.03 with JAX's own naive, 0.34 with the larger; over 112 kernel rows of 12
      reseeded cases the worst ratio was 0.91 with the own-framework naive, 0.64 with the larger).
    - training only, "jax xla (naive: torch eager)": the JAX fp32 run held to the rule with the
      torch fp32 run as naive (the fp32 cross-framework check; on CPU the only fp32 check of the
      training run that is not true by construction).
    """
    train = case.kind == "train"
    run_jax, run_torch = (train_jax, train_torch) if train else (run_jax_layer, run_torch_layer)
    inputs = draw_training_data(case) if train else draw_inputs(case)
    rows_for = _training_rows if train else _layer_rows
    wrap = (lambda losses: {"loss": losses}) if train else (lambda result: result)

    master = master_flax(case)
    golden_torch = torch_with_weights(case, "eager", "float64", master, device)
    start = {k: v.detach().clone() for k, v in golden_torch.state_dict().items()}
    golden = wrap(run_torch(golden_torch, case, "float64", inputs, device))
    rows = []
    try:
        golden_torch.load_state_dict(start)  # (training moved the weights)
        # standard dtype promotion: flax's LayerNorm promotes its float64 input with float32, which
        # jax's strict promotion refuses (the library's own code runs under either)
        with jax.enable_x64(True), jax.default_matmul_precision("highest"), jax.numpy_dtype_promotion("standard"):
            jax64 = build_flax(case, "xla", "float64")
            bridge.torch_to_flax(golden_torch, jax64)
            rows.append(_agreement_row(case, golden, wrap(run_jax(jax64, case, "float64", inputs))))
    except Exception as e:  # reported, like a crashing implementation
        rows.append(_crash_row(case, "golden torch-f64 vs jax-f64", e))

    results, seconds = {}, {}
    with exact_fp32():
        for impl in _implementations(case, device):
            framework, implementation = IMPLEMENTATIONS[impl]
            t0 = time.time()
            try:
                if framework == "jax":
                    out = run_jax(flax_with_weights(case, implementation, master), case, case.dtype, inputs)
                else:
                    module = torch_with_weights(case, implementation, case.dtype, master, device)
                    out = run_torch(module, case, case.dtype, inputs, device)
            except Exception as e:  # a crash is a failure of that implementation, reported
                rows.append(_crash_row(case, impl, e))
                continue
            results[impl], seconds[impl] = wrap(out), time.time() - t0

    plain = [results[p] for p in PLAIN.values() if p in results]
    naive_for_kernels = _larger_naive(plain, golden) if plain else None
    for impl, result in results.items():
        if impl in PLAIN.values():
            rows += rows_for(case, impl, result, result, golden, seconds[impl])
        elif naive_for_kernels is None:
            rows.append(_row(case, impl, "all", float("inf"), 0.0, False, "no plain result to serve as naive"))
        else:
            rows += rows_for(case, impl, result, naive_for_kernels, golden, seconds[impl])
    if train and "jax xla" in results and "torch eager" in results:
        rows += rows_for(case, "jax xla (naive: torch eager)", results["jax xla"], results["torch eager"], golden, 0.0)
    return rows
