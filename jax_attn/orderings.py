"""Space-filling-curve orderings in JAX: the cached permutations of `attn_spec.orderings` as jnp
arrays, and the explicit gathers of ordered attention, `unpermute(attn(permute(q), permute(k),
permute(v)))` (the composite for tests and benchmarks; in the kernels the permutation is an index
map on the loads and stores).

`permutation` is jittable: name, n and grid are static, and the permutation is a constant of the
trace, computed once per (name, n, grid) on the host.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn_spec import orderings
from attn_spec.orderings import ORDERINGS, default_grid

__all__ = ["ORDERINGS", "default_grid", "inverse", "permutation", "permute", "resolve", "unpermute"]


def permutation(name: str, n: int, grid=None) -> jax.Array:
    """pi int32 [n]: position t of the ordered sequence holds original token pi[t]
    (`attn_spec.orderings.permutation`)."""
    return jnp.asarray(orderings.permutation(name, n, grid))


def inverse(perm: jax.Array) -> jax.Array:
    """inv [n] (perm's dtype) with inv[perm[t]] = t. perm must be a permutation (not checked:
    it may be traced)."""
    perm = jnp.asarray(perm)
    if perm.ndim != 1:
        raise ValueError(f"perm must be 1-D, got shape {perm.shape}")
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def _check(x: jax.Array, perm: jax.Array, axis: int) -> int:
    if perm.ndim != 1:
        raise ValueError(f"perm must be 1-D, got shape {perm.shape}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for x of rank {x.ndim}")
    if x.shape[axis] != perm.shape[0]:
        raise ValueError(f"perm has {perm.shape[0]} entries but x.shape[{axis}] = {x.shape[axis]} ({x.shape=})")
    return axis % x.ndim


def permute(x: jax.Array, perm: jax.Array, axis: int = 1) -> jax.Array:
    """x in ordered positions along `axis`: out[t] = x[perm[t]] (default axis 1: the sequence of
    [B, S, H, D])."""
    perm = jnp.asarray(perm)
    return jnp.take(x, perm, axis=_check(x, perm, axis))


def unpermute(x: jax.Array, perm: jax.Array, axis: int = 1) -> jax.Array:
    """Back to the original positions, the inverse of `permute`: out[perm[t]] = x[t]."""
    perm = jnp.asarray(perm)
    return jnp.take(x, inverse(perm), axis=_check(x, perm, axis))


def resolve(ordering, grid, n: int):
    """The `ordering=` / `grid=` arguments of the attention functions for a sequence of n tokens
    (`attn_spec.orderings.check_ordering`) -> None where the ordering has no effect (none, or the
    identity) or the permutation, int32 [n]. A permutation array is checked where its values are
    known (under jit a traced array is taken as given)."""
    if ordering is None or isinstance(ordering, str):
        perm = orderings.check_ordering(ordering, grid, n)
        return None if perm is None else jnp.asarray(perm)
    if isinstance(ordering, (list, tuple)):
        ordering = np.asarray(ordering)
    shape, dtype = getattr(ordering, "shape", None), getattr(ordering, "dtype", None)
    is_int = dtype is not None and jnp.issubdtype(dtype, jnp.integer)
    try:
        values = np.asarray(ordering) if shape is not None else None
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        values = None
    kind = orderings.check_ordering(ordering, grid, n, shape, is_int, values if is_int else None)
    return None if kind is None else jnp.asarray(ordering).astype(jnp.int32)
