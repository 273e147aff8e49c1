"""Space-filling-curve orderings in PyTorch: the cached permutations of `attn_spec.orderings` as
int64 tensors, and the explicit gathers of ordered attention, `unpermute(attn(permute(q),
permute(k), permute(v)))` (the composite for tests and benchmarks; in the kernels the permutation
is an index map on the loads and stores)."""
from __future__ import annotations

import numpy as np
import torch

from attn_spec import orderings
from attn_spec.orderings import ORDERINGS, default_grid

__all__ = ["ORDERINGS", "default_grid", "inverse", "permutation", "permute", "resolve", "unpermute"]


def permutation(name: str, n: int, grid=None, device=None) -> torch.Tensor:
    """pi int64 [n] on `device`: position t of the ordered sequence holds original token pi[t]
    (`attn_spec.orderings.permutation`)."""
    return torch.as_tensor(orderings.permutation(name, n, grid).astype(np.int64), device=device)


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """inv [n] (perm's dtype and device) with inv[perm[t]] = t. perm must be a permutation (not
    checked: that would synchronise with the device)."""
    if perm.ndim != 1:
        raise ValueError(f"perm must be 1-D, got shape {tuple(perm.shape)}")
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0], dtype=perm.dtype, device=perm.device)
    return inv


def _check(x: torch.Tensor, perm: torch.Tensor, axis: int) -> int:
    if perm.ndim != 1:
        raise ValueError(f"perm must be 1-D, got shape {tuple(perm.shape)}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for x of rank {x.ndim}")
    if x.shape[axis] != perm.shape[0]:
        raise ValueError(f"perm has {perm.shape[0]} entries but x.shape[{axis}] = {x.shape[axis]} "
                         f"(x.shape={tuple(x.shape)})")
    return axis % x.ndim


def permute(x: torch.Tensor, perm: torch.Tensor, axis: int = 1) -> torch.Tensor:
    """x in ordered positions along `axis`: out[t] = x[perm[t]] (default axis 1: the sequence of
    [B, S, H, D])."""
    return x.index_select(_check(x, perm, axis), perm.to(x.device))


def unpermute(x: torch.Tensor, perm: torch.Tensor, axis: int = 1) -> torch.Tensor:
    """Back to the original positions, the inverse of `permute`: out[perm[t]] = x[t]."""
    return x.index_select(_check(x, perm, axis), inverse(perm.to(x.device)))


def resolve(ordering, grid, n: int, device=None):
    """The `ordering=` / `grid=` arguments of the attention functions for a sequence of n tokens
    (`attn_spec.orderings.check_ordering`) -> None where the ordering has no effect (none, or the
    identity) or the permutation, int64 [n] on `device`. A tensor is checked on the host (one
    copy of n ints)."""
    if ordering is None or isinstance(ordering, str):
        perm = orderings.check_ordering(ordering, grid, n)
        return None if perm is None else torch.as_tensor(perm.astype(np.int64), device=device)
    if isinstance(ordering, (list, tuple)):
        ordering = np.asarray(ordering)
    if isinstance(ordering, torch.Tensor):
        is_int = not ordering.dtype.is_floating_point and not ordering.dtype.is_complex and ordering.dtype != torch.bool
        values = ordering.detach().cpu().numpy() if is_int else None
    elif isinstance(ordering, np.ndarray):
        is_int = np.issubdtype(ordering.dtype, np.integer)
        values = ordering if is_int else None
    else:
        is_int, values = False, None
    kind = orderings.check_ordering(ordering, grid, n, getattr(ordering, "shape", None), is_int, values)
    return None if kind is None else torch.as_tensor(np.asarray(values, np.int64), device=device)
