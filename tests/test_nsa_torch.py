"""torch_ref's Native Sparse Attention (attn_spec.nsa): the Triton path (on CPU through the
interpreter) and the eager path against the float64 eager golden by the tolerance rule
(docs/design/parity.md): selection attention (block lists with counts, ignored entries, ranges,
segment ids, GQA ratios 1, 2, 4), the compression branch (mean and MLP), the top-n rule against a
plain recomputation, nsa_attention with gates, fully masked rows, determinism and every argument
error. `gpu` tests: compiled kernels at realistic shapes."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_ref
from attn_spec import nsa as spec
from attn_spec.nsa import CompressParams
from parity.tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, compare

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _np_dtype(dtype):
    if dtype == torch.bfloat16:
        import ml_dtypes

        return ml_dtypes.bfloat16
    return {torch.float16: np.float16, torch.float32: np.float32}[dtype]


def _check(names, fast, naive, gold, dtype):
    failures = []
    for name, f, n, g in zip(names, fast, naive, gold):
        factor = FORWARD_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR
        f, n, g = (x.detach().cpu().double().numpy() for x in (f, n, g))
        verdict = compare(f, n, g, _np_dtype(dtype), factor)
        if not verdict.ok:
            failures.append(f"{name}: error {verdict.error:.3g} > allowed {verdict.allowed:.3g} {verdict.reason}")
    assert not failures, "; ".join(failures)


def _randn(gen, *shape, device="cpu"):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)


# ----------------------------------------------------------------------------------------------
# Selection attention
# ----------------------------------------------------------------------------------------------
# (name, B, S, Hq, Hkv, D, block_size, n, form, segments, causal, dtype)
SELECTION_CASES = [
    ("blocks-gqa2-counts", 2, 70, 4, 2, 16, 16, 4, "blocks", False, True, torch.float32),
    ("blocks-mha-fp16", 1, 47, 2, 2, 16, 16, 3, "blocks", False, True, torch.float16),
    ("blocks-gqa4-segments", 1, 65, 8, 2, 16, 16, 3, "blocks", True, True, torch.float32),
    ("blocks-32-in-tiles-fp16", 1, 83, 4, 1, 40, 32, 2, "blocks", False, True, torch.float16),
    ("blocks-noncausal", 1, 50, 2, 1, 16, 16, 2, "blocks", False, False, torch.float32),
    ("blocks-group32", 1, 23, 32, 1, 16, 8, 2, "blocks", False, True, torch.float32),  # rows 32: one token a dK/dV step
    ("ranges-gqa2", 1, 53, 4, 2, 16, 16, 3, "ranges", False, True, torch.float32),
    ("ranges-segments-fp16", 2, 41, 2, 1, 24, 16, 4, "ranges", True, True, torch.float16),
    ("ranges-noncausal-segments-gqa4", 1, 50, 8, 2, 16, 16, 2, "ranges", True, False, torch.float32),
]


def _selection_inputs(B, S, Hq, Hkv, D, block_size, n, form, segments, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (_randn(gen, B, S, h, D, device=device) for h in (Hq, Hkv, Hkv, Hq))
    dlse = _randn(gen, B, Hq, S, device=device)
    kw = {}
    nb = spec.selection_count(S, block_size)
    if form == "blocks":
        # -1, past the frontier, past the sequence and repeats all occur
        kw["block_indices"] = torch.randint(-1, nb + 1, (B, S, Hkv, n), generator=gen).to(device)
        kw["block_counts"] = torch.randint(0, n + 1, (B, S, Hkv), generator=gen).to(device)
        kw["block_size"] = block_size
    else:
        start = torch.randint(0, S, (B, S, Hkv, n), generator=gen)
        length = torch.randint(0, 2 * block_size, (B, S, Hkv, n), generator=gen)
        length[..., 0] = 0  # an empty range
        kw["ranges"] = torch.stack([start, start + length], -1).to(device)  # overlaps and past-S ends too
    if segments:
        kw["segment_ids"] = torch.sort(torch.randint(0, 3, (B, S), generator=gen), dim=1).values.to(device)
    return (q, k, v, do, dlse), kw


def _selection_run(impl, dtype, q, k, v, do, dlse, **kw):
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out, lse = torch_ref.selection_attention(q, k, v, return_lse=True, implementation=impl, **kw)
    grads = torch.autograd.grad((out, lse), (q, k, v), (do.to(dtype), dlse.to(lse.dtype)))
    return [out, lse, *grads]


@pytest.mark.parametrize("name,B,S,Hq,Hkv,D,block_size,n,form,segments,causal,dtype", SELECTION_CASES,
                         ids=[c[0] for c in SELECTION_CASES])
def test_selection_matches_golden(name, B, S, Hq, Hkv, D, block_size, n, form, segments, causal, dtype):
    tensors, kw = _selection_inputs(B, S, Hq, Hkv, D, block_size, n, form, segments)
    kw["causal"] = causal
    gold = _selection_run("eager", torch.float64, *tensors, **kw)
    naive = _selection_run("eager", dtype, *tensors, **kw)
    for impl in ("triton", "eager"):
        _check(("out", "lse", "dq", "dk", "dv"), _selection_run(impl, dtype, *tensors, **kw), naive, gold, dtype)
    assert torch.isneginf(gold[1]).any()  # rows that see nothing are part of every case


def test_selection_config():
    """Another tiling (tiles of 32 over blocks of 16 and ranges, one token a dK/dV step, chunks of 3
    pieces) still meets the rule."""
    tensors, kw = _selection_inputs(1, 45, 4, 2, 16, 16, 3, "ranges", False, seed=9)
    gold = _selection_run("eager", torch.float64, *tensors, **kw)
    naive = _selection_run("eager", torch.float32, *tensors, **kw)
    cfg = torch_ref.NSABlockSizes(block_n=32, block_n_dkv=32, tokens_dkv=1, chunk_dkv=3, num_stages=1)
    fast = _selection_run("triton", torch.float32, *tensors, config=cfg, **kw)
    _check(("out", "lse", "dq", "dk", "dv"), fast, naive, gold, torch.float32)


def test_ranges_beyond_the_scan_length(monkeypatch):
    """Ranges on sequences longer than RANGES_SCAN_KEYS go through their canonical form and the
    per-token kernels (here the limit is lowered to reach that path at a CPU-sized length)."""
    monkeypatch.setattr(spec, "RANGES_SCAN_KEYS", 16)
    tensors, kw = _selection_inputs(2, 41, 2, 1, 24, 16, 4, "ranges", True, seed=11)
    gold = _selection_run("eager", torch.float64, *tensors, **kw)
    naive = _selection_run("eager", torch.float16, *tensors, **kw)
    _check(("out", "lse", "dq", "dk", "dv"), _selection_run("triton", torch.float16, *tensors, **kw), naive, gold,
           torch.float16)


def test_segment_ids_past_int32():
    """int64 segment ids that agree modulo 2^32 stay different segments (no narrowing)."""
    tensors, kw = _selection_inputs(1, 40, 2, 1, 16, 16, 3, "blocks", False, seed=10)
    ids = torch.zeros(1, 40, dtype=torch.int64)
    ids[:, 20:] = 1 << 32
    kw["segment_ids"] = ids
    gold = _selection_run("eager", torch.float64, *tensors, **kw)
    naive = _selection_run("eager", torch.float32, *tensors, **kw)
    _check(("out", "lse", "dq", "dk", "dv"), _selection_run("triton", torch.float32, *tensors, **kw), naive, gold,
           torch.float32)


def test_selection_canonical_form():
    """The ignored entries, by hand: -1, beyond the frontier, past block_counts and repeats count
    nothing; a key counts once; ranges are their union."""
    S, bs = 40, 8
    idx = torch.tensor([1, 3, 3, 4]).expand(1, S, 1, 4)
    blocks = torch_ref.ops.nsa.reference.canonical_blocks(idx, torch.full((1, S, 1), 3), bs, True, S)
    assert blocks[0, 39, 0].tolist() == [1, 3, -1, -1]  # slot 3 past the count, the repeat once
    assert blocks[0, 10, 0].tolist() == [1, -1, -1, -1]  # block 3 beyond token 10's frontier
    every = torch_ref.ops.nsa.reference.canonical_blocks(idx, None, bs, True, S)
    assert every[0, 39, 0].tolist() == [1, 3, 4, -1]  # ascending, the repeat's slot last
    neg = torch.tensor([-1, 0, 9, 0]).expand(1, S, 1, 4)  # -1, a repeat, past the sequence
    assert torch_ref.ops.nsa.reference.canonical_blocks(neg, None, bs, False, S)[0, 0, 0].tolist() == [0, -1, -1, -1]
    ranges = torch.tensor([[5, 9], [0, 3], [7, 12], [2, 2], [30, 50]]).expand(1, S, 1, 5, 2)
    spans = torch_ref.ops.nsa.reference.canonical_ranges(ranges, True, S)
    assert spans[0, 39, 0].tolist() == [[0, 3], [5, 9], [9, 12], [30, 40], [0, 0]]
    assert spans[0, 6, 0].tolist() == [[0, 3], [5, 7], [0, 0], [0, 0], [0, 0]]
    # selection over [3, 3] and over [3] alone agree (a repeated block counts once)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (_randn(gen, 1, S, 2, 16).float() for _ in range(3))
    k, v = k[:, :, :1], v[:, :, :1]
    one = torch_ref.selection_attention(q, k, v, torch.full((1, S, 1, 1), 3), block_size=bs, implementation="triton")
    two = torch_ref.selection_attention(q, k, v, torch.full((1, S, 1, 2), 3), block_size=bs, implementation="triton")
    assert torch.equal(one, two)


def test_fully_masked_rows_and_determinism():
    """Rows with no visible key: out 0, lse -inf, zero gradients, no NaN (keys the row cannot see
    hold NaN). Two runs of forward and backward are bitwise equal."""
    tensors, kw = _selection_inputs(1, 37, 4, 2, 16, 16, 3, "blocks", True, seed=5)
    q, k, v, do, dlse = tensors
    kw["block_indices"][:, 10:20] = -1
    ids = kw["segment_ids"].clone()
    ids[:, 30:] = 7  # the last rows' segment: keys 30.. exist, but the blocks chosen for them may not hold them
    kw["segment_ids"] = ids
    first = _selection_run("triton", torch.float32, q, k, v, do, dlse, **kw)
    second = _selection_run("triton", torch.float32, q, k, v, do, dlse, **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    out, lse, dq = first[:3]
    assert torch.isneginf(lse[:, :, 10:20]).all() and (out[:, 10:20] == 0).all() and (dq[:, 10:20] == 0).all()
    assert not any(torch.isnan(x).any() for x in first)
    # NaN in keys and values no row selects does not leak
    k2, v2 = k.clone(), v.clone()
    idx = kw["block_indices"].clamp(max=1)
    k2[:, 32:], v2[:, 32:] = float("nan"), float("nan")
    res = _selection_run("triton", torch.float32, q, k2, v2, do, dlse, **dict(kw, block_indices=idx))
    assert not any(torch.isnan(x[:, :32] if x.dim() == 4 else x[..., :32]).any() for x in res)


# ----------------------------------------------------------------------------------------------
# Compression branch
# ----------------------------------------------------------------------------------------------
def _leaves(params, dtype):
    return CompressParams(*(t.detach().to(dtype).requires_grad_() for t in params))


def _params(gen, block, D, hidden, dtype=torch.float64):
    shapes = dict(pos=(block, D), w1=(block * D, hidden), b1=(hidden,), w2=(hidden, D), b2=(D,))
    scales = dict(pos=1.0, w1=(block * D) ** -0.5, b1=0.1, w2=hidden ** -0.5, b2=0.1)
    return CompressParams(**{f: (_randn(gen, *s) * scales[f]).to(dtype) for f, s in shapes.items()})


# (name, B, S, Hq, Hkv, D, block, stride, mlp, segments, dtype)
COMPRESSION_CASES = [
    ("mean-gqa2", 2, 53, 4, 2, 16, 16, 8, False, False, torch.float32),
    ("mean-mha-fp16", 1, 45, 2, 2, 16, 8, 8, False, False, torch.float16),
    ("mlp-gqa4", 1, 40, 4, 1, 16, 8, 4, True, False, torch.float32),
    ("mean-segments-gqa2", 2, 50, 4, 2, 16, 8, 4, False, True, torch.float32),
    ("mlp-segments-fp16", 1, 47, 2, 1, 16, 16, 8, True, True, torch.float16),
]


@pytest.mark.parametrize("name,B,S,Hq,Hkv,D,block,stride,mlp,segments,dtype", COMPRESSION_CASES,
                         ids=[c[0] for c in COMPRESSION_CASES])
def test_compression_matches_golden(name, B, S, Hq, Hkv, D, block, stride, mlp, segments, dtype):
    gen = torch.Generator().manual_seed(1)
    q, do = _randn(gen, B, S, Hq, D), _randn(gen, B, S, Hq, D)
    k, v = _randn(gen, B, S, Hkv, D), _randn(gen, B, S, Hkv, D)
    dlse = _randn(gen, B, Hq, S)
    params = (_params(gen, block, D, 24), _params(gen, block, D, 24)) if mlp else None
    ids = torch.sort(torch.randint(0, 3, (B, S), generator=gen), dim=1).values if segments else None

    def run(impl, dt):
        qq, kk, vv = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
        pp = None if params is None else tuple(_leaves(p, dt) for p in params)
        kc, vc = torch_ref.compress_kv(kk, vv, block=block, stride=stride, params=pp)
        out, lse = torch_ref.compression_attention(qq, kc, vc, block=block, stride=stride, segment_ids=ids,
                                                   return_lse=True, implementation=impl)
        leaves = [qq, kk, vv] + ([t for p in pp for t in p] if pp else [])
        grads = torch.autograd.grad((out, lse), leaves, (do.to(dt), dlse.float() if dt != torch.float64 else dlse))
        return [out, lse, *grads]

    names = ["out", "lse", "dq", "dk", "dv"] + ([f"d{w}.{f}" for w in "kv" for f in CompressParams._fields]
                                                if mlp else [])
    gold, naive = run("eager", torch.float64), run("eager", dtype)
    assert torch.isneginf(gold[1][:, :, :block - 1]).all()  # no block is complete before t = block - 1
    for impl in ("triton", "eager"):
        _check(names, run(impl, dtype), naive, gold, dtype)


def test_compress_kv_geometry():
    """Block i covers [i * stride, i * stride + block): mean pooling by hand; S < block: no block."""
    x = torch.arange(20, dtype=torch.float64).reshape(1, 20, 1, 1).expand(1, 20, 1, 2)
    kc, vc = torch_ref.compress_kv(x, x, block=8, stride=4)
    assert kc.shape == (1, spec.compressed_count(20, 8, 4), 1, 2) == (1, 4, 1, 2)
    assert kc[0, :, 0, 0].tolist() == [3.5, 7.5, 11.5, 15.5]
    empty, _ = torch_ref.compress_kv(x[:, :7], x[:, :7], block=8, stride=4)
    assert empty.shape == (1, 0, 1, 2)
    q = torch.randn(1, 7, 2, 2, dtype=torch.float32)
    out, lse = torch_ref.compression_attention(q, empty.float(), empty.float(), block=8, stride=4, return_lse=True,
                                               implementation="triton")
    assert (out == 0).all() and torch.isneginf(lse).all()


# ----------------------------------------------------------------------------------------------
# Block selection
# ----------------------------------------------------------------------------------------------
def _plain_importance(q, k_cmp, lse, block, stride, select_block, scale):
    """float64 NumPy, the definition term by term."""
    q, k_cmp, lse = (x.double().numpy() for x in (q, k_cmp, lse))
    B, S, Hq, _ = q.shape
    Nc, Hkv = k_cmp.shape[1:3]
    G = Hq // Hkv
    overlap = spec.overlap_matrix(S, block, stride, select_block).astype(np.float64)
    imp = np.zeros((B, S, Hkv, overlap.shape[1]))
    for b in range(B):
        for t in range(S):
            for h in range(Hq):
                if not np.isfinite(lse[b, h, t]):
                    continue
                for i in range(Nc):
                    if spec.compressed_end(i, block, stride) <= t:
                        p = np.exp(scale * q[b, t, h] @ k_cmp[b, i, h // G] - lse[b, h, t])
                        imp[b, t, h // G] += p * overlap[i]
    return imp


def _plain_rule(imp, n, select_block):
    """The top-n rule, row by row: forced blocks first (lower index first), then larger importance,
    ties to the lower index; ascending, -1 padded. Also the gap at the cut (near ties)."""
    B, S, Hkv, _ = imp.shape
    out = np.full((B, S, Hkv, n), -1)
    gap = np.full((B, S, Hkv), np.inf)
    for b in range(B):
        for t in range(S):
            for h in range(Hkv):
                own = t // select_block
                forced = {j for j in spec.forced_blocks(t, select_block) if j >= 0}
                order = sorted(range(own + 1),
                               key=lambda j: (j not in forced, 0 if j in forced else -imp[b, t, h, j], j))
                chosen = order[:n]
                out[b, t, h, :len(chosen)] = sorted(chosen)
                if len(order) > n and order[n - 1] not in forced:
                    gap[b, t, h] = imp[b, t, h, order[n - 1]] - imp[b, t, h, order[n]]
    return out, gap


@pytest.mark.parametrize("block,stride,select_block,n", [(16, 8, 16, 3), (8, 8, 8, 4), (16, 16, 8, 5), (8, 4, 16, 2)])
def test_select_blocks_rule(block, stride, select_block, n):
    gen = torch.Generator().manual_seed(2)
    B, S, Hq, Hkv, D = 2, 61, 4, 2, 16
    q, k, v = _randn(gen, B, S, Hq, D).float(), _randn(gen, B, S, Hkv, D).float(), _randn(gen, B, S, Hkv, D).float()
    kc, vc = torch_ref.compress_kv(k, v, block=block, stride=stride)
    _, lse = torch_ref.compression_attention(q, kc, vc, block=block, stride=stride, return_lse=True,
                                             implementation="eager")
    imp = _plain_importance(q, kc, lse, block, stride, select_block, D ** -0.5)
    want, gap = _plain_rule(imp, n, select_block)
    # near ties may order either way in float32; exact ties (a compression block larger than a
    # selection block gives neighbours equal importance) must go to the lower index
    near_tie = (gap > 0) & (gap < 1e-5)
    assert near_tie.mean() < 0.02
    for impl in ("triton", "eager"):
        got = torch_ref.select_blocks(q, kc, lse, block=block, stride=stride, select_block=select_block,
                                      num_selected=n, implementation=impl).numpy()
        assert got.dtype == np.int32 and got.shape == (B, S, Hkv, n)
        assert np.array_equal(got[~near_tie], want[~near_tie]), impl


@pytest.mark.parametrize("block,stride,select_block", [(8, 4, 8), (8, 8, 8)])
def test_select_blocks_with_segments(block, stride, select_block):
    """nsa_attention's selection with segment ids (the importance of the segment-masked compression
    branch): the Triton kernel and the eager definition choose the same blocks."""
    gen = torch.Generator().manual_seed(7)
    B, S, Hq, Hkv, D, n = 2, 75, 4, 2, 16, 5
    q, k, v = _randn(gen, B, S, Hq, D).float(), _randn(gen, B, S, Hkv, D).float(), _randn(gen, B, S, Hkv, D).float()
    ids = torch.sort(torch.randint(0, 3, (B, S), generator=gen), dim=1).values
    kc, vc = torch_ref.compress_kv(k, v, block=block, stride=stride)
    _, lse = torch_ref.compression_attention(q, kc, vc, block=block, stride=stride, segment_ids=ids, return_lse=True,
                                             implementation="eager")
    picks = [torch_ref.registry.resolve("nsa", impl, torch_ref.registry.Call.of(q)).fn(
        "select_blocks", q, kc, lse, block=block, stride=stride, select_block=select_block, num_selected=n,
        scale=D ** -0.5, segment_ids=ids) for impl in ("triton", "eager")]
    assert torch.equal(*picks)
    plain = torch_ref.select_blocks(q, kc, lse, block=block, stride=stride, select_block=select_block, num_selected=n,
                                    implementation="eager")
    assert not torch.equal(picks[1], plain)  # the segments change the choice


def test_select_blocks_ties_to_lower_index():
    """Equal importances (all compressed keys equal): the lower indices win, every row."""
    B, S, H, D, sb, n = 1, 100, 2, 16, 8, 5
    q = torch.randn(B, S, H, D)
    kc = torch.zeros(B, spec.compressed_count(S, sb, sb), H, D)
    _, lse = torch_ref.compression_attention(q, kc, kc, block=sb, stride=sb, return_lse=True, implementation="eager")
    want, _ = _plain_rule(np.ones((B, S, H, spec.selection_count(S, sb))), n, sb)
    for impl in ("triton", "eager"):
        got = torch_ref.select_blocks(q, kc, lse, block=sb, stride=sb, select_block=sb, num_selected=n,
                                      implementation=impl)
        assert np.array_equal(got.numpy(), want), impl
    assert want[0, 99, 0].tolist() == [0, 1, 2, 11, 12] and want[0, 3, 0].tolist() == [0, -1, -1, -1, -1]


# ----------------------------------------------------------------------------------------------
# nsa_attention
# ----------------------------------------------------------------------------------------------
def _nsa_run(impl, dtype, tensors, gates, params, cotangent, **kw):
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in tensors)
    g = gates.detach().to(dtype).requires_grad_()
    pp = None if params is None else tuple(_leaves(p, dtype) for p in params)
    out = torch_ref.nsa_attention(q, k, v, g, compress_params=pp, implementation=impl, **kw)
    leaves = [q, k, v, g] + ([t for p in pp for t in p] if pp else [])
    return [out, *torch.autograd.grad(out, leaves, cotangent.to(dtype))]


# (name, B, S, Hq, Hkv, D, compress (block, stride), select_block, n, window, mlp, segments, dtype)
NSA_CASES = [
    ("all-blocks-gqa2-fp16", 1, 45, 4, 2, 16, (16, 8), 16, 3, 8, False, False, torch.float16),
    # (the fp16 MLP is compression's; here the params' gradients are sums over few rows of the
    # compressed keys' fp16 gradients, whose rounding the naive fp16 run may cancel by chance)
    ("all-blocks-mlp-mqa", 1, 40, 2, 1, 16, (8, 8), 8, 5, 6, True, False, torch.float32),
    ("some-blocks-gqa4-segments", 1, 70, 8, 2, 16, (8, 4), 8, 3, 10, False, True, torch.float32),
    ("some-blocks-no-window-mha", 2, 50, 2, 2, 16, (16, 8), 8, 2, 0, True, False, torch.float32),
]


@pytest.mark.parametrize("name,B,S,Hq,Hkv,D,cmp,select_block,n,window,mlp,segments,dtype", NSA_CASES,
                         ids=[c[0] for c in NSA_CASES])
def test_nsa_matches_golden(name, B, S, Hq, Hkv, D, cmp, select_block, n, window, mlp, segments, dtype):
    gen = torch.Generator().manual_seed(4)
    tensors = (_randn(gen, B, S, Hq, D), _randn(gen, B, S, Hkv, D), _randn(gen, B, S, Hkv, D))
    gates = torch.sigmoid(_randn(gen, B, S, Hq, 3))
    cot = _randn(gen, B, S, Hq, D)
    params = (_params(gen, cmp[0], D, 16), _params(gen, cmp[0], D, 16)) if mlp else None
    ids = torch.sort(torch.randint(0, 2, (B, S), generator=gen), dim=1).values if segments else None
    kw = dict(compress_block=cmp[0], compress_stride=cmp[1], select_block=select_block, num_selected=n,
              window=window, segment_ids=ids)
    if n < spec.selection_count(S, select_block):  # a discrete choice: the golden must choose the same blocks
        picks = []
        for dt in (torch.float64, dtype):
            q, k, v = (x.to(dt) for x in tensors)
            pp = None if params is None else tuple(CompressParams(*(t.to(dt) for t in p)) for p in params)
            kc, vc = torch_ref.compress_kv(k, v, block=cmp[0], stride=cmp[1], params=pp)
            _, lse = torch_ref.compression_attention(q, kc, vc, block=cmp[0], stride=cmp[1], return_lse=True,
                                                     segment_ids=ids, implementation="eager")
            picks.append(torch_ref.select_blocks(q, kc, lse, block=cmp[0], stride=cmp[1], select_block=select_block,
                                                 num_selected=n, implementation="eager"))
        if ids is None:
            assert torch.equal(*picks)
    names = ["out", "dq", "dk", "dv", "dgates"] + ([f"d{w}.{f}" for w in "kv" for f in CompressParams._fields]
                                                   if mlp else [])
    gold = _nsa_run("eager", torch.float64, tensors, gates, params, cot, **kw)
    naive = _nsa_run("eager", dtype, tensors, gates, params, cot, **kw)
    for impl in ("triton", "eager"):
        _check(names, _nsa_run(impl, dtype, tensors, gates, params, cot, **kw), naive, gold, dtype)


def test_nsa_branches_by_gates():
    """Gates (0, 1, 0) give the selection branch over select_blocks' choice; (1, 0, 0) the
    compression branch; (0, 0, 1) the window through flash_attention."""
    gen = torch.Generator().manual_seed(6)
    B, S, H, D = 1, 40, 2, 16
    q, k, v = (_randn(gen, B, S, H, D).float() for _ in range(3))
    kw = dict(compress_block=8, compress_stride=8, select_block=8, num_selected=2, window=5, implementation="triton")
    one_hot = lambda i: torch.nn.functional.one_hot(torch.full((B, S, H), i), 3).float()  # noqa: E731
    kc, vc = torch_ref.compress_kv(k, v, block=8, stride=8)
    o_cmp, lse = torch_ref.compression_attention(q, kc, vc, block=8, stride=8, return_lse=True, implementation="triton")
    blocks = torch_ref.select_blocks(q, kc, lse, block=8, stride=8, select_block=8, num_selected=2,
                                     implementation="triton")
    o_slc = torch_ref.selection_attention(q, k, v, blocks, block_size=8, implementation="triton")
    o_win = torch_ref.flash_attention(q, k, v, causal=True, window=(4, 0), implementation="triton")
    for i, want in enumerate((o_cmp, o_slc, o_win)):
        assert torch.equal(torch_ref.nsa_attention(q, k, v, one_hot(i), **kw), want)


# ----------------------------------------------------------------------------------------------
# Argument errors
# ----------------------------------------------------------------------------------------------
def test_argument_errors():
    q, kv = torch.zeros(1, 32, 4, 8), torch.zeros(1, 32, 2, 8)
    idx = torch.zeros(1, 32, 2, 2, dtype=torch.int32)
    sel = torch_ref.selection_attention
    sel(q, kv, kv, idx, block_size=16)  # the boundary: fine
    with pytest.raises(ValueError, match=r"block_indices must have shape \[B, S, Hkv, n\] = \[1, 32, 2, n >= 1\]"):
        sel(q, kv, kv, idx[:, :, :1])
    with pytest.raises(TypeError, match=r"block_indices must have an integer dtype"):
        sel(q, kv, kv, idx.float())
    with pytest.raises(ValueError, match=r"block_counts must have shape \[B, S, Hkv\]"):
        sel(q, kv, kv, idx, torch.zeros(1, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_size must be a power of two, got 48"):
        sel(q, kv, kv, idx, block_size=48)
    with pytest.raises(ValueError, match=r"exactly one of block_indices and ranges, got neither"):
        sel(q, kv, kv)
    ranges = torch.zeros(1, 32, 2, 3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"exactly one of block_indices and ranges, got both"):
        sel(q, kv, kv, idx, ranges=ranges)
    bad = ranges.clone()
    bad[0, 5, 1, 2] = torch.tensor([9, 4])
    with pytest.raises(ValueError,
                       match=r"ranges must have start <= end, got \[9, 4\] at \[b, t, h, r\] = \[0, 5, 1, 2\]"):
        sel(q, kv, kv, ranges=bad)
    with pytest.raises(ValueError, match=r"ranges must have shape \[B, S, Hkv, R, 2\]"):
        sel(q, kv, kv, ranges=ranges[..., :1])
    with pytest.raises(ValueError, match=r"same sequence length"):
        sel(q, kv[:, :16], kv[:, :16], idx[:, :16])
    with pytest.raises(ValueError, match=r"number of heads in k/v \(3\) must divide heads in q \(4\)"):
        sel(q, q[:, :, :3], q[:, :, :3], idx)
    with pytest.raises(NotImplementedError, match=r"implementation='triton' cannot serve this call: .*not float64"):
        sel(q.double(), kv.double(), kv.double(), idx, implementation="triton")
    with pytest.raises(torch_ref.UnknownImplementationError, match=r"unknown implementation='xla'"):
        sel(q, kv, kv, idx, implementation="xla")
    with pytest.raises(TypeError, match=r"takes no tile config"):
        sel(q, kv, kv, idx, implementation="eager", config=torch_ref.NSABlockSizes())
    with pytest.raises(ValueError, match=r"NSABlockSizes.block_n must be a power of two"):
        torch_ref.NSABlockSizes(block_n=48)

    with pytest.raises(ValueError, match=r"stride must be a power of two, got 12"):
        torch_ref.compress_kv(kv, kv, block=16, stride=12)
    with pytest.raises(ValueError, match=r"stride \(32\) must not exceed block \(16\)"):
        torch_ref.compress_kv(kv, kv, block=16, stride=32)
    gen = torch.Generator().manual_seed(0)
    p = _params(gen, 8, 8, 4, torch.float32)
    torch_ref.compress_kv(kv, kv, block=8, stride=8, params=(p, p))
    with pytest.raises(ValueError, match=r"params\[0\] \(k\).w1 must have shape \(64, 4\)"):
        torch_ref.compress_kv(kv, kv, block=8, stride=8, params=(p._replace(w1=torch.zeros(32, 4)), p))
    with pytest.raises(TypeError, match=r"params must be None or a pair"):
        torch_ref.compress_kv(kv, kv, block=8, stride=8, params=p)

    kc, _ = torch_ref.compress_kv(kv, kv, block=8, stride=8)
    with pytest.raises(ValueError, match=r"k_cmp must hold the 4 compression blocks .* got Nc=3"):
        torch_ref.compression_attention(q, kc[:, :3], kc[:, :3], block=8, stride=8)
    lse = torch.zeros(1, 4, 32)
    torch_ref.select_blocks(q, kc, lse, block=8, stride=8, select_block=8, num_selected=4)  # 4 blocks: fine
    with pytest.raises(ValueError, match=r"num_selected \(5\) is larger than the 4 selection blocks"):
        torch_ref.select_blocks(q, kc, lse, block=8, stride=8, select_block=8, num_selected=5)
    with pytest.raises(ValueError, match=r"lse_cmp must have shape \[B, Hq, S\] = \[1, 4, 32\]"):
        torch_ref.select_blocks(q, kc, lse[:, :2], block=8, stride=8, select_block=8, num_selected=2)

    gates = torch.zeros(1, 32, 4, 3)
    kw = dict(compress_block=8, compress_stride=8, select_block=8, num_selected=2, window=4)
    torch_ref.nsa_attention(q, kv, kv, gates, **kw)
    with pytest.raises(ValueError, match=r"gates must have shape \[B, S, Hq, 3\] = \[1, 32, 4, 3\]"):
        torch_ref.nsa_attention(q, kv, kv, gates[..., :2], **kw)
    with pytest.raises(TypeError, match=r"gates must be a floating torch.Tensor"):
        torch_ref.nsa_attention(q, kv, kv, gates.int(), **kw)
    with pytest.raises(ValueError, match=r"select_block must be a power of two, got 24"):
        torch_ref.nsa_attention(q, kv, kv, gates, **dict(kw, select_block=24))
    with pytest.raises(ValueError, match=r"window must be an int >= 0"):
        torch_ref.nsa_attention(q, kv, kv, gates, **dict(kw, window=-1))
    with pytest.raises(ValueError, match=r"num_selected \(9\) is larger than the 4 selection blocks"):
        torch_ref.nsa_attention(q, kv, kv, gates, **dict(kw, num_selected=9))


# ----------------------------------------------------------------------------------------------
# GPU: compiled kernels at realistic shapes
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("S,Hq,Hkv,n", [(4096, 16, 1, 16), (8192, 8, 2, 16), (4096, 4, 4, 8), (16384, 2, 1, 16)])
def test_gpu_selection_bf16(S, Hq, Hkv, n):
    """The compiled selection kernels against the eager golden (float64 on the GPU), bf16,
    NSA-shaped block lists (forced blocks plus random ones)."""
    if not torch.cuda.is_available():
        pytest.fail("a gpu test needs CUDA")
    gen = torch.Generator().manual_seed(0)
    B, D, bs = 1, 128, 64
    q, k, v, do = (_randn(gen, B, S, h, D, device="cuda") for h in (Hq, Hkv, Hkv, Hq))
    dlse = _randn(gen, B, Hq, S, device="cuda")
    t = torch.arange(S)[None, :, None, None]
    idx = torch.randint(0, S // bs, (B, S, Hkv, n), generator=gen) % (t // bs + 1)
    idx[..., 0], idx[..., 1] = 0, t[..., 0] // bs
    kw = dict(block_indices=idx.cuda(), block_size=bs)
    gold = _selection_run("eager", torch.float64, q, k, v, do, dlse, **kw)
    naive = _selection_run("eager", torch.bfloat16, q, k, v, do, dlse, **kw)
    fast = _selection_run("triton", torch.bfloat16, q, k, v, do, dlse, **kw)
    _check(("out", "lse", "dq", "dk", "dv"), fast, naive, gold, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_ranges_bf16(causal):
    """The ranges scan kernels compiled (S = 2048, GQA 8 / 2): two ranges per row (a window and a
    prefix) against the eager golden, and two runs bitwise equal (the dK/dV chunks add in order)."""
    if not torch.cuda.is_available():
        pytest.fail("a gpu test needs CUDA")
    gen = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D = 1, 2048, 8, 2, 128
    q, k, v, do = (_randn(gen, B, S, h, D, device="cuda") for h in (Hq, Hkv, Hkv, Hq))
    dlse = _randn(gen, B, Hq, S, device="cuda")
    t = torch.arange(S)[None, :, None]
    ranges = torch.stack([torch.stack([(t - 300).clamp(min=0), t + 1], -1),
                          torch.stack([torch.zeros_like(t), t.clamp(max=100)], -1)], dim=-2)
    kw = dict(ranges=ranges.expand(B, S, Hkv, 2, 2).cuda(), causal=causal)
    gold = _selection_run("eager", torch.float64, q, k, v, do, dlse, **kw)
    naive = _selection_run("eager", torch.bfloat16, q, k, v, do, dlse, **kw)
    fast = _selection_run("triton", torch.bfloat16, q, k, v, do, dlse, **kw)
    _check(("out", "lse", "dq", "dk", "dv"), fast, naive, gold, torch.bfloat16)
    again = _selection_run("triton", torch.bfloat16, q, k, v, do, dlse, **kw)
    assert all(torch.equal(a, b) for a, b in zip(fast, again))


@pytest.mark.gpu
def test_gpu_nsa_bf16():
    """nsa_attention, compiled, S = 4096, GQA 16 / 1, against the golden with the blocks chosen in
    bf16 (the discrete choice is the same when fast and golden take the same list)."""
    if not torch.cuda.is_available():
        pytest.fail("a gpu test needs CUDA")
    gen = torch.Generator().manual_seed(1)
    B, S, Hq, Hkv, D = 1, 4096, 16, 1, 64
    tensors = tuple(_randn(gen, B, S, h, D, device="cuda") for h in (Hq, Hkv, Hkv))
    gates = torch.sigmoid(_randn(gen, B, S, Hq, 3, device="cuda"))
    cot = _randn(gen, B, S, Hq, D, device="cuda")
    kw = dict(compress_block=64, compress_stride=64, select_block=64, num_selected=64, window=512)
    fast = _nsa_run("triton", torch.bfloat16, tensors, gates, None, cot, **kw)
    naive = _nsa_run("eager", torch.bfloat16, tensors, gates, None, cot, **kw)
    gold = _nsa_run("eager", torch.float64, tensors, gates, None, cot, **kw)
    _check(("out", "dq", "dk", "dv", "dgates"), fast, naive, gold, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_determinism_and_default_geometry():
    """Compiled, S = 8192, the default geometry (compression 32 / 16, selection 64, window 512):
    two runs of nsa_attention forward and backward are bitwise equal, and select_blocks agrees with
    the eager definition away from near ties."""
    if not torch.cuda.is_available():
        pytest.fail("a gpu test needs CUDA")
    gen = torch.Generator().manual_seed(2)
    B, S, Hq, Hkv, D = 1, 8192, 16, 1, 128
    tensors = tuple(_randn(gen, B, S, h, D, device="cuda") for h in (Hq, Hkv, Hkv))
    gates = torch.sigmoid(_randn(gen, B, S, Hq, 3, device="cuda"))
    cot = _randn(gen, B, S, Hq, D, device="cuda")
    runs = [_nsa_run("triton", torch.bfloat16, tensors, gates, None, cot) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    q, k, v = (x.float() for x in tensors)
    kc, vc = torch_ref.compress_kv(k, v)
    _, lse = torch_ref.compression_attention(q, kc, vc, return_lse=True)
    fast = torch_ref.select_blocks(q, kc, lse, implementation="triton")
    head = spec.compressed_count(2048, 32, 16)  # the first 2048 queries see no other block
    imp = torch_ref.ops.nsa.reference.importance(q[:, :2048].double(), kc[:, :head].double(),
                                                  lse[..., :2048].double(), block=32, stride=16, select_block=64,
                                                  scale=D ** -0.5)
    slow = torch_ref.ops.nsa.reference.top_n(imp, 16, 64)
    agree = (fast[:, :2048] == slow).all(-1)
    assert agree.float().mean() > 0.99, agree.float().mean()


@pytest.mark.parametrize("S", [1, 5, 17])
def test_nsa_short_sequences(S):
    """Sequences shorter than a compression block (no compressed key: that branch is 0) and than a
    selection block: both implementations agree with the golden and give no NaN. S = 1: every row
    sees one key, so dq and dk are exactly 0 in the golden and in the naive run (autograd's
    p (g - p g) cancels exactly); a fused backward's dS = P (dP - delta) takes dP = dO.V and delta
    = dO.O in different summation orders (the softmax kernels do the same), so there the rule's
    allowance is 0 and dq, dk are held to the rounding of dO.V instead."""
    gen = torch.Generator().manual_seed(8)
    tensors = (_randn(gen, 1, S, 4, 16), _randn(gen, 1, S, 2, 16), _randn(gen, 1, S, 2, 16))
    gates, cot = torch.sigmoid(_randn(gen, 1, S, 4, 3)), _randn(gen, 1, S, 4, 16)
    kw = dict(compress_block=16, compress_stride=8, select_block=16, num_selected=1, window=4)
    gold = _nsa_run("eager", torch.float64, tensors, gates, None, cot, **kw)
    naive = _nsa_run("eager", torch.float32, tensors, gates, None, cot, **kw)
    names = ("out", "dq", "dk", "dv", "dgates")
    for impl in ("triton", "eager"):
        fast = _nsa_run(impl, torch.float32, tensors, gates, None, cot, **kw)
        if S == 1:
            assert all(float(gold[i].abs().max()) == 0 for i in (1, 2))
            bound = 4 * 16 * torch.finfo(torch.float32).eps * float(cot.abs().max() * tensors[2].abs().max())
            assert all(float(fast[i].abs().max()) <= bound for i in (1, 2)), [fast[i].abs().max() for i in (1, 2)]
            keep = (0, 3, 4)
            fast, naive_, gold_ = ([x[i] for i in keep] for x in (fast, naive, gold))
            _check([names[i] for i in keep], fast, naive_, gold_, torch.float32)
        else:
            _check(names, fast, naive, gold, torch.float32)


def test_fp32_dkdv_tiles_meet_the_accumulator_once(tmp_path):
    """The dK/dV kernel's fp32 products start from a zero Triton does not fold away: in TTIR (sm_90,
    compiled on the CPU by scripts/torch_ttir.py) the dk and dv dots accumulate into `acc * 0`, and
    one add meets the accumulator. Folded, the GPU's fp32 dot is an FMA chain from the accumulator,
    which took dk of an fp32 GQA-16 case to 1.5x the parity rule's allowance (docs/design/nsa.md).
    16-bit inputs keep the accumulating MMA."""
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "scripts" / "torch_ttir.py"), str(tmp_path), "--nsa-only"],
                   check=True, capture_output=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})

    def accumulators(dtype):  # for each tt.dot: the op that defines its accumulator (None: a block argument)
        text = (tmp_path / f"nsa_blocks16_{dtype}___dkv_kernel.ttir").read_text()
        defs = dict(re.findall(r"(%[\w.]+) = ([\w.]+) ", text))
        return [defs.get(acc) for acc in re.findall(r"= tt\.dot %[\w.]+, %[\w.]+, (%[\w.]+) ", text)]

    assert accumulators("float32").count("arith.mulf") == 2  # dk and dv
    assert "arith.mulf" not in accumulators("float16")
