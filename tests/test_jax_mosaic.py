"""implementation="mosaic_gpu": the Hopper kernels (Pallas Mosaic GPU, `jax_attn.ops.softmax.mosaic`),
forward and backward.

CPU: no interpreter runs a Mosaic GPU kernel here, so the kernel is lowered for CUDA (which traces
it through this jax's Mosaic GPU API) and the call is refused with its reason. Tests marked `gpu`
(sm90) run it against the float64 golden, forward and gradients."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_attn
from attn_spec import autotune as tuning
from jax_attn import flash_attention
from jax_attn.ops.common import visit
from jax_attn.ops.softmax import mosaic as mosaic_gpu
from jax_attn.ops.common.rope import Rope
from jax_attn.ops.common.spec import AttentionSpec, visible
from jax_golden import _inputs, _run, check_against_golden


@pytest.mark.parametrize("causal, head_dim, seq, kv_len, group", [
    (False, 128, 256, 256, 1), (True, 128, 256, 200, 2), (True, 64, 384, 384, 4), (False, 64, 256, 130, 1)])
def test_kernel_lowers_for_cuda(causal, head_dim, seq, kv_len, group):
    spec = AttentionSpec(scale=head_dim ** -0.5, causal=causal)
    blocks = mosaic_gpu.default_mosaic_block_sizes(head_dim)
    q = jax.ShapeDtypeStruct((2, seq, 2 * group, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, seq, 2, head_dim), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((2, 2 * group, seq), jnp.float32)
    f = jax.jit(lambda q, k, v: mosaic_gpu.flash_forward(q, k, v, spec, kv_len, blocks))
    assert "mosaic_gpu" in f.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    g = jax.jit(lambda *a: mosaic_gpu.flash_backward(*a, spec, kv_len, blocks))
    assert "mosaic_gpu" in g.trace(q, kv, kv, q, rows, rows).lower(lowering_platforms=("cuda",)).as_text()


def _shipped_mosaic_configs():
    """(causal, head dim, GQA group, MosaicBlockSizes) of every Mosaic config the package ships
    (`attn_spec/autotune_defaults.json`, JAX softmax entries), which config=None calls run."""
    out = []
    for key, entry in sorted(json.loads(tuning.SHIPPED.read_text())["entries"].items()):
        framework, _, variant, shape, _, flags = key.split("|")
        if framework == "jax" and variant == "softmax" and "mosaic" in entry["configs"]:
            head_dim, group = (int(part[1:]) for part in shape.split("-")[2:])
            blocks = tuning.config_from_json(entry["configs"]["mosaic"], mosaic_gpu.MosaicBlockSizes)
            out.append(pytest.param("causal=1" in flags, head_dim, group, blocks, id=f"{shape}-{flags.split(',')[1]}"))
    return out


SHIPPED_MOSAIC = _shipped_mosaic_configs()


@pytest.mark.parametrize("causal, head_dim, group, blocks", SHIPPED_MOSAIC)
def test_shipped_configs_lower_for_cuda(causal, head_dim, group, blocks):
    """Forward and backward at 1000 rows, padded to the config's multiples as the engine pads them."""
    spec = AttentionSpec(scale=head_dim ** -0.5, causal=causal)
    q_len, kv_len = (-(-1000 // m) * m for m in blocks.tiles)
    q = jax.ShapeDtypeStruct((1, q_len, 2 * group, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, kv_len, 2, head_dim), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1, 2 * group, q_len), jnp.float32)
    f = jax.jit(lambda q, k, v: mosaic_gpu.flash_forward(q, k, v, spec, 1000, blocks))
    assert "mosaic_gpu" in f.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    g = jax.jit(lambda *a: mosaic_gpu.flash_backward(*a, spec, 1000, blocks))
    assert "mosaic_gpu" in g.trace(q, kv, kv, q, rows, rows).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("style, head_dim, group", [("interleaved", 128, 2), ("half", 64, 1)])
def test_rope_kernels_lower_for_cuda(style, head_dim, group):
    spec = AttentionSpec(scale=head_dim ** -0.5, causal=True, rope=Rope(style=style))
    blocks = mosaic_gpu.default_mosaic_block_sizes(head_dim)
    q = jax.ShapeDtypeStruct((1, 256, 2 * group, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, head_dim), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1, 2 * group, 256), jnp.float32)
    tables = mosaic_gpu.rope_tables(spec.rope, head_dim, head_dim, 256)
    f = jax.jit(lambda *a: mosaic_gpu.flash_forward(*a[:3], spec, 200, blocks, a[3], rotated=True))
    assert "mosaic_gpu" in f.trace(q, kv, kv, tables).lower(lowering_platforms=("cuda",)).as_text()
    g = jax.jit(lambda *a: mosaic_gpu.flash_backward(*a[:6], spec, 200, blocks, a[6]))
    assert "mosaic_gpu" in g.trace(q, kv, kv, q, rows, rows, tables).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="block_q = block_q_bwd = block_k_bwd = 64"):
        mosaic_gpu.flash_forward(q, kv, kv, spec, 200, mosaic_gpu.MosaicBlockSizes(block_q=128), tables)


