"""`python -m parity.check`: the same attention in JAX and PyTorch, against one float64 golden.

For every case of `parity.cases`: seeded NumPy inputs and cotangent go to both frameworks; the
golden is the plain reference in float64 (torch eager; the JAX plain reference in float64 must agree
with it to 1e-10, a check of its own); each implementation (JAX pallas_triton, JAX xla, torch triton,
torch eager; on Hopper also JAX mosaic_gpu, for the cases it serves: for stick-breaking, its
forward) is compared on out, lse, dq, dk, dv with the tolerance rule of `parity.tolerance`, the
naive error being that of its own framework's plain reference in the compute dtype.
Then the layer cases of `parity.layers` (variant "layers": Flax layers against their torch twins,
every parameter gradient, a 20-step training run), through `check_layer_case`.

Flags: --variant NAME, --quick, --json PATH, --cases NAME[,NAME]. Exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

import numpy as np

def _setup_torch():
    """Import torch; without CUDA, route Triton kernels through its interpreter (must precede the
    first triton import). fp32 cases compare exact matmuls: TF32 stays off (torch's default)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


torch = _setup_torch()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import jax_attn  # noqa: E402
from jax_attn.ops.stick_breaking import mosaic as stick_breaking_mosaic  # noqa: E402
import torch_ref  # noqa: E402
from parity.cases import CASES, Case  # noqa: E402
from parity.layers import LAYER_CASES, LayerCase, check_layer_case  # noqa: E402
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare  # noqa: E402

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
             "float64": np.float64}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


def _to_np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(jnp.asarray(x, jnp.float32) if x.dtype == jnp.bfloat16 else x, np.float64)


def run_jax(case: Case, implementation: str, dtype: str, inputs):
    """The case's quantities (float64 NumPy) from jax_attn on the default JAX device:
    out, lse | rem, then the gradients of q, k, v (and decay for stick-breaking)."""
    q, k, v, do, dstat, seg, pos = inputs
    jdt = {"float64": jnp.float64, "float32": jnp.float32, "float16": jnp.float16,
           "bfloat16": jnp.bfloat16}[dtype]
    cast = lambda x: jnp.asarray(x, jdt)
    ints = lambda x: None if x is None else (
        tuple(jnp.asarray(s) for s in x) if isinstance(x, tuple) else jnp.asarray(x))
    extra = {} if case.rope is None else dict(
        rope=jax_attn.Rope(style=case.rope[0], base=case.rope[1]), positions=ints(pos))
    stat_dtype = jnp.float64 if dtype == "float64" else jnp.float32
    args = [cast(q), cast(k), cast(v)]
    if case.variant == "stick_breaking":
        args.append(jnp.asarray(case.decay, stat_dtype))

        def f(q, k, v, decay):
            return jax_attn.stick_breaking_attention(q, k, v, decay=decay, return_remainder=True,
                                                     implementation=implementation, **case.call_kwargs(), **extra)
    else:
        def f(q, k, v):
            return jax_attn.flash_attention(q, k, v, segment_ids=ints(seg), return_lse=True,
                                            implementation=implementation, **case.call_kwargs(), **extra)

    (out, stat), vjp = jax.vjp(jax.jit(f), *args)
    grads = vjp((cast(do), jnp.asarray(dstat, stat_dtype)))
    return [_to_np(x) for x in (out, stat, *grads)]


