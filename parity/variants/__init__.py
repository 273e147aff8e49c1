"""One record per variant: everything the parity check, the tests and the benchmarks need to know
about it, and the only places that know how the variant is called.

A `VariantRecord` holds
  - `name`: the variant ("softmax", "stick_breaking", "dilated", "nsa"), also its key in both registries
    (`jax_attn.registry.REGISTRY`, `torch_ref.registry.REGISTRY`);
  - `quantities`: what is compared, in order (forward quantities first: `forward`); where they
    depend on the case (NSA's operations), `case_quantities(case)` gives each case's
    (`quantities_of`);
  - `draw(case) -> Inputs`: the seeded float64 NumPy inputs, random cotangents included;
  - `run_jax(case, implementation, dtype, inputs)` / `run_torch(case, implementation, dtype, inputs,
    device)`: the quantities (float64 NumPy) from one implementation through `jax.vjp` /
    `torch.autograd.grad` with the drawn cotangents;
  - `jax_call(case)`: the `jax_attn.registry.Call` of the case (whether an implementation serves it);
  - `cases`: the parity cases (`python -m parity.check`), `grid`: the awkward-shape test grid
    (`tests/test_<variant>.py`; `gpu=True` entries at realistic shapes).

`implementations(record, framework)` lists a framework's implementations of the variant (from its
registry; the plain reference, `REFERENCE[framework]`, among them) and `unsupported_reason(record,
framework, implementation, case, device)` says why one cannot serve a case here (None: it can).
`results(...)` runs one implementation in the right numeric context (float64 under x64, exact fp32
matmuls) and `verdicts(...)` applies the tolerance rule of `parity.tolerance` per quantity.

Importing this package imports torch and, without CUDA, routes Triton through its interpreter
(TRITON_INTERPRET=1, which must precede the first triton import).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import jax_attn.registry  # noqa: E402
import torch_ref.registry  # noqa: E402
from parity.cases import Case, Inputs  # noqa: E402
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, Verdict, compare  # noqa: E402

FRAMEWORKS = ("jax", "torch")
REFERENCE = {"jax": "xla", "torch": "eager"}  # the plain reference of each framework (golden in float64)
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64}
JAX_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16, "float64": jnp.float64}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class VariantRecord:
    name: str
    quantities: tuple[str, ...]
    forward: tuple[str, ...]  # the forward quantities (factor 2; the others are gradients, factor 3)
    draw: Callable[[Case], Inputs]
    run_jax: Callable[..., list]
    run_torch: Callable[..., list]
    jax_call: Callable[[Case], object]
    cases: tuple[Case, ...]
    grid: tuple[Case, ...]
    # the quantities of one case, where they differ from case to case (NSA's operations); None: `quantities`
    case_quantities: Callable[[Case], tuple[str, ...]] | None = None

    def factor(self, quantity: str) -> float:
        return FORWARD_FACTOR if quantity in self.forward else GRADIENT_FACTOR

    def quantities_of(self, case: Case | None) -> tuple[str, ...]:
        """The quantities the run functions return for `case`, in order."""
        return self.quantities if case is None or self.case_quantities is None else self.case_quantities(case)


def implementations(record: VariantRecord, framework: str) -> tuple[str, ...]:
    """The framework's implementation names of the variant, as its registry lists them."""
    registry = jax_attn.registry if framework == "jax" else torch_ref.registry
    return tuple(registry.REGISTRY[record.name])


def unsupported_reason(record: VariantRecord, framework: str, implementation: str, case: Case,
                       device: str = "cpu", dtype: str | None = None) -> str | None:
    """Why `implementation` cannot serve `case` (in `dtype`, default the case's) here, or None."""
    dtype = dtype or case.dtype
    if framework == "jax":
        call = dataclasses.replace(record.jax_call(case), dtype=jnp.dtype(JAX_DTYPES[dtype]))
        return jax_attn.registry.REGISTRY[record.name][implementation].unsupported_reason(call)
    call = torch_ref.registry.Call(torch.device(device), TORCH_DTYPES[dtype], case.shape[5])
    reason = torch_ref.registry.REGISTRY[record.name][implementation].unsupported_reason(call)
    if reason is None and implementation != REFERENCE["torch"] and dtype == "bfloat16" and device == "cpu":
        reason = "the Triton interpreter computes bf16 dots wrongly (bf16 runs on a GPU)"
    return reason


def numerics(framework: str, dtype: str):
    """The context a run takes place in: float64 under jax.enable_x64; exact fp32 matmuls in JAX
    (torch: allow_tf32 stays False, its default)."""
    if framework != "jax":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    if dtype == "float64":
        stack.enter_context(jax.enable_x64(True))
    if dtype in ("float64", "float32"):
        stack.enter_context(jax.default_matmul_precision("highest"))
    return stack


def results(record: VariantRecord, framework: str, implementation: str, case: Case, dtype: str, inputs: Inputs,
            device: str = "cpu") -> list[np.ndarray]:
    """The record's quantities (float64 NumPy) from one implementation in `dtype`."""
    with numerics(framework, dtype):
        if framework == "jax":
            return record.run_jax(case, implementation, dtype, inputs)
        return record.run_torch(case, implementation, dtype, inputs, device)


def golden(record: VariantRecord, framework: str, case: Case, inputs: Inputs, device: str = "cpu"):
    """The framework's plain reference in float64."""
    return results(record, framework, REFERENCE[framework], case, "float64", inputs, device)


def verdicts(record: VariantRecord, fast, naive, gold, dtype: str, case: Case | None = None) -> dict[str, Verdict]:
    """The tolerance rule per quantity: `fast` against `gold`, allowed from `naive`'s error (the
    quantities of `case`, `record.quantities_of`)."""
    names = record.quantities_of(case)
    if not len(names) == len(fast) == len(naive) == len(gold):
        raise ValueError(f"{record.name}: {len(names)} quantities {names} but {len(fast)} / {len(naive)} / "
                         f"{len(gold)} results")
    return {name: compare(f, n, g, NP_DTYPES[dtype], record.factor(name))
            for name, f, n, g in zip(names, fast, naive, gold)}


# --------------------------------------------------------------------------------------------------
# Framework helpers shared by the records' run functions
# --------------------------------------------------------------------------------------------------
def to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(jnp.asarray(x, jnp.float32) if x.dtype == jnp.bfloat16 else x, np.float64)


def jax_ints(x):
    """None, an int array or a pair of them, as jnp int32."""
    if x is None:
        return None
    return tuple(jnp.asarray(s) for s in x) if isinstance(x, tuple) else jnp.asarray(x)


def torch_ints(x, device):
    if x is None:
        return None
    ids = lambda s: torch.tensor(s, dtype=torch.int32, device=device)
    return tuple(ids(s) for s in x) if isinstance(x, tuple) else ids(x)


def stat_dtype(dtype: str) -> str:
    """The row statistic (lse, rem) and learnable decay: float64 in the golden, float32 otherwise."""
    return "float64" if dtype == "float64" else "float32"


from parity.variants.softmax import SOFTMAX  # noqa: E402
from parity.variants.stick_breaking import STICK_BREAKING  # noqa: E402
from parity.variants.dilated import DILATED  # noqa: E402
from parity.variants.nsa import NSA  # noqa: E402

RECORDS: tuple[VariantRecord, ...] = (SOFTMAX, STICK_BREAKING, DILATED, NSA)
BY_NAME = {r.name: r for r in RECORDS}
