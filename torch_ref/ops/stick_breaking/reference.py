"""Stick-breaking attention ("ExpoSB") for PyTorch: the definition and its plain (eager) reference.

Definition (Tan et al., "Scaling Stick-Breaking Attention", arXiv 2410.17980, with an exponential
distance decay; docs/design/stick_breaking.md; the same as `jax_attn.stick_breaking_attention`).
Query i sits at key position p_i = i + Sk - Sq (the queries are the last Sq positions of the keys)
and sees the keys j < p_i (j <= p_i with attend_current) of its own segment (segment ids); for
each batch b, head h, row i and key j it sees,
  z_ij = scale * q~_i . k~_j - lambda_h * (p_i - j)      (q~, k~: RoPE-rotated when asked; the
                                                        distance is the token index difference)
  beta_ij = sigmoid(z_ij),  A_ij = beta_ij * prod_{m seen, m > j} (1 - beta_im),
  out_i = sum_j A_ij v_j,  rem_i = 1 - sum_j A_ij   (the unspent stick).
In log space: log A_ij = log sigmoid(z_ij) - sum_{m seen, m > j} softplus(z_im) and
rem_i = exp(-sum_j softplus(z_ij)). Keys a row does not see take no weight and spend none of its
stick. A row that sees no key (row 0 without attend_current): out 0, rem 1, zero gradients.

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


def attention(q, k, v, *, scale: float, decay, rope=None, q_pos=None, kv_pos=None, attend_current: bool = False,
              q_ids=None, kv_ids=None):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (Sq <= Sk) -> (out [B, Sq, Hq, D] in q.dtype, rem [B, Hq, Sq]).

    q_ids [B, Sq], kv_ids [B, Sk]: segment ids or None. Inputs are assumed validated
    (torch_ref.ops.common.validation). Materialises z [B, Hq, Sq, Sk]:
    the q.k products in the input dtype (the "naive" of the tolerance rule), everything after that
    in float32 (float64 for float64 inputs: the golden); A is rounded to v.dtype for the A v
    product. decay: a float or a tensor [] / [Hq]. Differentiable by autograd (q, k, v and a decay tensor).
    """
    if rope is not None:
        q = apply_rope(q, q_pos, rope)
        k = apply_rope(k, kv_pos, rope)
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    group = Hq // k.shape[2]
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device

    rows = torch.arange(Sk - Sq, Sk, device=dev)  # the queries' key positions
    cols = torch.arange(Sk, device=dev)
    valid = cols[None, :] <= rows[:, None] if attend_current else cols[None, :] < rows[:, None]  # [Sq, Sk]
    valid = valid[None] if q_ids is None else valid[None] & (q_ids[:, :, None] == kv_ids[:, None, :])  # [B|1, Sq, Sk]
    # Rows that see no key (row 0) and keys no row sees (key S - 1) are zeroed, so that whatever
    # they hold (NaN, inf) cannot reach other entries through 0 * x in the products.
    zero = torch.zeros((), dtype=q.dtype, device=dev)
    q = torch.where(valid.any(2)[:, :, None, None], q, zero)
    k = torch.where(valid.any(1)[:, :, None, None], k, zero)
    v = torch.where(valid.any(1)[:, :, None, None], v, zero)
    if group > 1:  # query head h reads kv head h // group
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)

    z = torch.einsum("bqhd,bkhd->bhqk", q, k).to(stat) * scale  # [B, Hq, Sq, Sk]
    dist = (rows[:, None] - cols[None, :]).to(stat)  # p_i - j
    if isinstance(decay, torch.Tensor):
        lam = decay.to(stat).reshape(-1)  # [] -> [1], [Hq] -> [Hq]
        z = z - lam[None, :, None, None] * dist
    elif decay != 0.0:
        z = z - decay * dist
    valid = valid[:, None]  # [B|1, 1, Sq, Sk] against [B, Hq, Sq, Sk]
    zero_s = torch.zeros((), dtype=stat, device=dev)
    sp = torch.where(valid, torch.logaddexp(z, zero_s), zero_s)  # softplus, 0 where j is not seen
    log_beta = F.logsigmoid(z)  # = z - softplus(z), stable
    suffix = sp.flip(-1).cumsum(-1).flip(-1) - sp  # C_ij = sum_{m seen, m > j} sp_im
    a = torch.where(valid, torch.exp(log_beta - suffix), zero_s)
    a_v, v_a = a.to(v.dtype), v
    if v.dtype == torch.float16:
        # A's cotangent, dO . v, passes fp16's range under loss scaling (cotangents x 2^13) and
        # would come back inf from an fp16 product: take the product in fp32 on A rounded to fp16
        # (the same values), the cotangent straight through in fp32 (as jax_attn's XLA path)
        a_v, v_a = a + (a_v.to(stat) - a).detach(), v.to(stat)
    out = torch.einsum("bhqk,bkhd->bqhd", a_v, v_a).to(v.dtype)
    rem = torch.exp(-sp.sum(-1))  # [B, Hq, Sq]
    return out, rem
