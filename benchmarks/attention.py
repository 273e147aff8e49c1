#!/usr/bin/env python3
"""Attention kernel benchmark: forward and forward+backward, causal and not, bf16.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/attention.py --out benchmarks/results

Implementations (names for ``--impls``):

    jax_cudnn    jax.nn.dot_product_attention(..., implementation="cudnn")  (the reference)
    jax_xla      jax.nn.dot_product_attention(..., implementation="xla")
    jax_attn     jax_attn.flash_attention(..., implementation="pallas_triton")  ("ours")
    mha_tuned    jax.experimental.pallas.ops.gpu.attention.mha, 128x128 blocks, 8 warps, 3 stages
    mha_default  the same kernel with its default configuration
    torch_flash  torch SDPA, SDPBackend.FLASH_ATTENTION (BHSD, pre-transposed)
    torch_cudnn  torch SDPA, SDPBackend.CUDNN_ATTENTION (BHSD, pre-transposed)
    torch_ref    torch_ref.flash_attention(..., implementation="triton")

Timing. JAX: ``jax.jit`` of the forward, or of ``jax.vjp`` forward + backward with a fixed
random cotangent (returning dq, dk, dv); the first call (compile) and a second warm call are
left out; then ``--repeats`` repeats of N back-to-back calls closed by one
``jax.block_until_ready`` (N chosen so that a repeat lasts about ``--target-ms``); the median
per-call time is reported. Torch: ``triton.testing.do_bench(..., return_mode="median")`` after
one untimed first call; forward+backward is ``torch.autograd.grad(out, (q, k, v), dout)``.

FLOPs: forward 4*B*S*S*H*D, halved when causal; forward+backward 3.5x forward.

Every row carries ``relerr`` = ||out - ref|| / ||ref|| (fp32) of its forward output against the
reference (cuDNN through JAX; XLA when cuDNN fails, named in ``relerr_ref``), and forward+backward
rows also ``relerr_grad`` = max over dq, dk, dv of the same measure against the reference's
gradients. Each implementation/shape/mode runs under try/except: a failure is recorded as the
row's ``error`` and the run goes on. The JSON file is rewritten after every (shape, causal), so a
crash keeps what was measured. ``--budget`` seconds after start the remaining rows are recorded
as skipped.

``--cpu-smoke`` exercises the code paths on a CPU (tiny float32 shapes; cuDNN errors there, the
Pallas kernels run in interpret mode, jax_attn uses implementation="xla", the torch rows use the
MATH SDPA backend / implementation="eager" and a wall-clock timer).
"""

from __future__ import annotations

import os
import sys

# Before jax is imported: let torch and jax share the GPU (no 75 % preallocation by XLA), unless the
# caller asks for it (the plain-jnp stick-breaking at S=8192, see benchmarks/stick_breaking.py).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_SMOKE = "--cpu-smoke" in sys.argv
if _SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

# jax 0.11 warns at every Pallas Triton lowering; filtered by its exact text only.
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be removed in"
                      r" a future JAX version\.")
warnings.filterwarnings("ignore", message=TRITON_DEPRECATION)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

try:
    import torch  # noqa: E402
    import torch.nn.functional as F  # noqa: E402
    _TORCH_ERR = None
except Exception as _e:  # pragma: no cover - depends on the machine
    torch = None
    F = None
    _TORCH_ERR = f"{type(_e).__name__}: {_e}"

try:
    import triton  # noqa: E402
    import triton.testing  # noqa: E402
    _TRITON_ERR = None
except Exception as _e:  # pragma: no cover
    triton = None
    _TRITON_ERR = f"{type(_e).__name__}: {_e}"


T_START = time.perf_counter()

DEFAULT_SHAPES = [(8, 2048, 16, 128), (2, 8192, 16, 128), (1, 16384, 16, 128), (16, 1024, 16, 64)]
QUICK_SHAPES = [(2, 8192, 16, 128)]
SMOKE_SHAPES = [(1, 256, 2, 64)]

# name -> (lib, impl, side, label for plot/table)
IMPLS = {
    "jax_cudnn": ("jax", "cudnn", "jax", "cuDNN(jax)"),
    "jax_xla": ("jax", "xla", "jax", "XLA"),
    "jax_attn": ("jax_attn", "default", "jax", "ours"),
    "jax_attn_triton": ("jax_attn", "pallas_triton", "jax", "ours (Triton)"),
    "mha_tuned": ("jax_pallas_mha", "tuned_bq128_bk128_w8_s3", "jax", "mha tuned"),
    "mha_default": ("jax_pallas_mha", "default", "jax", "mha default"),
    "torch_flash": ("torch", "sdpa_flash", "torch", "torch flash"),
    "torch_cudnn": ("torch", "sdpa_cudnn", "torch", "torch cuDNN"),
    "torch_ref": ("torch_ref", "triton", "torch", "torch_ref"),
}
IMPL_ORDER = list(IMPLS)
REFERENCE_CHAIN = ("jax_cudnn", "jax_xla")

