"""PyTorch + Triton reference backend of the attention library.

`flash_attention` (Triton kernels or eager PyTorch, see its docstring), `flash_attention_reference`
(the eager reference returning (out, lse)), `stick_breaking_attention` / `stick_breaking_reference`
(stick-breaking attention, "ExpoSB"; torch_ref.stick_breaking), `Rope` (rotary position embedding
config, fused into the kernels; `torch_ref.rope.apply_rope` is the plain rotation) and
`FlashConfig` / `StickBreakingConfig` (the kernels' tile configurations).

Triton is imported lazily: `import torch_ref` does not import it, so TRITON_INTERPRET=1 may still
be set afterwards; the first Triton call (or touching `torch_ref.FlashConfig` or
`torch_ref.StickBreakingConfig`) imports it.
"""
from .flash import UnknownImplementationError, flash_attention, flash_attention_reference, resolve_implementation
from .layers import EncoderBlock, MultiHeadSelfAttention
from .positions import sinusoidal_positions
from .rope import Rope, apply_rope
from .stick_breaking import stick_breaking_attention, stick_breaking_reference

__all__ = ["flash_attention", "flash_attention_reference", "Rope", "apply_rope", "FlashConfig", "default_config",
           "resolve_implementation", "UnknownImplementationError", "EncoderBlock", "MultiHeadSelfAttention",
           "sinusoidal_positions", "stick_breaking_attention", "stick_breaking_reference", "StickBreakingConfig"]


def __getattr__(name):
    if name in ("FlashConfig", "default_config"):
        from . import flash_triton
        return getattr(flash_triton, name)
    if name == "StickBreakingConfig":
        from . import stick_breaking_triton
        return stick_breaking_triton.StickBreakingConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
