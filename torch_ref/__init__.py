"""PyTorch + Triton reference backend of the attention library.

`flash_attention` (Triton kernels or eager PyTorch, see its docstring), `flash_attention_reference`
(the eager reference returning (out, lse)) and `FlashConfig` (the kernels' tile configuration).

Triton is imported lazily: `import torch_ref` does not import it, so TRITON_INTERPRET=1 may still
be set afterwards; the first Triton call (or touching `torch_ref.FlashConfig`) imports it.
"""
from .flash import UnknownImplementationError, flash_attention, flash_attention_reference, resolve_implementation

__all__ = ["flash_attention", "flash_attention_reference", "FlashConfig", "default_config",
           "resolve_implementation", "UnknownImplementationError"]


def __getattr__(name):
    if name in ("FlashConfig", "default_config"):
        from . import flash_triton
        return getattr(flash_triton, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
