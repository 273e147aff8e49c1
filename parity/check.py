"""`python -m parity.check`: the same attention in JAX and PyTorch, against one float64 golden.

For every record of `parity.variants` (softmax, stick-breaking, dilated, NSA) and each of its cases: seeded NumPy
inputs and cotangents (`record.draw`) go to both frameworks; the golden is the plain reference in
float64 (torch eager; the JAX plain reference in float64 must agree with it to 1e-10, a check of its
own); every implementation of both frameworks that serves the case here (`parity.variants.
implementations` / `unsupported_reason`, read from the registries) is compared on the record's
quantities with the tolerance rule of `parity.tolerance`, the naive error being that of its own
framework's plain reference in the compute dtype.
Then the layer cases of `parity.layers` (variant "layers": Flax layers against their torch twins,
every parameter gradient, a 20-step training run), through `check_layer_case`.

Flags: --variant NAME, --quick, --json PATH, --cases NAME[,NAME]. Exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

# The naive reference is the plain one in the compute dtype. XLA's GPU compiler drops f32 -> bf16 -> f32
# round trips by default (excess precision), which torch eager and XLA on the CPU keep: set before
# the first JAX computation, so that JAX's plain reference rounds where it is written to.
if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_allow_excess_precision=false".strip()

import numpy as np  # noqa: E402

from parity import variants  # noqa: E402  (imports torch first: the Triton interpreter on CPU)
from parity.variants import BY_NAME, FRAMEWORKS, RECORDS, REFERENCE  # noqa: E402

import torch  # noqa: E402
import jax  # noqa: E402

import jax_attn  # noqa: E402
from parity.cases import Case  # noqa: E402
from parity.layers import LAYER_CASES, LayerCase, check_layer_case  # noqa: E402

# fp32 cases compare exact matmuls: TF32 off in torch (its default), "highest" in JAX (`variants.numerics`)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

# --variant names of earlier reports: "standard" and "rope" are the softmax cases without / with RoPE
LEGACY_VARIANTS = {"standard": lambda c: c.variant == "softmax" and c.rope is None,
                   "rope": lambda c: c.variant == "softmax" and c.rope is not None}


def _golden_disagreement(a, b) -> float:
    """max |a - b| over finite entries; inf if the infinities (empty rows' lse) differ."""
    finite = np.isfinite(a)
    if not np.array_equal(finite, np.isfinite(b)) or not np.array_equal(a[~finite], b[~finite]):
        return float("inf")
    return float(np.max(np.abs(a[finite] - b[finite]), initial=0.0))


def check_case(case: Case, device) -> list[dict]:
    """Rows of the report for one case: one per (implementation, quantity)."""
    record = BY_NAME[case.variant]
    inputs = record.draw(case)
    golden = variants.golden(record, "torch", case, inputs, device)
    golden_jax = variants.golden(record, "jax", case, inputs, device)
    rows = []
    agree = max(_golden_disagreement(a, b) for a, b in zip(golden, golden_jax))
    rows.append(dict(case=case.name, impl="golden torch-f64 vs jax-f64", quantity="all",
                     error=agree, allowed=1e-10, ratio=agree / 1e-10, ok=agree <= 1e-10))
    naive = {fw: variants.results(record, fw, REFERENCE[fw], case, case.dtype, inputs, device) for fw in FRAMEWORKS}
    for framework in FRAMEWORKS:
        for impl in variants.implementations(record, framework):
            if variants.unsupported_reason(record, framework, impl, case, device) is not None:
                continue  # e.g. the Mosaic kernels off Hopper, or for what they do not serve
            label = f"{framework} {impl}"
            t0 = time.time()
            try:
                fast = naive[framework] if impl == REFERENCE[framework] else variants.results(
                    record, framework, impl, case, case.dtype, inputs, device)
            except Exception as e:  # a crash is a failure of that implementation, reported
                rows.append(dict(case=case.name, impl=label, quantity="all", error=float("inf"),
                                 allowed=0.0, ratio=float("inf"), ok=False,
                                 reason=f"{type(e).__name__}: {e}"[:300]))
                continue
            for name, v in variants.verdicts(record, fast, naive[framework], golden, case.dtype, case).items():
                rows.append(dict(case=case.name, impl=label, quantity=name, error=v.error,
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
    parser.add_argument("--variant", help="only cases of this variant: " + ", ".join(
        [r.name for r in RECORDS] + ["layers"]) + " (also standard / rope: softmax without / with RoPE)")
    parser.add_argument("--cases", help="comma-separated case names")
    parser.add_argument("--quick", action="store_true", help="the small --quick subset")
    parser.add_argument("--json", metavar="PATH", help="write all rows and the environment as JSON")
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available() and jax.default_backend() == "gpu"
    device = "cuda" if on_gpu else "cpu"
    all_cases = [c for r in RECORDS for c in r.cases] + LAYER_CASES
    cases = [c for c in all_cases if on_gpu or not c.gpu]
    if args.variant:
        if args.variant not in {c.variant for c in all_cases} | set(LEGACY_VARIANTS):
            parser.error(f"unknown --variant {args.variant!r}")
        keep = LEGACY_VARIANTS.get(args.variant, lambda c: c.variant == args.variant)
        cases = [c for c in cases if keep(c)]
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
        for r in case_rows:  # now, not only in the final table: a run cut short still says what failed
            if not r["ok"]:
                print(f"    {r['impl']} {r['quantity']}: {r['error']:.3e}, {r['ratio']:.3f}x the allowed error "
                      f"{r.get('reason', '')}", file=sys.stderr, flush=True)
    ok = _report(rows, {c.name: c.variant for c in all_cases}, time.time() - start, env)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows, passed=ok), f, indent=1, default=float)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