def run_torch(case: Case, implementation: str, dtype: str, inputs, device):
    """The case's quantities (float64 NumPy) from torch_ref, as `run_jax`."""
    q, k, v, do, dstat, seg, pos = inputs
    tdt = TORCH_DTYPES[dtype]
    leaf = lambda x, dt=tdt: torch.tensor(x, dtype=dt, device=device, requires_grad=True)
    leaves = [leaf(q), leaf(k), leaf(v)]
    ids = lambda s: torch.tensor(s, dtype=torch.int32, device=device)
    ints = lambda x: None if x is None else (tuple(ids(s) for s in x) if isinstance(x, tuple) else ids(x))
    extra = {} if case.rope is None else dict(
        rope=torch_ref.Rope(style=case.rope[0], base=case.rope[1]), positions=ints(pos))
    impl = "eager" if dtype == "float64" else implementation
    stat_dtype = torch.float64 if dtype == "float64" else torch.float32
    if case.variant == "stick_breaking":
        leaves.append(leaf(case.decay, stat_dtype))
        out, stat = torch_ref.stick_breaking_attention(*leaves[:3], decay=leaves[3], return_remainder=True,
                                                       implementation=impl, **case.call_kwargs(), **extra)
    else:
        out, stat = torch_ref.flash_attention(*leaves, segment_ids=ints(seg), return_lse=True,
                                              implementation=impl, **case.call_kwargs(), **extra)
    cotangents = (torch.tensor(do, dtype=tdt, device=device), torch.tensor(dstat, dtype=stat.dtype, device=device))
    grads = torch.autograd.grad((out, stat), leaves, cotangents)
    return [_to_np(x) for x in (out, stat, *grads)]


def _golden_disagreement(a, b) -> float:
    """max |a - b| over finite entries; inf if the infinities (empty rows' lse) differ."""
    finite = np.isfinite(a)
    if not np.array_equal(finite, np.isfinite(b)) or not np.array_equal(a[~finite], b[~finite]):
        return float("inf")
    return float(np.max(np.abs(a[finite] - b[finite]), initial=0.0))


def _mosaic_serves(case: Case) -> bool:
    """Whether implementation="mosaic_gpu" serves the case here, by the rule `flash_attention`
    applies (`mosaic_gpu.unsupported_reason`: device, dtype, head dim, features, RoPE positions)."""
    if case.variant == "stick_breaking":  # its forward (`stick_breaking_mosaic`)
        spec = jax_attn.AttentionSpec(scale=1.0, causal=True, rope=None if case.rope is None else jax_attn.Rope())
        return stick_breaking_mosaic.unsupported_reason(spec, case.shape[5], jnp.dtype(case.dtype)) is None
    kw = case.call_kwargs()
    left, right = kw.get("window") or (None, None)
    spec = jax_attn.AttentionSpec(
        scale=1.0, causal=kw.get("causal", False), window_left=left, window_right=right,
        softcap=kw.get("softcap"), has_segments=case.segments is not None,
        rope=None if case.rope is None else jax_attn.Rope(style=case.rope[0], base=case.rope[1]))
    return jax_attn.ops.softmax.mosaic.unsupported_reason(spec, case.shape[5], jnp.dtype(case.dtype),
                                                  positions=case.positions is not None) is None


def check_case(case: Case, device) -> list[dict]:
    """Rows of the report for one case: one per (implementation, quantity)."""
    inputs = case.draw()
    golden = run_torch(case, "eager", "float64", inputs, device)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        golden_jax = run_jax(case, "xla", "float64", inputs)
    rows = []
    agree = max(_golden_disagreement(a, b) for a, b in zip(golden, golden_jax))
    rows.append(dict(case=case.name, impl="golden torch-f64 vs jax-f64", quantity="all",
                     error=agree, allowed=1e-10, ratio=agree / 1e-10, ok=agree <= 1e-10))
    exact = jax.default_matmul_precision("highest") if case.dtype == "float32" else contextlib.nullcontext()
    with exact:
        naive = {"jax": run_jax(case, "xla", case.dtype, inputs),
                 "torch": run_torch(case, "eager", case.dtype, inputs, device)}
        results = {
            "jax pallas_triton": ("jax", lambda: run_jax(case, "pallas_triton", case.dtype, inputs)),
            "jax xla": ("jax", lambda: naive["jax"]),
            "torch triton": ("torch", lambda: run_torch(case, "triton", case.dtype, inputs, device)),
            "torch eager": ("torch", lambda: naive["torch"]),
        }
        if _mosaic_serves(case):
            results["jax mosaic_gpu"] = ("jax", lambda: run_jax(case, "mosaic_gpu", case.dtype, inputs))
        for impl, (framework, run) in results.items():
            t0 = time.time()
            try:
                fast = run()
            except Exception as e:  # a crash is a failure of that implementation, reported
                rows.append(dict(case=case.name, impl=impl, quantity="all", error=float("inf"),
                                 allowed=0.0, ratio=float("inf"), ok=False,
                                 reason=f"{type(e).__name__}: {e}"[:300]))
                continue
            for name, f, n, g in zip(case.quantities, fast, naive[framework], golden):
                factor = FORWARD_FACTOR if name in ("out", "lse", "rem") else GRADIENT_FACTOR
                v = compare(f, n, g, NP_DTYPES[case.dtype], factor)
                rows.append(dict(case=case.name, impl=impl, quantity=name, error=v.error,
                                 allowed=v.allowed, ratio=v.ratio, ok=v.ok, reason=v.reason,
                                 seconds=time.time() - t0))
    return rows


