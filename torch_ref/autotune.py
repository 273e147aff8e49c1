"""The autotuner and the backend table of torch_ref, twins of jax_attn's (docs/design/autotune.md),
on the same cache (`attn_spec.autotune`: keys, shape classes, file, the rule config=None reads).

Timing: `warmup` untimed calls (Triton compilation and autotuning of the first launch stay out),
then `reps` calls each closed by `torch.cuda.synchronize()` on CUDA; the median is kept. Forward
timings run under `torch.no_grad()`; "fwd+bwd" times the forward and `torch.autograd.grad` of q, k,
v at a fixed random cotangent.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from attn_spec import autotune as tuning
from attn_spec.autotune import CacheError

from . import registry

__all__ = ["CacheError", "TuneResult", "autotune", "benchmark_backends", "time_call"]

MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """As `jax_attn.autotune.TuneResult`: key, fastest implementation and config, its ms, every
    candidate row, the file written (None when store=False)."""

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


def time_call(f: Callable, args: Sequence[torch.Tensor], *, mode: str = "fwd", warmup: int = 1,
              reps: int = 5) -> float:
    """Median milliseconds of `f(*args)` (mode "fwd", no autograd) or of the forward plus the
    gradient of the first three arguments at a fixed random cotangent (mode "fwd+bwd")."""
    _check_timing(mode, warmup, reps)
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return f(*args)
    else:
        leaves = [a.detach().requires_grad_(True) for a in args[:3]]
        rest = list(args[3:])
        with torch.no_grad():
            out = f(*leaves, *rest)
        out = out[0] if isinstance(out, tuple) else out
        ct = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float32).to(
            device=out.device, dtype=out.dtype)

        def run():
            o = f(*leaves, *rest)
            o = o[0] if isinstance(o, tuple) else o
            return torch.autograd.grad(o, leaves, ct)
    for _ in range(max(warmup, 1)):  # at least one: compilation never lands in a timed call
        run()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _probe(fn, args, kwargs, cache=None):
    with tuning.using_path(cache), tuning.probe(stop=True) as p:
        fn(*args, **kwargs)  # stopped at its choice: nothing runs
    if p.key is None:
        raise ValueError(f"{getattr(fn, '__name__', fn)!r} made no implementation choice that the autotuner can "
                         f"key (it serves the functions that take implementation= and config=, e.g. "
                         f"torch_ref.flash_attention)")
    return p


def _candidates(entry, call, configs, max_configs, lengths):
    if entry.config_type() is None:
        return [None]
    if configs is not None:
        given = configs.get(entry.name) if isinstance(configs, dict) else configs
        out = [registry.check_config(entry, c, call) for c in (given or ()) if isinstance(c, entry.config_type())]
        return out or [registry.check_config(entry, None, call)]

    def valid(c):
        try:
            registry.check_config(entry, c, call)
        except (TypeError, ValueError):
            return False
        return True

    def canonical(c):  # tiles past the sequence run as smaller ones: the same kernel
        return c.fitted(*lengths) if hasattr(c, "fitted") else c
    return tuning.candidate_configs(registry.check_config(entry, None, call), valid, max_configs, canonical)


def autotune(fn: Callable, *args, variant: str | None = None, implementations: Sequence[str] | None = None,
             configs=None, mode: str = "fwd+bwd", warmup: int = 1, reps: int = 5, max_configs: int = 8, cache=None,
             store: bool = True, **kwargs) -> TuneResult:
    """Time every (implementation, config) that can serve `fn(*args, **kwargs)` (e.g.
    `torch_ref.flash_attention`) and store the fastest in the cache; the arguments are those of
    `jax_attn.autotune`. A candidate that fails to compile or run is recorded with its error."""
    _check_timing(mode, warmup, reps)
    if "implementation" in kwargs or "config" in kwargs:
        raise TypeError("autotune chooses implementation and config; pass neither")
    kwargs.pop("return_lse", None)
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
                with tuning.using_path(tuning.DISABLED):
                    row["ms"] = time_call(lambda *a, _n=name, _c=config: fn(*a, implementation=_n, config=_c,
                                                                           **kwargs),
                                          args, mode=mode, warmup=warmup, reps=reps)
            except Exception as e:  # a tile that does not compile here (e.g. shared memory) is no answer
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    result = tuning.record_of(rows, mode, {"torch": torch.__version__})
    if result is None:
        raise RuntimeError(f"autotune: no candidate ran for {p.key}: " +
                           "; ".join(f"{r['implementation']} {r['config']}: {r['error']}" for r in rows))
    best, record = result
    path = tuning.store(p.key, record, cache) if store else None
    return TuneResult(p.key, best["implementation"], best["config"], best["ms"], tuple(rows), path)


# ------------------------------------------------------------------------------------------------
# benchmark_backends
# ------------------------------------------------------------------------------------------------
_SDPA_KWARGS = ("causal", "scale")  # what the SDPA rows take of the call
SDPA_BACKENDS = {"sdpa:math": "MATH", "sdpa:efficient": "EFFICIENT_ATTENTION", "sdpa:flash": "FLASH_ATTENTION",
                 "sdpa:cudnn": "CUDNN_ATTENTION"}


def _time_row(row, f, args, mode, warmup, reps):
    try:
        row["ms_fwd"] = time_call(f, args, mode="fwd", warmup=warmup, reps=reps)
        if mode == "fwd+bwd":
            row["ms_fwd_bwd"] = time_call(f, args, mode="fwd+bwd", warmup=warmup, reps=reps)
    except Exception as e:  # reported in the table, not hidden: the row says it did not run and why
        row["reason"] = f"{type(e).__name__}: {e}"
    return row


def _sdpa_row(name, q, k, v, kwargs, mode, warmup, reps):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    row = {"implementation": name, "config": None, "ms_fwd": None, "ms_fwd_bwd": None, "reason": None}
    extra = sorted(set(kwargs) - set(_SDPA_KWARGS))
    backend = getattr(SDPBackend, SDPA_BACKENDS[name], None)
    if extra:
        row["reason"] = f"this row serves causal and scale only, not {', '.join(extra)}"
        return row
    if backend is None:
        row["reason"] = f"torch {torch.__version__} has no SDPBackend.{SDPA_BACKENDS[name]}"
        return row
    gqa = q.shape[2] != k.shape[2]

    def f(q, k, v):  # SDPA takes [B, H, S, D]
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=bool(kwargs.get("causal")), scale=kwargs.get("scale"),
                                                 enable_gqa=gqa)
        return out.transpose(1, 2)
    return _time_row(row, f, (q, k, v), mode, warmup, reps)


def benchmark_backends(q, k, v, *, fn: Callable | None = None, mode: str = "fwd+bwd", warmup: int = 1,
                       reps: int = 5, **kwargs) -> list[dict]:
    """One row per backend for `fn(q, k, v, **kwargs)` (default `torch_ref.flash_attention`): every
    implementation of ours (with the config implementation=<name>, config=None gives it), then the
    torch SDPA backends "sdpa:math", "sdpa:efficient", "sdpa:flash", "sdpa:cudnn" (causal and
    scale only). Rows as `jax_attn.benchmark_backends`'s; a row that cannot serve the call (or that
    SDPA refuses here) has no times and says why."""
    _check_timing(mode, warmup, reps)
    if "implementation" in kwargs or "config" in kwargs:
        raise TypeError("benchmark_backends times every implementation; pass neither implementation nor config")
    if fn is None:
        from .api import flash_attention as fn
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
        for name in SDPA_BACKENDS:
            rows.append(_sdpa_row(name, q, k, v, kwargs, mode, warmup, reps))
    return rows
