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


# Eight CPU devices for the sequence-parallel tests (tests/test_ring.py); the flag must precede jax's
# backend initialisation. Other tests are unaffected: the default device stays the first one, and
# the flag only concerns the CPU platform.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


# The autotune cache (attn_spec.autotune) is read by implementation=None / config=None: tests never
# read a developer's ~/.cache file; they see a path in a fresh temporary folder, with no file in it.
import tempfile  # noqa: E402

os.environ["JAX_ATTN_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="jax_attn-test-cache-"), "autotune.json")


# The library must work under jax's strict settings (its own test suites run under them): every
# test here does, so that an implicit rank or dtype promotion anywhere fails loudly.
import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