@pytest.mark.parametrize("has_next, keys", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("steps", range(8))
def test_next_head_schedule(monkeypatch, has_next, keys, steps):
    """`_NextHead`'s chunks as the RoPE forward's producer runs them (a completed-store wait at
    each step's start, `advance` after the step's refill, `finish` at the end), for streams of any
    length: each enabled chunk loads once into the one stage and is rotated before the next
    loads; a flag (q after chunk 1, keys after chunk 3) follows a completed-store wait after its
    last chunk's rotation (which stores it); nothing runs for a disabled chunk."""
    log = []

    class Recording(mosaic_gpu._NextHead):
        def __init__(self):
            self.has_next, self.keys = has_next, keys

        def _load(self, c):
            log.append(("load", c))

        def _rotate(self, c):
            log.append(("rotate", c))

        def _flag(self, c):
            return c

    monkeypatch.setattr(mosaic_gpu, "plgpu", SimpleNamespace(wait_smem_to_gmem=lambda *a, **k: log.append(("wait",))))
    ahead, publish = Recording(), lambda flag: log.append(("flag", flag))
    for t in range(steps):
        log.append(("wait",))  # `_SharedKeys.publish`, before the refill and `idle`
        ahead.advance(t, publish)
    ahead.finish(steps, publish)

    enabled = [c for c in range(mosaic_gpu._NextHead.CHUNKS) if (keys if c >= 2 else has_next)]
    assert [e for e in log if e[0] != "wait" and e[0] != "flag"] == [(k, c) for c in enabled for k in ("load", "rotate")]
    flags = [c for c in (1, 3) if c in enabled]
    assert [e[1] for e in log if e[0] == "flag"] == flags
    for c in flags:
        assert ("wait",) in log[log.index(("rotate", c)):log.index(("flag", c))]


def test_vmap_folds_into_the_grid_and_refuses_rope_clearly():
    """plgpu.kernel's batching rule folds a vmapped axis into the grid; the RoPE forward (a flags
    Ref, `pl.kernel`) cannot be vmapped and says so."""
    blocks = mosaic_gpu.default_mosaic_block_sizes(128)
    q = jax.ShapeDtypeStruct((3, 1, 256, 2, 128), jnp.bfloat16)
    for rope in (None, Rope(style="half")):
        spec = AttentionSpec(scale=0.1, causal=True, rope=rope)
        tables = mosaic_gpu.rope_tables(rope, 128, 128, 256) if rope else None
        f = jax.jit(jax.vmap(lambda q, k, v: mosaic_gpu.flash_forward(q, k, v, spec, 256, blocks, tables)))
        if rope is None:
            assert "mosaic_gpu" in f.trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
        else:
            with pytest.raises(NotImplementedError, match="cannot be vmapped"):
                f.trace(q, q, q)


@pytest.mark.parametrize("style, head_dim, head_pad", [("interleaved", 128, 128), ("half", 64, 64),
                                                       ("half", 40, 64), ("interleaved", 96, 128)])
def test_rope_tables_rotate_as_the_reference(style, head_dim, head_pad):
    """The kernels' rotation, (a, b) -> (a cos - b sin, b cos + a sin) per pair, cos/sin by angle
    addition from `rope_tables` (pairs in `_pair_order`), equals `apply_rope`; R^T undoes it. (On
    the GPU the golden tests run the kernels themselves.)"""
    from jax_attn.ops.common.padding import pad_head_dim
    from jax_attn.ops.common.rope import apply_rope, merge_pairs, split_pairs
    rope, length = Rope(style=style), 256
    spec = AttentionSpec(scale=1.0, rope=rope)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, length, 1, head_dim)), jnp.float32)
    base, delta = mosaic_gpu.rope_tables(rope, head_dim, head_pad, length)
    rows = jnp.arange(length)
    cos0, sin0, cos_d, sin_d = base[0][rows // 64], base[1][rows // 64], delta[0][rows % 64], delta[1][rows % 64]
    cos, sin = cos0 * cos_d - sin0 * sin_d, sin0 * cos_d + cos0 * sin_d
    if style == "interleaved":  # table column -> pair
        natural = jnp.argsort(mosaic_gpu._pair_order(head_pad // 2))
        cos, sin = cos[:, natural], sin[:, natural]
    a, b = split_pairs(pad_head_dim(x, spec, head_pad, True)[0, :, 0], style)
    rotated = merge_pairs(a * cos - b * sin, b * cos + a * sin, style)
    expected = pad_head_dim(apply_rope(x, None, rope), spec, head_pad, True)[0, :, 0]
    # both round fp32 angles of up to 256 rad (ulp 3e-5), at different points
    np.testing.assert_allclose(rotated, expected, atol=1e-4)
    ra, rb = split_pairs(rotated, style)
    np.testing.assert_allclose(merge_pairs(ra * cos + rb * sin, rb * cos - ra * sin, style),
                               merge_pairs(a, b, style), atol=1e-5)


def test_pair_order_matches_the_register_layout():
    """`_interleave` gives register g = 2 g' + e of a 64-column piece the table element (g', e); in
    the WGMMA layout lane l holds columns 2 (l % 4) + 8 g + {0, 1} (pair (l % 4) + 4 g), and a
    32-column table piece gives it columns 2 (l % 4) + 8 g' + e: `_pair_order` must store pair
    (l % 4) + 4 (2 g' + e) there."""
    order = np.asarray(mosaic_gpu._pair_order(64))
    for piece in range(2):
        for lane in range(32):
            for g_table in range(4):
                for e in range(2):
                    table_column = piece * 32 + 2 * (lane % 4) + 8 * g_table + e
                    g = 2 * g_table + e
                    assert order[table_column] == piece * 32 + (lane % 4) + 4 * g


@pytest.mark.parametrize("causal, window, q_len, kv_len", [
    (False, None, 300, 300), (True, None, 300, 300), (True, None, 200, 333), (True, None, 333, 200),
    (False, (64, 0), 256, 256), (True, (100, None), 500, 470), (False, (30, 70), 256, 300),
    (False, (0, 0), 129, 129), (True, (5, 3), 260, 260), (False, (None, 40), 300, 200)])
def test_visited_blocks_cover_the_mask(causal, window, q_len, kv_len):
    """The kernels' tile walk (`_partner_blocks`) against the element mask, both orientations: every
    visible pair lies in a visited block, every plain block is visible whole (real rows and
    partners; a padded key block is never plain), and the ranges grow with the block's first
    row (which the two warpgroups' shared stream relies on: each passes every step of the pair's
    stream, its own or `Ring.follow`'s, so their ring releases and ping-pong passages pair up)."""
    left, right = window or (None, None)
    spec = AttentionSpec(scale=1.0, causal=causal, window_left=left, window_right=right)
    rows, keys = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
    mask = np.asarray(visible(spec, rows, keys, kv_len))
    before, after = visit.reach(spec)
    for own, size, block, num_own, num_partner, orient, b, a, ragged in (
            ("rows", 64, 128, q_len, kv_len, mask, before, after, kv_len % 128 != 0),
            ("keys", 64, 64, kv_len, q_len, mask.T, after, before, False)):
        num = -(-num_partner // block)
        previous = (0, 0, 0, 0)
        for first in range(0, num_own, size):
            lo, plain_lo, plain_hi, hi = (int(x) for x in visit.partner_blocks(
                first, size, block, num, b, a, ragged))
            assert lo <= plain_lo <= plain_hi <= hi <= num, (own, first)
            assert all(x >= y for x, y in zip((lo, hi), (previous[0], previous[3]))), (own, first)
            previous = (lo, plain_lo, plain_hi, hi)
            tile = np.zeros((size, num * block), bool)
            part = orient[first:first + size]
            tile[:part.shape[0], :part.shape[1]] = part
            seen = tile.reshape(size, num, block).any(axis=(0, 2))
            assert not seen[:lo].any() and not seen[hi:].any(), (own, first)
            for j in range(plain_lo, plain_hi):  # padded own rows and partners may be anything
                assert part[:, j * block:(j + 1) * block].all(), (own, first, j)


@pytest.mark.parametrize("kw, needle", [
    (dict(softcap=5.0), "softcap"), (dict(rope=Rope(), positions=jnp.zeros((1, 64), jnp.int32)), "positions"),
    (dict(segment_ids=jnp.zeros((1, 64), jnp.int32)), "segment_ids")])
def test_refuses_what_it_does_not_serve(kw, needle):
    x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=needle):
        flash_attention(x, x, x, implementation="mosaic_gpu", **kw)


def test_refuses_dtype_head_dim_and_device():
    spec = AttentionSpec(scale=1.0)
    assert "float16 or bfloat16" in mosaic_gpu.unsupported_reason(spec, 128, jnp.float32)
    assert "head dims" in mosaic_gpu.unsupported_reason(spec, 129, jnp.bfloat16)
    assert "head dims" in mosaic_gpu.unsupported_reason(spec, 32, jnp.bfloat16)
    assert jax_attn.default_implementation(spec, 128, jnp.bfloat16) == (
        "mosaic" if mosaic_gpu.unsupported_reason(spec, 128, jnp.bfloat16) is None else "triton")
    if jax.default_backend() == "cpu":
        x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
        with pytest.raises(NotImplementedError, match="Hopper"):
            flash_attention(x, x, x, implementation="mosaic_gpu")


def test_default_rule_on_hopper(monkeypatch):
    """implementation=None: mosaic_gpu where it serves the call on an sm90 GPU, else pallas_triton."""
    hopper = jax_attn.DeviceInfo("gpu", "NVIDIA H100 (pretended)", (9, 0), None, 132)
    monkeypatch.setattr(mosaic_gpu, "device_info", lambda: hopper)
    pick = lambda dtype=jnp.bfloat16, head_dim=128, positions=False, **kw: jax_attn.default_implementation(
        AttentionSpec(scale=1.0, **kw), head_dim, dtype, positions)
    assert pick(causal=True) == pick(window_left=8, window_right=0) == pick(head_dim=40) == "mosaic"
    assert pick(rope=Rope()) == pick(rope=Rope(style="half"), head_dim=96) == "mosaic"
    assert pick(softcap=5.0) == pick(has_segments=True) == pick(rope=Rope(), positions=True) == "triton"
    assert pick(dtype=jnp.float32) == pick(head_dim=256) == pick(head_dim=32) == "triton"
    # RoPE pads each half of the pairs' columns: 34 -> 2 * 32, 32 -> 2 * 16
    assert pick(rope=Rope(), head_dim=34) == "mosaic" and pick(rope=Rope(), head_dim=32) == "triton"
    assert jax_attn.default_implementation() == "triton"  # no call described (stick-breaking)


def test_blocks_validated():
    with pytest.raises(ValueError, match="block_q=32 must be a multiple of 64"):
        mosaic_gpu.MosaicBlockSizes(block_q=32)
    with pytest.raises(ValueError, match="block_k_bwd=96"):
        mosaic_gpu.MosaicBlockSizes(block_k_bwd=96)
    with pytest.raises(ValueError, match="num_stages_bwd=1"):
        mosaic_gpu.MosaicBlockSizes(num_stages_bwd=1)


# ---------------------------------------------------------------------------------------------
# Compiled on a Hopper GPU (make test-gpu).
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    ((2, 1024, 1024, 8, 8, 128), jnp.bfloat16, dict(causal=True)),
    ((2, 1024, 1024, 8, 2, 128), jnp.float16, {}),
    ((1, 1000, 1000, 4, 2, 64), jnp.bfloat16, dict(causal=True)),  # ragged: padded rows and keys
    ((1, 777, 1111, 4, 1, 96), jnp.bfloat16, {}),  # Sq != Sk, head dim padded to 128
    ((1, 1111, 777, 4, 4, 128), jnp.bfloat16, dict(causal=True)),  # rows past Sk see every key
    ((1, 300, 300, 2, 1, 40), jnp.float16, dict(causal=True, scale=0.3)),
    ((1, 300, 700, 4, 2, 64), jnp.bfloat16, dict(causal=True)),  # keys past the last row: dK = dV = 0
    ((2, 1500, 1500, 8, 2, 128), jnp.bfloat16, dict(causal=True, window=(256, 0))),  # sliding window
    ((1, 1000, 1200, 4, 4, 64), jnp.float16, dict(window=(100, 37))),
    # RoPE at positions arange: the forward's CTAs rotate q tiles and key blocks one head ahead and
    # share them through gmem (`_NextHead`, `_SharedKeys`), which the backward reads; dQ, dK rotated back
    ((2, 1024, 1024, 8, 2, 128), jnp.bfloat16, dict(causal=True, rope=Rope())),
    ((1, 4096, 4096, 8, 2, 128), jnp.bfloat16, dict(causal=True, rope=Rope())),  # 2 waves: later CTAs load shared keys
    ((1, 1000, 1000, 4, 4, 128), jnp.bfloat16, dict(causal=True, rope=Rope(style="half"))),
    ((1, 777, 1111, 4, 1, 96), jnp.float16, dict(rope=Rope(style="half"))),  # halves padded apart
    ((1, 600, 600, 4, 2, 64), jnp.float16, dict(causal=True, window=(200, 0), rope=Rope(base=500.0))),
    # every head its own kv head: each head's CTAs rotate the next head's keys (`_NextHead`)
    ((1, 4096, 4096, 8, 8, 128), jnp.bfloat16, dict(causal=True, rope=Rope(style="half"))),
    ((1, 1111, 777, 4, 2, 64), jnp.float16, dict(causal=True, rope=Rope())),  # more query tiles than key blocks
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype, kw", GPU_CASES, ids=lambda x: str(x))
def test_gpu_against_golden(shape, dtype, kw):
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    check_against_golden(shape, dtype=dtype, implementation="mosaic_gpu", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, head_dim, group, blocks", SHIPPED_MOSAIC)
def test_gpu_shipped_configs_against_golden(causal, head_dim, group, blocks):
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    check_against_golden((1, 1000, 1000, 2 * group, 2, head_dim), jnp.bfloat16, implementation="mosaic_gpu",
                         config=blocks, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("rope", [None, Rope(style="half")])
def test_gpu_deterministic_and_close_to_triton(rope):
    """Bitwise repeatable; with RoPE, whichever CTA rotated a shared key block (2 waves of CTAs).
    Close to the Triton engine without RoPE (with it, the engines round differently rotated keys
    to bf16: the golden cases check both)."""
    rng = np.random.default_rng(3)
    q, k, v, do = _inputs(rng, 2, 2048, 2048, 8, 2, 128)
    runs = [_run(q, k, v, do, jnp.bfloat16, "mosaic_gpu", causal=True, rope=rope) for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert np.array_equal(a, b)
    if rope is not None:
        return
    triton = _run(q, k, v, do, jnp.bfloat16, "pallas_triton", causal=True)
    np.testing.assert_allclose(runs[0][1], triton[1], atol=1e-4)  # lse, fp32
    assert np.abs(runs[0][0] - triton[0]).max() <= 2 ** -7  # out: a bf16 rounding apart at most
