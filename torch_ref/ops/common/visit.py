"""Visit plans on a torch device: the planner of `attn_spec.visit` (which key blocks each query
block visits, and the transpose for dK/dV), built once per static shape and read by the Triton
kernels."""
from __future__ import annotations

import functools

import torch

from attn_spec import visit as plan


@functools.lru_cache(maxsize=256)
def block_ranges(causal: bool, window, q_len: int, kv_len: int, block_q: int, block_k: int, *, key_major: bool,
                 device: torch.device) -> torch.Tensor:
    """int32 [n_outer, 4] = (lo, plain_lo, plain_hi, hi) on `device` (cached: do not modify).
    key_major=False: for each query block, the key blocks it visits (forward, dQ); True: for each
    key block, the query blocks that visit it (dK/dV). window: (left, right) or None."""
    before, after = plan.reach(causal, *(window if window is not None else (None, None)))
    nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
    # unpadded tensors: a block holding q_len or kv_len is always masked (bounds-checked loads)
    table = plan.block_table(before, after, q_len, kv_len, block_q, block_k, nq, nk, key_major, queries_padded=False)
    return torch.tensor(table, dtype=torch.int32, device=device)
