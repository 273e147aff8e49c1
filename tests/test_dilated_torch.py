"""torch_ref.dilated_attention: the Triton path (the softmax kernels through a row map, on CPU
through the interpreter) against the eager reference, by the tolerance rule (docs/design/parity.md):
the reference in float64 is the golden, the reference in the compute dtype the naive run; out, lse
and dq, dk, dv through torch.autograd.grad with random cotangents on out and lse."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_ref
from attn_spec.dilation import branches
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare

NP = {torch.float32: np.float32, torch.float16: np.float16}

# (name, B, S, H, Hkv, segment_lengths, dilation_rates, causal, merge, dtype)
CASES = [
    ("s37-pad-gqa", 1, 37, 4, 2, (8, 16), (1, 2), False, "lse", torch.float32),
    ("s37-pad-gqa-causal-fp16", 2, 37, 4, 2, (8, 16), (1, 2), True, "lse", torch.float16),
    ("s37-groups-gqa-causal", 1, 37, 4, 2, (8, 16), (1, 2), True, "head_groups", torch.float32),
    ("s64-free-view-causal", 1, 64, 4, 4, (16, 32, 64), (1, 2, 4), True, "lse", torch.float32),
    ("s64-free-view-groups-fp16", 1, 64, 3, 3, (16, 32, 64), (1, 2, 4), False, "head_groups", torch.float16),
    ("segment-past-sequence-gqa", 1, 37, 4, 2, (16, 100), (1, 4), True, "lse", torch.float32),
    ("groups-split-kv-heads", 1, 29, 4, 2, (8, 16, 32, 64), (1, 2, 2, 4), False, "head_groups", torch.float32),
    ("rows-kept-by-none-mqa", 1, 30, 2, 1, (8, 16), (2, 4), False, "lse", torch.float16),
    # GQA groups of 4 at rates 2, 4: two query heads of a group share an offset (dk / dv add in rounds)
    ("gqa-group-shares-offsets", 1, 32, 8, 2, (8, 16, 32), (1, 2, 4), True, "lse", torch.float32),
    # groups of 3 at rate 2: the heads of an offset are no arithmetic run (gathered, index_add_)
    ("gqa-group3-rate2-partial", 1, 24, 12, 4, (8, 16), (1, 2), False, "lse", torch.float32),
]


def _draw(B, S, H, Hkv, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, S, H, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, H, D), (B, H, S)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]  # q, k, v, d_out, d_lse


def _run(implementation, dtype, q, k, v, do, dlse, **cfg):
    """(out, lse, dq, dk, dv) as float64 NumPy."""
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    out, lse = torch_ref.dilated_attention(q, k, v, return_lse=True, implementation=implementation, **cfg)
    grads = torch.autograd.grad((out, lse), (q, k, v), (do.to(out.dtype), dlse.to(lse.dtype)))
    return [x.detach().to(torch.float64).numpy() for x in (out, lse, *grads)]


@pytest.mark.parametrize("name,B,S,H,Hkv,segments,rates,causal,merge,dtype", CASES, ids=[c[0] for c in CASES])
def test_triton_matches_reference(name, B, S, H, Hkv, segments, rates, causal, merge, dtype):
    q, k, v, do, dlse = _draw(B, S, H, Hkv)
    cfg = dict(segment_lengths=segments, dilation_rates=rates, causal=causal, merge=merge)
    gold = _run("eager", torch.float64, q, k, v, do, dlse, **cfg)
    naive = _run("eager", dtype, q, k, v, do, dlse, **cfg)
    fast = _run("triton", dtype, q, k, v, do, dlse, **cfg)
    names = ("out", "lse", "dq", "dk", "dv")
    verdicts = {n: compare(f, nv, g, NP[dtype], FORWARD_FACTOR if n in ("out", "lse") else GRADIENT_FACTOR)
                for n, f, nv, g in zip(names, fast, naive, gold)}
    failed = {n: v for n, v in verdicts.items() if not v.ok}
    assert not failed, "; ".join(f"{n}: error {v.error:.3g} > allowed {v.allowed:.3g} {v.reason}"
                                 for n, v in failed.items())
    if name.startswith("rows-kept-by-none"):  # odd rows of head 0, even rows of head 1: out 0, lse -inf
        assert np.isneginf(gold[1]).any() and np.array_equal(np.isneginf(fast[1]), np.isneginf(gold[1]))
        assert not np.isnan(np.concatenate([x.ravel() for x in fast])).any()


def test_free_view_and_determinism():
    """S = 64 with (16, 32, 64) / (1, 2, 4) needs no padding (the slot view is a free reshape); two
    runs of forward and backward are bitwise equal."""
    assert not any(b.padded for b in branches((16, 32, 64), (1, 2, 4), 64))
    assert all(b.padded for b in branches((8, 16), (1, 2), 37))
    q, k, v, do, dlse = _draw(1, 40, 4, 2, seed=1)
    cfg = dict(segment_lengths=(8, 16), dilation_rates=(1, 2), causal=True, merge="lse")
    first, second = (_run("triton", torch.float32, q, k, v, do, dlse, **cfg) for _ in range(2))
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


def test_argument_errors():
    x = torch.zeros(1, 16, 4, 8)
    kv = torch.zeros(1, 16, 2, 8)
    ok = dict(segment_lengths=(8,), dilation_rates=(2,))
    torch_ref.dilated_attention(x, kv, kv, segment_lengths=(16, 8), dilation_rates=(16, 1), implementation="triton")
    with pytest.raises(ValueError, match=r"same sequence length, got Sq=16 .* Sk=8"):
        torch_ref.dilated_attention(x, kv[:, :8], kv[:, :8], **ok)
    with pytest.raises(ValueError, match=r"dilation_rates: rate 4 is larger than its segment length 2"):
        torch_ref.dilated_attention(x, kv, kv, segment_lengths=(2,), dilation_rates=(4,))
    with pytest.raises(ValueError, match=r"segment_lengths must hold positive ints"):
        torch_ref.dilated_attention(x, kv, kv, segment_lengths=(0,), dilation_rates=(1,))
    with pytest.raises(ValueError, match=r"same count"):
        torch_ref.dilated_attention(x, kv, kv, segment_lengths=(8, 16), dilation_rates=(1,))
    with pytest.raises(ValueError, match=r"head count must be a multiple of the branch count 3"):
        torch_ref.dilated_attention(x, kv, kv, segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4),
                                    merge="head_groups")
    with pytest.raises(ValueError, match=r"merge must be one of"):
        torch_ref.dilated_attention(x, kv, kv, merge="sum", **ok)
    with pytest.raises(ValueError, match=r"number of heads in k/v \(3\) must divide heads in q \(4\)"):
        torch_ref.dilated_attention(x, x[:, :, :3], x[:, :, :3], **ok)
    with pytest.raises(NotImplementedError, match=r"implementation='triton' cannot serve this call: .*not float64"):
        torch_ref.dilated_attention(x.double(), kv.double(), kv.double(), implementation="triton", **ok)
    with pytest.raises(TypeError):
        torch_ref.dilated_attention(x, kv, kv, implementation="eager", config=torch_ref.BlockSizes(), **ok)
