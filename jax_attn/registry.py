"""Which implementation computes a call: one entry per (variant, implementation) and the rule for None.

An entry holds the function that runs the call, why it cannot serve a call (`unsupported_reason`),
its tile config type and the default tile config for a call. `resolve(variant, implementation,
call)` is what the public functions use: it accepts the canonical names and the documented older
spellings, applies the rule for None (`choose`), and raises for names it does not know and for an
implementation that cannot serve the call (no silent fallback).

Implementation names (tokamax's, the same in torch_ref wherever the thing is the same):
  "triton": the Pallas kernels with Triton lowering (compiled on NVIDIA sm80+, interpreted on CPU);
  "mosaic": the Pallas Mosaic GPU kernels (Hopper, sm90);
  "xla":    plain jnp (any device; float64 for golden references).
"pallas_triton" and "mosaic_gpu" are accepted spellings of "triton" and "mosaic" (`ALIASES`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from attn_spec.registry import Entry, Registry, UnknownImplementationError
from jax_attn.device import pallas_triton_unsupported_reason
from jax_attn.ops.common.spec import AttentionSpec, padded_head_dim
from jax_attn.ops.dilated import reference as dilated_reference
from jax_attn.ops.dilated import triton as dilated_triton
from jax_attn.ops.orderings import reference as orderings_reference
from jax_attn.ops.nsa import reference as nsa_reference
from jax_attn.ops.nsa import triton as nsa_triton
from jax_attn.ops.softmax import mosaic as softmax_mosaic
from jax_attn.ops.softmax import reference as softmax_reference
from jax_attn.ops.softmax import triton as softmax_triton
from jax_attn.ops.stick_breaking import mosaic as stick_breaking_mosaic
from jax_attn.ops.stick_breaking import reference as stick_breaking_reference
from jax_attn.ops.stick_breaking import triton as stick_breaking_triton

ALIASES = {"pallas_triton": "triton", "mosaic_gpu": "mosaic"}  # accepted older spellings -> canonical

__all__ = ["ALIASES", "Call", "Entry", "IMPLEMENTATIONS", "REGISTRY", "UnknownImplementationError", "VARIANTS",
           "canonical", "check_config", "choose", "default_implementation", "resolve"]


@dataclasses.dataclass(frozen=True)
class Call:
    """What an implementation's choice depends on: the spec (mask, softcap, RoPE, precision), the
    head dim (unpadded), the dtype, whether RoPE positions are given as arrays and whether keys
    have positions of their own (a (q_pos, kv_pos) pair)."""

    spec: AttentionSpec
    head_dim: int
    dtype: Any
    positions: bool = False
    kv_positions: bool = False

    @property
    def interpret(self) -> bool:
        """The Pallas Triton kernels run through the interpreter (CPU)."""
        return jax.default_backend() == "cpu"

    @property
    def head_pad(self) -> int:
        return padded_head_dim(self.spec, self.head_dim)


def _float64_reason(call: Call) -> str | None:
    if jnp.dtype(call.dtype) == jnp.float64:
        return "float64 inputs are served by implementation='xla' only (the golden reference)"
    return None


def _triton_reason(call: Call) -> str | None:
    return _float64_reason(call) or pallas_triton_unsupported_reason()


_ORDERED_MOSAIC = ("an ordering gathers every tile's rows through an index vector; the Mosaic GPU kernels "
                   "load tiles as contiguous TMA boxes (implementation='triton' gathers them)")


def _softmax_mosaic_reason(call: Call) -> str | None:
    if call.spec.ordered:
        return _ORDERED_MOSAIC
    return _triton_reason(call) or softmax_mosaic.unsupported_reason(call.spec, call.head_dim, call.dtype,
                                                                     call.positions)


def _stick_breaking_mosaic_reason(call: Call) -> str | None:
    return _triton_reason(call) or stick_breaking_mosaic.unsupported_reason(call.spec, call.head_dim, call.dtype)


def _softmax_mosaic_config_reason(config, call: Call) -> str | None:
    return softmax_mosaic.rope_blocks_reason(config) if call.spec.rope is not None else None


def _stick_breaking_mosaic_config_reason(config, call: Call) -> str | None:
    if config.block_k != stick_breaking_mosaic.BLOCK:  # the backward reads the forward's per-block sums
        return (f"the Mosaic GPU forward stores its sums per {stick_breaking_mosaic.BLOCK} keys: "
                f"block_k must be {stick_breaking_mosaic.BLOCK}, got {config.block_k}")
    return None


def _softmax_triton(q, k, v, q_seg, kv_seg, spec, *, q_pos=None, kv_pos=None, slopes=None, seed=None,
                    config=None, order=None):
    return softmax_triton.flash_attention_pallas(q, k, v, q_seg, kv_seg, spec, q_pos=q_pos, kv_pos=kv_pos,
                                                 slopes=slopes, seed=seed, blocks=config, order=order)


def _softmax_mosaic(q, k, v, q_seg, kv_seg, spec, *, q_pos=None, kv_pos=None, slopes=None, seed=None, order=None,
                    config=None):
    # the Hopper kernels (`ops/softmax/mosaic.py`), wired through the engine's padding and custom_vjp
    return softmax_triton.flash_attention_pallas(q, k, v, q_seg, kv_seg, spec, q_pos=q_pos, kv_pos=kv_pos,
                                                 kernels="mosaic_gpu", mosaic_blocks=config)


def _softmax_xla(q, k, v, q_seg, kv_seg, spec, *, q_pos=None, kv_pos=None, slopes=None, seed=None,
                 config=None, order=None):
    if order is not None:  # the explicit composite: permute, attend, unpermute
        return orderings_reference.ordered_attention_reference(q, k, v, q_seg, kv_seg, spec, order, seed=seed,
                                                               slopes=slopes)
    return softmax_reference.attention_reference(q, k, v, q_seg, kv_seg, spec, q_pos=q_pos, kv_pos=kv_pos,
                                                 slopes=slopes, seed=seed)


def _stick_breaking_triton(q, k, v, decay, spec, *, pos=None, kv_pos=None, q_ids=None, kv_ids=None,
                           attend_current=False, config=None):
    return stick_breaking_triton.stick_breaking_pallas(q, k, v, decay, spec, pos=pos, kv_pos=kv_pos, q_ids=q_ids,
                                                       kv_ids=kv_ids, attend_current=attend_current, blocks=config)


def _stick_breaking_mosaic(q, k, v, decay, spec, *, pos=None, kv_pos=None, q_ids=None, kv_ids=None,
                           attend_current=False, config=None):
    # the forward on the Hopper kernel (`ops/stick_breaking/mosaic.py`), the backward on Pallas Triton's
    return stick_breaking_triton.stick_breaking_pallas(q, k, v, decay, spec, pos=pos, kv_pos=kv_pos, q_ids=q_ids,
                                                       kv_ids=kv_ids, attend_current=attend_current, blocks=config,
                                                       forward="mosaic_gpu")


def _stick_breaking_xla(q, k, v, decay, spec, *, pos=None, kv_pos=None, q_ids=None, kv_ids=None,
                        attend_current=False, config=None):
    return stick_breaking_reference.stick_breaking_reference(q, k, v, decay, spec, pos=pos, kv_pos=kv_pos,
                                                             q_ids=q_ids, kv_ids=kv_ids, attend_current=attend_current)


def _dilated_triton(q, k, v, spec, *, segment_lengths, dilation_rates, merge, config=None, order=None):
    return dilated_triton.dilated_attention_triton(q, k, v, segment_lengths=segment_lengths,
                                                   dilation_rates=dilation_rates, causal=spec.causal, merge=merge,
                                                   scale=spec.scale, precision=spec.precision, blocks=config,
                                                   order=order)


def _dilated_mosaic(q, k, v, spec, *, segment_lengths, dilation_rates, merge, config=None, order=None):
    return dilated_triton.dilated_attention_triton(q, k, v, segment_lengths=segment_lengths,
                                                   dilation_rates=dilation_rates, causal=spec.causal, merge=merge,
                                                   scale=spec.scale, precision=spec.precision, mosaic=True,
                                                   mosaic_blocks=config)


def _dilated_xla(q, k, v, spec, *, segment_lengths, dilation_rates, merge, config=None, order=None):
    if order is not None:  # the explicit composite: permute, attend, unpermute
        return orderings_reference.ordered_dilated_reference(
            q, k, v, order, segment_lengths=segment_lengths, dilation_rates=dilation_rates, causal=spec.causal,
            merge=merge, scale=spec.scale)
    return dilated_reference.dilated_reference(q, k, v, segment_lengths=segment_lengths,
                                               dilation_rates=dilation_rates, causal=spec.causal, merge=merge,
                                               scale=spec.scale)


def _nsa_triton(q, k, v, *, blocks=None, counts=None, ranges=None, q_ids=None, block_size, spec, config=None):
    return nsa_triton.selection_pallas(q, k, v, blocks=blocks, counts=counts, ranges=ranges, q_ids=q_ids,
                                       block_size=block_size, causal=spec.causal, scale=spec.scale,
                                       precision=spec.precision, config=config)


def _nsa_xla(q, k, v, *, blocks=None, counts=None, ranges=None, q_ids=None, block_size, spec, config=None):
    return nsa_reference.selection_reference(q, k, v, blocks, ranges, block_size=block_size, causal=spec.causal,
                                             scale=spec.scale, precision=spec.precision, q_ids=q_ids, kv_ids=q_ids)


def _softmax_triton_default(call: Call):
    return softmax_triton.default_block_sizes(call.head_pad, call.interpret, call.dtype,
                                              rope=call.spec.rope is not None, rope_positions=call.positions)


def _stick_breaking_default(call: Call):
    return stick_breaking_triton.default_stick_breaking_block_sizes(call.head_pad, call.interpret, call.dtype)


_ENTRIES = (
    Entry("softmax", "triton", _softmax_triton, _triton_reason, lambda: softmax_triton.BlockSizes,
          _softmax_triton_default),
    Entry("softmax", "mosaic", _softmax_mosaic, _softmax_mosaic_reason, lambda: softmax_mosaic.MosaicBlockSizes,
          lambda call: softmax_mosaic.default_mosaic_block_sizes(call.head_pad), _softmax_mosaic_config_reason),
    Entry("softmax", "xla", _softmax_xla, lambda call: None),
    Entry("stick_breaking", "triton", _stick_breaking_triton, _triton_reason,
          lambda: stick_breaking_triton.StickBreakingBlockSizes, _stick_breaking_default),
    # the config is the Triton backward's (the Mosaic forward's tiles are fixed: 64 rows, 64 keys)
    Entry("stick_breaking", "mosaic", _stick_breaking_mosaic, _stick_breaking_mosaic_reason,
          lambda: stick_breaking_triton.StickBreakingBlockSizes, _stick_breaking_default,
          _stick_breaking_mosaic_config_reason),
    Entry("stick_breaking", "xla", _stick_breaking_xla, lambda call: None),
    # each branch one call of the softmax engine through a row map (its Triton kernels)
    Entry("dilated", "triton", _dilated_triton, _triton_reason, lambda: softmax_triton.BlockSizes,
          _softmax_triton_default),
    # the branches without segment ids on the Hopper kernels, the others on the Triton kernels
    Entry("dilated", "mosaic", _dilated_mosaic, _softmax_mosaic_reason, lambda: softmax_mosaic.MosaicBlockSizes,
          lambda call: softmax_mosaic.default_mosaic_block_sizes(call.head_pad), _softmax_mosaic_config_reason),
    Entry("dilated", "xla", _dilated_xla, lambda call: None),
    # NSA: the selection kernels (and, for its other branches, the flash engine and chunked XLA)
    Entry("nsa", "triton", _nsa_triton, _triton_reason, lambda: nsa_triton.NSABlockSizes,
          lambda call: nsa_triton.default_block_sizes(call.head_pad, call.interpret, call.dtype)),
    Entry("nsa", "xla", _nsa_xla, lambda call: None),
)
def _choose(variant: str, call: Call) -> str:
    """The rule for implementation=None.

    Softmax: "xla" where Pallas Triton cannot run (e.g. TPU, pre-sm80 GPUs); "mosaic" where its
    Hopper kernels serve the call (faster than the Triton engine; docs/design/softmax.md); else
    "triton" (compiled on NVIDIA sm80+, through the interpreter on CPU).
    Stick-breaking: "xla" where Pallas Triton cannot run, else "triton", on Hopper too: the Mosaic
    forward walks every tile, while the Triton forward ends a row block's walk where its sticks are
    spent (see `jax_attn.stick_breaking_attention`). Dilated: as softmax ("mosaic" where the Hopper
    kernels serve the call: 16-bit, head dims 33 to 128). Ordered calls (spec.ordered, an ordering
    with a locality pattern): "triton", the kernels that gather rows (Mosaic's reason says why).
    NSA: as stick-breaking ("xla" where Pallas Triton cannot run, else "triton": its selection
    kernels have no Mosaic twin).
    """
    if pallas_triton_unsupported_reason() is not None:
        return "xla"
    if variant in ("softmax", "dilated") and _softmax_mosaic_reason(call) is None:
        return "mosaic"
    return "triton"


# variant -> canonical name -> entry. Adding a backend = one entry (and, if it should be picked by
# default, a line in `_choose`).
REGISTRY = Registry(_ENTRIES, _choose, ALIASES)
canonical, choose, resolve, check_config = REGISTRY.canonical, REGISTRY.choose, REGISTRY.resolve, REGISTRY.check_config
VARIANTS = tuple(REGISTRY)
IMPLEMENTATIONS = tuple(REGISTRY["softmax"])  # canonical names


def default_implementation(spec: AttentionSpec | None = None, head_dim: int | None = None,
                           dtype=None, positions: bool = False) -> str:
    """The canonical name implementation=None picks (`choose`): for softmax attention when the
    call is described (spec, head dim, dtype, whether RoPE positions are given), else the rule
    without the Mosaic kernels (that of stick-breaking attention)."""
    if spec is None:
        return choose("stick_breaking", None)
    return choose("softmax", Call(spec, head_dim, dtype, positions))
