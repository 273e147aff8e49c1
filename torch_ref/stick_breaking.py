"""Stick-breaking attention ("ExpoSB") for PyTorch: validation, dispatch, autograd and the eager reference.

Definition (DESIGN.md "ExpoSB"; Tan et al., "Scaling Stick-Breaking Attention", arXiv 2410.17980;
the same as `jax_attn.stick_breaking`). Strictly causal: for each batch b, head h, row i, key j < i,
  z_ij = scale * q~_i . k~_j - lambda_h * (i - j)        (q~, k~: RoPE-rotated when asked; the
                                                        distance is the token index difference)
  beta_ij = sigmoid(z_ij),  A_ij = beta_ij * prod_{j<m<i} (1 - beta_im),
  out_i = sum_{j<i} A_ij v_j,  rem_i = 1 - sum_j A_ij   (the unspent stick).
In log space: log A_ij = log sigmoid(z_ij) - sum_{j<m<i} softplus(z_im) and
rem_i = exp(-sum_{j<i} softplus(z_ij)). Row 0 has no key: out 0, rem 1, zero gradients.

The Triton kernels (`torch_ref.stick_breaking_triton`) walk the key blocks of a query tile from the
diagonal leftwards with a running softplus sum (forward), and sum the backward's prefix sums of
A * dA from the left (deterministic, no atomics); the eager reference here materialises
[B, Hq, S, S]. Triton is imported lazily, as for `flash_attention`.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from .flash import _segment_pair_for_kernel, _triton_module, _validate, _validate_rope, resolve_implementation
from .rope import apply_rope

__all__ = ["stick_breaking_attention", "stick_breaking_reference"]


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _validate_decay(decay, q: torch.Tensor):
    """decay: a real number >= 0 (-> float) or a floating tensor of shape [] or [Hq] with finite
    values >= 0 on q's device (-> the tensor itself, so that autograd can reach it)."""
    Hq = q.shape[2]
    if isinstance(decay, numbers.Real) and not isinstance(decay, bool):
        decay = float(decay)
        if not (math.isfinite(decay) and decay >= 0):
            raise ValueError(f"decay must be finite and >= 0, got decay={decay!r}")
        return decay
    if not isinstance(decay, torch.Tensor):
        raise TypeError(f"decay must be a float >= 0 or a floating torch.Tensor of shape [] or [Hq] = [{Hq}], "
                        f"got {type(decay).__name__}")
    if not decay.dtype.is_floating_point:
        raise TypeError(f"decay must have a floating dtype, got decay.dtype={decay.dtype}")
    if tuple(decay.shape) not in ((), (Hq,)):
        raise ValueError(f"decay must be a scalar or have shape [Hq] = [{Hq}], got {list(decay.shape)}")
    if decay.device != q.device:
        raise ValueError(f"decay is on {decay.device} but q is on {q.device}")
    concrete = decay.detach()
    if not bool((torch.isfinite(concrete) & (concrete >= 0)).all()):
        raise ValueError(f"decay must be finite and >= 0, got decay={concrete.cpu().tolist()}")
    return decay


def _validate_sb(q, k, v, scale, decay, rope, positions):
    """-> (scale, decay, q_pos, kv_pos). The tensor checks are flash_attention's (shapes, dtypes,
    devices, heads, head dim, scale), plus Sq == Sk; rope / positions likewise."""
    scale = _validate(q, k, v, False, scale, None, None, None)[0]
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"stick-breaking attention is causal self-attention: q and k/v need the same sequence "
                         f"length, got Sq={q.shape[1]} (q {list(q.shape)}), Sk={k.shape[1]} (k {list(k.shape)})")
    q_pos, kv_pos = _validate_rope(q, k, rope, positions)
    decay = _validate_decay(decay, q)
    return scale, decay, q_pos, kv_pos


# ----------------------------------------------------------------------------------------------
# Eager reference
# ----------------------------------------------------------------------------------------------
def eager(q, k, v, *, scale: float, decay, rope=None, q_pos=None, kv_pos=None):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] -> (out [B, S, Hq, D] in q.dtype, rem [B, Hq, S]).

    Inputs are assumed validated. Materialises z [B, Hq, S, S]: the q.k products in the input dtype
    (the "naive" of the tolerance rule), everything after that in float32 (float64 for float64
    inputs: the golden); A is rounded to v.dtype for the A v product. decay: a float or a tensor
    [] / [Hq]. Differentiable by autograd (q, k, v and a decay tensor).
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


