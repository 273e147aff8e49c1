"""Shared benchmark machinery: cases x columns -> timed rows, JSON, a markdown table, an optional PNG.

A benchmark script lists its `Case`s (shapes and settings) and its `Column`s (implementations,
each a builder `build(case, opts) -> f(q, k, v) -> out`) and calls `main(...)`. This module does
the rest, the same way for every script:

- inputs: fresh N(0, 1) q, k, v and cotangent per case (never zeros), cast to the run's dtype;
  torch columns get the same values;
- JAX timing: `jax.jit` of the forward, or of `jax.vjp` forward + backward applied to the random
  cotangent (returning dq, dk, dv); the first call (compile) and one warm call stay out of the
  numbers; then `--repeats` repeats of N back-to-back calls closed by `jax.block_until_ready`
  (N chosen so one repeat lasts about `--target-ms`); the median per-call time is reported;
- torch timing: one untimed call, then `triton.testing.do_bench(..., return_mode="median")`
  (CUDA events); forward+backward is `torch.autograd.grad(out, (q, k, v), do)`;
- FLOPs (`FLOP_FORMULA`): forward 4*B*Sq*Sk*H*D, halved when causal; forward+backward 3.5x;
- accuracy: relerr = ||out - ref|| / ||ref|| (fp32) against the first reference column that
  runs, relerr_grad the largest of the same over dq, dk, dv;
- every row runs under try/except: a failure is the row's error, an anchor that does not import
  or does not take the case is an "absent" row with the reason, rows past `--budget` seconds are
  "skipped"; the JSON is rewritten after every case.

Importing this module sets the XLA allocator to grow on demand (torch and JAX share the GPU) and,
with `--smoke` on the command line, JAX to the CPU; so import it before jax.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import importlib.abc  # noqa: E402
import importlib.machinery  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from typing import Callable, Sequence  # noqa: E402

# jax 0.11 warns at every Pallas Triton lowering; filtered by its exact text only.
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be removed in"
                      r" a future JAX version\.")
warnings.filterwarnings("ignore", message=TRITON_DEPRECATION)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

MODES = ("fwd", "fwdbwd")
FLOP_FORMULA = ("forward = 4*B*Sq*Sk*H*D (x0.5 when causal); forward+backward = 3.5 * forward "
                "(backward = 2.5 * forward); TFLOP/s = FLOPs / median time")
T_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def attention_flops(B: int, Sq: int, Sk: int, H: int, D: int, causal: bool, mode: str) -> float:
    """FLOPs of `FLOP_FORMULA` (H counts query heads)."""
    f = 4.0 * B * Sq * Sk * H * D
    if causal:
        f *= 0.5
    return f * 3.5 if mode == "fwdbwd" else f


def error_text(e: BaseException, limit: int = 2000) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= limit else s[:limit] + " ...[truncated]"


def first_line(s: str | None, limit: int = 200) -> str:
    lines = (s or "").strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[:limit] + "..."


def slugify(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "unknown"


# ------------------------------------------------------------------------------------------------
# Optional imports (anchors)
# ------------------------------------------------------------------------------------------------

_IMPORTS: dict[str, tuple[object, str | None]] = {}


def optional_import(name: str):
    """(module, None), or (None, why it did not import); cached."""
    if name not in _IMPORTS:
        try:
            _IMPORTS[name] = (importlib.import_module(name), None)
        except Exception as e:  # an anchor that fails to import becomes an "absent" row
            _IMPORTS[name] = (None, error_text(e, 300))
    return _IMPORTS[name]


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves empty modules for one top-level package name (and its submodules)."""

    def __init__(self, top: str):
        self.top = top

    def find_spec(self, fullname, path, target=None):
        if fullname == self.top or fullname.startswith(self.top + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []

        def missing(attr, _name=spec.name):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return None  # a profiling hook tokamax imports but the timed path never calls
        mod.__getattr__ = missing
        return mod

    def exec_module(self, module):
        pass


def import_tokamax():
    """(tokamax, note) or (None, why not). tokamax imports `xprof` for its own profiler only; where
    that package is missing it is stubbed, and the note says so."""
    mod, err = optional_import("tokamax")
    if mod is not None or "xprof" not in (err or ""):
        return mod, err
    sys.meta_path.insert(0, _StubFinder("xprof"))
    for name in [n for n in sys.modules if n == "tokamax" or n.startswith("tokamax.")]:
        del sys.modules[name]
    _IMPORTS.pop("tokamax")
    mod, err = optional_import("tokamax")
    return mod, (err if mod is None else "xprof (profiling only) stubbed")


def torch_modules():
    """(torch, triton-or-None, None) or (None, None, why not)."""
    torch, err = optional_import("torch")
    if torch is None:
        return None, None, err
    triton, _ = optional_import("triton.testing")
    return torch, (importlib.import_module("triton") if triton is not None else None), None


# ------------------------------------------------------------------------------------------------
# Device and versions
# ------------------------------------------------------------------------------------------------

def device_info() -> dict:
    """name (torch's CUDA name where it has one, else JAX's device kind), kind, platform."""
    d = jax.devices()[0]
    name = d.device_kind
    torch, _, _ = torch_modules() if d.platform == "gpu" else (None, None, None)
    if torch is not None:
        try:
            if torch.cuda.is_available():
                name = torch.cuda.get_device_name()
        except Exception:
            pass
    return {"name": name, "kind": d.device_kind, "platform": d.platform,
            "compute_capability": getattr(d, "compute_capability", None)}


def versions(extra: Sequence[str] = ()) -> dict:
    v = {"python": platform.python_version(), "jax": jax.__version__}
    try:
        import jaxlib
        v["jaxlib"] = jaxlib.__version__
    except Exception as e:
        v["jaxlib"] = f"unavailable: {type(e).__name__}"
    for name in ("torch", "triton", *extra):
        mod = sys.modules.get(name) or (import_tokamax() if name == "tokamax" else optional_import(name))[0]
        v[name] = getattr(mod, "__version__", "imported") if mod is not None else "not importable"
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            v["torch_cuda"] = torch.version.cuda
            if torch.cuda.is_available():
                v["torch_cudnn"] = torch.backends.cudnn.version()
        except Exception:
            pass
    return v


# ------------------------------------------------------------------------------------------------
# Cases and columns
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One input configuration: q [B, S, H, D], k/v [B, S_kv, H_kv, D]."""
    tag: str
    B: int
    S: int
    H: int
    D: int
    causal: bool = False
    kv_heads: int | None = None
    kv_len: int | None = None
    params: dict = dataclasses.field(default_factory=dict)  # variant settings, copied into rows
    # (q, k, v, do) numpy float32 -> the same, changed (e.g. a data distribution); None: N(0, 1)
    transform: Callable | None = None

    @property
    def Hkv(self) -> int:
        return self.kv_heads or self.H

    @property
    def Sk(self) -> int:
        return self.kv_len or self.S

    def flops(self, mode: str) -> float:
        return attention_flops(self.B, self.S, self.Sk, self.H, self.D, self.causal, mode)

    def label(self) -> str:
        kv = f" kv{self.Hkv}" if self.Hkv != self.H else ""
        return f"{self.tag} {self.B}x{self.S}x{self.H}x{self.D}{kv}{' causal' if self.causal else ''}"


class Absent(Exception):
    """This column cannot run this case here (an anchor that does not import, a shape it does not
    take); the row records the reason."""


@dataclasses.dataclass
class Column:
    """One implementation. build(case, opts) -> f(q, k, v) -> out (arrays of its framework, BSHD
    unless layout="bhsd"; JAX: or a `WithArgs` for more array arguments), or raises Absent."""
    name: str
    build: Callable
    framework: str = "jax"  # "jax" or "torch"
    layout: str = "bshd"  # torch: "bhsd" inputs are transposed once, outside the timing
    compare: bool = True  # relerr against the case's reference (False: another function)
    timed: bool = True  # False: a reference only
    quick: bool = True  # part of --quick
    modes: tuple = MODES
    params: dict = dataclasses.field(default_factory=dict)  # copied into rows
    note: Callable | str | None = None  # str, or (case, opts) -> str: copied into rows


@dataclasses.dataclass(frozen=True)
class WithArgs:
    """What a column's build may return instead of f(q, k, v): fn(q, k, v, *args), the arrays in
    args (block lists, gates, ...) passed to the jitted function at every call. A closed-over
    array would be a compile-time constant, and XLA may spend minutes folding work on it (a sort
    over a block list); an argument is not folded."""
    fn: Callable
    args: tuple


def jax_forward(f: Callable | WithArgs) -> Callable:
    if isinstance(f, WithArgs):
        g, extra = jax.jit(f.fn), f.args
        return lambda q, k, v: g(q, k, v, *extra)
    return jax.jit(f)


def jax_forward_backward(f: Callable | WithArgs) -> Callable:
    """jit of (q, k, v, do) -> (dq, dk, dv), through jax.vjp of f (in q, k, v; a WithArgs's
    arrays are arguments of the jitted function, not differentiated)."""
    fn, extra = (f.fn, f.args) if isinstance(f, WithArgs) else (f, ())

    def fb(q, k, v, do, *args):
        _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *args), q, k, v)
        return vjp(do)
    g = jax.jit(fb)
    return lambda q, k, v, do: g(q, k, v, do, *extra)


def time_jax(g: Callable, args: tuple, target_ms: float, repeats: int):
    """(median ms per call, first call's output, first call's seconds)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(g(*args))
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(g(*args))
    est = max(time.perf_counter() - t0, 1e-6)
    n = int(max(1, min(2000, round(target_ms * 1e-3 / est))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            r = g(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t0) / n)
        del r
    return statistics.median(times) * 1e3, out, first_s


def time_torch(fn: Callable, target_ms: float, repeats: int):
    """(median ms, first call's output, first call's seconds); CUDA: do_bench's median."""
    torch, triton, err = torch_modules()
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    if cuda:
        if triton is None:
            raise RuntimeError("triton.testing is not importable: no CUDA-event timer")
        ms = triton.testing.do_bench(fn, warmup=25, rep=max(25, int(target_ms * repeats)),
                                     return_mode="median")
        return float(ms), out, first_s
    times = []  # CPU (smoke): wall clock
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out, first_s


@jax.jit
def _relerr(a, b):
    a = a.astype(jnp.float32).ravel()
    b = b.astype(jnp.float32).ravel()
    return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def relerr(a, b) -> float:
    """||a - b|| / ||b|| in fp32; torch tensors are brought over through the host."""
    if not isinstance(a, jax.Array):
        a = jnp.asarray(a.detach().float().cpu().numpy())
    return float(_relerr(a, b))


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------

def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks", "results"),
                   help="output folder (default: benchmarks/results)")
    p.add_argument("--quick", action="store_true", help="fewer cases and columns (run_all.py)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny float32 shapes on the CPU (Pallas interpret mode): the code paths only")
    p.add_argument("--columns", default=None, help="comma-separated subset of the columns")
    p.add_argument("--cases", default=None, help="comma-separated subset of the case tags")
    p.add_argument("--repeats", type=int, default=None, help="timing repeats, median (default 5; 3 quick)")
    p.add_argument("--target-ms", type=float, default=None,
                   help="JAX: wall time of one repeat (default 30; 20 quick); torch: do_bench rep = "
                        "target-ms * repeats")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds after start beyond which remaining rows are recorded as skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    return p


def finish_options(opts: argparse.Namespace) -> argparse.Namespace:
    if opts.repeats is None:
        opts.repeats = 2 if opts.smoke else (3 if opts.quick else 5)
    if opts.target_ms is None:
        opts.target_ms = 1.0 if opts.smoke else (20.0 if opts.quick else 30.0)
    if opts.budget is None:
        opts.budget = 1e9
    opts.dtype = jnp.float32 if opts.smoke else jnp.bfloat16
    opts.dtype_name = "float32" if opts.smoke else "bfloat16"
    return opts


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------

class _CaseState:
    """Inputs, compiled callables and the reference of one case."""

    def __init__(self, case: Case, opts, seed: int):
        rng = np.random.default_rng(seed)
        shapes = [(case.B, case.S, case.H, case.D), (case.B, case.Sk, case.Hkv, case.D),
                  (case.B, case.Sk, case.Hkv, case.D), (case.B, case.S, case.H, case.D)]
        host = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        if case.transform is not None:
            host = list(case.transform(*host))
        self.host = host
        self.jax = tuple(jax.block_until_ready(jnp.asarray(x).astype(opts.dtype)) for x in host)
        self.case, self.opts = case, opts
        self.compiled: dict = {}
        self.torch_inputs: dict = {}
        self.ref_name = self.grads_name = None
        self.ref_out = self.ref_grads = None

    def jax_callable(self, col: Column, mode: str):
        key = (col.name, mode)
        if key not in self.compiled:
            f = col.build(self.case, self.opts)
            self.compiled[key] = jax_forward(f) if mode == "fwd" else jax_forward_backward(f)
        return self.compiled[key]

    def jax_args(self, mode: str):
        return self.jax[:3] if mode == "fwd" else self.jax

    def torch_args(self, layout: str, mode: str):
        torch, _, err = torch_modules()
        if torch is None:
            raise Absent(f"torch does not import: {err}")
        if layout not in self.torch_inputs:
            dev = "cuda" if torch.cuda.is_available() and not self.opts.smoke else "cpu"
            dt = torch.float32 if self.opts.smoke else torch.bfloat16
            ts = [torch.from_numpy(x).to(dev).to(dt) for x in self.host]
            if layout == "bhsd":
                ts = [t.transpose(1, 2) for t in ts]
            self.torch_inputs[layout] = [t.contiguous() for t in ts]
        q, k, v, do = self.torch_inputs[layout]
        if mode == "fwd":
            return q, k, v, None
        return (*(t.detach().clone().requires_grad_(True) for t in (q, k, v)), do)

    def compute_reference(self, chain: Sequence[Column]):
        for mode in MODES:
            for col in chain:
                try:
                    res = self.jax_callable(col, mode)(*self.jax_args(mode))
                    if mode == "fwd":
                        self.ref_out, self.ref_name = jax.block_until_ready(res.astype(jnp.float32)), col.name
                    else:
                        self.ref_grads = jax.block_until_ready(tuple(x.astype(jnp.float32) for x in res))
                        self.grads_name = col.name
                    break
                except Exception as e:
                    log(f"  reference {col.name} {mode}: {first_line(error_text(e))}")
        log(f"  reference: out from {self.ref_name}, grads from {self.grads_name}")

    def close(self):
        self.compiled.clear()
        self.torch_inputs.clear()
        self.ref_out = self.ref_grads = None
        torch = sys.modules.get("torch")
        gc.collect()
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()


def _new_row(benchmark, case: Case, col: Column, mode: str, dtype_name: str) -> dict:
    return {"benchmark": benchmark, "tag": case.tag, "impl": col.name, "framework": col.framework,
            "B": case.B, "S": case.S, "Sk": case.Sk, "H": case.H, "Hkv": case.Hkv, "D": case.D,
            "causal": case.causal, "dtype": dtype_name, "mode": mode,
            "params": {**case.params, **col.params}, "status": None, "ms": None, "tflops": None,
            "relerr": None, "relerr_grad": None, "relerr_ref": None, "first_call_s": None,
            "error": None, "note": None}


def _add_note(row: dict, text: str | None):
    if text:
        row["note"] = text if not row["note"] else f"{row['note']}; {text}"


def _measure(row: dict, state: _CaseState, col: Column, mode: str, opts) -> None:
    case = state.case
    if col.framework == "jax":
        g = state.jax_callable(col, mode)
        ms, out, first_s = time_jax(g, state.jax_args(mode), opts.target_ms, opts.repeats)
    else:
        torch, _, _ = torch_modules()
        q, k, v, do = state.torch_args(col.layout, mode)
        f = col.build(case, opts)
        if mode == "fwd":
            def fn():
                with torch.no_grad():
                    return f(q, k, v)
        else:
            def fn():
                return torch.autograd.grad(f(q, k, v), (q, k, v), do)
        ms, out, first_s = time_torch(fn, opts.target_ms, opts.repeats)
    row.update(status="ok", ms=ms, tflops=case.flops(mode) / (ms * 1e-3) / 1e12, first_call_s=first_s)
    if not col.compare:
        return
    back = (lambda x: x.transpose(1, 2)) if col.layout == "bhsd" else (lambda x: x)
    try:
        if mode == "fwd" and state.ref_out is not None:
            row["relerr"], row["relerr_ref"] = relerr(back(out), state.ref_out), state.ref_name
        elif mode == "fwdbwd" and state.ref_grads is not None:
            row["relerr_grad"] = max(relerr(back(a), b) for a, b in zip(out, state.ref_grads))
            row["relerr_ref"] = state.grads_name
    except Exception as e:
        _add_note(row, f"relerr failed: {first_line(error_text(e))}")


def _print_row(row: dict) -> None:
    head = f"  {row['impl']:<22} {row['mode']:<6}"
    if row["status"] != "ok":
        log(f"{head} {row['status'].upper()} {first_line(row['error'] or row['note'], 160)}")
        return
    rel = "" if row["relerr"] is None else f" relerr={row['relerr']:.1e}"
    relg = "" if row["relerr_grad"] is None else f" relerr_grad={row['relerr_grad']:.1e}"
    log(f"{head} {row['ms']:9.3f} ms {row['tflops']:7.1f} TF/s{rel}{relg}")


def run(benchmark: str, cases: Sequence[Case], columns: Sequence[Column], opts,
        reference: Sequence[Column] = (), paired: Sequence[str] = (), paired_rounds: int = 0,
        doc: dict | None = None, path: str | None = None) -> list[dict]:
    """Every case x timed column x mode; rows appended to doc["rows"], the JSON rewritten at `path`
    after each case. `paired`: columns timed again in turn, `paired_rounds` rounds, per case and
    mode: the medians of their per-round ratios to the first (drift between rows cancels).
    `reference`: columns tried in turn for the relerr reference (see `pick`)."""
    rows = doc["rows"] if doc is not None else []
    by_name = {c.name: c for c in columns}
    chain = list(reference)
    for i, case in enumerate(cases):
        log(f"=== {case.label()} {case.params or ''} ({opts.dtype_name}) ===")
        over = time.perf_counter() - T_START > opts.budget
        state = None
        if not over:
            try:
                state = _CaseState(case, opts, opts.seed + i)
                if chain:
                    state.compute_reference(chain)
            except Exception as e:
                log(f"  inputs failed: {first_line(error_text(e))}")
        for mode in MODES:
            for col in columns:
                if not col.timed or mode not in col.modes:
                    continue
                row = _new_row(benchmark, case, col, mode, opts.dtype_name)
                try:
                    if over or time.perf_counter() - T_START > opts.budget:
                        row.update(status="skipped", error=f"time budget ({opts.budget:.0f} s) spent")
                    elif state is None:
                        row.update(status="error", error="case inputs could not be made")
                    else:
                        _add_note(row, col.note(case, opts) if callable(col.note) else col.note)
                        _measure(row, state, col, mode, opts)
                except Absent as e:
                    row.update(status="absent", note=str(e))
                except Exception as e:
                    row.update(status="error", error=error_text(e))
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
                rows.append(row)
                _print_row(row)
        if state is not None and paired and paired_rounds and doc is not None:
            doc.setdefault("paired", []).extend(_paired(state, [by_name[n] for n in paired if n in by_name],
                                                        rows, paired_rounds, opts))
        if state is not None:
            state.close()
        if doc is not None and path:
            write_json(path, doc)
    return rows


def _paired(state: _CaseState, cols: list, rows: list, rounds: int, opts) -> list[dict]:
    out = []
    for mode in MODES:
        ok = [c for c in cols if c.framework == "jax" and (c.name, mode) in state.compiled
              and any(r["impl"] == c.name and r["mode"] == mode and r["tag"] == state.case.tag
                      and r["params"] == {**state.case.params, **c.params} and r["status"] == "ok"
                      for r in rows)]
        if len(ok) < 2:
            continue
        times = {c.name: [] for c in ok}
        for _ in range(rounds):
            for c in ok:
                times[c.name].append(time_jax(state.compiled[c.name, mode], state.jax_args(mode),
                                              opts.target_ms, 1)[0])
        base = ok[0].name
        entry = {"tag": state.case.tag, "params": state.case.params, "mode": mode, "rounds": times,
                 "ms": {n: statistics.median(t) for n, t in times.items()},
                 "ratio_to": base,
                 "ratio": {n: statistics.median(a / b for a, b in zip(t, times[base])) for n, t in times.items()}}
        log(f"  paired {mode} ({rounds} rounds), time / {base}: "
            + ", ".join(f"{n} {r:.3f}" for n, r in entry["ratio"].items()))
        out.append(entry)
    return out


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------

def _sanitize(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _sanitize(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_sanitize(v) for v in x]
    return x


def write_json(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_sanitize(doc), f, indent=1, default=str)
    os.replace(tmp, path)


def new_document(benchmark: str, opts, anchors: dict | None = None, **extra):
    """(doc, stem): the result document and its path stem `<out>/<benchmark>-<device slug>-<date>`."""
    dev = device_info()
    date = datetime.date.today().isoformat()
    os.makedirs(opts.out, exist_ok=True)
    stem = os.path.join(opts.out, f"{benchmark}-{slugify(dev['kind'])}-{date}" + ("-smoke" if opts.smoke else ""))
    doc = {"benchmark": benchmark, "device": dev["name"], "device_kind": dev["kind"],
           "platform": dev["platform"], "date": date,
           "versions": versions(("tokamax", "fla", "matplotlib") if not opts.smoke else ()),
           "anchors": anchors or {}, "flop_formula": FLOP_FORMULA,
           "timing": ("JAX: jit, compile and one warm call excluded, median over "
                      f"{opts.repeats} repeats of N back-to-back calls + one block_until_ready "
                      f"(about {opts.target_ms:g} ms per repeat); torch: triton.testing.do_bench median "
                      "after one untimed call; fwdbwd = forward + backward of (q, k, v) with a random "
                      "cotangent; inputs N(0, 1), fresh per case"),
           "relerr": "||out - ref|| / ||ref|| in fp32 against relerr_ref; relerr_grad: max over dq, dk, dv",
           "smoke": bool(opts.smoke), "quick": bool(opts.quick),
           "args": {k: v for k, v in vars(opts).items() if k not in ("dtype",)},
           **extra, "rows": []}
    log(f"device: {dev['name']} ({dev['platform']}); versions: {doc['versions']}")
    return doc, stem


def pick(columns: Sequence[Column], *names: str) -> list[Column]:
    """The named columns, in the order named."""
    by_name = {c.name: c for c in columns}
    return [by_name[n] for n in names]


def select(items: Sequence, names: str | None, key: Callable, quick: bool = False, what: str = "column"):
    """The items whose key is in the comma-separated `names` (all, or the quick ones, when None)."""
    if names:
        wanted = [n for n in names.split(",") if n]
        known = {key(x) for x in items}
        bad = [n for n in wanted if n not in known]
        if bad:
            raise SystemExit(f"unknown {what}(s) {bad}; known: {sorted(known)}")
        return [x for x in items if key(x) in wanted]
    return [x for x in items if not quick or getattr(x, "quick", True)]


def markdown_table(rows: list[dict], columns: Sequence[str], metric: str = "tflops",
                   row_key: Callable | None = None) -> str:
    """Cases x modes down, columns across; cells TF/s (metric "tflops") or ms. err / absent / skip
    where the row did not run; the notes of absent columns follow the table."""
    row_key = row_key or (lambda r: (f"{r['tag']} {r['B']}x{r['S']}x{r['H']}x{r['D']}"
                                     + (f" kv{r['Hkv']}" if r["Hkv"] != r["H"] else ""),
                                     "yes" if r["causal"] else "no", r["mode"]))
    keys, cells = [], {}
    for r in rows:
        k = row_key(r)
        if k not in keys:
            keys.append(k)
        cells[k, r["impl"]] = r
    cols = [c for c in columns if any((k, c) in cells for k in keys)]
    unit = "TF/s" if metric == "tflops" else "ms"
    lines = ["| case | causal | mode | " + " | ".join(cols) + " |", "|---" * (3 + len(cols)) + "|"]
    absent = {}
    for k in keys:
        out = []
        for c in cols:
            r = cells.get((k, c))
            if r is None:
                out.append("-")
            elif r["status"] == "ok":
                out.append(f"{r[metric]:.1f}" if metric == "tflops" else f"{r[metric]:.3f}")
            else:
                out.append({"error": "err", "absent": "absent", "skipped": "skip"}[r["status"]])
                if r["status"] == "absent":
                    absent.setdefault(c, first_line(r["note"], 300))
        lines.append("| " + " | ".join([*k, *out]) + " |")
    lines.append("")
    lines.append(f"{unit}; err = failed (error in the JSON), skip = past the time budget, "
                 "absent = cannot run here (below), - = not run.")
    for c, why in absent.items():
        lines.append(f"- {c}: {why}")
    return "\n".join(lines)


def plot(rows: list[dict], columns: Sequence[str], path: str, title: str) -> str | None:
    """A bar chart of TF/s per case and mode, when matplotlib imports; the path or None."""
    plt_mod, err = optional_import("matplotlib")
    if plt_mod is None:
        log(f"no plot: matplotlib does not import ({first_line(err, 80)})")
        return None
    plt_mod.use("Agg")
    import matplotlib.pyplot as plt
    keys = []
    for r in rows:
        k = (r["tag"], r["B"], r["S"], r["H"], r["D"], r["causal"], r["mode"])
        if k not in keys:
            keys.append(k)
    cols = [c for c in columns if any(r["impl"] == c and r["status"] == "ok" for r in rows)]
    if not cols:
        return None
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(keys) * max(1, len(cols)) / 4), 5))
    width = 0.8 / len(cols)
    for j, c in enumerate(cols):
        xs, ys = [], []
        for i, k in enumerate(keys):
            for r in rows:
                if r["impl"] == c and r["status"] == "ok" and (r["tag"], r["B"], r["S"], r["H"], r["D"],
                                                                r["causal"], r["mode"]) == k:
                    xs.append(i + (j - (len(cols) - 1) / 2) * width)
                    ys.append(r["tflops"])
                    break
        ax.bar(xs, ys, width, label=c)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{t}\n{b}x{s}x{h}x{d}\n{'causal' if cz else 'full'} {m}" for t, b, s, h, d, cz, m in keys],
                       fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=4)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish(doc: dict, stem: str, columns: Sequence[str], opts, metric: str = "tflops",
           row_key: Callable | None = None, extra_markdown: str = "") -> str:
    """Write the JSON, the markdown table (printed last) and, unless --no-plot, the PNG."""
    doc["wall_s"] = round(time.perf_counter() - T_START, 1)
    write_json(stem + ".json", doc)
    log(f"wrote {stem}.json")
    title = (f"{doc['benchmark']} {opts.dtype_name}, {doc['device']}, {doc['date']} "
             f"(jax {doc['versions'].get('jax')})")
    table = markdown_table(doc["rows"], columns, metric, row_key)
    with open(stem + ".md", "w") as f:
        f.write(f"# {title}\n\n{FLOP_FORMULA}\n\n{table}\n" + (f"\n{extra_markdown}\n" if extra_markdown else ""))
    if not opts.no_plot and metric == "tflops":
        try:
            plot(doc["rows"], columns, stem + ".png", title)
        except Exception as e:
            log(f"plot failed: {first_line(error_text(e))}")
    counts = {s: sum(r["status"] == s for r in doc["rows"]) for s in ("ok", "error", "absent", "skipped")}
    log(f"done: {len(doc['rows'])} rows {counts}")
    print(f"\n## {title}\n\n{table}\n" + (f"\n{extra_markdown}\n" if extra_markdown else ""), flush=True)
    return table
