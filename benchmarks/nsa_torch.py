#!/usr/bin/env python3
"""NSA on torch_ref (Triton) beside the anchors: fla-org's `parallel_nsa` (where it is installed
and runs: a power-of-two group of 16 or more query heads per kv head) and cuDNN full causal
attention (torch SDPA); and the original project's ranges case against torch SDPA.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/nsa_torch.py [--seq 65536] [--heads 64] [--kv-heads 4] [--quick]
        [--sweep] [--ranges | --skip-ranges] [--out benchmarks/results]

Default case (the DESIGN.md anchor): B=1, 64k tokens, 64 query / 4 kv heads, D=128, bf16, 16
selected blocks of 64, compression blocks of 64 (stride 64), window 0 (the defaults of
--compress-block, --compress-stride and --window, passed explicitly to nsa_attention, whose own
defaults are 32/16 and 512). Rows, forward and forward+backward (median ms of
triton.testing.do_bench, compilation and autotuning warmed up):

    selection        torch_ref.selection_attention over NSA-shaped block lists (block 0, the two
                     local blocks, random others; the same lists for fla)
    fla_selection    fla.ops.nsa.parallel_nsa with the same block lists (g_slc = 1, no compression,
                     no window); absent where fla is missing or refuses the shape
    compression      torch_ref.compression_attention over mean-pooled keys / values
    select_blocks    torch_ref.select_blocks (forward only: not differentiated)
    nsa              torch_ref.nsa_attention, all branches: mean-pooled compression (block/stride
                     from --compress-block/--compress-stride), its top-n selection, the window
                     branch if --window > 0; random gates [B, S, Hq, 3] (gradients timed)
    fla_nsa          fla's whole parallel_nsa at the same setting: g_cmp, g_slc (the nsa row's gate
                     values, gradients timed), block_indices=None (it compresses with block = stride
                     = block_size by mean pooling and selects its own top block_counts, block 0 and
                     the two local blocks forced), block_counts=--blocks, block_size=--block,
                     window_size=--window (0: g_swa None; its window branch needs the flash-attn
                     package). Absent, with the reason, where fla is missing, the compression is
                     not block/block, the group is not a power of two >= 16, or the window is on
                     without flash-attn. The row also carries the output difference from the nsa
                     row (the same definition: it differs only where near-ties pick other blocks)
                     and fla's time over ours (fwd_fla_over_nsa, fwd_bwd_fla_over_nsa).
    cudnn_causal     torch SDPA, cuDNN backend, full causal attention (GQA expanded)

Ranges section (run first; `--ranges`: only it, seconds; `--skip-ranges`: none): the original
project's case "N=1024, H=8, D=128, L=256 against torch SDPA": N query tokens, H query heads
sharing one kv head, each row attending to L keys given as R disjoint [start, end) ranges
(--ranges-counts, default 1 and 8), not causal; torch_ref.selection_attention(ranges=...) against
SDPA with the equivalent boolean mask and plain dense SDPA (see `ranges_section`).

TF/s of the selection rows: 4 * B * S * Hq * D * (keys visited per query, n * block less the
causal cut) forward, 2.5x that more for the backward. Results land as JSON in --out
(nsa_torch_{S}_{Hq}x{Hkv}.json, nsa_torch_ranges_{N}.json).
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

DEVICE = "cuda"  # a module constant so a CPU dry run can swap it


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
    t = torch.arange(S, device=DEVICE)[None, :, None, None]
    own = t // block
    idx = torch.randint(0, 1 << 30, (B, S, Hkv, n), device=DEVICE, generator=gen) % (own + 1)
    idx[..., 0], idx[..., 1], idx[..., 2] = 0, (own[..., 0] - 1).clamp(min=0), own[..., 0]
    return torch.sort(idx, dim=-1).values.to(torch.int32)


def _fla_runs(fn):
    """(fn, None) if one call of fla's `fn` runs here, else (None, why)."""
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - fla refusing a shape is a result, reported as absent
        return None, f"fla refused the call: {type(e).__name__}: {str(e)[:200]}"
    return fn, None


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
    return _fla_runs(lambda: parallel_nsa(q, k, v, **kw))


