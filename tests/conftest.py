"""Shared test set-up. CPU runs: Triton kernels go through TRITON_INTERPRET=1 (it must be set
before triton is imported) and Pallas kernels through interpret mode (chosen by jax_attn)."""
import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    # gpu-marked tests need compiled kernels; on a machine without a GPU they are an error to run,
    # so they are deselected by the documented command (-m "not gpu"), never skipped.
    pass
