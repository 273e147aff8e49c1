"""The stick-breaking record: `stick_breaking_attention` (ExpoSB, causal) in both frameworks, with a
learnable decay (float32 leaf; float64 in the golden), attend_current either way, segment ids
(packed sequences) and queries that are the last Sq of Sk key positions.

Compared: out, rem, dq, dk, dv and d decay (a random cotangent on rem unless the case says not).
The decay gradient's fp32 error is mostly the logits' own rounding carried through one sum: one
number's error is a single draw of that noise, for the plain fp32 run as for a kernel, and the
tolerance rule, which compares maxima, would compare two draws. So d decay is compared per head
(a case's scalar broadcast; `tests/test_stick_breaking.py` holds a shared decay's gradient to the
sum of the per-head ones) and for DECAY_DRAWS cotangents (the case's and more drawn from its seed):
[DECAY_DRAWS, Hq] (docs/design/parity.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_attn
import jax_attn.registry
import torch_ref
from parity.cases import Case, case, draw
from parity import variants as v


def _sb_case(name, shape, dtype="float32", rope=None, stat_grad=True, **kw) -> Case:
    """Shape (B, S, Hq, Hkv, D) or (B, Sq, Sk, Hq, Hkv, D); rope (style, base) or None; decay=float
    or per-head tuple; attend_current=True; segments (`parity.cases.SEGMENTS`)."""
    b, sq, sk, hq, hkv, d = shape if len(shape) == 6 else (shape[0], shape[1], *shape[1:])
    return case(name, (b, sq, sk, hq, hkv, d), dtype, variant="stick_breaking", rope=rope, stat_grad=stat_grad, **kw)


def per_head_decay(case: Case) -> np.ndarray:
    """The case's decay as [Hq] float64 (a scalar broadcast)."""
    return np.array(np.broadcast_to(np.asarray(case.decay, np.float64), (case.shape[3],)))


DECAY_DRAWS = 4


def cotangents(case: Case, inputs) -> list[tuple]:
    """(do, d rem) pairs: the case's own, then DECAY_DRAWS - 1 more from the case's seed."""
    rng = np.random.default_rng(case.seed + 1)
    pairs = [(inputs.do, inputs.dstat)]
    for _ in range(DECAY_DRAWS - 1):
        do = rng.standard_normal(inputs.do.shape)
        pairs.append((do, rng.standard_normal(inputs.dstat.shape) if case.stat_grad else np.zeros_like(inputs.dstat)))
    return pairs


def run_jax(case: Case, implementation: str, dtype: str, inputs) -> list:
    q, k, vv, _, _, seg, pos = inputs  # the cotangents: `cotangents`
    cast = lambda x: jnp.asarray(x, v.JAX_DTYPES[dtype])
    stat = v.JAX_DTYPES[v.stat_dtype(dtype)]
    extra = {} if case.rope is None else dict(rope=jax_attn.Rope(style=case.rope[0], base=case.rope[1]),
                                             positions=v.jax_ints(pos))

    def f(q, k, vv, decay):
        return jax_attn.stick_breaking_attention(q, k, vv, decay=decay, segment_ids=v.jax_ints(seg),
                                                 return_remainder=True, implementation=implementation,
                                                 **case.call_kwargs(), **extra)

    (out, rem), vjp = jax.vjp(jax.jit(f), cast(q), cast(k), cast(vv), jnp.asarray(per_head_decay(case), stat))
    grads = [vjp((cast(do), jnp.asarray(dstat, stat))) for do, dstat in cotangents(case, inputs)]
    return [v.to_numpy(x) for x in (out, rem, *grads[0][:3])] + [np.stack([v.to_numpy(g[3]) for g in grads])]


def run_torch(case: Case, implementation: str, dtype: str, inputs, device="cpu") -> list:
    q, k, vv, _, _, seg, pos = inputs
    tdt = v.TORCH_DTYPES[dtype]
    leaf = lambda x, dt=tdt: torch.tensor(x, dtype=dt, device=device, requires_grad=True)
    leaves = [leaf(q), leaf(k), leaf(vv), leaf(per_head_decay(case), v.TORCH_DTYPES[v.stat_dtype(dtype)])]
    extra = {} if case.rope is None else dict(rope=torch_ref.Rope(style=case.rope[0], base=case.rope[1]),
                                             positions=v.torch_ints(pos, device))
    out, rem = torch_ref.stick_breaking_attention(*leaves[:3], decay=leaves[3], segment_ids=v.torch_ints(seg, device),
                                                  return_remainder=True, implementation=implementation,
                                                  **case.call_kwargs(), **extra)
    pairs = [(torch.tensor(do, dtype=tdt, device=device), torch.tensor(dstat, dtype=rem.dtype, device=device))
             for do, dstat in cotangents(case, inputs)]
    grads = [torch.autograd.grad((out, rem), leaves, pair, retain_graph=True) for pair in pairs]
    return [v.to_numpy(x) for x in (out, rem, *grads[0][:3])] + [np.stack([v.to_numpy(g[3]) for g in grads])]


