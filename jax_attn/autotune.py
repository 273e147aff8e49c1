"""The autotuner and the backend table (docs/design/autotune.md).

`autotune(fn, *args, **kwargs)` traces `fn(*args, **kwargs)` once to learn the call's cache key and
registry `Call`, then times every implementation of ours that can serve it with a few valid tile
configs each (the heuristic's config first, then neighbours; `attn_spec.autotune.candidate_configs`),
and stores the fastest in the on-disk cache that implementation=None and config=None read.
`benchmark_backends(q, k, v, **kwargs)` times every implementation of ours plus cuDNN and XLA through
`jax.nn.dot_product_attention`, and says why a row cannot serve the call.

Timing: the function and its gradient are jitted; `warmup` untimed calls (compilation and the first
run stay out), one more to size the batch, then `reps` repetitions of back-to-back calls (about
10 ms of them, `attn_spec.autotune.batch_size`) each closed by `jax.block_until_ready`; the median
time per call is kept.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from attn_spec import autotune as tuning
from attn_spec.autotune import CacheError, TuneResult
from jax_attn.device import device_info

__all__ = ["CacheError", "TuneResult", "autotune", "benchmark_backends", "time_call"]


def _loss_fn(f: Callable, cotangent_seed: int = 0):
    """sum(out * ct) in float32 for a fixed random ct: its gradient runs the backward at a random cotangent."""
    def loss(*args):
        out = f(*args)
        out = out[0] if isinstance(out, tuple) else out
        ct = jax.random.normal(jax.random.key(cotangent_seed), out.shape, jnp.float32)
        return jnp.sum(out.astype(jnp.float32) * ct)
    return loss


def time_call(f: Callable, args: Sequence, *, mode: str = "fwd", warmup: int = 1, reps: int = 5,
              grad_argnums=(0, 1, 2)) -> float:
    """Median milliseconds of `f(*args)` (mode "fwd") or of its gradient with respect to
    `grad_argnums` (mode "fwd+bwd", forward included), jitted; compilation is in the warm-up."""
    tuning.check_timing(mode, warmup, reps)
    g = jax.jit(f if mode == "fwd" else jax.grad(_loss_fn(f), argnums=grad_argnums))

    def timed(calls: int) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            out = g(*args)  # only the last is kept: they run in order
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / calls

    for _ in range(max(warmup, 1)):  # at least one: compilation never lands in a timed call
        jax.block_until_ready(g(*args))
    return tuning.per_call_ms(timed, reps)


def autotune(fn: Callable, *args, variant: str | None = None, implementations: Sequence[str] | None = None,
             configs=None, mode: str = "fwd+bwd", warmup: int = 1, reps: int = 5, max_configs: int = 8, cache=None,
             store: bool = True, **kwargs) -> TuneResult:
    """Time every (implementation, config) that can serve `fn(*args, **kwargs)` and cache the fastest.

    fn: a public function that takes implementation= and config= and reads the cache
      (`jax_attn.flash_attention`, `stick_breaking_attention`, `dilated_attention`);
      args, kwargs: one call of it (its keyword arguments other than implementation and config).
    variant: optional check: the variant `fn` chooses for (found by tracing the call; ValueError if
      it differs).
    implementations: names to time (default: every implementation of the variant that can serve the
      call, by the registry's `unsupported_reason`); an explicit one that cannot serve it raises.
    configs: candidate configs, a list (each used by the implementations whose config type it is)
      or {implementation: list}, timed in `mode`; default: the heuristic's config and its valid
      neighbours, at most `max_configs` per implementation and side: the forward's tiles chosen on
      the forward's time, then (mode "fwd+bwd") the backward's on the forward+backward's.
    mode: "fwd+bwd" (default: the gradient of q, k, v at a random cotangent, forward included) or "fwd".
    warmup, reps: untimed calls, then timed repetitions (batches of calls) per candidate (median kept).
    cache: the cache file (default `attn_spec.autotune.default_path()`); store=False times only.
    A candidate that fails to compile or run is recorded with its error and skipped; if none runs,
    RuntimeError.
    """
    return tuning.tune(fn, args, kwargs, time_call, {"jax": jax.__version__}, variant=variant,
                       implementations=implementations, configs=configs, mode=mode, warmup=warmup, reps=reps,
                       max_configs=max_configs, cache=cache, store=store)


# ------------------------------------------------------------------------------------------------
# benchmark_backends
# ------------------------------------------------------------------------------------------------
_JAX_NN_KWARGS = ("causal", "scale")  # what jax.nn.dot_product_attention rows take of the call


def _jax_nn_row(name, q, k, v, kwargs, mode, warmup, reps):
    row = {"implementation": name, "config": None, "ms_fwd": None, "ms_fwd_bwd": None, "reason": None}
    extra = sorted(set(kwargs) - set(_JAX_NN_KWARGS))
    impl = name.split(":", 1)[1]
    if extra:
        row["reason"] = f"this row serves causal and scale only, not {', '.join(extra)}"
        return row
    if impl == "cudnn" and device_info().platform != "gpu":
        row["reason"] = f"cuDNN needs an NVIDIA GPU, this is {device_info().platform!r}"
        return row

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=kwargs.get("scale"), is_causal=bool(kwargs.get("causal")),
                                            implementation=impl)
    return tuning.time_row(row, f, (q, k, v), time_call, mode, warmup, reps)


def benchmark_backends(q, k, v, *, fn: Callable | None = None, mode: str = "fwd+bwd", warmup: int = 1,
                       reps: int = 5, **kwargs) -> list[dict]:
    """One row per backend for the call `fn(q, k, v, **kwargs)` (default `jax_attn.flash_attention`):
    every implementation of ours (with the config implementation=<name>, config=None gives it,
    cached or heuristic), then "jax.nn:cudnn" and "jax.nn:xla" (`jax.nn.dot_product_attention`;
    they take causal and scale only). Row: {"implementation", "config", "ms_fwd", "ms_fwd_bwd"
    (None for mode="fwd"), "reason"}; a row that cannot serve the call has no times and says why."""
    if fn is None:
        from jax_attn.api import flash_attention as fn
    variant, kwargs, rows = tuning.backend_rows(fn, (q, k, v), kwargs, time_call, mode, warmup, reps)
    if variant == "softmax":
        for name in ("jax.nn:cudnn", "jax.nn:xla"):
            rows.append(_jax_nn_row(name, q, k, v, kwargs, mode, warmup, reps))
    return rows
