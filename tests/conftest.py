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


# The library must work under jax's strict settings (its own test suites run under them): every
# test here does, so that an implicit rank or dtype promotion anywhere fails loudly.
import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
