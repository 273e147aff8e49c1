"""Public entry points: `flash_attention` (validation, dispatch, autograd) and the eager reference.

Triton is imported lazily (only when the Triton path runs), so the choice of interpreter
(`TRITON_INTERPRET=1`) can still be made after `import torch_ref`.
"""
from __future__ import annotations

import importlib
import math
import numbers
import os

import torch

from . import reference
from .rope import Rope

MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_IMPLEMENTATIONS = (None, "triton", "eager")


class UnknownImplementationError(ValueError, NotImplementedError):
    """`implementation` is not None, "triton" or "eager" (both a ValueError and a NotImplementedError)."""


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_ids(ids, name: str, B: int, S: int, device) -> torch.Tensor:
    """An integer [B, S] tensor on `device` (segment ids, positions)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor of shape [{B}, {S}], got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
    if tuple(ids.shape) != (B, S):
        raise ValueError(f"{name} must have shape [B, S] = [{B}, {S}], got {list(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but q is on {device}")
    return ids


def _validate(q, k, v, causal, scale, segment_ids, window, softcap):
    """Check the arguments; return (scale, q_ids, kv_ids, window) normalised."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, D], got shape {list(t.shape)} ({t.dim()}-D)")
    if q.dtype not in _FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"q dtype must be float16, bfloat16 or float32 (float64: eager only), got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v dtypes must match, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v shapes must match, got k {list(k.shape)}, v {list(v.shape)}")
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"batch mismatch: q has batch {B}, k/v have {k.shape[0]}")
    if k.shape[3] != D:
        raise ValueError(f"head-dim mismatch: q has head dim {D}, k/v have {k.shape[3]}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{MAX_HEAD_DIM}, got {D}")
    Sk, Hkv = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"number of heads in k/v ({Hkv}) must divide heads in q ({Hq})")

    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if scale is None:
        scale = D ** -0.5
    elif not (_is_real(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    scale = float(scale)

    if softcap is not None and not (_is_real(softcap) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    softcap = None if softcap is None else float(softcap)

    if window is not None:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(_is_int(w) and w >= 0 for w in window)):
            raise ValueError(f"window must be a pair (left, right) of non-negative ints, got {window!r}")
        window = (int(window[0]), int(window[1]))

    q_ids = kv_ids = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(f"segment_ids must be one [B, S] tensor or a pair (q_ids, kv_ids), "
                                 f"got a sequence of length {len(segment_ids)}")
            q_ids = _check_ids(segment_ids[0], "segment_ids[0] (q_ids)", B, Sq, q.device)
            kv_ids = _check_ids(segment_ids[1], "segment_ids[1] (kv_ids)", B, Sk, q.device)
        else:
            if Sq != Sk:
                raise ValueError(f"a single segment_ids tensor needs Sq == Sk (self-attention), got Sq={Sq}, "
                                 f"Sk={Sk}; pass a pair (q_ids, kv_ids)")
            q_ids = kv_ids = _check_ids(segment_ids, "segment_ids", B, Sq, q.device)
    return scale, q_ids, kv_ids, window, softcap


def _validate_rope(q, k, rope, positions):
    """Check rope / positions; return (q_pos [B, Sq], kv_pos [B, Sk]) (None, None without rope).

    positions None means q at arange(Sq) and k at arange(Sk) (each batch row)."""
    if rope is not None and not isinstance(rope, Rope):
        raise TypeError(f"rope must be a torch_ref.Rope or None, got {type(rope).__name__}")
    if rope is None:
        if positions is not None:
            raise ValueError("positions given without rope: positions only apply with rope=torch_ref.Rope(...)")
        return None, None
    B, Sq, _, D = q.shape
    Sk = k.shape[1]
    if D % 2 != 0:
        raise ValueError(f"head dim must be even for RoPE, got D={D}")
    if positions is None:
        return (torch.arange(Sq, dtype=torch.int32, device=q.device).expand(B, Sq),
                torch.arange(Sk, dtype=torch.int32, device=q.device).expand(B, Sk))
    if isinstance(positions, (tuple, list)):
        if len(positions) != 2:
            raise ValueError(f"positions must be one [B, S] tensor or a pair (q_pos, kv_pos), "
                             f"got a sequence of length {len(positions)}")
        return (_check_ids(positions[0], "positions[0] (q_pos)", B, Sq, q.device),
                _check_ids(positions[1], "positions[1] (kv_pos)", B, Sk, q.device))
    if Sq != Sk:
        raise ValueError(f"a single positions tensor needs Sq == Sk (self-attention), got Sq={Sq}, Sk={Sk}; "
                         f"pass a pair (q_pos, kv_pos)")
    pos = _check_ids(positions, "positions", B, Sq, q.device)
    return pos, pos


def _segment_pair_for_kernel(q_ids, kv_ids):
    """One integer dtype for both (int32 unless a side is int64), so the kernel compares like types.
    Also used for the RoPE positions."""
    if q_ids is None:
        return None, None
    dt = torch.int64 if torch.int64 in (q_ids.dtype, kv_ids.dtype) else torch.int32
    return q_ids.to(dt), kv_ids.to(dt)


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------
def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_implementation(q: torch.Tensor, implementation=None) -> str:
    """The implementation a call would use: see `flash_attention` for the rule."""
    if implementation not in _IMPLEMENTATIONS:
        raise UnknownImplementationError(
            f"implementation must be None, 'triton' or 'eager', got {implementation!r}")
    if implementation is None:
        return "triton" if (q.is_cuda or _interpreter_requested()) else "eager"
    return implementation


def _triton_module(q: torch.Tensor, name: str = "flash_triton"):
    """Import the kernel module `torch_ref.<name>`, or raise NotImplementedError saying why Triton
    cannot serve this call."""
    if q.dtype == torch.float64:
        raise NotImplementedError("implementation='triton' does not support float64; use implementation='eager'")
    if not q.is_cuda and not _interpreter_requested():
        raise NotImplementedError(
            f"implementation='triton' needs a CUDA tensor or the Triton interpreter (TRITON_INTERPRET=1); "
            f"q is on {q.device}")
    try:
        kernels = importlib.import_module(f"{__package__}.{name}")
    except ImportError as e:  # pragma: no cover - triton is a declared dependency
        raise NotImplementedError(f"implementation='triton' needs triton: {e}") from e
    if not q.is_cuda and not kernels.INTERPRETED:
        raise NotImplementedError(
            "implementation='triton' on a CPU tensor needs the Triton interpreter, but triton was imported "
            "before TRITON_INTERPRET=1 was set")
    return kernels


class _FlashAttentionFn(torch.autograd.Function):
    """Triton forward + backward. Outputs (out, lse); both are differentiable: a cotangent on lse
    enters the backward as delta_i -= dlse_i (d lse_i / d s_ij = P_ij)."""

    @staticmethod
    def forward(ctx, q, k, v, q_ids, kv_ids, causal, scale, window, softcap, kernels, rope, q_pos, kv_pos):
        out, lse, stats = kernels.forward(q, k, v, causal=causal, scale=scale, q_ids=q_ids, kv_ids=kv_ids,
                                          window=window, softcap=softcap, rope=rope, q_pos=q_pos, kv_pos=kv_pos)
        ctx.save_for_backward(q, k, v, out, *stats, q_ids, kv_ids, q_pos, kv_pos)
        ctx.opts = dict(causal=causal, scale=scale, window=window, softcap=softcap, rope=rope)
        ctx.kernels = kernels
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, m2, inv_l, q_ids, kv_ids, q_pos, kv_pos = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = ctx.kernels.backward(dout, q, k, v, out, (m2, inv_l), q_ids=q_ids, kv_ids=kv_ids, dlse=dlse,
                                          q_pos=q_pos, kv_pos=kv_pos, **ctx.opts)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def flash_attention(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None,
                    rope=None, positions=None, return_lse=False, implementation=None):
    """Scaled dot-product attention, FlashAttention-style.

    Args:
      q: `[B, Sq, Hq, D]`; k, v: `[B, Sk, Hkv, D]` with Hq % Hkv == 0 (query head h reads kv head
        h // (Hq // Hkv): GQA / MQA). D in 1..256, any Sq, Sk. dtype float16, bfloat16 or float32
        (float64 with implementation="eager" only); output in the input dtype.
      causal: query i sees key j only if j <= i (top-left aligned, also when Sq != Sk).
      scale: score multiplier, default D ** -0.5. Scores are s_ij = scale * q_i . k_j.
      segment_ids: one integer tensor `[B, S]` (self-attention, Sq == Sk) or a pair
        (q_ids `[B, Sq]`, kv_ids `[B, Sk]`); i sees j only where the ids are equal.
      window: (left, right) non-negative ints; i sees j only if i - left <= j <= i + right.
      softcap: c > 0 applies s = c * tanh(s / c) before masking.
      rope: a `torch_ref.Rope` (rotary position embedding: q and k, not v, are rotated by their
        positions before the scores; see torch_ref.rope) or None. Needs an even D. The Triton
        kernels rotate q and k tiles after loading them (no extra pass over memory), forward
        and backward (the gradients are rotated back).
      positions: with rope only. None: q at arange(Sq), k at arange(Sk); one integer tensor
        `[B, S]` (Sq == Sk; the same positions for q and k, e.g. restarting at 0 in each packed
        sequence); or a pair (q_pos `[B, Sq]`, kv_pos `[B, Sk]`).
      return_lse: also return lse `[B, Hq, Sq]`, lse_i = log sum_{visible j} exp(s_ij) (natural log;
        float32, float64 for float64 eager). A row with no visible key gets out 0, lse -inf and
        zero gradients.
      implementation: None, "triton" or "eager".
        - "eager": plain PyTorch (materialised scores), differentiable by autograd.
        - "triton": the Triton kernels in a torch.autograd.Function, gradients for q, k, v
          (lse is differentiable as well).
        - None: "triton" when q is on CUDA or the Triton interpreter is active
          (os.environ["TRITON_INTERPRET"] == "1"), else "eager".
        Anything else raises (ValueError and NotImplementedError); "triton" raises
        NotImplementedError when it cannot serve the call (float64, or a CPU tensor without the
        interpreter). There is no silent fallback.

    Precision: softmax statistics in float32. On the GPU, float32 inputs use IEEE fp32 dots unless
    torch.backends.cuda.matmul.allow_tf32 is True, then TF32.

    Returns: out `[B, Sq, Hq, D]`, or (out, lse) when return_lse.
    """
    impl = resolve_implementation(q, implementation) if isinstance(q, torch.Tensor) else None
    scale, q_ids, kv_ids, window, softcap = _validate(q, k, v, causal, scale, segment_ids, window, softcap)
    q_pos, kv_pos = _validate_rope(q, k, rope, positions)
    if impl is None:  # unreachable: _validate rejects non-tensors
        raise TypeError("q must be a torch.Tensor")
    if impl == "eager":
        out, lse = reference.attention(q, k, v, causal=causal, scale=scale, q_ids=q_ids, kv_ids=kv_ids,
                                       window=window, softcap=softcap, rope=rope, q_pos=q_pos, kv_pos=kv_pos)
    else:
        kernels = _triton_module(q)
        q_ids, kv_ids = _segment_pair_for_kernel(q_ids, kv_ids)
        q_pos, kv_pos = _segment_pair_for_kernel(q_pos, kv_pos)
        out, lse = _FlashAttentionFn.apply(q, k, v, q_ids, kv_ids, causal, scale, window, softcap, kernels,
                                           rope, q_pos, kv_pos)
    return (out, lse) if return_lse else out


def flash_attention_reference(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None,
                              rope=None, positions=None):
    """The eager reference with the same arguments as `flash_attention`; returns (out, lse).

    Works in float64 too (the golden; with rope the rotation then runs in float64). Differentiable
    by autograd.
    """
    scale, q_ids, kv_ids, window, softcap = _validate(q, k, v, causal, scale, segment_ids, window, softcap)
    q_pos, kv_pos = _validate_rope(q, k, rope, positions)
    return reference.attention(q, k, v, causal=causal, scale=scale, q_ids=q_ids, kv_ids=kv_ids, window=window,
                               softcap=softcap, rope=rope, q_pos=q_pos, kv_pos=kv_pos)
