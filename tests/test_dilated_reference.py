"""The plain dilated references (JAX and PyTorch) against a brute-force NumPy definition, their
gradients against each other, and the configuration checks of `attn_spec.dilation`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from attn_spec.dilation import check_config
from jax_attn.ops.dilated.reference import dilated_reference
from torch_ref.ops.dilated import reference as torch_dilated


def brute_force(q, k, v, segment_lengths, dilation_rates, causal, merge, scale):
    """float64 NumPy, loops: the explicit key set of every row, one softmax over it. For the lse
    merge, one softmax over the union of the branches' key sets, a key in two branches counted twice."""
    batch, seq_len, heads, head_dim = q.shape
    group = heads // k.shape[2]
    num_branches = len(segment_lengths)
    out = np.zeros(q.shape)
    lse = np.full((batch, heads, seq_len), -np.inf)
    for h in range(heads):
        if merge == "lse":
            plan = [(w, r, h % r) for w, r in zip(segment_lengths, dilation_rates)]
        else:  # head group i runs branch i alone, offset i mod r_i
            i = h // (heads // num_branches)
            w, r = segment_lengths[i], dilation_rates[i]
            plan = [(w, r, i % r)]
        keys = [[] for _ in range(seq_len)]  # row -> its keys over all branches, with repeats
        for w, r, offset in plan:
            for start in range(0, seq_len, w):
                kept = [i for i in range(start, min(start + w, seq_len)) if (i - start) % r == offset]
                for i in kept:
                    keys[i] += [j for j in kept if not causal or j <= i]
        for b in range(batch):
            for i in range(seq_len):
                if not keys[i]:
                    continue
                js = np.array(keys[i])
                s = scale * k[b, js, h // group] @ q[b, i, h]
                p = np.exp(s - s.max())
                out[b, i, h] = p @ v[b, js, h // group] / p.sum()
                lse[b, h, i] = s.max() + np.log(p.sum())
    return out, lse


def _inputs(seed, batch, seq_len, heads, kv_heads, head_dim=8):
    rng = np.random.default_rng(seed)
    shapes = [(batch, seq_len, heads, head_dim), (batch, seq_len, kv_heads, head_dim),
              (batch, seq_len, kv_heads, head_dim), (batch, seq_len, heads, head_dim), (batch, heads, seq_len)]
    return [rng.standard_normal(s) for s in shapes]  # q, k, v, d_out, d_lse


def _jax(q, k, v, do, dlse, **cfg):
    """out, lse, dq, dk, dv in float64 through jax.vjp with cotangents (do, dlse)."""
    def run(q, k, v, do, dlse):
        (out, lse), vjp = jax.vjp(lambda q, k, v: dilated_reference(q, k, v, **cfg), q, k, v)
        return (out, lse, *vjp((do, dlse)))

    with jax.enable_x64(True), jax.default_matmul_precision("highest"):  # jit: one compile, not one per op
        res = jax.jit(run)(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, do, dlse)))
        return [np.asarray(x) for x in res]


def _torch(q, k, v, do, dlse, **cfg):
    """out, lse, dq, dk, dv in float64 through torch.autograd.grad with cotangents (do, dlse)."""
    q, k, v = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    out, lse = torch_dilated.attention(q, k, v, **cfg)
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.tensor(do), torch.tensor(dlse)))
    return [x.detach().numpy() for x in (out, lse, *grads)]


