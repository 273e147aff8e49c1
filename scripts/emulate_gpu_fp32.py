"""Run an NSA parity case on the CPU with the Triton interpreter imitating two places where the GPU's
fp32 arithmetic differs from the interpreter's (torch's Triton kernels only; JAX's Pallas kernels
and the references are unchanged, and serve as the control):

- "fma": `tl.dot(a, b, acc)` as the GPU's fp32 FMA dot computes it, one fused multiply-add per k in
  order, starting from the accumulator (the interpreter adds a NumPy matmul to it once). Triton
  folds `acc + tl.dot(a, b)` into this form too.
- "ex2": `tl.exp2` with a relative error of up to 2^-22, the size of `ex2.approx.f32`'s (uniform,
  seeded; the hardware's error is a fixed function of x).

  PYTHONPATH=. python scripts/emulate_gpu_fp32.py MODE [CASE]   MODE: none | fma | ex2 | fma+ex2
                                                               CASE: default nsa_random_gqa16_s77
"""
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import numpy as np  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

_matmul_dot = interpreter.InterpreterBuilder.create_dot
_rng = np.random.default_rng(0)


def _fma_chain_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.data.dtype != np.float32 or d.data.dtype != np.float32 or a.data.ndim != 2:
        return _matmul_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    lhs, rhs = a.data.astype(np.float64), b.data.astype(np.float64)
    acc = d.data.astype(np.float32)
    for k in np.arange(lhs.shape[1]).tolist():  # (the interpreter patches `range` while a kernel runs)
        acc = (np.outer(lhs[:, k], rhs[k, :]) + acc).astype(np.float32)  # exact product, one rounding
    return interpreter.TensorHandle(acc, d.dtype.scalar)


def _approx_exp2(x):
    y = np.exp2(x.astype(np.float64))
    return (y * (1 + _rng.uniform(-1, 1, np.shape(y)) * 2.0 ** -22)).astype(x.dtype)


def main(mode: str, name: str = "nsa_random_gqa16_s77") -> None:
    if mode not in ("none", "fma", "ex2", "fma+ex2"):
        raise SystemExit(f"MODE must be none, fma, ex2 or fma+ex2, got {mode!r}")
    if "fma" in mode:
        interpreter.InterpreterBuilder.create_dot = _fma_chain_dot
    if "ex2" in mode:
        interpreter.InterpreterBuilder.create_exp2 = lambda self, arg: self.unary_op(arg, _approx_exp2)
    import parity.check as check
    from parity.variants import nsa

    case = next((c for c in nsa.NSA.cases if c.name == name), None)
    if case is None:
        raise SystemExit(f"no NSA case {name!r}")
    for r in check.check_case(case, "cpu"):
        if r["quantity"] in ("out", "dq", "dk", "dv") or not r["ok"]:
            print(f"{r['impl']:14s} {r['quantity']:3s} err {r['error']:.3e} ratio {r['ratio']:.3f} "
                  f"{r.get('reason', '')}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
