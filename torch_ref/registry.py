"""Implementation names and how to run them.

Every public function takes `implementation`: None, "triton" or "eager".
  - "eager": the variant's plain PyTorch reference (`torch_ref.ops.<variant>.reference`),
    differentiable by autograd;
  - "triton": the variant's Triton kernels and autograd Function (`torch_ref.ops.<variant>.triton`,
    `TRITON_MODULES`), imported only when a call runs them;
  - None: "triton" when q is on CUDA or the Triton interpreter is active
    (os.environ["TRITON_INTERPRET"] == "1"), else "eager".
Anything else raises `UnknownImplementationError` (a ValueError and a NotImplementedError);
"triton" raises NotImplementedError when it cannot serve the call. There is no silent fallback.

Triton is imported lazily (only when the Triton path runs), so the choice of interpreter
(`TRITON_INTERPRET=1`) can still be made after `import torch_ref`.
"""
from __future__ import annotations

import importlib
import os

import torch

IMPLEMENTATIONS = (None, "triton", "eager")
# variant -> its Triton kernel module (relative to this package)
TRITON_MODULES = {"softmax": ".ops.softmax.triton", "stick_breaking": ".ops.stick_breaking.triton"}

__all__ = ["IMPLEMENTATIONS", "TRITON_MODULES", "UnknownImplementationError", "interpreter_requested",
           "resolve_implementation", "triton_module"]


class UnknownImplementationError(ValueError, NotImplementedError):
    """`implementation` is not None, "triton" or "eager" (both a ValueError and a NotImplementedError)."""


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_implementation(q: torch.Tensor, implementation=None) -> str:
    """The implementation a call would use: see `torch_ref.flash_attention` for the rule."""
    if implementation not in IMPLEMENTATIONS:
        raise UnknownImplementationError(
            f"implementation must be None, 'triton' or 'eager', got {implementation!r}")
    if implementation is None:
        return "triton" if (q.is_cuda or interpreter_requested()) else "eager"
    return implementation


def triton_module(q: torch.Tensor, variant: str):
    """Import the kernel module of `variant` (a key of TRITON_MODULES), or raise NotImplementedError
    saying why Triton cannot serve this call."""
    if q.dtype == torch.float64:
        raise NotImplementedError("implementation='triton' does not support float64; use implementation='eager'")
    if not q.is_cuda and not interpreter_requested():
        raise NotImplementedError(
            f"implementation='triton' needs a CUDA tensor or the Triton interpreter (TRITON_INTERPRET=1); "
            f"q is on {q.device}")
    try:
        kernels = importlib.import_module(TRITON_MODULES[variant], __package__)
    except ImportError as e:  # pragma: no cover - triton is a declared dependency
        raise NotImplementedError(f"implementation='triton' needs triton: {e}") from e
    if not q.is_cuda and not kernels.INTERPRETED:
        raise NotImplementedError(
            "implementation='triton' on a CPU tensor needs the Triton interpreter, but triton was imported "
            "before TRITON_INTERPRET=1 was set")
    return kernels