def _fla_nsa(q, k, v, gates, n, block, cblock, cstride, window):
    """fla's whole parallel_nsa (mean-pooled compression, its own top-n, selection, gates), or
    (None, why). fla 0.6.0 compresses with block = stride = its block_size; with g_cmp given and
    block_indices None it computes the compression branch and selects from its probabilities
    (block 0 and the two local blocks forced); its window branch calls the flash-attn package."""
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception as e:  # noqa: BLE001 - any import failure means "absent"
        return None, f"fla not importable: {e}"
    if (cblock, cstride) != (block, block):
        return None, f"fla compresses with block = stride = block_size ({block}), not {cblock}/{cstride}"
    if "g_cmp" not in inspect.signature(parallel_nsa).parameters:
        return None, "this fla's parallel_nsa takes no g_cmp: it does not compress and select by itself"
    G = q.shape[2] // k.shape[2]
    if G < 16 or G & (G - 1):
        return None, f"fla's parallel_nsa needs a power-of-two group of 16 or more query heads per kv head, not {G}"
    if window > 0:
        try:
            import flash_attn  # noqa: F401
        except Exception:  # noqa: BLE001
            return None, "fla's window branch calls the flash-attn package, which does not import"
    # the same gate values as the nsa row, as leaves of their own (their gradients are timed too)
    g_cmp, g_slc, g_swa = (gates[..., i].detach().contiguous().requires_grad_() for i in range(3))
    kw = dict(g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa if window > 0 else None, block_indices=None, block_counts=n,
              block_size=block, window_size=window)
    fn, reason = _fla_runs(lambda: parallel_nsa(q, k, v, **kw))
    return (None if fn is None else (fn, (g_cmp, g_slc) + ((g_swa,) if window > 0 else ()))), reason


class Recorder:
    """Rows: record(name, fn, inputs, flop) times fn forward and forward+backward, keeps going on errors."""

    def __init__(self):
        self.rows = []

    def __call__(self, name, fn, inputs, flop=None, backward=True):
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
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def _write(args, name, rows):
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(), args=vars(args), rows=rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def _random_ranges(B, S, Hkv, L, R, gen):
    """int32 [B, S, Hkv, R, 2]: per row R disjoint ranges of L / R keys at arbitrary (unaligned)
    starts, one in each of R equal windows of the sequence (R = 1: one range of L anywhere)."""
    if L % R or L > S:
        raise ValueError(f"--ranges-keys ({L}) must be a multiple of the range count ({R}) and at most "
                         f"the tokens ({S})")
    width, span = L // R, S // R
    off = torch.randint(0, span - width + 1, (B, S, Hkv, R), device=DEVICE, generator=gen)
    start = off + torch.arange(R, device=DEVICE) * span
    return torch.stack([start, start + width], dim=-1).to(torch.int32)