# (batch, seq_len, heads, kv_heads, segment_lengths, dilation_rates, merge)
CONFIGS = [
    (2, 13, 2, 2, (5, 7), (2, 3), "lse"),        # S a multiple of no segment, segments coprime
    (1, 37, 4, 2, (5, 7), (2, 3), "lse"),        # GQA
    (1, 37, 4, 2, (4, 64), (1, 4), "lse"),       # r = 1, a segment longer than the sequence
    (2, 13, 4, 2, (6, 3), (3, 1), "head_groups"),
    (1, 37, 4, 2, (8, 100), (4, 3), "head_groups"),
    (1, 3, 4, 1, (8,), (4,), "lse"),             # S < r: head 3 keeps no row
    (1, 1, 2, 1, (2, 3), (1, 2), "lse"),         # one row
    (1, 20, 4, 4, (5, 4, 10, 20), (1, 2, 5, 4), "head_groups"),  # one head per group
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,seq_len,heads,kv_heads,lengths,rates,merge", CONFIGS)
def test_references_match_brute_force(batch, seq_len, heads, kv_heads, lengths, rates, merge, causal):
    q, k, v, do, dlse = _inputs(seq_len * heads, batch, seq_len, heads, kv_heads)
    cfg = dict(segment_lengths=lengths, dilation_rates=rates, causal=causal, merge=merge, scale=0.4)
    want_out, want_lse = brute_force(q, k, v, lengths, rates, causal, merge, 0.4)
    jax_res, torch_res = _jax(q, k, v, do, dlse, **cfg), _torch(q, k, v, do, dlse, **cfg)
    for name, res in (("jax", jax_res), ("torch", torch_res)):
        out, lse = res[:2]
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12, err_msg=f"{name} out")
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse), err_msg=f"{name} lse -inf rows")
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12, err_msg=f"{name} lse")
    for name, a, b in zip(("dq", "dk", "dv"), jax_res[2:], torch_res[2:]):
        assert np.isfinite(a).all() and np.isfinite(b).all(), name
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_rows_kept_by_no_branch(causal):
    """One branch w=4, r=2 over 11 rows: head h keeps rows of parity h mod 2, the other rows are kept
    by no branch (out 0, lse -inf) and the gradients stay finite and agree."""
    q, k, v, do, dlse = _inputs(3, 2, 11, 4, 2)
    cfg = dict(segment_lengths=(4,), dilation_rates=(2,), causal=causal, merge="lse", scale=0.3)
    jax_res, torch_res = _jax(q, k, v, do, dlse, **cfg), _torch(q, k, v, do, dlse, **cfg)
    dropped = (np.arange(11)[None, :] % 2) != (np.arange(4)[:, None] % 2)  # [H, S]
    for res in (jax_res, torch_res):
        out, lse = res[:2]
        assert (out.transpose(0, 2, 1, 3)[:, dropped] == 0).all()
        assert np.isneginf(lse[:, dropped]).all() and np.isfinite(lse[:, ~dropped]).all()
        assert all(np.isfinite(g).all() for g in res[2:])
        # q rows kept by no branch get no gradient
        assert (res[2].transpose(0, 2, 1, 3)[:, dropped] == 0).all()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), jax_res, torch_res):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jax_dtypes(dtype):
    """Out in q's dtype, lse in float32; close to the float64 golden."""
    q, k, v, _, _ = _inputs(5, 1, 13, 4, 2)
    cfg = dict(segment_lengths=(5, 7), dilation_rates=(2, 3), causal=True, scale=0.4)
    for merge in ("lse", "head_groups"):
        f = jax.jit(lambda q, k, v: dilated_reference(q, k, v, merge=merge, **cfg))
        out, lse = f(*(jnp.asarray(x, dtype) for x in (q, k, v)))
        assert out.dtype == dtype and lse.dtype == jnp.float32
        want_out, _ = brute_force(*(np.asarray(jnp.asarray(x, dtype), np.float64) for x in (q, k, v)),
                                  cfg["segment_lengths"], cfg["dilation_rates"], True, merge, 0.4)
        tol = 1e-5 if dtype == jnp.float32 else 5e-2
        np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_dtypes(dtype):
    q, k, v, _, _ = _inputs(5, 1, 13, 4, 2)
    cfg = dict(segment_lengths=(5, 7), dilation_rates=(2, 3), causal=True, scale=0.4)
    for merge in ("lse", "head_groups"):
        out, lse = torch_dilated.attention(*(torch.tensor(x).to(dtype) for x in (q, k, v)), merge=merge, **cfg)
        assert out.dtype == dtype and lse.dtype == torch.float32
        want_out, _ = brute_force(*(torch.tensor(x).to(dtype).double().numpy() for x in (q, k, v)),
                                  cfg["segment_lengths"], cfg["dilation_rates"], True, merge, 0.4)
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        np.testing.assert_allclose(out.double().numpy(), want_out, atol=tol)


