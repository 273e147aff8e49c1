"""Dump the TTIR of torch_ref's softmax kernels (forward, dK/dV, dQ) for a fixed set of configurations,
one file per kernel, compiled for sm_90 without a GPU: a change that must not touch the kernels
(a constexpr-gated feature, off) leaves every file identical. The torch counterpart of
scripts/trace_kernels.py.

  python scripts/torch_ttir.py OUT_DIR           (then: diff -r BEFORE_DIR OUT_DIR)
  python scripts/torch_ttir.py OUT_DIR --dropout (the dropout kernels too: they compile)
  python scripts/torch_ttir.py OUT_DIR --orderings (+ the ordered kernels: rows gathered through a permutation)
  python scripts/torch_ttir.py OUT_DIR --stick-breaking          (+ the stick-breaking kernels)
  python scripts/torch_ttir.py OUT_DIR --stick-breaking-options  (+ those with attend_current,
                                                                  Sq < Sk, segment ids: they compile)
  python scripts/torch_ttir.py OUT_DIR --nsa-only  (only the NSA selection kernels: forward, dQ,
                                                    dK/dV, the dK/dV sum; block lists and ranges)

The launchers (`forward`, `backward`) run on CPU tensors with the Triton JIT's launch replaced by
a compile to TTIR (`triton.compile`'s front end and TTIR passes for GPUTarget("cuda", 90, 32), the
specialisation the launcher would use); source locations are stripped. Uses Triton's JIT internals
(`create_function_from_signature`, `JITFunction._pack_args`; Triton 3.9).
"""
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the compiled kernels

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime import jit as triton_jit  # noqa: E402

from attn_spec.dilation import RowMap  # noqa: E402
from torch_ref import Rope  # noqa: E402
from torch_ref.ops.softmax import triton as K  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
_current = [""]


def strip_locations(ttir: str) -> str:
    lines = [line for line in ttir.splitlines() if not line.startswith("#loc")]
    return "\n".join(re.sub(r"\s*loc\([^()]*(\([^()]*\))?[^()]*\)", "", line) for line in lines) + "\n"


def _compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    binder = triton_jit.create_function_from_signature(self.signature, self.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound, specialization, options)
    src = ASTSource(self, signature, constexprs, attrs)
    opts = BACKEND.parse_options(options.__dict__)
    context = triton._C.libtriton.ir.context()
    triton._C.libtriton.ir.load_dialects(context)
    BACKEND.load_dialects(context)
    module = src.make_ir(TARGET, opts, BACKEND.get_codegen_implementation(opts), BACKEND.get_module_map(), context)
    stages = {}
    BACKEND.add_stages(stages, opts, src.language)
    module = stages["ttir"](module, {})
    with open(os.path.join(OUT, f"{_current[0]}__{self.fn.__name__}.ttir"), "w") as f:
        f.write(strip_locations(str(module)))


def run(name, B=2, Sq=100, Sk=100, Hq=4, Hkv=2, D=64, dtype=torch.float16, causal=False, segments=False, **kw):
    """Launch forward and backward (compiled to TTIR, not run) for one configuration."""
    _current[0] = f"{name}_{str(dtype).split('.')[1]}"
    q = torch.randn(B, Sq, Hq, D).to(dtype)
    k = torch.randn(B, Sk, Hkv, D).to(dtype)
    if segments:
        kw.update(q_ids=torch.zeros(B, Sq, dtype=torch.int32), kv_ids=torch.zeros(B, Sk, dtype=torch.int32))
    if kw.get("rope") is not None:
        kw.update(q_pos=torch.arange(Sq, dtype=torch.int32).expand(B, Sq),
                  kv_pos=torch.arange(Sk, dtype=torch.int32).expand(B, Sk))
    config = K.default_block_sizes(D, dtype, True)
    K.forward(q, k, k, causal=causal, scale=0.125, config=config, **kw)
    stats = (torch.zeros(B, Hq, Sq), torch.zeros(B, Hq, Sq))
    K.backward(q, q, k, k, q, stats, causal=causal, scale=0.125, config=config, **kw)


def run_sb(name, B=2, Sq=100, Sk=100, Hq=4, Hkv=2, D=64, dtype=torch.float16, decay=False, drem=True, segments=False,
           **kw):
    """Stick-breaking's forward and backward (compiled to TTIR, not run) for one configuration."""
    from torch_ref.ops.stick_breaking import triton as SB

    _current[0] = f"sb_{name}_{str(dtype).split('.')[1]}"
    q = torch.randn(B, Sq, Hq, D).to(dtype)
    k = torch.randn(B, Sk, Hkv, D).to(dtype)
    if segments:
        kw.update(q_ids=torch.zeros(B, Sq, dtype=torch.int32), kv_ids=torch.zeros(B, Sk, dtype=torch.int32))
    if kw.get("rope") is not None:
        kw.update(q_pos=torch.arange(Sk - Sq, Sk, dtype=torch.int32).expand(B, Sq),
                  kv_pos=torch.arange(Sk, dtype=torch.int32).expand(B, Sk))
    lam = torch.full((Hq,), 0.1) if decay else None
    config = SB.default_stick_breaking_block_sizes(D, dtype, True)
    SB.forward(q, k, k, scale=0.125, decay=lam, config=config, **kw)
    rem = torch.zeros(B, Hq, Sq)
    SB.backward(q, q, k, k, rem, scale=0.125, drem=rem if drem else None, decay=lam, decay_grad=decay, config=config,
                **kw)