FLOP_FORMULA = ("forward = 4*B*S*S*H*D (x0.5 when causal); forward+backward = 3.5 * forward "
                "(backward = 2.5 * forward); TFLOP/s = flops / time")

# mha (jax.experimental.pallas.ops.gpu.attention) tuned configuration.
MHA_TUNED_BLOCKS = dict(block_q=128, block_k=128, block_q_dkv=64, block_kv_dkv=128,
                        block_q_dq=128, block_kv_dq=64)
MHA_TUNED_WARPS = 8
MHA_TUNED_STAGES = 3


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def err_str(e: BaseException, limit: int = 3000) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= limit else s[:limit] + " ...[truncated]"


def first_line(s: str, limit: int = 240) -> str:
    line = (s or "").strip().splitlines()[0] if (s or "").strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def slugify(s: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")
    return s or "unknown"


def flops(B, S, H, D, causal, mode) -> float:
    f = 4.0 * B * S * S * H * D
    if causal:
        f *= 0.5
    if mode == "fwdbwd":
        f *= 3.5
    return f


def finite_or_none(x):
    if x is None:
        return None
    try:
        x = float(x)
    except Exception:
        return None
    return x if math.isfinite(x) else None


# --------------------------------------------------------------------------------------------
# Budget
# --------------------------------------------------------------------------------------------

class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - T_START)

    def exhausted(self) -> bool:
        return self.left() <= 0


class BudgetExhausted(Exception):
    pass


# --------------------------------------------------------------------------------------------
# JAX side
# --------------------------------------------------------------------------------------------

_MHA_MOD = None


def _mha_module():
    global _MHA_MOD
    if _MHA_MOD is None:
        from jax.experimental.pallas.ops.gpu import attention as mod
        _MHA_MOD = mod
    return _MHA_MOD


def _mha_block_sizes(mod, overrides: dict):
    """BlockSizes from the installed jax's defaults with `overrides`, only known fields."""
    BS = mod.BlockSizes
    names = {f.name for f in dataclasses.fields(BS)}
    ov = dict(overrides)
    if "block_k" in ov and "block_k" not in names and "block_kv" in names:
        ov["block_kv"] = ov.pop("block_k")
    dropped = sorted(k for k in ov if k not in names)
    ov = {k: v for k, v in ov.items() if k in names}
    try:
        base = BS.get_default()
        bs = dataclasses.replace(base, **ov)
    except Exception:
        bs = BS(**ov)
    return bs, dropped


def _mha_callable(causal: bool, D: int, kwargs: dict, smoke: bool):
    """A (q, k, v) -> out closure over mha with the given extra kwargs (filtered by signature)."""
    mod = _mha_module()
    kw = dict(sm_scale=1.0 / math.sqrt(D), causal=causal)
    kw.update(kwargs)
    if smoke:
        kw["interpret"] = True
    notes = []
    try:
        params = inspect.signature(mod.mha).parameters
        has_var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
        if not has_var_kw:
            unknown = [k for k in kw if k not in params]
            for k in unknown:
                kw.pop(k)
            if unknown:
                notes.append(f"mha has no parameter(s) {unknown}: dropped")
        pass_segment_ids = "segment_ids" in params
    except Exception as e:  # signature not inspectable: pass everything
        notes.append(f"inspect.signature(mha) failed ({type(e).__name__}); passing all kwargs")
        pass_segment_ids = True

    def f(q, k, v):
        if pass_segment_ids:
            return mod.mha(q, k, v, segment_ids=None, **kw)
        return mod.mha(q, k, v, **kw)

    return f, notes


