"""The NSA record: Native Sparse Attention's operations (`attn_spec/nsa.py`) in both frameworks (JAX
triton / xla, torch triton / eager), one operation per case (`op=`):

- "selection": `selection_attention` with block lists (messy: -1, repeats, past the frontier or the
  sequence), with lists and per-row counts, or with `[start, end)` ranges; segment ids (packed
  sequences); causal or not. Compared: out, lse, dq, dk, dv (a random cotangent on lse).
- "compression": `compress_kv` (mean pooling, or the MLP of `CompressParams`) then
  `compression_attention`. Compared: out, lse, dq, dk, dv and, for the MLP, the gradient of every
  compression parameter ("d cmp_k.w1", ...).
- "select": `select_blocks` on the framework's own compressed keys and compression lse.
  Compared: the chosen blocks ("blocks", int32 as float: any difference is an error of >= 1).
- "nsa": `nsa_attention` with gates (in (0, 1)). Compared: out, dq, dk, dv, dgates and the
  compression parameters' gradients (MLP).

The implementation under test runs every operation of the case (compression attention and selection
included); the compression map has one implementation (plain ops in both frameworks).

Selection is discrete: a block near the n-th importance could be chosen in float64 and not in fp16,
which would be an O(1) difference no tolerance describes. The "select" and "nsa" cases therefore
choose blocks robustly, by design: every visible block (num_selected = the block count), only the
forced ones (num_selected = 3: block 0 and the two local blocks), in fp32 (random near-ties are
far below fp32 rounding at these sizes), or with "boosted" blocks (`boost=`): every query gets a
component c along the first feature and the keys of the boosted blocks the same (the others 0),
c * c * scale = 4, so the boosted blocks' importance is e^4 times the others' and they, with the
forced ones, fill the n slots of every row that has a choice (`_check_boost` verifies that at
definition time). Segment ids are sorted (packed sequences): the frameworks agree on what a
compression block straddling two segments is only there (JAX: first and last id equal; torch:
all ids equal).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_attn
import jax_attn.registry
import torch_ref
from attn_spec import nsa
from parity import variants as v
from parity.cases import Case, case, segment_ids

OPS = ("selection", "compression", "select", "nsa")
FIELDS = nsa.CompressParams._fields
BOOST_LOGIT = 4.0  # c * c * scale: the boosted compressed keys' score above the others'


def _param_names(mlp: bool) -> tuple[str, ...]:
    return tuple(f"d cmp_{kv}.{f}" for kv in ("k", "v") for f in FIELDS) if mlp else ()


def case_quantities(c: Case) -> tuple[str, ...]:
    kw = dict(c.kwargs)
    op, mlp = kw["op"], kw.get("hidden") is not None
    if op == "selection":
        return "out", "lse", "dq", "dk", "dv"
    if op == "compression":
        return ("out", "lse", "dq", "dk", "dv", *_param_names(mlp))
    if op == "select":
        return ("blocks",)
    return ("out", "dq", "dk", "dv", "dgates", *_param_names(mlp))


class NSAInputs(NamedTuple):
    """Float64 NumPy inputs of an NSA case (None where the operation takes no such input)."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    dlse: np.ndarray  # [B, Hq, S]
    gates: np.ndarray | None  # [B, S, Hq, 3] in (0, 1)
    params: tuple | None  # 10 arrays: CompressParams for k, then for v
    block_indices: np.ndarray | None  # int32 [B, S, Hkv, n]
    block_counts: np.ndarray | None  # int32 [B, S, Hkv]
    ranges: np.ndarray | None  # int32 [B, S, Hkv, R, 2]
    segment_ids: np.ndarray | None  # int32 [B, S], sorted


