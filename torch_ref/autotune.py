"""The autotuner and the backend table of torch_ref, twins of jax_attn's (docs/design/autotune.md),
on the same cache (`attn_spec.autotune`: keys, shape classes, file, the rule config=None reads).

Timing: `warmup` untimed calls (Triton compilation and autotuning of the first launch stay out),
then `reps` calls each closed by `torch.cuda.synchronize()` on CUDA; the median is kept. Forward
timings run under `torch.no_grad()`; "fwd+bwd" times the forward and `torch.autograd.grad` of q, k,
v at a fixed random cotangent.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from attn_spec import autotune as tuning
from attn_spec.autotune import CacheError, TuneResult


__all__ = ["CacheError", "TuneResult", "autotune", "benchmark_backends", "time_call"]


def time_call(f: Callable, args: Sequence[torch.Tensor], *, mode: str = "fwd", warmup: int = 1,
              reps: int = 5) -> float:
    """Median milliseconds of `f(*args)` (mode "fwd", no autograd) or of the forward plus the
    gradient of the first three arguments at a fixed random cotangent (mode "fwd+bwd"): `warmup`
    untimed calls, one more to size the batch, then `reps` repetitions of back-to-back calls (about
    10 ms of them, `attn_spec.autotune.batch_size`), each closed by a synchronisation."""
    tuning.check_timing(mode, warmup, reps)
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

    def timed(calls: int) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls

    for _ in range(max(warmup, 1)):  # at least one: compilation never lands in a timed call
        run()
    if cuda:
        torch.cuda.synchronize()
    return tuning.per_call_ms(timed, reps)


def autotune(fn: Callable, *args, variant: str | None = None, implementations: Sequence[str] | None = None,
             configs=None, mode: str = "fwd+bwd", warmup: int = 1, reps: int = 5, max_configs: int = 8, cache=None,
             store: bool = True, **kwargs) -> TuneResult:
    """Time every (implementation, config) that can serve `fn(*args, **kwargs)` (`torch_ref.flash_attention`,
    `stick_breaking_attention`, `dilated_attention`) and store the fastest in the cache; the arguments are those of
    `jax_attn.autotune`. A candidate that fails to compile or run is recorded with its error."""
    return tuning.tune(fn, args, kwargs, time_call, {"torch": torch.__version__}, variant=variant,
                       implementations=implementations, configs=configs, mode=mode, warmup=warmup, reps=reps,
                       max_configs=max_configs, cache=cache, store=store)


# ------------------------------------------------------------------------------------------------
# benchmark_backends
# ------------------------------------------------------------------------------------------------
_SDPA_KWARGS = ("causal", "scale")  # what the SDPA rows take of the call
SDPA_BACKENDS = {"sdpa:math": "MATH", "sdpa:efficient": "EFFICIENT_ATTENTION", "sdpa:flash": "FLASH_ATTENTION",
                 "sdpa:cudnn": "CUDNN_ATTENTION"}


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
    return tuning.time_row(row, f, (q, k, v), time_call, mode, warmup, reps)


def benchmark_backends(q, k, v, *, fn: Callable | None = None, mode: str = "fwd+bwd", warmup: int = 1,
                       reps: int = 5, **kwargs) -> list[dict]:
    """One row per backend for `fn(q, k, v, **kwargs)` (default `torch_ref.flash_attention`): every
    implementation of ours (with the config implementation=<name>, config=None gives it), then the
    torch SDPA backends "sdpa:math", "sdpa:efficient", "sdpa:flash", "sdpa:cudnn" (causal and
    scale only). Rows as `jax_attn.benchmark_backends`'s; a row that cannot serve the call (or that
    SDPA refuses here) has no times and says why."""
    if fn is None:
        from .api import flash_attention as fn
    variant, kwargs, rows = tuning.backend_rows(fn, (q, k, v), kwargs, time_call, mode, warmup, reps)
    if variant == "softmax":
        for name in SDPA_BACKENDS:
            rows.append(_sdpa_row(name, q, k, v, kwargs, mode, warmup, reps))
    return rows