def jax_candidates(name: str, causal: bool, D: int, mode: str, smoke: bool):
    """List of (label, note, f) with f: (q, k, v) -> out [B,S,H,D]; tried in order."""
    if name == "jax_cudnn":
        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        return [("cudnn", "", f)]
    if name == "jax_xla":
        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
        return [("xla", "", f)]
    if name in ("jax_attn", "jax_attn_triton"):
        import jax_attn  # ImportError -> errored row
        if smoke:
            impl = "xla"
        elif name == "jax_attn":  # what implementation=None picks for this call
            impl = jax_attn.default_implementation(jax_attn.AttentionSpec(scale=D ** -0.5, causal=causal), D,
                                                   jnp.bfloat16)
        else:
            impl = "pallas_triton"

        def f(q, k, v):
            out = jax_attn.flash_attention(q, k, v, causal=causal, implementation=impl)
            return out[0] if isinstance(out, (tuple, list)) else out
        note = "cpu-smoke: implementation='xla'" if smoke else f"implementation={impl!r}"
        return [(impl, note, f)]
    if name in ("mha_tuned", "mha_default"):
        mod = _mha_module()
        configs = []
        if name == "mha_tuned":
            bs, dropped = _mha_block_sizes(mod, MHA_TUNED_BLOCKS)
            n0 = f"block_sizes={bs}, num_warps={MHA_TUNED_WARPS}, num_stages={MHA_TUNED_STAGES}"
            if dropped:
                n0 += f"; BlockSizes has no {dropped}"
            configs.append(("tuned", n0, dict(block_sizes=bs, num_warps=MHA_TUNED_WARPS,
                                              num_stages=MHA_TUNED_STAGES)))
            if mode == "fwdbwd":
                bs2, _ = _mha_block_sizes(mod, dict(block_q=128, block_k=128))
                configs.append(("tuned-fwd+default-bwd",
                                f"block_sizes={bs2}, num_warps=None, num_stages={MHA_TUNED_STAGES}",
                                dict(block_sizes=bs2, num_stages=MHA_TUNED_STAGES)))
            configs.append(("defaults", "mha defaults", {}))
        else:
            configs.append(("default", "mha defaults (block_sizes, num_warps, num_stages)", {}))
        out = []
        for label, note, kw in configs:
            f, notes = _mha_callable(causal, D, kw, smoke)
            full = "; ".join([n for n in [note] + notes if n])
            if smoke:
                full = (full + "; " if full else "") + "cpu-smoke: interpret=True"
            out.append((label, full, f))
        return out
    raise ValueError(f"unknown JAX implementation {name!r}")


def _make_fwdbwd(f):
    def fb(q, k, v, do):
        _, vjp = jax.vjp(f, q, k, v)
        return vjp(do)
    return fb


