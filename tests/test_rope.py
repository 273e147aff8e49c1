"""Fused RoPE, both frameworks: what the softmax grid (tests/test_softmax.py, which runs the RoPE
cases of `parity.variants.softmax` on every implementation) does not cover — the relative-position
property, fused == rotate-then-attend, default and packed positions, the rotation's definition,
the Rope config and the input errors of each framework."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_golden as jg
from jax_attn import Rope, apply_rope, flash_attention
from torch_golden import DEVICE, F16, F32, F64, NAMES, Case, _assert_rule, _run, _to, randn_inputs
from torch_ref import Rope as TorchRope
from torch_ref import apply_rope as torch_apply_rope
from torch_ref import flash_attention as torch_flash_attention
from torch_ref import flash_attention_reference
from torch_ref.ops.common.rope import inverse_frequencies

# ---------------------------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------------------------

STYLES = ["interleaved", "half"]


@pytest.mark.parametrize("style", STYLES)
def test_jax_rope_is_relative(style):
    """Shifting every position by a constant leaves the attention output unchanged."""
    rng = np.random.default_rng(2)
    q, k, v, _ = (jnp.asarray(x, jnp.float32) for x in jg._inputs(rng, 1, 40, 40, 2, 2, 32))
    pos = jnp.arange(40, dtype=jnp.int32)[None]
    with jax.default_matmul_precision("highest"):
        a = flash_attention(q, k, v, causal=True, rope=Rope(style=style), positions=pos)
        b = flash_attention(q, k, v, causal=True, rope=Rope(style=style), positions=pos + 37)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_jax_fused_equals_rotate_then_attend():
    """The fused kernel computes what rotating in XLA and calling the plain kernel computes."""
    rng = np.random.default_rng(3)
    q, k, v, _ = (jnp.asarray(x, jnp.float32) for x in jg._inputs(rng, 1, 50, 50, 4, 2, 64))
    pos = jnp.broadcast_to(jnp.arange(50, dtype=jnp.int32), (1, 50))
    rope = Rope(style="half")
    with jax.default_matmul_precision("highest"):
        fused = flash_attention(q, k, v, causal=True, rope=rope)
        unfused = flash_attention(apply_rope(q, pos, rope), apply_rope(k, pos, rope), v, causal=True)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(unfused), rtol=1e-5, atol=1e-6)


def test_rope_errors():
    x = jnp.ones((1, 8, 2, 16), jnp.float32)
    odd = jnp.ones((1, 8, 2, 15), jnp.float32)
    with pytest.raises(ValueError, match=r"unknown rope style='neox'"):
        Rope(style="neox")
    with pytest.raises(ValueError, match=r"rope base must be a number > 1"):
        Rope(base=1.0)
    with pytest.raises(ValueError, match=r"head dim must be even for RoPE, got D=15"):
        flash_attention(odd, odd, odd, rope=Rope())
    with pytest.raises(ValueError, match=r"positions are given but rope is None"):
        flash_attention(x, x, x, positions=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(TypeError, match=r"rope must be a jax_attn.Rope"):
        flash_attention(x, x, x, rope="half")
    with pytest.raises(ValueError, match=r"q positions must have shape \(1, 8\)"):
        flash_attention(x, x, x, rope=Rope(), positions=jnp.zeros((1, 9), jnp.int32))
    with pytest.raises(TypeError, match=r"q positions must be an integer array"):
        flash_attention(x, x, x, rope=Rope(), positions=jnp.zeros((1, 8)))
    short = jnp.ones((1, 6, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"single positions array needs Sq == Sk"):
        flash_attention(x, short, short, rope=Rope(), positions=jnp.zeros((1, 8), jnp.int32))
    # boundary: the smallest even head dim passes
    two = jnp.ones((1, 8, 2, 2), jnp.float32)
    assert flash_attention(two, two, two, rope=Rope()).shape == (1, 8, 2, 2)


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RCase(Case):
    """A torch softmax case with RoPE."""

    style: str = "interleaved"
    base: float = 10000.0
    # None: default positions (arange); "packed": one [B, S] tensor restarting at 0 in each segment
    # (with those segment ids); "pair": (q_pos, kv_pos), q placed after a per-batch prefix of k;
    # "large": a pair of unsorted positions up to 20000; "pair_empty": a pair of positions with
    # segment ids where the last q rows have no key (out 0, lse -inf, zero gradients).
    pos: str | None = None

    def __str__(self):
        parts = [f"B{self.B}", f"{self.Sq}x{self.Sk}", f"H{self.Hq}/{self.Hkv}", f"D{self.D}",
                 str(self.dtype).replace("torch.", ""), self.style]
        for flag in ("base", "pos", "causal", "window", "softcap", "lse_grad"):
            val = getattr(self, flag)
            if val not in (None, False) and not (flag == "base" and val == 10000.0):
                parts.append(flag if val is True else f"{flag}={val}")
        return "-".join(parts)


def _packed_positions(ids: torch.Tensor) -> torch.Tensor:
    """Per-token positions restarting at 0 where the (sorted) segment id changes."""
    idx = torch.arange(ids.shape[1]).expand_as(ids)
    start = torch.ones_like(ids, dtype=torch.bool)
    start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def _positions_and_segments(case: RCase, gen: torch.Generator):
    B, Sq, Sk = case.B, case.Sq, case.Sk
    if case.pos is None:
        return None, None
    if case.pos == "packed":
        assert Sq == Sk
        ids = torch.sort(torch.randint(0, 3, (B, Sq), generator=gen), dim=1).values
        return _packed_positions(ids), ids
    if case.pos == "pair":
        prefix = torch.randint(0, 50, (B, 1), generator=gen)
        kv_pos = torch.arange(Sk)[None] + prefix
        q_pos = torch.arange(Sq)[None] + prefix + max(Sk - Sq, 0)
        return (q_pos.to(torch.int32), kv_pos), None
    if case.pos == "large":
        return (torch.randint(0, 20000, (B, Sq), generator=gen), torch.randint(0, 20000, (B, Sk), generator=gen)), None
    if case.pos == "pair_empty":
        q_ids = torch.sort(torch.randint(0, 2, (B, Sq), generator=gen), dim=1).values
        kv_ids = torch.sort(torch.randint(0, 2, (B, Sk), generator=gen), dim=1).values
        q_ids[:, -5:] = 2  # no key has id 2
        return (_packed_positions(q_ids), _packed_positions(kv_ids)), (q_ids, kv_ids)
    raise AssertionError(case.pos)


def _inputs(case: RCase, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do, dl = randn_inputs(gen, (case.B, case.Sq, case.Hq, case.D), (case.B, case.Sk, case.Hkv, case.D),
                                   (case.B, case.Hq, case.Sq), case.lse_grad)
    positions, seg = _positions_and_segments(case, gen)
    return q, k, v, do, dl, positions, seg


def _kwargs(case: RCase, positions, seg):
    return dict(causal=case.causal, window=case.window, softcap=case.softcap, segment_ids=seg,
                rope=TorchRope(base=case.base, style=case.style), positions=positions)


def _three(case: RCase, device=DEVICE, seed=0):
    q, k, v, do, dl, positions, seg = (_to(x, device) for x in _inputs(case, seed))
    kw = _kwargs(case, positions, seg)
    gold = _run("eager", F64, q, k, v, do, dl, kw)
    naive = _run("eager", case.dtype, q, k, v, do, dl, kw)
    fast = _run("triton", case.dtype, q, k, v, do, dl, kw)
    return fast, naive, gold


def test_torch_rope_relative_positions():
    """Scores depend on p_i - p_j only: shifting every position by a constant leaves the result
    unchanged (float64 reference: to rounding; Triton with shifted positions: held to the rule
    against the golden of the unshifted positions)."""
    case = RCase(2, 40, 40, 2, 1, 40, F32, style="half", pos="packed", causal=True)
    q, k, v, do, dl, positions, seg = (_to(x, DEVICE) for x in _inputs(case, seed=4))
    shift = 1000
    kw = _kwargs(case, positions, seg)
    kw_shift = dict(kw, positions=positions + shift)
    gold = _run("eager", F64, q, k, v, do, dl, kw)
    gold_shift = _run("eager", F64, q, k, v, do, dl, kw_shift)
    for name in NAMES:
        torch.testing.assert_close(gold_shift[name], gold[name], rtol=1e-9, atol=1e-9)
    naive_shift = _run("eager", F32, q, k, v, do, dl, kw_shift)
    fast_shift = _run("triton", F32, q, k, v, do, dl, kw_shift)
    _assert_rule(fast_shift, naive_shift, gold, F32)
    # and the rotation is not a no-op: a per-token (non-constant) change of positions changes out
    kw_other = dict(kw, positions=positions * 2)
    assert (_run("triton", F32, q, k, v, do, dl, kw_other)["out"] - fast_shift["out"]).abs().max() > 1e-2


@pytest.mark.parametrize("style,dtype", [("interleaved", F16), ("half", F32)], ids=["interleaved-f16", "half-f32"])
def test_torch_fused_equals_rotate_then_attend(style, dtype):
    """Fused RoPE == rotate q, k with the eager helper (in the compute dtype), then the Triton
    kernels without rope (gradients through the helper by autograd), within the rule."""
    case = RCase(1, 33, 47, 6, 2, 72, dtype, style=style, pos="pair", causal=True)
    q, k, v, do, dl, (q_pos, kv_pos), _ = (_to(x, DEVICE) for x in _inputs(case, seed=2))
    rope = TorchRope(style=style)
    gold = _run("eager", F64, q, k, v, do, dl, dict(causal=True, rope=rope, positions=(q_pos, kv_pos)))
    fused = _run("triton", dtype, q, k, v, do, dl, dict(causal=True, rope=rope, positions=(q_pos, kv_pos)))
    qq, kk, vv = (x.to(dtype).detach().requires_grad_() for x in (q, k, v))
    out, lse = torch_flash_attention(torch_apply_rope(qq, q_pos, rope), torch_apply_rope(kk, kv_pos, rope), vv, causal=True,
                               return_lse=True, implementation="triton")
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), do.to(dtype))
    unfused = dict(out=out.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv)
    _assert_rule(fused, unfused, gold, dtype)
    _assert_rule(unfused, fused, gold, dtype)


def test_rope_default_positions_and_determinism():
    """positions=None is arange for q and k (bitwise the same as passing them); runs are bitwise
    repeatable (GQA: the dK/dV kernel sums the group's q heads in a fixed order)."""
    B, S, Hq, Hkv, D = 1, 37, 4, 2, 40
    gen = torch.Generator().manual_seed(9)
    q, k, v, do = (torch.randn(B, S, h, D, generator=gen).to(DEVICE) for h in (Hq, Hkv, Hkv, Hq))
    rope = TorchRope(style="interleaved")
    pos = torch.arange(S, device=DEVICE).expand(B, S)
    a = _run("triton", F32, q, k, v, do, None, dict(causal=True, rope=rope))
    b = _run("triton", F32, q, k, v, do, None, dict(causal=True, rope=rope, positions=pos))
    c = _run("triton", F32, q, k, v, do, None, dict(causal=True, rope=rope, positions=(pos, pos.to(torch.int16))))
    for name in NAMES:
        assert torch.equal(a[name], b[name]), name
        assert torch.equal(a[name], c[name]), name


def test_packed_sequences_equal_separate_runs():
    """Two sequences packed into one row (segment ids, positions restarting at 0) give the same
    out, lse and gradients as each sequence run alone with default positions."""
    lens = (13, 20)
    S, Hq, Hkv, D = sum(lens), 4, 2, 16
    gen = torch.Generator().manual_seed(8)
    q, k, v, do = (torch.randn(1, S, h, D, generator=gen).to(DEVICE) for h in (Hq, Hkv, Hkv, Hq))
    ids = torch.tensor([[0] * lens[0] + [1] * lens[1]], device=DEVICE)
    pos = _packed_positions(ids.cpu()).to(DEVICE)
    assert pos[0, :lens[0]].tolist() == list(range(lens[0])) and pos[0, lens[0]:].tolist() == list(range(lens[1]))
    rope = TorchRope(style="half")
    packed = _run("triton", F32, q, k, v, do, None, dict(causal=True, rope=rope, positions=pos, segment_ids=ids))
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        alone = _run("triton", F32, q[:, sl], k[:, sl], v[:, sl], do[:, sl], None, dict(causal=True, rope=rope))
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(packed[name][:, sl], alone[name], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed["lse"][:, :, sl], alone["lse"], rtol=1e-5, atol=1e-5)
        start += n


def test_apply_rope_definition():
    """The eager rotation against the formula written out (both styles; float64)."""
    gen = torch.Generator().manual_seed(1)
    B, S, H, D = 2, 5, 3, 8
    x = torch.randn(B, S, H, D, generator=gen, dtype=F64)
    pos = torch.randint(-3, 50, (B, S), generator=gen)
    theta = 10000.0 ** (-torch.arange(0, D // 2, dtype=F64) * 2 / D)
    assert torch.allclose(inverse_frequencies(D, 10000.0, F64), theta, rtol=1e-15, atol=0)
    ang = pos.to(F64)[:, :, None, None] * theta
    for style, (ia, ib) in (("interleaved", (slice(0, D, 2), slice(1, D, 2))),
                            ("half", (slice(0, D // 2), slice(D // 2, D)))):
        y = torch_apply_rope(x, pos, TorchRope(style=style))
        torch.testing.assert_close(y[..., ia], x[..., ia] * ang.cos() - x[..., ib] * ang.sin(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(y[..., ib], x[..., ia] * ang.sin() + x[..., ib] * ang.cos(), rtol=1e-12, atol=1e-12)
        # position 0 is the identity; the rotation preserves each pair's norm
        assert torch.equal(torch_apply_rope(x, torch.zeros_like(pos), TorchRope(style=style)), x)
        torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)


def _t(*shape, dtype=F32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def _i(*shape, dtype=torch.int32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


Q, KV, KV9 = (1, 8, 4, 16), (1, 8, 2, 16), (1, 9, 2, 16)
INVALID = [
    # (name, shapes (q, kv), kwargs, exception, message)
    ("rope str", (Q, KV), dict(rope="half"), TypeError, r"rope must be a torch_ref.Rope or None, got str"),
    ("rope odd D", ((1, 8, 4, 15), (1, 8, 2, 15)), dict(rope=TorchRope()), ValueError,
     r"head dim must be even for RoPE, got D=15"),
    ("positions no rope", (Q, KV), dict(positions=_i(1, 8)), ValueError, r"positions given without rope"),
    ("positions float", (Q, KV), dict(rope=TorchRope(), positions=_t(1, 8)), TypeError,
     r"positions must have an integer dtype, got torch.float32"),
    ("positions bool", (Q, KV), dict(rope=TorchRope(), positions=_i(1, 8, dtype=torch.bool)), TypeError,
     r"positions must have an integer dtype, got torch.bool"),
    ("positions numpy", (Q, KV), dict(rope=TorchRope(), positions=np.zeros((1, 8), np.int32)), TypeError,
     r"positions must be an integer torch.Tensor of shape \[1, 8\], got ndarray"),
    ("positions shape", (Q, KV), dict(rope=TorchRope(), positions=_i(1, 7)), ValueError,
     r"positions must have shape \[B, S\] = \[1, 8\], got \[1, 7\]"),
    ("positions 1-D", (Q, KV), dict(rope=TorchRope(), positions=_i(8)), ValueError,
     r"positions must have shape \[B, S\] = \[1, 8\], got \[8\]"),
    ("positions single cross", (Q, KV9), dict(rope=TorchRope(), positions=_i(1, 8)), ValueError,
     r"a single positions tensor needs Sq == Sk.*Sq=8, Sk=9.*pair \(q_pos, kv_pos\)"),
    ("positions pair kv shape", (Q, KV9), dict(rope=TorchRope(), positions=(_i(1, 8), _i(1, 8))), ValueError,
     r"positions\[1\] \(kv_pos\) must have shape \[B, S\] = \[1, 9\], got \[1, 8\]"),
    ("positions pair q dtype", (Q, KV9), dict(rope=TorchRope(), positions=(_t(1, 8), _i(1, 9))), TypeError,
     r"positions\[0\] \(q_pos\) must have an integer dtype, got torch.float32"),
    ("positions triple", (Q, KV), dict(rope=TorchRope(), positions=(_i(1, 8),) * 3), ValueError,
     r"positions must be one \[B, S\] tensor or a pair \(q_pos, kv_pos\), got a sequence of length 3"),
]


@pytest.mark.parametrize("name,shapes,kwargs,exc,match", INVALID, ids=[c[0] for c in INVALID])
@pytest.mark.parametrize("impl", ["triton", "eager"])
def test_rope_invalid_arguments(name, shapes, kwargs, exc, match, impl):
    q, kv = _t(*shapes[0]), _t(*shapes[1])
    with pytest.raises(exc, match=match):
        torch_flash_attention(q, kv, kv, implementation=impl, **kwargs)
    if impl == "eager":
        with pytest.raises(exc, match=match):
            flash_attention_reference(q, kv, kv, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(style="rotate"), r"unknown rope style='rotate'; choose one of \('interleaved', 'half'\)"),
    (dict(style="HALF"), r"unknown rope style='HALF'"),
    (dict(base=1.0), r"rope base must be a number > 1, got base=1.0"),
    (dict(base=-5), r"rope base must be a number > 1, got base=-5"),
    (dict(base="10000"), r"rope base must be a number > 1, got base='10000'"),
])
def test_rope_config_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TorchRope(**kwargs)


def test_rope_config_defaults_and_frozen():
    r = TorchRope()
    assert (r.base, r.style) == (10000.0, "interleaved")
    assert TorchRope(base=1.5, style="half").base == 1.5 and TorchRope(base=10).base == 10  # boundary: any base > 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.base = 2.0
    assert TorchRope(500000.0, "half") == TorchRope(base=500000.0, style="half")


@pytest.mark.parametrize("impl", ["triton", "eager"])
def test_rope_boundary_arguments_pass(impl):
    """The edges that are accepted: D = 2 (the smallest even head dim), D = 256 (the widest),
    negative positions, int16 / int64 positions of different dtypes in a pair, base just above 1;
    each against the float64 golden."""
    gen = torch.Generator().manual_seed(6)
    for D, Sq, Sk in ((2, 9, 13), (256, 5, 7)):
        q = torch.randn(1, Sq, 2, D, generator=gen).to(DEVICE)
        kv = torch.randn(1, Sk, 1, D, generator=gen).to(DEVICE)
        q_pos = torch.randint(-40, 40, (1, Sq), generator=gen, dtype=torch.int16).to(DEVICE)
        kv_pos = torch.randint(-40, 40, (1, Sk), generator=gen).to(DEVICE)
        for rope in (TorchRope(base=1.001, style="half"), TorchRope(style="interleaved")):
            kw = dict(rope=rope, positions=(q_pos, kv_pos), causal=True)
            out, lse = torch_flash_attention(q, kv, kv, return_lse=True, implementation=impl, **kw)
            gold, gold_lse = flash_attention_reference(q.double(), kv.double(), kv.double(), **kw)
            assert out.shape == q.shape and torch.isfinite(out).all()
            torch.testing.assert_close(out.double(), gold, rtol=1e-4, atol=2e-5)
            torch.testing.assert_close(lse.double(), gold_lse, rtol=1e-4, atol=2e-5)
    # a single positions tensor with Sq == Sk, and no rope with positions=None, still work
    x = torch.randn(1, 6, 2, 4, generator=gen).to(DEVICE)
    torch_flash_attention(x, x, x, rope=TorchRope(), positions=torch.arange(6, device=DEVICE)[None], implementation=impl)
    assert torch.equal(torch_flash_attention(x, x, x, rope=None, positions=None, implementation=impl),
                       torch_flash_attention(x, x, x, implementation=impl))