def run_nsa(name, B=2, S=100, Hq=8, Hkv=2, D=64, dtype=torch.float16, block_size=16, ranges=False, segments=False,
            dlse=False):
    """NSA selection's forward and backward kernels (compiled to TTIR, not run) for one configuration:
    block lists of block_size (one-tile walk where block_size <= the key tile) or R = 3 arbitrary ranges."""
    from torch_ref.ops.nsa import reference as R
    from torch_ref.ops.nsa import triton as N

    _current[0] = f"nsa_{name}_{str(dtype).split('.')[1]}"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    if ranges:
        start = torch.randint(0, S, (B, S, Hkv, 3, 1), generator=g)
        spans = R.canonical_ranges(torch.cat([start, start + 7], -1), True, S)
        block_size = None
    else:
        idx = torch.randint(0, -(-S // block_size), (B, S, Hkv, 4), generator=g)
        spans = R.blocks_to_ranges(R.canonical_blocks(idx, None, block_size, True, S), block_size, True, S)
    spans = spans.to(torch.int32).contiguous()
    counts = (spans[..., 0] < spans[..., 1]).sum(-1, dtype=torch.int32)
    ids = torch.zeros(B, S, dtype=torch.int32) if segments else None
    config = N.default_nsa_block_sizes(D, dtype, True)
    out, _, m2, inv_l = N._forward(q, k, k, spans, counts, ids, 0.125, config, block_size)
    N._backward(q, q, k, k, q, m2, inv_l, m2 if dlse else None, spans, counts, ids, 0.125, config, block_size)


def main():
    triton_jit.JITFunction.run = _compile_instead_of_launch
    if "--nsa-only" in sys.argv:  # the NSA selection kernels alone (seconds)
        for dt in (torch.float16, torch.float32):
            run_nsa("blocks16", dtype=dt)
            run_nsa("blocks64_d128_g16", Hq=32, D=128, block_size=64, dtype=dt)
            run_nsa("blocks128_mha", Hq=2, S=300, block_size=128, dtype=dt)
            run_nsa("ranges_segments_dlse", ranges=True, segments=True, dlse=True, dtype=dt)
            run_nsa("blocks16_g3_d40", Hq=6, D=40, segments=True, dtype=dt)
        print(f"{len(os.listdir(OUT))} files in {OUT}")
        return
    for dt in (torch.float16, torch.float32):
        run("dense", dtype=dt)
        run("causal", causal=True, dtype=dt)
        run("window_segments", window=(16, 8), segments=True, dtype=dt)
        run("softcap_causal", causal=True, softcap=5.0, dtype=dt)
        run("rope_causal", causal=True, rope=Rope(style="half"), dtype=dt)
        run("rope_interleaved", rope=Rope(style="interleaved"), D=40, dtype=dt)
        run("alibi", alibi=(torch.ones(4), 3), causal=True, dtype=dt)
        run("d128_mha", Hkv=4, D=128, dtype=dt)
        # row maps (dilated): q, k, v as slot views [B', L, rate * heads, D]
        run("rowmap_rate2", Hq=8, Hkv=4, dtype=dt, row_map=RowMap(rate=2, heads=4, kv_heads=2), grid_heads=4)
        run("rowmap_fixed_causal", Hq=8, Hkv=4, dtype=dt, causal=True,
            row_map=RowMap(rate=2, heads=4, kv_heads=2, offset=1), grid_heads=4)
    if "--orderings" in sys.argv:  # rows gathered through an ordering (flash: scattered back; row map: compact)
        for dt in (torch.float16, torch.float32):
            orig = torch.randperm(100).to(torch.int32)[None].expand(2, 100)
            run("ordered_window_causal", dtype=dt, causal=True, window=(16, 0), gather=(orig, True, 1))
            run("ordered_window_segments", dtype=dt, window=(8, 8), segments=True, gather=(orig, True, 1))
            rows = torch.randint(0, 100, (2 * 4 * 2, 25), dtype=torch.int32)  # B' = 2 * 4 segments, rate 2
            run("ordered_rowmap_causal", Hq=4, Hkv=2, Sq=100, Sk=100, dtype=dt, causal=True,
                row_map=RowMap(rate=2, heads=4, kv_heads=2), grid_heads=4, gather=(rows, False, 4))
    if "--dropout" in sys.argv:
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            run("dropout_dense", dtype=dt, dropout=(0.1, (5, 2 ** 32 - 1)))
            run("dropout_causal_segments", causal=True, segments=True, dtype=dt, dropout=(0.5, (2 ** 31, 3)))
            run("dropout_rope_alibi_softcap", rope=Rope(style="half"), alibi=(torch.ones(4), 0), softcap=3.0,
                dtype=dt, dropout=(0.2, (1, 1)))
    if "--stick-breaking" in sys.argv or "--stick-breaking-options" in sys.argv:
        for dt in (torch.float16, torch.float32):
            run_sb("plain", dtype=dt)
            run_sb("gqa_decay_no_rem_grad", Hq=8, decay=True, drem=False, dtype=dt)
            run_sb("rope_half_decay", rope=Rope(style="half"), decay=True, dtype=dt)
            run_sb("rope_interleaved_d40", rope=Rope(style="interleaved"), D=40, dtype=dt)
            run_sb("d128_mha", Hkv=4, D=128, dtype=dt)
    if "--stick-breaking-options" in sys.argv:
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            run_sb("attend_current", attend_current=True, decay=True, dtype=dt)
            run_sb("sq_lt_sk", Sq=37, Sk=100, decay=True, dtype=dt)
            run_sb("segments", segments=True, decay=True, dtype=dt)
            run_sb("all_rope", Sq=37, Sk=100, segments=True, attend_current=True, rope=Rope(style="half"), decay=True,
                   dtype=dt)
    print(f"{len(os.listdir(OUT))} files in {OUT}")


if __name__ == "__main__":
    OUT = [a for a in sys.argv[1:] if not a.startswith("--")][0]
    os.makedirs(OUT, exist_ok=True)
    main()