def _check_boost(seq_len: int, select_block: int, n: int, boost) -> None:
    """Every row with more visible blocks than slots sees enough boosted blocks besides the forced
    ones to fill its slots (so its choice does not rest on near-equal importances)."""
    boost = set(boost)
    for own in range(nsa.selection_count(seq_len, select_block)):
        if own + 1 <= n:
            continue  # every visible block is chosen
        forced = {0, own - 1, own}
        free = {j for j in boost if j <= own} - forced
        if len(free) < n - len(forced):
            raise ValueError(f"boost={sorted(boost)} leaves rows of block {own} a choice among near-equal "
                             f"importances (n={n}, select_block={select_block}, S={seq_len})")


def _nsa_case(name, shape, op, dtype="float32", **kw) -> Case:
    """Shape (B, S, Hq, Hkv, D). kw: the operation's arguments (see the module docstring), plus
    `hidden` (the compression MLP's width; None: mean pooling), `boost` (boosted selection blocks),
    `segments` ("packed" or None), `gpu`, `quick`, `slow`."""
    b, s, hq, hkv, d = shape
    assert op in OPS, op
    if kw.get("boost") is not None:
        _check_boost(s, kw["select_block"], kw["num_selected"], kw["boost"])
        kw["boost"] = tuple(kw["boost"])
    return case(name, (b, s, s, hq, hkv, d), dtype, variant="nsa", stat_grad=op in ("selection", "compression"),
                op=op, **kw)


def _messy_indices(rng, batch, seq_len, kv_heads, n, block_size):
    """Block lists with every kind of ignored entry (-1, beyond the frontier, past the sequence,
    repeated); slot 0 holds the row's own block, so most rows see some keys."""
    num = nsa.selection_count(seq_len, block_size)
    idx = rng.integers(-1, num + 1, (batch, seq_len, kv_heads, n))
    idx[..., 0] = np.arange(seq_len)[None, :, None] // block_size
    if n > 2:
        idx[..., 1] = idx[..., 2]  # a repeat
    return idx.astype(np.int32)


def _ranges(rng, batch, seq_len, kv_heads, count):
    """[start, end) ranges: range 0 ends at the row (a local band), the others random, some empty,
    some overlapping, some past the row (causal clips them)."""
    start = rng.integers(0, seq_len + 1, (batch, seq_len, kv_heads, count))
    end = np.minimum(seq_len, start + rng.integers(0, 20, start.shape))
    t = np.arange(seq_len)[None, :, None]
    start[..., 0], end[..., 0] = np.maximum(0, t - rng.integers(0, 6, (batch, seq_len, kv_heads))), t + 1
    return np.stack([start, end], axis=-1).astype(np.int32)


def _compress_params(rng, block, head_dim, hidden):
    """One CompressParams' arrays, at scales that keep the MLP's output O(1)."""
    return (0.5 * rng.standard_normal((block, head_dim)),
            rng.standard_normal((block * head_dim, hidden)) / np.sqrt(block * head_dim),
            0.1 * rng.standard_normal(hidden),
            rng.standard_normal((hidden, head_dim)) / np.sqrt(hidden),
            0.1 * rng.standard_normal(head_dim))


def draw(c: Case) -> NSAInputs:
    kw = dict(c.kwargs)
    rng = np.random.default_rng(c.seed)
    b, s, _, hq, hkv, d = c.shape
    q = rng.standard_normal((b, s, hq, d))
    k = rng.standard_normal((b, s, hkv, d))
    vv = rng.standard_normal((b, s, hkv, d))
    do = rng.standard_normal((b, s, hq, d))
    dlse = rng.standard_normal((b, hq, s))
    seg = segment_ids(c, rng)
    op = kw["op"]
    gates = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, s, hq, 3)))) if op == "nsa" else None
    params = None
    if kw.get("hidden") is not None:
        params = (*_compress_params(rng, kw["block"], d, kw["hidden"]),
                  *_compress_params(rng, kw["block"], d, kw["hidden"]))
    indices = counts = ranges = None
    if op == "selection":
        if kw["form"] == "ranges":
            ranges = _ranges(rng, b, s, hkv, kw["n"])
        else:
            indices = _messy_indices(rng, b, s, hkv, kw["n"], kw["block_size"])
            if kw["form"] == "counts":
                counts = rng.integers(0, kw["n"] + 1, (b, s, hkv)).astype(np.int32)
    if kw.get("boost") is not None:
        c_amp = np.sqrt(BOOST_LOGIT / _scale(c))
        q[..., 0] = c_amp
        k[..., 0] = 0.0
        for j in kw["boost"]:
            k[:, j * kw["select_block"]:(j + 1) * kw["select_block"], :, 0] = c_amp
    return NSAInputs(q, k, vv, do, dlse, gates, params, indices, counts, ranges, seg)