def jax_call(case: Case):
    rope = None if case.rope is None else jax_attn.Rope(style=case.rope[0], base=case.rope[1])
    spec = jax_attn.AttentionSpec(scale=1.0, causal=True, rope=rope, has_segments=case.segments is not None,
                                  offset=case.shape[2] - case.shape[1])
    pair = case.positions == "pair_random" or (rope is not None and case.shape[1] != case.shape[2])
    return jax_attn.registry.Call(spec, case.shape[5], jnp.dtype(case.dtype), positions=case.positions is not None,
                                  kv_positions=pair)


CASES = (
    # Stick-breaking (ExpoSB): strictly causal; out, rem, dq, dk, dv and d decay, with a cotangent on rem.
    _sb_case("sb_gqa", (1, 77, 4, 2, 32), quick=True),
    _sb_case("sb_decay_per_head_d48", (2, 64, 4, 4, 48), decay=(0.0, 0.02, 0.1, 0.5)),
    _sb_case("sb_rope_interleaved_mqa", (1, 70, 6, 1, 32), rope=("interleaved", 10000.0), decay=0.05),
    _sb_case("sb_rope_half_packed_positions", (2, 72, 4, 2, 40), rope=("half", 500.0),
             positions="restart_per_segment", decay=0.01),
    _sb_case("sb_fp16", (1, 64, 2, 2, 64), "float16", decay=0.01),
    _sb_case("sb_bf16_2k_gqa", (2, 2048, 8, 2, 128), "bfloat16", gpu=True),
    _sb_case("sb_bf16_4k_rope_decay", (1, 4096, 4, 4, 128), "bfloat16", rope=("half", 10000.0),
             decay=(0.0, 0.001, 0.01, 0.1), gpu=True),
    _sb_case("sb_fp16_1k_d64", (2, 1000, 8, 8, 64), "float16", decay=0.01, gpu=True),
    _sb_case("sb_fp32_1k", (1, 1024, 4, 2, 128), gpu=True),
    # fla-org's / shawntan's options: the diagonal, packed sequences, decoding against a longer prefix
    _sb_case("sb_attend_current_gqa", (1, 70, 4, 2, 32), decay=0.05, attend_current=True, quick=True),
    _sb_case("sb_packed_rope_restart", (2, 80, 4, 2, 32), segments="packed", rope=("half", 10000.0),
             positions="restart_per_segment", decay=0.02),
    _sb_case("sb_prefix_fp16", (1, 24, 90, 4, 2, 64), "float16", decay=(0.0, 0.01, 0.05, 0.1), attend_current=True),
    _sb_case("sb_bf16_2k_packed_attend_current", (2, 2048, 8, 2, 128), "bfloat16", segments="packed",
             attend_current=True, decay=0.01, gpu=True),
    _sb_case("sb_fp16_decode_1x4k", (2, 1, 4096, 8, 2, 128), "float16", decay=0.01, gpu=True),
)

_HEADS = {2: (0.0, 0.3), 4: (0.0, 0.1, 0.2, 0.3)}  # per-head decay (head 0: none), as linspace(0, 0.3, Hq)

