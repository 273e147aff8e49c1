"""The autotuner and the backend table (docs/design/autotune.md).

`autotune(fn, *args, **kwargs)` traces `fn(*args, **kwargs)` once to learn the call's cache key and
registry `Call`, then times every implementation of ours that can serve it with a few valid tile
configs each (the heuristic's config first, then neighbours; `attn_spec.autotune.candidate_configs`),
and stores the fastest in the on-disk cache that implementation=None and config=None read.
`benchmark_backends(q, k, v, **kwargs)` times every implementation of ours plus cuDNN and XLA through
`jax.nn.dot_product_attention`, and says why a row cannot serve the call.

Timing: the function and its gradient are jitted; `warmup` untimed calls (compilation and the first
run stay out), then `reps` calls each closed by `jax.block_until_ready`; the median is kept.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from attn_spec import autotune as tuning
from attn_spec.autotune import CacheError
from attn_spec.tiles import BlockSizes
from jax_attn import registry
from jax_attn.device import device_info

__all__ = ["CacheError", "TuneResult", "autotune", "benchmark_backends", "time_call"]

MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """The autotuner's answer: the cache key, the fastest (implementation, config) and its time,
    every timed candidate (dicts: implementation, config, ms, error) and the file written (None
    when store=False)."""

    key: str
    implementation: str
    config: Any
    ms: float
    rows: tuple
    path: Any


def _check_timing(mode, warmup, reps):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")


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
    _check_timing(mode, warmup, reps)
    g = jax.jit(f if mode == "fwd" else jax.grad(_loss_fn(f), argnums=grad_argnums))
    for _ in range(max(warmup, 1)):  # at least one: compilation never lands in a timed call
        jax.block_until_ready(g(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(g(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _probe(fn, args, kwargs, cache=None):
    with tuning.using_path(cache), tuning.probe(stop=True) as p:
        fn(*args, **kwargs)  # stopped at its choice: nothing runs
    if p.key is None:
        raise ValueError(f"{getattr(fn, '__name__', fn)!r} made no implementation choice that the autotuner can "
                         f"key (it serves the functions that take implementation= and config=, e.g. "
                         f"jax_attn.flash_attention)")
    return p


def _candidates(entry, call, configs, max_configs, lengths):
    if entry.config_type() is None:
        return [None]
    if configs is not None:
        given = configs.get(entry.name) if isinstance(configs, dict) else configs
        if given is None:
            return [registry.check_config(entry, None, call)]
        out = []
        for c in given:
            if isinstance(c, entry.config_type()):
                out.append(registry.check_config(entry, c, call))  # raises for a config that cannot serve
        return out or [registry.check_config(entry, None, call)]

    def valid(c):
        try:
            registry.check_config(entry, c, call)
        except (TypeError, ValueError):
            return False
        return True
    def canonical(c):  # tiles past the sequence run as smaller ones: the same kernel
        return c.fitted(*lengths) if isinstance(c, BlockSizes) else c
    return tuning.candidate_configs(registry.check_config(entry, None, call), valid, max_configs, canonical)


def autotune(fn: Callable, *args, variant: str | None = None, implementations: Sequence[str] | None = None,
             configs=None, mode: str = "fwd+bwd", warmup: int = 1, reps: int = 5, max_configs: int = 8, cache=None,
             store: bool = True, **kwargs) -> TuneResult:
    """Time every (implementation, config) that can serve `fn(*args, **kwargs)` and cache the fastest.

    fn: a public function that takes implementation= and config= (e.g. `jax_attn.flash_attention`);
      args, kwargs: one call of it (its keyword arguments other than implementation and config).
    variant: optional check: the variant `fn` chooses for (found by tracing the call; ValueError if
      it differs).
    implementations: names to time (default: every implementation of the variant that can serve the
      call, by the registry's `unsupported_reason`); an explicit one that cannot serve it raises.
    configs: candidate configs, a list (each used by the implementations whose config type it is)
      or {implementation: list}; default: the heuristic's config and its valid neighbours, at most
      `max_configs` per implementation.
    mode: "fwd+bwd" (default: the gradient of q, k, v at a random cotangent, forward included) or "fwd".
    warmup, reps: untimed calls, then timed calls per candidate (median kept).
    cache: the cache file (default `attn_spec.autotune.default_path()`); store=False times only.
    A candidate that fails to compile or run is recorded with its error and skipped; if none runs,
    RuntimeError.
    """
    _check_timing(mode, warmup, reps)
    if "implementation" in kwargs or "config" in kwargs:
        raise TypeError("autotune chooses implementation and config; pass neither")
    kwargs.pop("return_lse", None)  # the output alone is timed
    p = _probe(fn, args, kwargs, cache)
    if variant is not None and variant != p.variant:
        raise ValueError(f"variant={variant!r}, but {getattr(fn, '__name__', fn)!r} chooses for "
                         f"variant {p.variant!r}")
    names = tuple(p.registry[p.variant]) if implementations is None else tuple(
        p.registry.canonical(p.variant, n) for n in implementations)
    rows = []
    for name in names:
        entry = p.registry[p.variant][name]
        if reason := entry.unsupported_reason(p.call):
            if implementations is not None:
                raise NotImplementedError(f"implementation={name!r} cannot serve this call: {reason}")
            continue
        lengths = (args[0].shape[1], args[1].shape[1])
        for config in _candidates(entry, p.call, configs, max_configs, lengths):
            row = {"implementation": name, "config": config, "ms": None, "error": None}
            try:
                with tuning.using_path(tuning.DISABLED):  # the candidate runs as given, whatever the cache holds
                    row["ms"] = time_call(lambda *a, _n=name, _c=config: fn(*a, implementation=_n, config=_c,
                                                                           **kwargs),
                                          args, mode=mode, warmup=warmup, reps=reps)
            except Exception as e:  # a tile that does not compile here (e.g. shared memory) is no answer
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    result = tuning.record_of(rows, mode, {"jax": jax.__version__})
    if result is None:
        raise RuntimeError(f"autotune: no candidate ran for {p.key}: " +
                           "; ".join(f"{r['implementation']} {r['config']}: {r['error']}" for r in rows))
    best, record = result
    path = tuning.store(p.key, record, cache) if store else None
    return TuneResult(p.key, best["implementation"], best["config"], best["ms"], tuple(rows), path)


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
    return _time_row(row, f, (q, k, v), mode, warmup, reps)


def _time_row(row, f, args, mode, warmup, reps):
    try:
        row["ms_fwd"] = time_call(f, args, mode="fwd", warmup=warmup, reps=reps)
        if mode == "fwd+bwd":
            row["ms_fwd_bwd"] = time_call(f, args, mode="fwd+bwd", warmup=warmup, reps=reps)
    except Exception as e:  # reported in the table, not hidden: the row says it did not run and why
        row["reason"] = f"{type(e).__name__}: {e}"
    return row


def benchmark_backends(q, k, v, *, fn: Callable | None = None, mode: str = "fwd+bwd", warmup: int = 1,
                       reps: int = 5, **kwargs) -> list[dict]:
    """One row per backend for the call `fn(q, k, v, **kwargs)` (default `jax_attn.flash_attention`):
    every implementation of ours (with the config implementation=<name>, config=None gives it,
    cached or heuristic), then "jax.nn:cudnn" and "jax.nn:xla" (`jax.nn.dot_product_attention`;
    they take causal and scale only). Row: {"implementation", "config", "ms_fwd", "ms_fwd_bwd"
    (None for mode="fwd"), "reason"}; a row that cannot serve the call has no times and says why."""
    _check_timing(mode, warmup, reps)
    if "implementation" in kwargs or "config" in kwargs:
        raise TypeError("benchmark_backends times every implementation; pass neither implementation nor config")
    if fn is None:
        from jax_attn.api import flash_attention as fn
    kwargs.pop("return_lse", None)
    p = _probe(fn, (q, k, v), kwargs)
    rows = []
    for name, entry in p.registry[p.variant].items():
        row = {"implementation": name, "config": None, "ms_fwd": None, "ms_fwd_bwd": None, "reason": None}
        if reason := entry.unsupported_reason(p.call):
            row["reason"] = reason
            rows.append(row)
            continue
        _, row["config"] = tuning.select(p.registry, p.variant, name, None, p.call, lambda: p.key)
        rows.append(_time_row(row, lambda *a, _n=name, _c=row["config"]: fn(*a, implementation=_n, config=_c,
                                                                           **kwargs),
                              (q, k, v), mode, warmup, reps))
    if p.variant == "softmax":
        for name in ("jax.nn:cudnn", "jax.nn:xla"):
            rows.append(_jax_nn_row(name, q, k, v, kwargs, mode, warmup, reps))
    return rows