def _scale(c: Case) -> float:
    return dict(c.kwargs).get("scale") or c.shape[5] ** -0.5


def _compress_kwargs(kw) -> dict:
    return dict(block=kw["block"], stride=kw["stride"])


def _nsa_kwargs(kw) -> dict:
    return dict(compress_block=kw["block"], compress_stride=kw["stride"], select_block=kw["select_block"],
                num_selected=kw["num_selected"], window=kw["window"], scale=kw.get("scale"))


# --------------------------------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------------------------------
def run_jax(c: Case, implementation: str, dtype: str, inputs: NSAInputs) -> list:
    kw = dict(c.kwargs)
    op = kw["op"]
    jdt = v.JAX_DTYPES[dtype]
    cast = lambda x: jnp.asarray(x, jdt)
    ints = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    seg = ints(inputs.segment_ids)
    params = () if inputs.params is None else tuple(cast(p) for p in inputs.params)
    pair = lambda flat: (nsa.CompressParams(*flat[:5]), nsa.CompressParams(*flat[5:])) if flat else None

    if op == "selection":
        # the block lists are arguments, not constants: XLA would constant-fold their sort for minutes
        lists = (ints(inputs.block_indices), ints(inputs.block_counts), ints(inputs.ranges), seg)

        def f(q, k, vv, lists):
            indices, counts, ranges, segment_ids = lists
            return jax_attn.selection_attention(
                q, k, vv, indices, counts, ranges=ranges, block_size=kw.get("block_size", 64),
                causal=kw.get("causal", True), scale=kw.get("scale"), segment_ids=segment_ids, return_lse=True,
                implementation=implementation)
        (out, lse), vjp = jax.vjp(lambda q, k, vv: jax.jit(f)(q, k, vv, lists), cast(inputs.q), cast(inputs.k),
                                  cast(inputs.v))
        grads = vjp((cast(inputs.do), jnp.asarray(inputs.dlse, v.JAX_DTYPES[v.stat_dtype(dtype)])))
        return [v.to_numpy(x) for x in (out, lse, *grads)]

    if op == "compression":
        def f(q, k, vv, *flat):
            k_cmp, v_cmp = jax_attn.compress_kv(k, vv, params=pair(flat), **_compress_kwargs(kw))
            return jax_attn.compression_attention(q, k_cmp, v_cmp, scale=kw.get("scale"), segment_ids=seg,
                                                  return_lse=True, implementation=implementation,
                                                  **_compress_kwargs(kw))
        (out, lse), vjp = jax.vjp(jax.jit(f), cast(inputs.q), cast(inputs.k), cast(inputs.v), *params)
        grads = vjp((cast(inputs.do), jnp.asarray(inputs.dlse, v.JAX_DTYPES[v.stat_dtype(dtype)])))
        return [v.to_numpy(x) for x in (out, lse, *grads)]

    if op == "select":
        @jax.jit
        def f(q, k, vv):
            k_cmp, v_cmp = jax_attn.compress_kv(k, vv, **_compress_kwargs(kw))
            _, lse = jax_attn.compression_attention(q, k_cmp, v_cmp, scale=kw.get("scale"), return_lse=True,
                                                    implementation=implementation, **_compress_kwargs(kw))
            return jax_attn.select_blocks(q, k_cmp, lse, select_block=kw["select_block"],
                                          num_selected=kw["num_selected"], scale=kw.get("scale"),
                                          implementation=implementation, **_compress_kwargs(kw))
        return [v.to_numpy(f(cast(inputs.q), cast(inputs.k), cast(inputs.v)))]

    def f(q, k, vv, gates, *flat):
        return jax_attn.nsa_attention(q, k, vv, gates, compress_params=pair(flat), segment_ids=seg,
                                      implementation=implementation, **_nsa_kwargs(kw))
    out, vjp = jax.vjp(jax.jit(f), cast(inputs.q), cast(inputs.k), cast(inputs.v), cast(inputs.gates), *params)
    return [v.to_numpy(x) for x in (out, *vjp(cast(inputs.do)))]


