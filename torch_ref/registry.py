"""Which implementation computes a call: one entry per (variant, implementation) and the rule for None.

The shape of `jax_attn.registry`: an entry holds the function that runs the call, why it cannot
serve a call (`unsupported_reason`), its tile config type and the default tile config for a call;
`resolve(variant, implementation, call)` accepts the names, applies the rule for None (`choose`)
and raises for an unknown name and for an implementation that cannot serve the call.

Implementation names (the same as jax_attn's wherever the thing is the same):
  - "triton": the variant's Triton kernels and autograd Function (`torch_ref.ops.<variant>.triton`),
    imported only when a call runs them; on CPU through the Triton interpreter;
  - "eager": the variant's plain PyTorch reference (`torch_ref.ops.<variant>.reference`),
    differentiable by autograd (not jax_attn's "xla": a different thing, so a different name);
  - None: "triton" when q is on CUDA or the Triton interpreter is active
    (os.environ["TRITON_INTERPRET"] == "1"), else "eager".
Anything else raises `UnknownImplementationError` (a ValueError and a NotImplementedError);
"triton" raises NotImplementedError when it cannot serve the call. There is no silent fallback.

Triton is imported lazily (only when the Triton path runs), so the choice of interpreter
(`TRITON_INTERPRET=1`) can still be made after `import torch_ref`.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Callable

import torch

from attn_spec.registry import Entry, Registry, UnknownImplementationError

from .ops.common.validation import segment_pair_for_kernel
from .ops.dilated import reference as dilated_ref
from .ops.orderings import reference as orderings_ref
from .ops.nsa import reference as nsa_ref
from .ops.softmax import reference as softmax_ref
from .ops.stick_breaking import reference as stick_breaking_ref

# variant -> its Triton kernel module (relative to this package)
TRITON_MODULES = {"softmax": ".ops.softmax.triton", "stick_breaking": ".ops.stick_breaking.triton",
                  "dilated": ".ops.dilated.triton", "nsa": ".ops.nsa.triton"}
# variant -> (its config class, its default-config function) in TRITON_MODULES[variant]
_TRITON_CONFIGS = {"softmax": ("BlockSizes", "default_block_sizes"),
                   "stick_breaking": ("StickBreakingBlockSizes", "default_stick_breaking_block_sizes"),
                   "dilated": ("BlockSizes", "default_block_sizes"),  # the softmax engine's tiles
                   "nsa": ("NSABlockSizes", "default_nsa_block_sizes")}

__all__ = ["Call", "Entry", "IMPLEMENTATIONS", "REGISTRY", "TRITON_MODULES", "UnknownImplementationError", "VARIANTS",
           "canonical", "check_config", "choose", "interpreter_requested", "resolve", "resolve_implementation"]


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclasses.dataclass(frozen=True)
class Call:
    """What an implementation's choice depends on: q's device and dtype, and the head dim."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int

    @classmethod
    def of(cls, q: torch.Tensor) -> "Call":
        return cls(q.device, q.dtype, q.shape[-1])

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def _triton_reason(call: Call, variant: str) -> str | None:
    if call.dtype == torch.float64:
        return "the Triton kernels take float16, bfloat16 or float32, not float64; use implementation='eager'"
    if not call.is_cuda and not interpreter_requested():
        return (f"it needs a CUDA tensor or the Triton interpreter (TRITON_INTERPRET=1); "
                f"q is on {call.device}")
    try:
        kernels = importlib.import_module(TRITON_MODULES[variant], __package__)
    except ImportError as e:  # pragma: no cover - triton is a declared dependency
        return f"it needs triton: {e}"
    if not call.is_cuda and not kernels.INTERPRETED:
        return ("a CPU tensor needs the Triton interpreter, but triton was imported before "
                "TRITON_INTERPRET=1 was set")
    return None


def _kernels(variant: str):
    return importlib.import_module(TRITON_MODULES[variant], __package__)


def _triton_config_type(variant: str) -> type:
    return getattr(_kernels(variant), _TRITON_CONFIGS[variant][0])


def _triton_default_config(variant: str, call: Call):
    kernels = _kernels(variant)
    default = getattr(kernels, _TRITON_CONFIGS[variant][1])  # looked up per call (tests patch it)
    return default(call.head_dim, call.dtype, call.is_cuda and not kernels.INTERPRETED)


def _softmax_eager(q, k, v, *, causal, scale, q_ids, kv_ids, window, softcap, rope, q_pos, kv_pos, config=None,
                   alibi=None, dropout=None, order=None):
    if order is not None:  # the explicit composite: permute, attend, unpermute
        return orderings_ref.attention(q, k, v, order, causal=causal, scale=scale, q_ids=q_ids, kv_ids=kv_ids,
                                       window=window, softcap=softcap, alibi=alibi, dropout=dropout)
    return softmax_ref.attention(q, k, v, causal=causal, scale=scale, q_ids=q_ids, kv_ids=kv_ids, window=window,
                                 softcap=softcap, rope=rope, q_pos=q_pos, kv_pos=kv_pos, alibi=alibi, dropout=dropout)