# ----------------------------------------------------------------------------------------------
# Triton path
# ----------------------------------------------------------------------------------------------
class _StickBreakingFn(torch.autograd.Function):
    """Triton forward + backward. Outputs (out, rem), both differentiable. Gradients for q, k, v
    and the decay tensor (when one is given: `decay_t`, its own shape and dtype)."""

    @staticmethod
    def forward(ctx, q, k, v, decay_t, decay_value, scale, rope, q_pos, kv_pos, kernels):
        Hq = q.shape[2]
        if decay_t is not None:
            lam = decay_t.detach().to(torch.float32).reshape(-1).expand(Hq).contiguous()
        elif decay_value != 0.0:
            lam = torch.full((Hq,), decay_value, dtype=torch.float32, device=q.device)
        else:
            lam = None
        out, rem = kernels.forward(q, k, v, scale=scale, decay=lam, rope=rope, q_pos=q_pos, kv_pos=kv_pos)
        ctx.save_for_backward(q, k, v, rem, lam, q_pos, kv_pos)
        ctx.opts = dict(scale=scale, rope=rope)
        ctx.kernels = kernels
        ctx.decay_meta = None if decay_t is None else (tuple(decay_t.shape), decay_t.dtype)
        ctx.set_materialize_grads(False)
        return out, rem

    @staticmethod
    def backward(ctx, dout, drem):
        q, k, v, rem, lam, q_pos, kv_pos = ctx.saved_tensors
        want_decay = ctx.decay_meta is not None and ctx.needs_input_grad[3]
        if dout is None and drem is None:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            ddecay_rows = torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device) if want_decay else None
        else:
            if dout is None:
                dout = torch.zeros_like(q)
            dq, dk, dv, ddecay_rows = ctx.kernels.backward(dout, q, k, v, rem, drem=drem, decay=lam,
                                                           decay_grad=want_decay, q_pos=q_pos, kv_pos=kv_pos,
                                                           **ctx.opts)
        ddecay = None
        if want_decay:
            shape, dtype = ctx.decay_meta
            per_head = ddecay_rows.to(torch.float64).sum(dim=(0, 2))  # [Hq]
            ddecay = (per_head.sum() if shape == () else per_head).to(dtype).reshape(shape)
        return dq, dk, dv, ddecay, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def stick_breaking_attention(q, k, v, *, scale=None, decay=0.0, rope=None, positions=None, return_remainder=False,
                             implementation=None):
    """Stick-breaking attention (ExpoSB), strictly causal: token i attends to keys j < i.

    Args:
      q: `[B, S, Hq, D]`; k, v: `[B, S, Hkv, D]` (the same S), Hq % Hkv == 0 (query head h reads kv
        head h // (Hq // Hkv): GQA / MQA). D in 1..256, any S. dtype float16, bfloat16 or float32
        (float64 with implementation="eager" only); output in the input dtype.
      scale: logit multiplier, default D ** -0.5.
      decay: lambda >= 0 of the distance penalty -lambda * (i - j): a float, a 0-d tensor or a
        tensor `[Hq]` (per head), finite and >= 0 (checked). A tensor may require grad: it gets
        its gradient with its own shape and dtype. The distance is the token index difference
        i - j, whatever the RoPE positions.
      rope: a `torch_ref.Rope` or None: q and k (not v) are rotated by their positions before the
        scores (inside the kernels after load; the backward rotates dq, dk back). Needs an even D.
      positions: with rope only. None: arange(S) in every batch row; one integer tensor `[B, S]`
        (the same positions for q and k); or a pair (q_pos, kv_pos) of `[B, S]` tensors.
      return_remainder: also return rem `[B, Hq, S]` float32 (float64 for float64 eager), the
        unspent stick 1 - sum_j A_ij = exp(-sum_{j<i} softplus(z_ij)); differentiable.
      implementation: None, "triton" or "eager", with the rule of `torch_ref.flash_attention`:
        None picks "triton" when q is on CUDA or the Triton interpreter is active, else "eager";
        "triton" raises NotImplementedError when it cannot serve the call (float64, CPU tensor
        without the interpreter); anything else raises (ValueError and NotImplementedError).

    Row 0 has no key: out 0, rem 1, zero gradients. Log-space math in float32; on the GPU
    float32 inputs use IEEE fp32 dots unless torch.backends.cuda.matmul.allow_tf32 is True.

    Returns: out `[B, S, Hq, D]`, or (out, rem) when return_remainder.
    """
    impl = resolve_implementation(q, implementation) if isinstance(q, torch.Tensor) else None
    scale, decay, q_pos, kv_pos = _validate_sb(q, k, v, scale, decay, rope, positions)
    if impl == "eager":
        out, rem = eager(q, k, v, scale=scale, decay=decay, rope=rope, q_pos=q_pos, kv_pos=kv_pos)
    else:
        kernels = _triton_module(q, "stick_breaking_triton")
        q_pos, kv_pos = _segment_pair_for_kernel(q_pos, kv_pos)
        decay_t = decay if isinstance(decay, torch.Tensor) else None
        decay_value = 0.0 if decay_t is not None else decay
        out, rem = _StickBreakingFn.apply(q, k, v, decay_t, decay_value, scale, rope, q_pos, kv_pos, kernels)
    return (out, rem) if return_remainder else out


def stick_breaking_reference(q, k, v, *, scale=None, decay=0.0, rope=None, positions=None):
    """The eager reference with the arguments of `stick_breaking_attention` (less
    return_remainder and implementation); returns (out, rem).

    Works in float64 too (the golden). Differentiable by autograd, decay tensors included.
    """
    scale, decay, q_pos, kv_pos = _validate_sb(q, k, v, scale, decay, rope, positions)
    return eager(q, k, v, scale=scale, decay=decay, rope=rope, q_pos=q_pos, kv_pos=kv_pos)