# --------------------------------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------------------------------
def run_torch(c: Case, implementation: str, dtype: str, inputs: NSAInputs, device="cpu") -> list:
    kw = dict(c.kwargs)
    op = kw["op"]
    tdt = v.TORCH_DTYPES[dtype]
    leaf = lambda x: torch.tensor(x, dtype=tdt, device=device, requires_grad=True)
    ints = lambda x: None if x is None else torch.tensor(x, dtype=torch.int32, device=device)
    seg = ints(inputs.segment_ids)
    q, k, vv = leaf(inputs.q), leaf(inputs.k), leaf(inputs.v)
    params = [] if inputs.params is None else [leaf(p) for p in inputs.params]
    pair = (nsa.CompressParams(*params[:5]), nsa.CompressParams(*params[5:])) if params else None
    do = torch.tensor(inputs.do, dtype=tdt, device=device)

    if op == "selection":
        out, lse = torch_ref.selection_attention(
            q, k, vv, ints(inputs.block_indices), ints(inputs.block_counts), ranges=ints(inputs.ranges),
            block_size=kw.get("block_size", 64), causal=kw.get("causal", True), scale=kw.get("scale"),
            segment_ids=seg, return_lse=True, implementation=implementation)
        dlse = torch.tensor(inputs.dlse, dtype=lse.dtype, device=device)
        grads = torch.autograd.grad((out, lse), (q, k, vv), (do, dlse))
        return [v.to_numpy(x) for x in (out, lse, *grads)]

    if op == "compression":
        k_cmp, v_cmp = torch_ref.compress_kv(k, vv, params=pair, **_compress_kwargs(kw))
        out, lse = torch_ref.compression_attention(q, k_cmp, v_cmp, scale=kw.get("scale"), segment_ids=seg,
                                                   return_lse=True, implementation=implementation,
                                                   **_compress_kwargs(kw))
        dlse = torch.tensor(inputs.dlse, dtype=lse.dtype, device=device)
        grads = torch.autograd.grad((out, lse), (q, k, vv, *params), (do, dlse))
        return [v.to_numpy(x) for x in (out, lse, *grads)]

    if op == "select":
        with torch.no_grad():
            k_cmp, v_cmp = torch_ref.compress_kv(k, vv, **_compress_kwargs(kw))
            _, lse = torch_ref.compression_attention(q, k_cmp, v_cmp, scale=kw.get("scale"), return_lse=True,
                                                     implementation=implementation, **_compress_kwargs(kw))
            blocks = torch_ref.select_blocks(q, k_cmp, lse, select_block=kw["select_block"],
                                             num_selected=kw["num_selected"], scale=kw.get("scale"),
                                             implementation=implementation, **_compress_kwargs(kw))
        return [v.to_numpy(blocks)]

    gates = leaf(inputs.gates)
    out = torch_ref.nsa_attention(q, k, vv, gates, compress_params=pair, segment_ids=seg,
                                  implementation=implementation, **_nsa_kwargs(kw))
    grads = torch.autograd.grad(out, (q, k, vv, gates, *params), do)
    return [v.to_numpy(x) for x in (out, *grads)]