class JaxFns:
    """Jitted candidates cached per (name, causal, mode) for one shape (so the reference
    computation and the timed row share one compilation)."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.cache = {}

    def get(self, name, causal, mode, D):
        key = (name, causal, mode, D)
        if key not in self.cache:
            cands = jax_candidates(name, causal, D, mode, self.smoke)
            jitted = []
            for label, note, f in cands:
                g = jax.jit(f) if mode == "fwd" else jax.jit(_make_fwdbwd(f))
                jitted.append((label, note, g))
            self.cache[key] = jitted
        return self.cache[key]

    def clear(self):
        self.cache.clear()


def time_jax(g, args, target_ms: float, repeats: int):
    """Returns (median ms per call, output of the first call, first-call seconds)."""
    t0 = time.perf_counter()
    out = g(*args)
    jax.block_until_ready(out)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = g(*args)
    jax.block_until_ready(r)
    est = max(time.perf_counter() - t0, 1e-6)
    del r
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


@jax.jit
def _jax_relerr(a, b):
    a = a.astype(jnp.float32).ravel()
    b = b.astype(jnp.float32).ravel()
    return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def jax_relerr(a, b):
    return float(_jax_relerr(a, b))


# --------------------------------------------------------------------------------------------
# Torch side
# --------------------------------------------------------------------------------------------

def torch_device(smoke: bool):
    if torch is None:
        raise RuntimeError(f"torch unavailable: {_TORCH_ERR}")
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    return torch.device("cuda")


def torch_sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _do_bench(fn, warmup_ms, rep_ms):
    params = inspect.signature(triton.testing.do_bench).parameters
    if "return_mode" in params:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                             return_mode="median"))
    res = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])
    return float(res[0] if isinstance(res, (list, tuple)) else res)


def time_torch(fn, dev, target_ms: float, repeats: int):
    """Returns (median ms, output of the first call, first-call seconds)."""
    t0 = time.perf_counter()
    out = fn()
    torch_sync(dev)
    first_s = time.perf_counter() - t0
    if dev.type == "cuda":
        if triton is None:
            raise RuntimeError(f"triton unavailable: {_TRITON_ERR}")
        ms = _do_bench(fn, warmup_ms=10, rep_ms=max(20, int(target_ms * repeats / 2)))
        return ms, out, first_s
    # CPU (smoke only): plain wall clock.
    t0 = time.perf_counter()
    fn()
    est = max(time.perf_counter() - t0, 1e-6)
    n = int(max(1, min(200, round(target_ms * 1e-3 / est))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times) * 1e3, out, first_s


def torch_relerr(a, b):
    a = a.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class TorchInputs:
    def __init__(self, host: dict, dtype_name: str, dev):
        tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32,
               "float16": torch.float16}[dtype_name]
        self.dev = dev
        self.t = {}
        for n in ("q", "k", "v", "do"):
            x = torch.from_numpy(host[n]).to(dev).to(tdt).contiguous()
            self.t[n] = x                                     # BSHD
            self.t[n + "_h"] = x.transpose(1, 2).contiguous()  # BHSD for SDPA
        for n in ("q", "k", "v"):
            self.t[n + "_g"] = self.t[n].detach().clone().requires_grad_(True)
            self.t[n + "_hg"] = self.t[n + "_h"].detach().clone().requires_grad_(True)

    def __getitem__(self, k):
        return self.t[k]


def torch_row_fn(name, causal, mode, T: TorchInputs, smoke: bool):
    """Returns (fn, context_factory, to_bshd, note). fn() returns out (fwd) or (dq, dk, dv)."""
    import contextlib
    note = ""
    if name in ("torch_flash", "torch_cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if smoke:
            backend = SDPBackend.MATH
            note = "cpu-smoke: SDPBackend.MATH"
        else:
            backend = (SDPBackend.FLASH_ATTENTION if name == "torch_flash"
                       else SDPBackend.CUDNN_ATTENTION)

        def ctx():
            return sdpa_kernel(backend)

        def attn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def to_bshd(x):
            return x.transpose(1, 2)
        sfx, gsfx = "_h", "_hg"
    elif name == "torch_ref":
        import torch_ref  # ImportError -> errored row
        impl = "eager" if smoke else "triton"
        if smoke:
            note = "cpu-smoke: implementation='eager'"

        def ctx():
            return contextlib.nullcontext()

        def attn(q, k, v):
            out = torch_ref.flash_attention(q, k, v, causal=causal, implementation=impl)
            return out[0] if isinstance(out, (tuple, list)) else out

        def to_bshd(x):
            return x
        sfx, gsfx = "", "_g"
    else:
        raise ValueError(f"unknown torch implementation {name!r}")

    if mode == "fwd":
        q, k, v = T["q" + sfx], T["k" + sfx], T["v" + sfx]

        def fn():
            with torch.no_grad():
                return attn(q, k, v)
    else:
        q, k, v = T["q" + gsfx], T["k" + gsfx], T["v" + gsfx]
        do = T["do" + sfx]

        def fn():
            out = attn(q, k, v)
            return torch.autograd.grad(out, (q, k, v), do)
    return fn, ctx, to_bshd, note


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

def make_row(name, causal, shape, dtype_name, mode):
    lib, impl, _, _ = IMPLS[name]
    B, S, H, D = shape
    return {"lib": lib, "impl": impl, "name": name, "causal": bool(causal),
            "B": B, "S": S, "H": H, "D": D, "dtype": dtype_name, "mode": mode,
            "ms": None, "tflops": None, "relerr": None, "relerr_grad": None,
            "relerr_ref": None, "first_call_s": None, "error": None, "note": None}


def add_note(row, text):
    if not text:
        return
    row["note"] = text if not row["note"] else row["note"] + "; " + text


def finish_row(row, ms, first_s):
    row["ms"] = finite_or_none(ms)
    row["first_call_s"] = finite_or_none(first_s)
    if row["ms"] and row["ms"] > 0:
        f = flops(row["B"], row["S"], row["H"], row["D"], row["causal"], row["mode"])
        row["tflops"] = f / (row["ms"] * 1e-3) / 1e12


def print_row(row):
    try:
        shape = f"({row['B']},{row['S']},{row['H']},{row['D']})"
        head = f"{row['name']:<12} {shape:<20} causal={int(row['causal'])} {row['mode']:<6}"
        if row["error"]:
            log(f"{head} ERROR {first_line(row['error'])}")
        else:
            rel = "" if row["relerr"] is None else f" relerr={row['relerr']:.2e}"
            relg = "" if row["relerr_grad"] is None else f" relerr_grad={row['relerr_grad']:.2e}"
            note = f"  [{first_line(row['note'], 160)}]" if row["note"] else ""
            log(f"{head} {row['ms']:9.3f} ms {row['tflops']:8.1f} TF/s{rel}{relg}{note}")
    except Exception as e:
        log(f"(row print failed: {type(e).__name__}: {e}) {row}")


class Reference:
    def __init__(self):
        self.name = None
        self.out = None          # jax f32, BSHD
        self.grads_name = None
        self.grads = None        # tuple of jax f32 (dq, dk, dv)
        self._t_out = None
        self._t_grads = None

    def torch_out(self, dev):
        if self.out is None:
            return None
        if self._t_out is None:
            self._t_out = torch.from_numpy(np.array(self.out, dtype=np.float32)).to(dev)
        return self._t_out

    def torch_grads(self, dev):
        if self.grads is None:
            return None
        if self._t_grads is None:
            self._t_grads = tuple(torch.from_numpy(np.array(g, dtype=np.float32)).to(dev) for g in self.grads)
        return self._t_grads


def compute_reference(fns: JaxFns, causal, D, args_fwd, args_bwd, budget: Budget) -> Reference:
    ref = Reference()
    for mode in ("fwd", "fwdbwd"):
        for name in REFERENCE_CHAIN:
            if budget.exhausted():
                break
            try:
                label, _, g = fns.get(name, causal, mode, D)[0]
                res = g(*(args_fwd if mode == "fwd" else args_bwd))
                if mode == "fwd":
                    ref.out = res.astype(jnp.float32)
                    jax.block_until_ready(ref.out)
                    ref.name = name
                else:
                    ref.grads = tuple(x.astype(jnp.float32) for x in res)
                    jax.block_until_ready(ref.grads)
                    ref.grads_name = name
                del res
                break
            except Exception as e:
                log(f"reference {name} {mode} causal={int(causal)} failed: "
                    f"{first_line(err_str(e))}")
    log(f"reference causal={int(causal)}: out from {ref.name}, grads from {ref.grads_name}")
    return ref


def run_jax_row(row, fns: JaxFns, ref: Reference, fwd_relerr: dict, args_fwd, args_bwd,
                opts, budget: Budget):
    name, causal, mode, D = row["name"], row["causal"], row["mode"], row["D"]
    cands = fns.get(name, causal, mode, D)
    failures = []
    for i, (label, note, g) in enumerate(cands):
        if budget.exhausted():
            raise BudgetExhausted()
        try:
            ms, out, first_s = time_jax(g, args_fwd if mode == "fwd" else args_bwd,
                                        opts.target_ms, opts.repeats)
        except Exception as e:
            failures.append(f"config '{label}' failed: {first_line(err_str(e), 400)}")
            log(f"{name} {mode} causal={int(causal)}: config '{label}' failed: "
                f"{first_line(err_str(e))}")
            if i == len(cands) - 1:
                add_note(row, "; ".join(failures[:-1]))
                raise
            continue
        if failures:
            add_note(row, "; ".join(failures) + f"; FELL BACK to config '{label}'")
        add_note(row, note)
        finish_row(row, ms, first_s)
        try:
            if mode == "fwd":
                if ref.out is not None:
                    rel = jax_relerr(out, ref.out)
                    row["relerr"] = finite_or_none(rel)
                    row["relerr_ref"] = ref.name
                    if row["relerr"] is None:
                        add_note(row, f"relerr={rel}")
                    fwd_relerr[(name, causal)] = (row["relerr"], ref.name)
            else:
                if (name, causal) in fwd_relerr:
                    row["relerr"], row["relerr_ref"] = fwd_relerr[(name, causal)]
                if ref.grads is not None:
                    rels = [jax_relerr(a, b) for a, b in zip(out, ref.grads)]
                    row["relerr_grad"] = finite_or_none(max(rels))
                    if row["relerr_grad"] is None:
                        add_note(row, f"relerr_grad(dq,dk,dv)={rels}")
                    row["relerr_ref"] = row["relerr_ref"] or ref.grads_name
                    if ref.grads_name != row["relerr_ref"]:
                        add_note(row, f"grads reference: {ref.grads_name}")
        except Exception as e:
            add_note(row, f"relerr failed: {first_line(err_str(e), 300)}")
        del out
        return


def run_torch_row(row, T: TorchInputs, ref: Reference, fwd_relerr: dict, opts,
                  budget: Budget, smoke: bool):
    if budget.exhausted():
        raise BudgetExhausted()
    name, causal, mode = row["name"], row["causal"], row["mode"]
    fn, ctx, to_bshd, note = torch_row_fn(name, causal, mode, T, smoke)
    add_note(row, note)
    with ctx():
        ms, out, first_s = time_torch(fn, T.dev, opts.target_ms, opts.repeats)
    finish_row(row, ms, first_s)
    try:
        if mode == "fwd":
            r = ref.torch_out(T.dev)
            if r is not None:
                rel = torch_relerr(to_bshd(out), r)
                row["relerr"] = finite_or_none(rel)
                row["relerr_ref"] = ref.name
                if row["relerr"] is None:
                    add_note(row, f"relerr={rel}")
                fwd_relerr[(name, causal)] = (row["relerr"], ref.name)
        else:
            if (name, causal) in fwd_relerr:
                row["relerr"], row["relerr_ref"] = fwd_relerr[(name, causal)]
            rg = ref.torch_grads(T.dev)
            if rg is not None:
                rels = [torch_relerr(to_bshd(a), b) for a, b in zip(out, rg)]
                row["relerr_grad"] = finite_or_none(max(rels))
                if row["relerr_grad"] is None:
                    add_note(row, f"relerr_grad(dq,dk,dv)={rels}")
                row["relerr_ref"] = row["relerr_ref"] or ref.grads_name
                if ref.grads_name != row["relerr_ref"]:
                    add_note(row, f"grads reference: {ref.grads_name}")
    except Exception as e:
        add_note(row, f"relerr failed: {first_line(err_str(e), 300)}")
    del out


def versions() -> dict:
    v = {"python": platform.python_version(), "jax": getattr(jax, "__version__", None)}
    try:
        import jaxlib
        v["jaxlib"] = getattr(jaxlib, "__version__", None)
        if v["jaxlib"] is None:
            from jaxlib import version as _jv
            v["jaxlib"] = _jv.__version__
    except Exception as e:
        v["jaxlib"] = f"unavailable: {type(e).__name__}"
    v["torch"] = torch.__version__ if torch is not None else f"unavailable: {_TORCH_ERR}"
    v["triton"] = triton.__version__ if triton is not None else f"unavailable: {_TRITON_ERR}"
    if torch is not None:
        try:
            v["torch_cuda"] = torch.version.cuda
            v["torch_cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
        except Exception:
            pass
    try:
        import flax
        v["flax"] = flax.__version__
    except Exception:
        pass
    return v


def device_info(smoke: bool):
    try:
        d = jax.devices()[0]
        kind = d.device_kind
        platform_ = d.platform
    except Exception as e:
        kind, platform_ = f"unknown ({type(e).__name__})", "unknown"
    name = kind
    if torch is not None and not smoke:
        try:
            if torch.cuda.is_available():
                name = torch.cuda.get_device_name()
        except Exception:
            pass
    return name, kind, platform_


def _sanitize(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _sanitize(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_sanitize(v) for v in x]
    return x


def write_json(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_sanitize(doc), f, indent=1, default=str)
    os.replace(tmp, path)


def ms_table_row(labels, times, ratios) -> str:
    """A markdown row: labels, then times in ms ("err" where missing), then a/b ratios ("-")."""
    cells = [*labels, *(f"{x:.3f}" if x else "err" for x in times),
             *(f"{a / b:.3f}" if a and b else "-" for a, b in ratios)]
    return "| " + " | ".join(cells) + " |"


def save_run(out_dir: str, stem: str, device_kind: str, device_name: str, rows: list, **extra) -> str:
    """Write one run of a benchmark script as {out_dir}/{stem}-{device kind}-{date}.json."""
    os.makedirs(out_dir, exist_ok=True)
    date = time.strftime("%Y-%m-%d")
    path = os.path.join(out_dir, f"{stem}-{slugify(device_kind)}-{date}.json")
    write_json(path, dict(device=device_name, date=date, versions=versions(), **extra, rows=rows))
    log(f"wrote {path}")
    return path


# --------------------------------------------------------------------------------------------
# Plot and table
# --------------------------------------------------------------------------------------------

def _ok(r):
    return not r.get("error") and r.get("tflops") is not None


def make_plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = []
    for r in rows:
        s = (r["B"], r["S"], r["H"], r["D"])
        if s not in shapes:
            shapes.append(s)
    names = [n for n in IMPL_ORDER if any(_ok(r) and r["name"] == n for r in rows)]
    panels = [("fwd", False), ("fwd", True), ("fwdbwd", False), ("fwdbwd", True)]
    fig, axes = plt.subplots(2, 2, figsize=(17, 10), squeeze=False)
    cmap = plt.get_cmap("tab10")
    width = 0.8 / max(1, len(names))
    for ax, (mode, causal) in zip(axes.ravel(), panels):
        for j, n in enumerate(names):
            xs, ys = [], []
            for i, s in enumerate(shapes):
                for r in rows:
                    if (_ok(r) and r["name"] == n and r["mode"] == mode
                            and r["causal"] == causal and (r["B"], r["S"], r["H"], r["D"]) == s):
                        xs.append(i + (j - (len(names) - 1) / 2) * width)
                        ys.append(r["tflops"])
                        break
            if xs:
                bars = ax.bar(xs, ys, width, label=IMPLS[n][3], color=cmap(j % 10))
                for b, y in zip(bars, ys):
                    ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.0f}", ha="center",
                            va="bottom", fontsize=6, rotation=90)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"B{b} S{s}\nH{h} D{d}" for b, s, h, d in shapes], fontsize=8)
        ax.set_title(f"{'forward' if mode == 'fwd' else 'forward+backward'}, "
                     f"{'causal' if causal else 'non-causal'}")
        ax.set_ylabel("TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    handles, labels = [], []
    for ax in axes.ravel():
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.965),
                   ncol=min(8, len(labels)), fontsize=9)
    fig.suptitle(title, y=0.995, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=120)
    plt.close(fig)


RELERR_FLAG = 0.05


def make_table(rows, names) -> str:
    cols = [n for n in names]
    hdr = (["shape (B,S,H,D)", "causal", "mode"] + [IMPLS[n][3] for n in cols]
           + ["ours/cuDNN", "ours/mha tuned"])
    lines = ["| " + " | ".join(hdr) + " |", "|" + "|".join(["---"] * len(hdr)) + "|"]
    keys = []
    for r in rows:
        k = ((r["B"], r["S"], r["H"], r["D"]), r["causal"], r["mode"])
        if k not in keys:
            keys.append(k)
    flagged = False
    for shape, causal, mode in keys:
        by = {}
        for r in rows:
            if ((r["B"], r["S"], r["H"], r["D"]), r["causal"], r["mode"]) == (shape, causal, mode):
                by[r["name"]] = r
        cells = []
        for n in cols:
            r = by.get(n)
            if r is None:
                cells.append("-")
            elif not _ok(r):
                cells.append("skip" if (r.get("error") or "").startswith("skipped") else "err")
            else:
                c = f"{r['tflops']:.1f}"
                note = r.get("note") or ""
                bad = [x for x in (r.get("relerr"), r.get("relerr_grad"))
                       if x is not None and x > RELERR_FLAG]
                if bad or "relerr=" in note or "relerr_grad(" in note:
                    c += "!"
                    flagged = True
                if "FELL BACK" in note:
                    c += "*"
                cells.append(c)

        def ratio(a, b):
            ra, rb = by.get(a), by.get(b)
            if ra is not None and rb is not None and _ok(ra) and _ok(rb) and rb["tflops"]:
                return f"{ra['tflops'] / rb['tflops']:.2f}"
            return "-"
        cells += [ratio("jax_attn", "jax_cudnn"), ratio("jax_attn", "mha_tuned")]
        lines.append("| " + " | ".join([f"{shape}".replace(" ", ""), "yes" if causal else "no",
                                        mode] + cells) + " |")
    lines.append("")
    lines.append("TFLOP/s. err = failed (see the JSON), skip = time budget, - = not run; "
                 "* = fell back to another config (see note)"
                 + (f"; ! = relerr > {RELERR_FLAG} vs the reference" if flagged else "") + ".")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def parse_shape(s: str):
    parts = [p for p in re.split(r"[,x:/ ]+", s.strip().strip("()")) if p]
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"shape must be B,S,H,D: {s!r}")
    return tuple(int(p) for p in parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(_REPO_ROOT, "benchmarks", "results"),
                   help="output folder (default: benchmarks/results)")
    p.add_argument("--quick", action="store_true", help="only shape (2,8192,16,128)")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                   help="override shapes, each B,S,H,D (e.g. --shapes 2,8192,16,128 8,2048,16,128)")
    p.add_argument("--impls", nargs="+", default=None,
                   help=f"subset of implementations (space or comma separated): {', '.join(IMPL_ORDER)}")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats (median)")
    p.add_argument("--target-ms", type=float, default=30.0,
                   help="JAX: wall time of one repeat; torch: do_bench rep ~ target*repeats/2")
    p.add_argument("--budget", type=float, default=390.0,
                   help="seconds after start beyond which remaining rows are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny float32 CPU run of the code paths (JSON, plot, table)")
    args = p.parse_args(argv)
    if args.impls:
        names = [n for item in args.impls for n in item.split(",") if n]
        bad = [n for n in names if n not in IMPLS]
        if bad:
            p.error(f"unknown --impls {bad}; known: {IMPL_ORDER}")
        args.impls = [n for n in IMPL_ORDER if n in names]
    else:
        args.impls = list(IMPL_ORDER)
    if args.shapes:
        pass
    elif args.cpu_smoke:
        args.shapes = SMOKE_SHAPES
    elif args.quick:
        args.shapes = QUICK_SHAPES
    else:
        args.shapes = DEFAULT_SHAPES
    return args


def main(argv=None) -> int:
    opts = parse_args(argv)
    smoke = opts.cpu_smoke
    dtype_name = "float32" if smoke else "bfloat16"
    jdt = jnp.float32 if smoke else jnp.bfloat16
    budget = Budget(opts.budget)

    os.makedirs(opts.out, exist_ok=True)
    dev_name, dev_kind, dev_platform = device_info(smoke)
    date = datetime.date.today().isoformat()
    slug = slugify(dev_kind)
    stem = f"attention-{slug}-{date}" + ("-cpu-smoke" if smoke else "")
    json_path = os.path.join(opts.out, stem + ".json")
    png_path = os.path.join(opts.out, stem + ".png")
    md_path = os.path.join(opts.out, stem + ".md")

    vers = versions()
    log(f"device: {dev_name} (jax platform {dev_platform}, kind {dev_kind}); versions: {vers}")
    log(f"shapes: {opts.shapes}; impls: {opts.impls}; budget {opts.budget:.0f}s; out {json_path}")
    if not smoke and dev_platform != "gpu":
        log("WARNING: jax sees no GPU; the GPU implementations will error")

    rows = []
    doc = {
        "device": dev_name,
        "device_kind": dev_kind,
        "date": date,
        "versions": vers,
        "flop_formula": FLOP_FORMULA,
        "timing": ("JAX: jit, first call (compile) and one warm call excluded, median over "
                   f"{opts.repeats} repeats of N back-to-back calls + one block_until_ready "
                   f"(~{opts.target_ms:g} ms per repeat); torch: triton.testing.do_bench "
                   "median after one untimed call; fwdbwd = forward + backward of (q,k,v) "
                   "with a fixed random cotangent"),
        "relerr": ("||out - ref|| / ||ref|| in fp32 against relerr_ref's forward output "
                   "(cuDNN via jax, XLA if cuDNN failed); relerr_grad: max over dq,dk,dv"),
        "mha_tuned_config": {"block_sizes": MHA_TUNED_BLOCKS, "num_warps": MHA_TUNED_WARPS,
                             "num_stages": MHA_TUNED_STAGES},
        "cpu_smoke": smoke,
        "args": {"shapes": [list(s) for s in opts.shapes], "impls": opts.impls,
                 "repeats": opts.repeats, "target_ms": opts.target_ms, "budget": opts.budget},
        "rows": rows,
    }

    fns = JaxFns(smoke)
    torch_names = [n for n in opts.impls if IMPLS[n][2] == "torch"]
    rng = np.random.default_rng(opts.seed)

    for shape in opts.shapes:
        B, S, H, D = shape
        log(f"=== shape B={B} S={S} H={H} D={D} ({dtype_name}) ===")
        if budget.exhausted():
            for causal in (False, True):
                for n in opts.impls:
                    for mode in ("fwd", "fwdbwd"):
                        row = make_row(n, causal, shape, dtype_name, mode)
                        row["error"] = f"skipped: time budget ({opts.budget:.0f}s) exhausted"
                        rows.append(row)
            log("skipped: time budget exhausted")
            continue
        host = {}
        jx = {}
        T = None
        T_err = None
        try:
            for n in ("q", "k", "v", "do"):
                host[n] = rng.standard_normal((B, S, H, D), dtype=np.float32)
                jx[n] = jnp.asarray(host[n]).astype(jdt)
            jax.block_until_ready(list(jx.values()))
        except Exception as e:
            msg = f"input creation failed: {err_str(e)}"
            log(msg)
            for causal in (False, True):
                for n in opts.impls:
                    for mode in ("fwd", "fwdbwd"):
                        row = make_row(n, causal, shape, dtype_name, mode)
                        row["error"] = msg
                        rows.append(row)
            host.clear()
            jx.clear()
            continue
        if torch_names:
            try:
                T = TorchInputs(host, dtype_name, torch_device(smoke))
            except Exception as e:
                T_err = f"torch inputs unavailable: {err_str(e)}"
                log(T_err)
        host.clear()
        args_fwd = (jx["q"], jx["k"], jx["v"])
        args_bwd = (jx["q"], jx["k"], jx["v"], jx["do"])

        for causal in (False, True):
            ref = Reference()
            if not budget.exhausted():
                try:
                    ref = compute_reference(fns, causal, D, args_fwd, args_bwd, budget)
                except Exception as e:
                    log(f"reference failed: {first_line(err_str(e))}")
            fwd_relerr = {}
            for n in opts.impls:
                side = IMPLS[n][2]
                for mode in ("fwd", "fwdbwd"):
                    row = make_row(n, causal, shape, dtype_name, mode)
                    try:
                        if budget.exhausted():
                            raise BudgetExhausted()
                        if side == "jax":
                            run_jax_row(row, fns, ref, fwd_relerr, args_fwd, args_bwd, opts,
                                        budget)
                        else:
                            if T is None:
                                raise RuntimeError(T_err or "torch inputs unavailable")
                            run_torch_row(row, T, ref, fwd_relerr, opts, budget, smoke)
                    except BudgetExhausted:
                        row["error"] = f"skipped: time budget ({opts.budget:.0f}s) exhausted"
                    except Exception as e:
                        row["error"] = err_str(e)
                        if os.environ.get("BENCH_TRACEBACK"):
                            traceback.print_exc()
                    rows.append(row)
                    print_row(row)
                if side == "torch" and torch is not None and not smoke:
                    try:
                        torch.cuda.empty_cache()
                    except Exception:
                        pass
            del ref
            gc.collect()
            try:
                write_json(json_path, doc)
            except Exception as e:
                log(f"writing JSON failed: {err_str(e)}")

        # Free this shape's memory before the next.
        del args_fwd, args_bwd
        jx.clear()
        T = None
        fns.clear()
        gc.collect()
        if torch is not None and not smoke:
            try:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except Exception:
                pass

    doc["wall_s"] = round(time.perf_counter() - T_START, 1)
    try:
        write_json(json_path, doc)
        log(f"wrote {json_path}")
    except Exception as e:
        log(f"writing JSON failed: {err_str(e)}")
    try:
        make_plot(rows, png_path, f"attention {dtype_name}: {dev_name}, {date} "
                                  f"(jax {vers.get('jax')}, torch {vers.get('torch')})")
        log(f"wrote {png_path}")
    except Exception as e:
        log(f"plot failed: {err_str(e)}")
    table = ""
    try:
        table = make_table(rows, opts.impls)
        with open(md_path, "w") as f:
            f.write(f"# attention {dtype_name}, {dev_name}, {date}\n\n{table}\n")
    except Exception as e:
        log(f"table failed: {err_str(e)}")
    n_err = sum(1 for r in rows if r["error"])
    log(f"done: {len(rows)} rows, {n_err} errored/skipped")
    print(flush=True)
    print(f"## attention {dtype_name} on {dev_name} ({date})", flush=True)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
