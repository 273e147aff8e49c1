"""Device facts in one place: what the kernels run on and what they recommend."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    platform: str  # "gpu" or "cpu" (or another JAX platform)
    name: str  # e.g. "NVIDIA H100 80GB HBM3"
    compute_capability: tuple[int, int] | None  # NVIDIA only
    memory_bytes: int | None
    sm_count: int | None


@functools.lru_cache(maxsize=None)
def device_info(device: jax.Device | None = None) -> DeviceInfo:
    """Facts about `device` (default: the first JAX device), read once."""
    device = device or jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    compute_capability = tuple(int(x) for x in str(cc).split(".")) if cc else None
    memory = None
    try:
        stats = device.memory_stats() or {}
        memory = stats.get("bytes_limit")
    except Exception:  # CPU devices may not report memory; that is not an error
        memory = None
    return DeviceInfo(platform=device.platform, name=device.device_kind,
                      compute_capability=compute_capability, memory_bytes=memory,
                      sm_count=getattr(device, "core_count", None))


def recommended_dtype() -> jnp.dtype:
    """bf16 on GPUs with native bf16 matrix units (sm80+), else float32."""
    info = device_info()
    if info.platform == "gpu" and info.compute_capability and info.compute_capability >= (8, 0):
        return jnp.bfloat16
    return jnp.float32


def pallas_triton_unsupported_reason() -> str | None:
    """Why the Pallas Triton engine cannot run here, or None if it can."""
    info = device_info()
    if info.platform == "cpu":
        return None  # runs through the Pallas interpreter
    if info.platform != "gpu":
        return f"Pallas Triton kernels need an NVIDIA GPU or the CPU interpreter, not {info.platform!r}"
    if info.compute_capability is not None and info.compute_capability < (8, 0):
        return f"Pallas Triton kernels need sm80+, this GPU is sm{info.compute_capability}"
    return None