def jax_call(c: Case):
    spec = jax_attn.AttentionSpec(scale=1.0, causal=dict(c.kwargs).get("causal", True),
                                  has_segments=c.segments is not None)
    return jax_attn.registry.Call(spec, c.shape[5], jnp.dtype(c.dtype))


def _sel(name, shape, form, block_size, n, dtype="float32", **kw):
    return _nsa_case(name, shape, "selection", dtype, form=form, block_size=block_size, n=n, **kw)


def _cmp(name, shape, block, stride, hidden=None, dtype="float32", **kw):
    return _nsa_case(name, shape, "compression", dtype, block=block, stride=stride, hidden=hidden, **kw)


def _full(name, shape, block, stride, select_block, num_selected, window, hidden=None, dtype="float32", **kw):
    return _nsa_case(name, shape, "nsa", dtype, block=block, stride=stride, select_block=select_block,
                     num_selected=num_selected, window=window, hidden=hidden, **kw)


CASES = (
    # selection: lists (messy), lists with counts (rows with count 0 see nothing), ranges, packed
    # sequences, not causal; GQA 1, 2, 4, 16; fp32 and fp16; odd lengths
    _sel("nsa_sel_lists_gqa2_s37", (1, 37, 4, 2, 16), "lists", 8, 4, quick=True),
    _sel("nsa_sel_lists_mha_fp16_s29", (2, 29, 2, 2, 16), "lists", 8, 3, "float16"),
    _sel("nsa_sel_counts_gqa4_s45", (1, 45, 8, 2, 32), "counts", 16, 3),
    _sel("nsa_sel_counts_gqa2_fp16_s51", (1, 51, 4, 2, 16), "counts", 8, 5, "float16", scale=0.3),
    _sel("nsa_sel_ranges_gqa16_s33", (1, 33, 16, 1, 16), "ranges", 16, 3),
    _sel("nsa_sel_ranges_not_causal_gqa4_fp16_s50", (1, 50, 4, 1, 32), "ranges", 16, 3, "float16", causal=False),
    _sel("nsa_sel_varlen_lists_gqa2_s67", (2, 67, 4, 2, 16), "lists", 16, 3, segments="packed", quick=True),
    _sel("nsa_sel_varlen_ranges_mha_fp16_s41", (1, 41, 2, 2, 16), "ranges", 16, 2, "float16", segments="packed"),
    _sel("nsa_sel_lists_gqa16_fp16_s41", (1, 41, 16, 1, 16), "lists", 8, 3, "float16"),
    # compression: mean pooling and the MLP (gradients to its parameters), overlapping or not, packed
    _cmp("nsa_cmp_mean_gqa2_s45", (1, 45, 4, 2, 16), 16, 8, quick=True),
    _cmp("nsa_cmp_mlp_gqa4_s61", (1, 61, 8, 2, 16), 8, 4, hidden=24, quick=True),
    _cmp("nsa_cmp_mlp_varlen_mha_fp16_s70", (2, 70, 2, 2, 16), 16, 16, hidden=16, dtype="float16",
         segments="packed"),
    _cmp("nsa_cmp_mean_gqa16_fp16_s53", (1, 53, 16, 1, 16), 8, 8, dtype="float16"),
    # top-n: boosted blocks (fp16: the choice rests on clear margins), random importances (fp32)
    _nsa_case("nsa_select_boosted_overlap_fp16_s130", (1, 130, 4, 2, 16), "select", "float16", block=16, stride=8,
              select_block=16, num_selected=5, boost=(1, 3)),
    _nsa_case("nsa_select_random_gqa4_s100", (2, 100, 8, 2, 16), "select", block=8, stride=4, select_block=8,
              num_selected=6),
    # the whole of NSA with gates: every block, only the forced ones, boosted, random (fp32)
    _full("nsa_all_blocks_mlp_gqa2_s45", (1, 45, 4, 2, 16), 16, 8, 16, 3, 8, hidden=16, quick=True),
    _full("nsa_boosted_mean_gqa4_fp16_s130", (1, 130, 8, 2, 16), 16, 8, 16, 5, 16, dtype="float16", boost=(1, 3)),
    _full("nsa_forced_mlp_varlen_mha_s67", (2, 67, 2, 2, 16), 8, 4, 8, 3, 0, hidden=8, segments="packed"),
    _full("nsa_random_gqa16_s77", (1, 77, 16, 1, 16), 8, 4, 8, 5, 12),
    # fp16 with the MLP in the compression-only cases: in the whole of NSA the compression biases'
    # gradients sum every row's rounded fp16 terms, where the naive fp16 runs of the two frameworks'
    # identical references already err 2.5x apart (4.9e-4 and 1.2e-3 at S = 59): a tolerance edge
    _full("nsa_forced_mlp_gqa4_s59", (1, 59, 4, 1, 32), 16, 16, 8, 3, 10, hidden=16),
    # GPU only: realistic sizes in bf16 / fp16 (the goldens are dense [B, Hkv, G, S, S] float64)
    _sel("nsa_gpu_sel_lists_bf16_8k_gqa4", (1, 8192, 4, 1, 128), "lists", 64, 16, "bfloat16", gpu=True),
    _sel("nsa_gpu_sel_counts_fp16_4k_gqa16", (1, 4096, 16, 1, 64), "counts", 64, 16, "float16", gpu=True),
    _sel("nsa_gpu_sel_ranges_bf16_2k_gqa2", (2, 2048, 8, 4, 64), "ranges", 64, 8, "bfloat16", gpu=True),
    _sel("nsa_gpu_sel_varlen_bf16_4k_mha", (1, 4096, 4, 4, 128), "lists", 64, 16, "bfloat16", segments="packed",
         gpu=True),
    _cmp("nsa_gpu_cmp_mlp_bf16_4k_gqa4", (1, 4096, 8, 2, 128), 32, 16, hidden=128, dtype="bfloat16", gpu=True),
    _cmp("nsa_gpu_cmp_mean_varlen_bf16_8k_gqa4", (1, 8192, 4, 1, 64), 32, 16, dtype="bfloat16",
         segments="packed", gpu=True),
    _nsa_case("nsa_gpu_select_boosted_bf16_4k", (1, 4096, 16, 2, 64), "select", "bfloat16", block=32, stride=16,
              select_block=64, num_selected=16, boost=tuple(range(1, 14)), gpu=True),
    _full("nsa_gpu_boosted_bf16_2k_gqa8", (1, 2048, 16, 2, 64), 32, 16, 64, 16, 512, dtype="bfloat16",
          boost=tuple(range(1, 14)), gpu=True),
    _full("nsa_gpu_forced_mlp_bf16_4k_gqa4", (1, 4096, 8, 2, 128), 32, 16, 64, 3, 512, hidden=128,
          dtype="bfloat16", gpu=True),
    # (packed sequences: blocks of other segments have importance 0, so only the forced choice is robust)
    _full("nsa_gpu_forced_varlen_fp16_4k_gqa16", (1, 4096, 16, 1, 64), 32, 16, 64, 3, 256, dtype="float16",
          segments="packed", gpu=True),
)

# The test grid (tests/test_records.py): the same cases, the CPU ones outside --quick in the slow tier.
GRID = tuple(dataclasses.replace(c, slow=not (c.quick or c.gpu)) for c in CASES)

NSA = v.VariantRecord(
    name="nsa",
    quantities=("out", "lse", "dq", "dk", "dv", "dgates", "blocks", *_param_names(True)),
    forward=("out", "lse", "blocks"), draw=draw, run_jax=run_jax, run_torch=run_torch, jax_call=jax_call,
    cases=CASES, grid=GRID, case_quantities=case_quantities)
