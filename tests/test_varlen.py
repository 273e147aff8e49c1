"""flash_attention_varlen (FlashAttention's cu_seqlens form) in both frameworks against a loop over
the sequences, each run alone with its bottom-right offsets: outputs and gradients, every
implementation, with and without a copy into the aligned layout."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_attn
import torch_ref
from torch_golden import DEVICE

CASES = {  # (cu_seqlens_q, cu_seqlens_k or None): lengths that differ per sequence, empty ones, q = k
    "longer_keys": ([0, 5, 12, 30], [0, 9, 12, 40]),
    "longer_queries_and_empty": ([0, 7, 7, 20], [0, 3, 10, 14]),
    "self": ([0, 10, 11, 25], None),
}
MASKS = {"causal": dict(causal=True), "window": dict(window=(4, 1)), "none": dict(),
         "causal_rope": dict(causal=True, rope="half")}


def _draw(cq, ck):
    rng = np.random.default_rng(7)
    q, do = rng.standard_normal((cq[-1], 4, 16)), rng.standard_normal((cq[-1], 4, 16))
    k, v = rng.standard_normal((ck[-1], 2, 16)), rng.standard_normal((ck[-1], 2, 16))
    return q, k, v, do


def _per_sequence(q, k, v, do, cq, ck, kw):
    """float64 golden: each sequence alone (q_offset / kv_offset align it bottom-right), then d(out . do)."""
    def loss(q, k, v):
        outs = []
        for s in range(len(cq) - 1):
            qs, ks, vs = q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]]
            if qs.shape[0] == 0:
                continue
            if ks.shape[0] == 0:  # no key: output 0
                outs.append(jnp.zeros_like(qs))
                continue
            lq, lk = qs.shape[0], ks.shape[0]
            outs.append(jax_attn.flash_attention(qs[None], ks[None], vs[None], q_offset=max(0, lk - lq),
                                                 kv_offset=max(0, lq - lk), implementation="xla", **kw)[0])
        return jnp.concatenate(outs)
    with jax.enable_x64(True):
        out, vjp = jax.vjp(loss, *(jnp.asarray(x) for x in (q, k, v)))
        return [np.asarray(x) for x in (out, *vjp(jnp.asarray(do)))]


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_varlen_equals_each_sequence_alone(name, mask):
    cq, ck = CASES[name]
    ck_all = cq if ck is None else ck
    q, k, v, do = _draw(cq, ck_all)
    kw = dict(MASKS[mask])
    style = kw.pop("rope", None)
    want = _per_sequence(q, k, v, do, cq, ck_all, dict(kw, rope=None if style is None else jax_attn.Rope(style=style)))
    for impl in ("xla", "triton"):
        f = lambda q, k, v: jax_attn.flash_attention_varlen(
            q, k, v, jnp.asarray(cq), None if ck is None else jnp.asarray(ck), implementation=impl,
            rope=None if style is None else jax_attn.Rope(style=style), **kw)
        with jax.default_matmul_precision("highest"):
            out, vjp = jax.vjp(f, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
            got = [out, *vjp(jnp.asarray(do, jnp.float32))]
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), w, atol=2e-5, err_msg=f"jax {impl}")
    for impl in ("eager", "triton"):
        t = [torch.tensor(x, dtype=torch.float32, device=DEVICE, requires_grad=True) for x in (q, k, v)]
        cu = lambda c: None if c is None else torch.tensor(c, dtype=torch.int32, device=DEVICE)
        out = torch_ref.flash_attention_varlen(*t, cu(cq), cu(ck), implementation=impl,
                                               rope=None if style is None else torch_ref.Rope(style=style), **kw)
        got = [out, *torch.autograd.grad(out, t, torch.tensor(do, dtype=torch.float32, device=DEVICE))]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.detach().cpu().numpy(), w, atol=2e-5, err_msg=f"torch {impl}")


def test_varlen_errors():
    x = jnp.zeros((10, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q must rise from 0 to the packed length 10"):
        jax_attn.flash_attention_varlen(x, x, x, jnp.asarray([0, 4, 9]))
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer"):
        jax_attn.flash_attention_varlen(x, x, x, jnp.asarray([0.0, 10.0]))
    with pytest.raises(ValueError, match="q must be 3-D"):
        jax_attn.flash_attention_varlen(x[None], x, x, jnp.asarray([0, 10]))
    t = torch.zeros(10, 2, 16)
    with pytest.raises(ValueError, match="cu_seqlens_k must rise from 0 to the packed length 10"):
        torch_ref.flash_attention_varlen(t, t, t, torch.tensor([0, 10]), torch.tensor([0, 3, 2, 10]))
    assert torch_ref.flash_attention_varlen(t, t, t, torch.tensor([0, 10])).shape == t.shape  # the boundary


def test_varlen_under_jit():
    """Traced cu_seqlens: checked by shape only; the aligned layout serves any values."""
    cq, ck = CASES["longer_keys"]
    q, k, v, _ = _draw(cq, ck)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)] + [jnp.asarray(cq), jnp.asarray(ck)]
    f = lambda q, k, v, cq, ck: jax_attn.flash_attention_varlen(q, k, v, cq, ck, causal=True, implementation="xla")
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(np.asarray(jax.jit(f)(*args)), np.asarray(f(*args)), atol=1e-6)


@pytest.mark.parametrize("aligned", [False, True])
def test_varlen_float64_under_x64(aligned):
    """The golden's setting (jax_enable_x64, under the suite's strict dtype promotion): the layout's
    indices stay int32 and the call matches the sequences run one by one."""
    rng = np.random.default_rng(3)
    cu_q, cu_k = np.array([0, 4, 10]), np.array([0, 3, 9]) if aligned else np.array([0, 4, 10])
    with jax.enable_x64(True):
        q = jnp.asarray(rng.standard_normal((10, 2, 8)))
        k = jnp.asarray(rng.standard_normal((int(cu_k[-1]), 2, 8)))
        out = jax_attn.flash_attention_varlen(q, k, k, jnp.asarray(cu_q), jnp.asarray(cu_k), causal=True,
                                              implementation="xla")
        for s in range(2):
            qs, ks = q[cu_q[s]:cu_q[s + 1]][None], k[cu_k[s]:cu_k[s + 1]][None]
            lq, lk = qs.shape[1], ks.shape[1]  # bottom-right
            alone = jax_attn.flash_attention(qs, ks, ks, causal=True, q_offset=max(0, lk - lq),
                                             kv_offset=max(0, lq - lk), implementation="xla")[0]
            np.testing.assert_allclose(np.asarray(out[cu_q[s]:cu_q[s + 1]]), np.asarray(alone), rtol=1e-12, atol=0)
