"""Shared test set-up. CPU runs: Triton kernels go through TRITON_INTERPRET=1 (it must be set
before triton is imported) and Pallas kernels through interpret mode (chosen by jax_attn)."""
import os


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