def _report(rows, variant_of, elapsed, env):
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text when rich is missing
        Console = None
    by_variant: dict[str, list] = {}
    for r in rows:
        by_variant.setdefault(variant_of[r["case"]], []).append(r)
    console = Console(width=130) if Console else None
    for variant, vrows in by_variant.items():
        title = f"parity: {variant}  ({env['device']})"
        if console:
            table = Table(title=title)
            for col in ("case", "framework / impl", "qty", "max abs err", "ratio to allowed", "pass"):
                table.add_column(col, justify="right" if col in ("max abs err", "ratio to allowed") else "left")
            for r in vrows:
                table.add_row(r["case"], r["impl"], r["quantity"], f"{r['error']:.3e}",
                              f"{r['ratio']:.3f}", "[green]ok[/]" if r["ok"] else f"[red]FAIL[/] {r.get('reason', '')}")
            console.print(table)
        else:
            print(title)
            for r in vrows:
                print(f"{r['case']:28s} {r['impl']:28s} {r['quantity']:5s} {r['error']:.3e} "
                      f"{r['ratio']:.3f} {'ok' if r['ok'] else 'FAIL ' + r.get('reason', '')}")
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} comparisons passed in {elapsed:.1f}s on {env['device']}")
    return not failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", help="only cases of this variant (e.g. standard)")
    parser.add_argument("--cases", help="comma-separated case names")
    parser.add_argument("--quick", action="store_true", help="the small --quick subset")
    parser.add_argument("--json", metavar="PATH", help="write all rows and the environment as JSON")
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available() and jax.default_backend() == "gpu"
    device = "cuda" if on_gpu else "cpu"
    all_cases = CASES + LAYER_CASES
    cases = [c for c in all_cases if on_gpu or not c.gpu]
    if args.variant:
        cases = [c for c in cases if c.variant == args.variant]
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {c.name for c in all_cases}
        if unknown:
            parser.error(f"unknown --cases {sorted(unknown)}")
        cases = [c for c in cases if c.name in wanted]
    if args.quick:
        cases = [c for c in cases if c.quick]
    if not cases:
        parser.error("no case selected")
    env = dict(device=jax_attn.device_info().name if on_gpu else f"cpu ({platform.processor() or platform.machine()})",
               jax=jax.__version__, torch=torch.__version__,
               triton=__import__("triton").__version__, python=platform.python_version(),
               date=time.strftime("%Y-%m-%d"))
    start = time.time()
    rows = []
    for case in cases:
        t = time.time()
        case_rows = (check_layer_case if isinstance(case, LayerCase) else check_case)(case, device)
        rows += case_rows
        failed = sorted({r["impl"] for r in case_rows if not r["ok"]})
        verdict = "ok" if not failed else "FAIL: " + ", ".join(failed)
        print(f"  {case.name}: {verdict} ({time.time() - t:.1f}s)", file=sys.stderr, flush=True)
    ok = _report(rows, {c.name: c.variant for c in all_cases}, time.time() - start, env)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows, passed=ok), f, indent=1, default=float)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