def ranges_section(args, record, gen):
    """The original project's ranges case: selection over several [start, end) key ranges per
    query row against torch SDPA computing the same thing. Its kernel took per row N (= tokens),
    H query heads sharing one kv head, D, and L keys (the union of the row's ranges); it timed
    N=1024, H=8, D=128, L=256, not causal, one range per row ("few") and several ("many").
    Here: B=1, S = N tokens of self-attention (k, v [1, N, 1, D]), each row's ranges cover L of
    them; causal=False. Rows, forward and forward+backward:

        ranges_R{R}          torch_ref.selection_attention(..., ranges=[1, N, 1, R, 2], causal=False)
        sdpa_mask_R{R}       torch SDPA with the equivalent boolean mask [1, 1, N, N] (kv expanded to H)
        sdpa_dense           torch SDPA over all N keys (no mask): the second anchor
    """
    N, H, D, L = args.ranges_tokens, args.ranges_heads, args.dim, args.ranges_keys
    dt = torch.bfloat16
    q = torch.randn(1, N, H, D, device=DEVICE, dtype=dt, generator=gen).requires_grad_()
    k = torch.randn(1, N, 1, D, device=DEVICE, dtype=dt, generator=gen).requires_grad_()
    v = torch.randn(1, N, 1, D, device=DEVICE, dtype=dt, generator=gen).requires_grad_()
    # SDPA's layout [B, H, N, D], kv expanded to the H heads once, outside the timing
    qt = q.detach().transpose(1, 2).contiguous().requires_grad_()
    kt, vt = (x.detach().transpose(1, 2).expand(1, H, N, D).contiguous().requires_grad_() for x in (k, v))
    F = torch.nn.functional
    for R in args.ranges_counts:
        ranges = _random_ranges(1, N, 1, L, R, gen)
        keys = torch.arange(N, device=DEVICE)
        mask = ((keys >= ranges[..., 0:1].long()) & (keys < ranges[..., 1:2].long())).any(3)  # [1, N, 1, N]
        mask = mask.permute(0, 2, 1, 3).contiguous()  # [1, 1, N, N]
        flop = 4.0 * N * H * D * L
        ours = lambda ranges=ranges: torch_ref.selection_attention(q, k, v, ranges=ranges, causal=False)  # noqa: E731
        sdpa = lambda mask=mask: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)  # noqa: E731
        record(f"ranges_R{R}", ours, (q, k, v), flop)
        record(f"sdpa_mask_R{R}", sdpa, (qt, kt, vt), flop)
        with torch.no_grad():
            diff = (ours().float() - sdpa().transpose(1, 2).float()).abs().max()
        record.rows[-1]["max_abs_diff_vs_ranges"] = float(diff)
        print(json.dumps(dict(name=f"ranges_R{R} vs sdpa_mask_R{R}", max_abs_diff=float(diff))), flush=True)
    record("sdpa_dense", lambda: F.scaled_dot_product_attention(qt, kt, vt), (qt, kt, vt), 4.0 * N * N * H * D)


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
    ap.add_argument("--ranges", action="store_true", help="only the ranges section (seconds)")
    ap.add_argument("--skip-ranges", action="store_true", help="no ranges section")
    ap.add_argument("--ranges-tokens", type=int, default=1024)
    ap.add_argument("--ranges-heads", type=int, default=8)
    ap.add_argument("--ranges-keys", type=int, default=256, help="keys per row (the union of its ranges)")
    ap.add_argument("--ranges-counts", default="1,8", help="ranges per row, comma-separated")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    args.ranges_counts = [int(x) for x in args.ranges_counts.split(",")]
    if args.quick:
        args.seq = 16384
    if not args.skip_ranges:
        record = Recorder()
        ranges_section(args, record, torch.Generator(device=DEVICE).manual_seed(1))
        _write(args, f"nsa_torch_ranges_{args.ranges_tokens}.json", record.rows)
        if args.ranges:
            return
    B, S, Hq, Hkv, D, n, bs = args.batch, args.seq, args.heads, args.kv_heads, args.dim, args.blocks, args.block
    dt = torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(B, S, Hq, D, device=DEVICE, dtype=dt, generator=gen).requires_grad_()
    k = torch.randn(B, S, Hkv, D, device=DEVICE, dtype=dt, generator=gen).requires_grad_()
    v = torch.randn(B, S, Hkv, D, device=DEVICE, dtype=dt, generator=gen).requires_grad_()
    idx = _block_lists(B, S, Hkv, n, bs, gen)
    visited = float(torch.clamp(torch.arange(1, S + 1).float(), max=n * bs).mean())  # keys per query, about
    sel_flop = 4.0 * B * S * Hq * D * visited
    record = Recorder()
    rows = record.rows

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
    gates = torch.rand(B, S, Hq, 3, device=DEVICE, dtype=dt, generator=gen).requires_grad_()
    ours = lambda: torch_ref.nsa_attention(q, k, v, gates, compress_block=cb, compress_stride=cs,  # noqa: E731
                                           select_block=bs, num_selected=n, window=args.window)
    record("nsa", ours, (q, k, v, gates))
    rows[-1].update(compress_block=cb, compress_stride=cs, window=args.window, num_selected=n, select_block=bs)
    fla_nsa, reason = _fla_nsa(q, k, v, gates, n, bs, cb, cs, args.window)
    if fla_nsa is None:
        rows.append(dict(name="fla_nsa", absent=reason))
        print(json.dumps(rows[-1]), flush=True)
    else:
        fn, g_leaves = fla_nsa
        record("fla_nsa", fn, (q, k, v) + g_leaves)
        with torch.no_grad():  # the same definition: the outputs differ only where near-ties pick other blocks
            diff = (fn().float() - ours().float()).abs()
        rows[-1].update(max_abs_diff_vs_nsa=float(diff.max()), mean_abs_diff_vs_nsa=float(diff.mean()),
                        rows_over_1e_2_vs_nsa=float((diff.amax(-1) > 1e-2).float().mean()))
        mine = next(r for r in rows if r["name"] == "nsa")
        for key in ("fwd_ms", "fwd_bwd_ms"):
            if key in mine and key in rows[-1]:
                rows[-1][key.replace("_ms", "_fla_over_nsa")] = rows[-1][key] / mine[key]
        print(json.dumps(rows[-1]), flush=True)
    if not args.skip_cudnn:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

        record("cudnn_causal", cudnn, (qt, kt, vt), 4.0 * B * S * S * Hq * D / 2)

    _write(args, f"nsa_torch_{S}_{Hq}x{Hkv}.json", rows)


if __name__ == "__main__":
    main()
