#!/usr/bin/env python3
"""NSA on torch_ref (Triton) beside the anchors: fla-org's `parallel_nsa` (where it is installed
and runs: 16 or more query heads per kv head) and cuDNN full causal attention (torch SDPA).

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/nsa_torch.py [--seq 65536] [--heads 64] [--kv-heads 4] [--quick]
        [--sweep] [--out benchmarks/results]

Default case (the DESIGN.md anchor): B=1, 64k tokens, 64 query / 4 kv heads, D=128, bf16, 16
selected blocks of 64, compression blocks of 64 (stride 64), window 0. Rows, forward and
forward+backward (median ms of triton.testing.do_bench, compilation and autotuning warmed up):

    selection        torch_ref.selection_attention over NSA-shaped block lists (block 0, the two
                     local blocks, random others; the same lists for fla)
    fla_selection    fla.ops.nsa.parallel_nsa with the same block lists (g_slc = 1, no compression,
                     no window); absent where fla is missing or refuses the shape
    compression      torch_ref.compression_attention over mean-pooled keys / values
    select_blocks    torch_ref.select_blocks (forward only: not differentiated)
    nsa              torch_ref.nsa_attention, all branches (the window branch if --window > 0)
    cudnn_causal     torch SDPA, cuDNN backend, full causal attention (GQA expanded)

TF/s of the selection rows: 4 * B * S * Hq * D * (keys visited per query, n * block less the
causal cut) forward, 2.5x that more for the backward. Results land as JSON in --out.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

import torch_ref  # noqa: E402


def _bench(fn, backward: bool, inputs):
    """Median ms of fn (and of fn + backward with a fixed cotangent)."""
    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    out = fn()
    cot = torch.randn_like(out)

    def step():
        for x in inputs:
            x.grad = None
        fn().backward(cot)

    return triton.testing.do_bench(step, warmup=5, rep=30, return_mode="median")


def _block_lists(B, S, Hkv, n, block, gen):
    """NSA-shaped lists: block 0, the two local blocks, the rest random below the frontier; sorted."""
    t = torch.arange(S, device="cuda")[None, :, None, None]
    own = t // block
    idx = torch.randint(0, 1 << 30, (B, S, Hkv, n), device="cuda", generator=gen) % (own + 1)
    idx[..., 0], idx[..., 1], idx[..., 2] = 0, (own[..., 0] - 1).clamp(min=0), own[..., 0]
    return torch.sort(idx, dim=-1).values.to(torch.int32)


def _fla_selection(q, k, v, idx, n, block):
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception as e:  # noqa: BLE001 - any import failure means "absent"
        return None, f"fla not importable: {e}"
    params = inspect.signature(parallel_nsa).parameters
    g = torch.ones(q.shape[:3], dtype=q.dtype, device=q.device)
    kw = dict(block_indices=idx.long(), block_counts=n, block_size=block)
    if "g_cmp" in params:
        kw.update(g_cmp=None, g_slc=g, g_swa=None)
    else:
        kw.update(g_slc=g, g_swa=torch.zeros_like(g))
    if "window_size" in params:
        kw["window_size"] = 0
    fn = lambda: parallel_nsa(q, k, v, **kw)  # noqa: E731
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return None, f"fla refused the call: {type(e).__name__}: {str(e)[:200]}"
    return fn, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--compress-block", type=int, default=64)
    ap.add_argument("--compress-stride", type=int, default=64)
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="16k tokens")
    ap.add_argument("--skip-cudnn", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the selection rows under a few NSABlockSizes (warps, stages, dK/dV tokens)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.quick:
        args.seq = 16384
    B, S, Hq, Hkv, D, n, bs = args.batch, args.seq, args.heads, args.kv_heads, args.dim, args.blocks, args.block
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dt, generator=gen).requires_grad_()
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dt, generator=gen).requires_grad_()
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=dt, generator=gen).requires_grad_()
    idx = _block_lists(B, S, Hkv, n, bs, gen)
    visited = float(torch.clamp(torch.arange(1, S + 1).float(), max=n * bs).mean())  # keys per query, about
    sel_flop = 4.0 * B * S * Hq * D * visited
    rows = []

    def record(name, fn, inputs, flop=None, backward=True):
        row = dict(name=name)
        try:
            row["fwd_ms"] = _bench(fn, False, inputs)
            if backward:
                row["fwd_bwd_ms"] = _bench(fn, True, inputs)
            if flop:
                row["fwd_tflops"] = flop / row["fwd_ms"] / 1e9
                if backward:
                    row["fwd_bwd_tflops"] = 3.5 * flop / row["fwd_bwd_ms"] / 1e9
        except Exception as e:  # noqa: BLE001 - report, keep the other rows
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)

    record("selection", lambda: torch_ref.selection_attention(q, k, v, idx, block_size=bs), (q, k, v), sel_flop)
    if args.sweep:
        import dataclasses

        base = torch_ref.default_nsa_block_sizes(D, dt, True)
        for change in (dict(num_warps=2), dict(num_warps=8), dict(num_stages=1), dict(num_stages=3),
                       dict(num_warps_bwd=4), dict(tokens_dkv=4), dict(tokens_dkv=1), dict(chunk_dkv=4096)):
            cfg = dataclasses.replace(base, **change)
            run = lambda cfg=cfg: torch_ref.selection_attention(q, k, v, idx, block_size=bs, config=cfg)  # noqa: E731
            record(f"selection {change}", run, (q, k, v), sel_flop)
    fla_fn, reason = _fla_selection(q, k, v, idx, n, bs)
    if fla_fn is None:
        rows.append(dict(name="fla_selection", absent=reason))
        print(json.dumps(rows[-1]), flush=True)
    else:
        record("fla_selection", fla_fn, (q, k, v), sel_flop)

    cb, cs = args.compress_block, args.compress_stride
    kc, vc = (x.detach() for x in torch_ref.compress_kv(k, v, block=cb, stride=cs))
    kc.requires_grad_()
    vc.requires_grad_()
    record("compression", lambda: torch_ref.compression_attention(q, kc, vc, block=cb, stride=cs), (q, kc, vc))
    with torch.no_grad():
        _, lse = torch_ref.compression_attention(q, kc, vc, block=cb, stride=cs, return_lse=True)
    record("select_blocks", lambda: torch_ref.select_blocks(q, kc, lse, block=cb, stride=cs, select_block=bs,
                                                            num_selected=n).float(), (), backward=False)
    gates = torch.rand(B, S, Hq, 3, device="cuda", dtype=dt, generator=gen).requires_grad_()
    record("nsa", lambda: torch_ref.nsa_attention(q, k, v, gates, compress_block=cb, compress_stride=cs,
                                                  select_block=bs, num_selected=n, window=args.window),
           (q, k, v, gates))
    if not args.skip_cudnn:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

        record("cudnn_causal", cudnn, (qt, kt, vt), 4.0 * B * S * S * Hq * D / 2)

    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(), args=vars(args), rows=rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"nsa_torch_{S}_{Hq}x{Hkv}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