# The awkward-shape grid: S = 1, 17, 31, 33, 37, 45, 50, 64, 100 against tiles of 16 / 32 / 64, GQA / MQA,
# head dims 16 to 80 (48, 80: padded), decay 0 / scalar / per head, RoPE both styles with default,
# restarting and pair positions, cotangents on rem or not; fp32 and fp16 (bf16 on the GPU).
GRID = (
    _sb_case("ragged_37", (1, 37, 2, 2, 32), seed=0),
    _sb_case("gqa_per_head_decay", (2, 50, 4, 2, 32), decay=(0.0, 0.05, 0.2, 1.0), seed=0),
    _sb_case("mqa_scalar_decay_d48", (1, 33, 4, 1, 48), decay=0.1, seed=0),
    _sb_case("single_token", (1, 1, 2, 2, 16), seed=0),
    _sb_case("d80_17", (1, 17, 1, 1, 80), decay=0.3, seed=0),
    *(_sb_case(f"rope_{style}_per_head_decay", (1, 40, 4, 2, 32), rope=(style, 500.0), decay=(0.0, 0.1, 0.0, 0.4),
               seed=0)
      for style in ("interleaved", "half")),
    _sb_case("rope_restart_positions", (1, 45, 2, 2, 32), rope=("interleaved", 10000.0), positions="restart_halfway",
             decay=0.05, seed=0),
    _sb_case("fp16_64", (1, 64, 2, 2, 64), "float16", decay=0.02, seed=0),
    # (from the torch grid)
    _sb_case("single_token_mqa_no_rem_grad", (1, 1, 2, 1, 16), stat_grad=False),
    _sb_case("single_token_fp16_per_head", (2, 1, 4, 2, 32), "float16", decay=_HEADS[4]),
    _sb_case("s17_fp16", (1, 17, 2, 2, 16), "float16"),
    _sb_case("s17_gqa_no_rem_grad", (2, 17, 4, 2, 32), decay=0.1, stat_grad=False),
    _sb_case("s100_mqa_fp16_per_head", (1, 100, 4, 1, 64), "float16", decay=_HEADS[4], slow=True),
    _sb_case("s100_rope_interleaved_d48", (1, 100, 2, 2, 48), rope=("interleaved", 10000.0), stat_grad=False,
             slow=True),
    _sb_case("s45_rope_half_restart_d80_fp16", (1, 45, 4, 2, 80), "float16", decay=0.07, rope=("half", 10000.0),
             positions="restart_halfway", stat_grad=False),
    _sb_case("s33_rope_half_pair_mqa", (2, 33, 2, 1, 64), decay=_HEADS[2], rope=("half", 10000.0),
             positions="pair_random"),
    _sb_case("s64_decay_scale_fp16", (1, 64, 2, 2, 32), "float16", decay=0.5, scale=0.3, stat_grad=False),
    _sb_case("s31_rope_interleaved_restart_d16", (1, 31, 4, 4, 16), decay=_HEADS[4], rope=("interleaved", 10000.0),
             positions="restart_halfway"),
    _sb_case("s100_mqa_scalar_decay", (1, 100, 2, 1, 32), decay=0.07, slow=True),
    # attend_current (the diagonal's stick), packed segments (the stick restarts per id), queries at
    # the last Sq of Sk key positions, and each with GQA, RoPE, fp16, rows that see no key
    _sb_case("attend_current_gqa_per_head", (1, 37, 4, 2, 32), decay=(0.0, 0.05, 0.2, 1.0), attend_current=True),
    _sb_case("attend_current_rope_half_fp16", (1, 33, 2, 2, 32), "float16", rope=("half", 500.0), decay=0.1,
             attend_current=True),
    _sb_case("packed_rope_restart_gqa", (2, 50, 4, 2, 32), segments="packed", rope=("interleaved", 10000.0),
             positions="restart_per_segment", decay=0.1, seed=0),
    _sb_case("packed_attend_current_mqa_fp16", (1, 64, 2, 1, 64), "float16", segments="packed", decay=0.05,
             attend_current=True),
    _sb_case("decode_one_query", (1, 1, 40, 4, 2, 32), decay=(0.0, 0.1, 0.0, 0.3)),
    _sb_case("prefix_attend_current_fp16", (1, 17, 47, 4, 2, 16), "float16", decay=0.05, attend_current=True),
    _sb_case("prefix_unsorted_pair_mqa", (2, 21, 50, 4, 1, 32), segments="pair_unsorted", decay=0.1),
    _sb_case("prefix_rope_half", (1, 20, 33, 2, 2, 32), rope=("half", 10000.0), decay=0.05, seed=1),
    _sb_case("rows_without_keys", (1, 31, 31, 2, 2, 16), segments="pair_with_empty_rows", decay=0.2),
    # Compiled kernels at realistic shapes (make test-gpu).
    *(_sb_case(f"gpu_gqa_d128_{dt}", (2, 1024, 8, 2, 128), dt, decay=0.01, gpu=True) for dt in ("bfloat16", "float16")),
    *(_sb_case(f"gpu_rope_half_d64_{dt}", (1, 2048, 4, 4, 64), dt, rope=("half", 10000.0), gpu=True)
      for dt in ("bfloat16", "float16")),
    *(_sb_case(f"gpu_rope_interleaved_gqa_d128_{dt}", (1, 1024, 8, 2, 128), dt, rope=("interleaved", 10000.0),
               decay=0.01, gpu=True) for dt in ("bfloat16", "float16")),
    *(_sb_case(f"gpu_ragged_mqa_d64_{dt}", (1, 1000, 4, 1, 64), dt, decay=(0.0, 0.05, 0.2, 1.0), gpu=True)
      for dt in ("bfloat16", "float16")),
    *(_sb_case(f"gpu_d48_{dt}", (1, 300, 2, 2, 48), dt, decay=0.1, gpu=True) for dt in ("bfloat16", "float16")),
    *(_sb_case(f"gpu_long_no_decay_{dt}", (1, 4096, 2, 2, 128), dt, gpu=True) for dt in ("bfloat16", "float16")),
    *(_sb_case(f"gpu_sharp_logits_{dt}", (1, 1024, 4, 2, 64), dt, scale=0.5, gpu=True)
      for dt in ("bfloat16", "float16")),
    _sb_case("gpu_rope_half_per_head_bf16", (2, 1024, 8, 2, 128), "bfloat16",
             decay=tuple(0.3 * i / 7 for i in range(8)), rope=("half", 10000.0), gpu=True),
    _sb_case("gpu_rope_interleaved_mha_fp16_no_rem_grad", (2, 1024, 8, 8, 64), "float16",
             rope=("interleaved", 10000.0), stat_grad=False, gpu=True),
    _sb_case("gpu_rope_restart_bf16_no_rem_grad", (1, 2048, 8, 2, 64), "bfloat16", decay=0.01,
             rope=("interleaved", 10000.0), positions="restart_halfway", stat_grad=False, gpu=True),
    _sb_case("gpu_mqa_scalar_decay_fp16", (1, 2048, 4, 1, 128), "float16", decay=0.07, gpu=True),
    _sb_case("gpu_ragged_pair_d96_bf16", (1, 1000, 4, 2, 96), "bfloat16", decay=_HEADS[4], rope=("half", 10000.0),
             positions="pair_random", gpu=True),
    _sb_case("gpu_fp32_rope_half", (1, 1024, 4, 2, 64), decay=_HEADS[4], rope=("half", 10000.0), gpu=True),
    _sb_case("gpu_d256_rope_bf16", (1, 1024, 4, 2, 256), "bfloat16", decay=_HEADS[4], rope=("interleaved", 10000.0),
             gpu=True),
    *(_sb_case(f"gpu_attend_current_gqa_d128_{dt}", (2, 1024, 8, 2, 128), dt, decay=0.01, attend_current=True,
               gpu=True) for dt in ("bfloat16", "float16")),
    *(_sb_case(f"gpu_packed_{dt}", (2, 2048, 4, 2, 128), dt, segments="packed", decay=0.01, gpu=True)
      for dt in ("bfloat16", "float16")),
    _sb_case("gpu_packed_rope_restart_attend_current_bf16", (1, 2048, 8, 2, 64), "bfloat16", segments="packed",
             rope=("half", 10000.0), positions="restart_per_segment", attend_current=True, gpu=True),
    *(_sb_case(f"gpu_prefix_{dt}", (1, 300, 2048, 8, 2, 128), dt, decay=_HEADS[4] * 2, gpu=True)
      for dt in ("bfloat16", "float16")),
    _sb_case("gpu_decode_rope_bf16", (2, 1, 2048, 8, 2, 128), "bfloat16", rope=("half", 10000.0), decay=0.01,
             gpu=True),
    _sb_case("gpu_prefix_pair_segments_fp16", (1, 500, 1000, 4, 2, 64), "float16", segments="pair_sorted",
             decay=_HEADS[4], gpu=True),
)

STICK_BREAKING = v.VariantRecord(
    name="stick_breaking", quantities=("out", "rem", "dq", "dk", "dv", "ddecay"), forward=("out", "rem"), draw=draw,
    run_jax=run_jax, run_torch=run_torch, jax_call=jax_call, cases=CASES, grid=GRID)