@pytest.mark.parametrize("args,match", [
    (((4, 8), (1,), "lse", 4), "segment_lengths and dilation_rates must have the same count"),
    (((), (), "lse", 4), "segment_lengths must not be empty"),
    (((4,), [], "lse", 4), "dilation_rates must not be empty"),
    (((0, 8), (1, 1), "lse", 4), "segment_lengths must hold positive ints"),
    (((4, 8), (1, -2), "lse", 4), "dilation_rates must hold positive ints"),
    (((4.0,), (1,), "lse", 4), "segment_lengths must hold positive ints"),
    (((4,), (1.5,), "lse", 4), "dilation_rates must hold positive ints"),
    (((True,), (1,), "lse", 4), "segment_lengths must hold positive ints"),
    (((4,), (True,), "lse", 4), "dilation_rates must hold positive ints"),
    ((4, (1,), "lse", 4), "segment_lengths must be a sequence"),
    (("48", (1, 1), "lse", 4), "segment_lengths must be a sequence"),
    (((4, 8), (5, 1), "lse", 4), "dilation_rates: rate 5 is larger than its segment length 4"),
    (((4,), (1,), "sum", 4), "merge must be one of"),
    (((4, 8), (1, 2), None, 4), "merge must be one of"),
    (((4, 8, 16), (1, 2, 4), "head_groups", 2), "merge='head_groups'.*2 heads.*branch count 3"),
    (((4, 8, 16), (1, 2, 4), "head_groups", 4), "merge='head_groups'.*4 heads.*branch count 3"),
])
def test_check_config_errors(args, match):
    with pytest.raises(ValueError, match=match):
        check_config(*args)


def test_check_config_boundaries():
    assert check_config((4, 8), (4, 8), "lse", 1) == ((4, 8), (4, 8))  # rate == segment
    assert check_config([np.int64(5)], (np.int32(1),), "lse", 3) == ((5,), (1,))
    assert check_config((4, 8, 16), (1, 2, 4), "head_groups", 3) == ((4, 8, 16), (1, 2, 4))  # K == H
    assert check_config((4, 8), (1, 2), "head_groups", 6) == ((4, 8), (1, 2))
    assert check_config((4, 8, 16), (1, 2, 4), "lse", 1) == ((4, 8, 16), (1, 2, 4))  # lse: any head count


def test_reference_refuses_bad_calls():
    q = np.zeros((1, 6, 2, 4))
    k = np.zeros((1, 5, 2, 4))
    cfg = dict(segment_lengths=(4,), dilation_rates=(2,), causal=False, merge="lse", scale=1.0)
    with pytest.raises(ValueError, match="Sq == Sk"):
        dilated_reference(jnp.asarray(q, jnp.float32), *(jnp.asarray(k, jnp.float32),) * 2, **cfg)
    with pytest.raises(ValueError, match="Sq == Sk"):
        torch_dilated.attention(torch.tensor(q), *(torch.tensor(k),) * 2, **cfg)
    with pytest.raises(ValueError, match="dilation_rates"):
        dilated_reference(*(jnp.asarray(q, jnp.float32),) * 3, **{**cfg, "dilation_rates": (5,)})
    with pytest.raises(ValueError, match="merge"):
        torch_dilated.attention(*(torch.tensor(q),) * 3, **{**cfg, "merge": "mean"})