def _softmax_triton(q, k, v, *, causal, scale, q_ids, kv_ids, window, softcap, rope, q_pos, kv_pos, config=None,
                    alibi=None, dropout=None, order=None):
    q_ids, kv_ids = segment_pair_for_kernel(q_ids, kv_ids)
    q_pos, kv_pos = segment_pair_for_kernel(q_pos, kv_pos)
    gather = None
    if order is not None:  # the kernels gather rows at order[t] and store there; ids per ordered position
        if q_ids is not None:
            q_ids, kv_ids = (x.index_select(1, order).contiguous() for x in (q_ids, kv_ids))
        gather = (order.to(torch.int32)[None].expand(q.shape[0], -1), True, 1)
    return _kernels("softmax").FlashAttentionFn.apply(q, k, v, q_ids, kv_ids, causal, scale, window, softcap, rope,
                                                     q_pos, kv_pos, config, alibi, dropout, gather)


def _stick_breaking_eager(q, k, v, *, scale, decay, rope, q_pos, kv_pos, attend_current=False, q_ids=None,
                          kv_ids=None, config=None):
    return stick_breaking_ref.attention(q, k, v, scale=scale, decay=decay, rope=rope, q_pos=q_pos, kv_pos=kv_pos,
                                        attend_current=attend_current, q_ids=q_ids, kv_ids=kv_ids)


def _stick_breaking_triton(q, k, v, *, scale, decay, rope, q_pos, kv_pos, attend_current=False, q_ids=None,
                           kv_ids=None, config=None):
    q_pos, kv_pos = segment_pair_for_kernel(q_pos, kv_pos)
    decay_t = decay if isinstance(decay, torch.Tensor) else None
    decay_value = 0.0 if decay_t is not None else decay
    return _kernels("stick_breaking").StickBreakingFn.apply(q, k, v, decay_t, decay_value, scale, rope, q_pos, kv_pos,
                                                           config, attend_current, q_ids, kv_ids)


def _dilated_eager(q, k, v, *, segment_lengths, dilation_rates, causal, merge, scale, config=None, order=None):
    if order is not None:  # the explicit composite: permute, attend, unpermute
        return orderings_ref.dilated_attention(q, k, v, order, segment_lengths=segment_lengths,
                                               dilation_rates=dilation_rates, causal=causal, merge=merge, scale=scale)
    return dilated_ref.attention(q, k, v, segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                                 causal=causal, merge=merge, scale=scale)


def _dilated_triton(q, k, v, *, segment_lengths, dilation_rates, causal, merge, scale, config=None, order=None):
    return _kernels("dilated").dilated_attention_triton(q, k, v, segment_lengths=segment_lengths,
                                                        dilation_rates=dilation_rates, causal=causal, merge=merge,
                                                        scale=scale, config=config, order=order)


# NSA has several operations (attn_spec.nsa): an entry's fn takes the operation's name first,
# `fn(op, *args, **kwargs)`, op one of "selection", "compress_kv", "compression", "select_blocks", "combine",
# each with the arguments of `torch_ref.ops.nsa.reference`'s function of that name (the Triton
# module's take `config` as well).
def _nsa_eager(op: str, *args, config=None, **kwargs):
    return getattr(nsa_ref, op)(*args, **kwargs)


def _nsa_triton(op: str, *args, **kwargs):
    return getattr(_kernels("nsa"), op)(*args, **kwargs)


def _triton_entry(variant: str, fn: Callable) -> Entry:
    return Entry(variant, "triton", fn, lambda call: _triton_reason(call, variant),
                 lambda: _triton_config_type(variant), lambda call: _triton_default_config(variant, call))


_ENTRIES = (
    _triton_entry("softmax", _softmax_triton),
    Entry("softmax", "eager", _softmax_eager, lambda call: None),
    _triton_entry("stick_breaking", _stick_breaking_triton),
    Entry("stick_breaking", "eager", _stick_breaking_eager, lambda call: None),
    _triton_entry("dilated", _dilated_triton),
    Entry("dilated", "eager", _dilated_eager, lambda call: None),
    _triton_entry("nsa", _nsa_triton),
    Entry("nsa", "eager", _nsa_eager, lambda call: None),
)


def _choose(variant: str, call: Call) -> str:
    """The rule for implementation=None, every variant: "triton" when q is on CUDA or the Triton
    interpreter is active (os.environ["TRITON_INTERPRET"] == "1"), else "eager"."""
    return "triton" if (call.is_cuda or interpreter_requested()) else "eager"


# variant -> name -> entry. Adding a backend = one entry.
REGISTRY = Registry(_ENTRIES, _choose)
canonical, choose, resolve, check_config = REGISTRY.canonical, REGISTRY.choose, REGISTRY.resolve, REGISTRY.check_config
VARIANTS = tuple(REGISTRY)
IMPLEMENTATIONS = tuple(REGISTRY["softmax"])  # canonical names


def resolve_implementation(q: torch.Tensor, implementation=None) -> str:
    """The name a call would use (`choose` for None; no check that it can serve the call)."""
    if implementation is None:
        return choose("softmax", Call.of(q))
    return canonical("softmax", implementation)
