"""Stick-breaking attention ("ExpoSB") for PyTorch: the definition and its plain (eager) reference.

Definition (Tan et al., "Scaling Stick-Breaking Attention", arXiv 2410.17980, with an exponential
distance decay; docs/design/stick_breaking.md; the same as `jax_attn.stick_breaking_attention`). Strictly causal: for each batch b, head h, row i, key j < i,
  z_ij = scale * q~_i . k~_j - lambda_h * (i - j)        (q~, k~: RoPE-rotated when asked; the
                                                        distance is the token index difference)
  beta_ij = sigmoid(z_ij),  A_ij = beta_ij * prod_{j<m<i} (1 - beta_im),
  out_i = sum_{j<i} A_ij v_j,  rem_i = 1 - sum_j A_ij   (the unspent stick).
In log space: log A_ij = log sigmoid(z_ij) - sum_{j<m<i} softplus(z_im) and
rem_i = exp(-sum_{j<i} softplus(z_ij)). Row 0 has no key: out 0, rem 1, zero gradients.

The Triton kernels (`torch_ref.ops.stick_breaking.triton`) walk the key blocks of a query tile
from the diagonal leftwards with a running softplus sum (forward), and sum the backward's prefix
sums of A * dA from the left (deterministic, no atomics); the eager reference here materialises
[B, Hq, S, S]. The public functions (validation, dispatch) are in `torch_ref.api`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.rope import apply_rope

__all__ = ["attention"]


def attention(q, k, v, *, scale: float, decay, rope=None, q_pos=None, kv_pos=None):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] -> (out [B, S, Hq, D] in q.dtype, rem [B, Hq, S]).

    Inputs are assumed validated (torch_ref.ops.common.validation). Materialises z [B, Hq, S, S]:
    the q.k products in the input dtype (the "naive" of the tolerance rule), everything after that
    in float32 (float64 for float64 inputs: the golden); A is rounded to v.dtype for the A v
    product. decay: a float or a tensor [] / [Hq]. Differentiable by autograd (q, k, v and a decay tensor).
    """
    if rope is not None:
        q = apply_rope(q, q_pos, rope)
        k = apply_rope(k, kv_pos, rope)
    B, S, Hq, D = q.shape
    group = Hq // k.shape[2]
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device

    # Row 0 sees no key and key S - 1 is seen by no row: zero them, so that whatever they hold
    # (NaN, inf) cannot reach other entries through 0 * x in the products.
    idx = torch.arange(S, device=dev)
    zero = torch.zeros((), dtype=q.dtype, device=dev)
    q = torch.where((idx > 0)[None, :, None, None], q, zero)
    k = torch.where((idx < S - 1)[None, :, None, None], k, zero)
    v = torch.where((idx < S - 1)[None, :, None, None], v, zero)
    if group > 1:  # query head h reads kv head h // group
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)

    z = torch.einsum("bqhd,bkhd->bhqk", q, k).to(stat) * scale  # [B, Hq, S, S]
    dist = (idx[:, None] - idx[None, :]).to(stat)  # i - j
    if isinstance(decay, torch.Tensor):
        lam = decay.to(stat).reshape(-1)  # [] -> [1], [Hq] -> [Hq]
        z = z - lam[None, :, None, None] * dist
    elif decay != 0.0:
        z = z - decay * dist
    valid = idx[None, :] < idx[:, None]  # [S, S]: key j < row i
    zero_s = torch.zeros((), dtype=stat, device=dev)
    sp = torch.where(valid, torch.logaddexp(z, zero_s), zero_s)  # softplus, 0 where j >= i
    log_beta = F.logsigmoid(z)  # = z - softplus(z), stable
    suffix = sp.flip(-1).cumsum(-1).flip(-1) - sp  # C_ij = sum_{j<m<i} sp_im
    a = torch.where(valid, torch.exp(log_beta - suffix), zero_s)
    a_v, v_a = a.to(v.dtype), v
    if v.dtype == torch.float16:
        # A's cotangent, dO . v, passes fp16's range under loss scaling (cotangents x 2^13) and
        # would come back inf from an fp16 product: take the product in fp32 on A rounded to fp16
        # (the same values), the cotangent straight through in fp32 (as jax_attn's XLA path)
        a_v, v_a = a + (a_v.to(stat) - a).detach(), v.to(stat)
    out = torch.einsum("bhqk,bkhd->bqhd", a_v, v_a).to(v.dtype)
    rem = torch.exp(-sp.sum(-1))  # [B, Hq, S]
    return out, rem
