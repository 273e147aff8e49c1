"""PyTorch + Triton reference backend of the attention library.

`flash_attention` (Triton kernels or eager PyTorch, see its docstring), `flash_attention_reference`
(the eager reference returning (out, lse)), `stick_breaking_attention` / `stick_breaking_reference`
(stick-breaking attention, "ExpoSB"; torch_ref.ops.stick_breaking), `Rope` (rotary position
embedding config, fused into the kernels; `torch_ref.ops.common.rope.apply_rope` is the plain
rotation) and `FlashConfig` / `StickBreakingConfig` (the kernels' tile configurations).

Layout (variant first, the mirror of jax_attn): `api.py` (the public functions), `registry.py`
(implementation names), `ops/common/` (validation, rope, the Triton tile toolkit),
`ops/softmax/` and `ops/stick_breaking/` (each: `reference.py` beside `triton.py`), `nn/` (layers,
positions).

Triton is imported lazily: `import torch_ref` does not import it, so TRITON_INTERPRET=1 may still
be set afterwards; the first Triton call (or touching `torch_ref.FlashConfig` or
`torch_ref.StickBreakingConfig`) imports it.
"""
from .api import flash_attention, flash_attention_reference, stick_breaking_attention, stick_breaking_reference
from .nn.layers import EncoderBlock, MultiHeadSelfAttention
from .nn.positions import sinusoidal_positions
from .ops.common.rope import Rope, apply_rope
from .registry import UnknownImplementationError, resolve_implementation

__all__ = ["flash_attention", "flash_attention_reference", "Rope", "apply_rope", "FlashConfig", "default_config",
           "resolve_implementation", "UnknownImplementationError", "EncoderBlock", "MultiHeadSelfAttention",
           "sinusoidal_positions", "stick_breaking_attention", "stick_breaking_reference", "StickBreakingConfig"]


def __getattr__(name):
    if name in ("FlashConfig", "default_config"):
        from .ops.softmax import triton as softmax_triton
        return getattr(softmax_triton, name)
    if name == "StickBreakingConfig":
        from .ops.stick_breaking import triton as stick_breaking_triton
        return stick_breaking_triton.StickBreakingConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
