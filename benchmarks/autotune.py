#!/usr/bin/env python3
"""Autotune softmax attention at the anchors' shapes, then time every backend with the tuned choice.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/autotune.py --cache /tmp/autotune.json --out benchmarks/results [--quick]

For each case (bf16, B,S,Hq,D; Hkv, causal and not): `jax_attn.autotune(flash_attention, ...)` (mode
fwd+bwd, its default candidates), then `jax_attn.benchmark_backends` (ours with the tuned configs,
cuDNN and XLA through jax.nn.dot_product_attention) and the torch twins when torch has CUDA. The
cache file written is the measurement a shipped H100/H200 default would come from; the JSON in
--out holds the rows. --quick: 2x8192x16x128 only.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_attn  # noqa: E402

CASES = [(2, 8192, 16, 128, 16), (4, 4096, 32, 128, 8), (1, 32768, 16, 128, 16), (16, 1024, 16, 64, 16),
         (8, 2048, 16, 128, 16), (2, 4096, 16, 256, 16)]


def _plain(row):
    return {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in row.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True, help="the autotune cache file to write (and read)")
    ap.add_argument("--out", default=None, help="folder for the JSON of the rows")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--torch", action="store_true", help="also tune and benchmark torch_ref")
    ap.add_argument("--shapes", default=None,
                    help="semicolon-separated B,S,Hq,D,Hkv shapes instead of the anchors' (e.g. '1,32768,16,128,16')")
    args = ap.parse_args()
    os.environ["JAX_ATTN_CACHE"] = args.cache  # benchmark_backends reads the configs just tuned
    results = []
    cases = ([tuple(int(x) for x in shape.split(",")) for shape in args.shapes.split(";")] if args.shapes
             else CASES[:1] if args.quick else CASES)
    for b, s, hq, d, hkv in cases:
        for causal in (False, True):
            keys = jax.random.split(jax.random.key(0), 3)
            q = jax.random.normal(keys[0], (b, s, hq, d), jnp.bfloat16)
            k, v = (jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16) for kk in keys[1:])
            tuned = jax_attn.autotune(jax_attn.flash_attention, q, k, v, causal=causal, reps=args.reps,
                                      cache=args.cache)
            rows = jax_attn.benchmark_backends(q, k, v, causal=causal, reps=args.reps)
            case = f"jax {b}x{s}x{hq}x{d}; {hkv} causal={causal}"
            print(f"{case}: tuned {tuned.implementation} {tuned.config} {tuned.ms:.3f} ms", flush=True)
            for r in rows:
                print(f"  {r['implementation']:>16} fwd {r['ms_fwd'] or float('nan'):8.3f} ms  "
                      f"fwd+bwd {r['ms_fwd_bwd'] or float('nan'):8.3f} ms  {r['reason'] or ''}", flush=True)
            results.append({"case": case, "tuned": _plain({"implementation": tuned.implementation,
                                                           "config": tuned.config, "ms": tuned.ms}),
                            "candidates": [_plain(r) for r in tuned.rows], "rows": [_plain(r) for r in rows]})
            if args.torch:
                import torch
                import torch_ref
                if torch.cuda.is_available():
                    tq, tk, tv = (torch.randn(x.shape, device="cuda", dtype=torch.bfloat16) for x in (q, k, v))
                    tuned = torch_ref.autotune(torch_ref.flash_attention, tq, tk, tv, causal=causal, reps=args.reps,
                                               cache=args.cache)
                    rows = torch_ref.benchmark_backends(tq, tk, tv, causal=causal, reps=args.reps)
                    results.append({"case": "torch" + case[3:], "rows": [_plain(r) for r in rows],
                                    "candidates": [_plain(r) for r in tuned.rows]})
                    for r in rows:
                        print(f"  torch {r['implementation']:>16} fwd {r['ms_fwd'] or float('nan'):8.3f} ms  "
                              f"fwd+bwd {r['ms_fwd_bwd'] or float('nan'):8.3f} ms  {r['reason'] or ''}", flush=True)
    if args.out:
        info = jax_attn.device_info()
        name = info.name.lower().replace(" ", "-")
        date = datetime.date.today().isoformat()
        path = os.path.join(args.out, f"autotune-{name}-{date}.json")
        with open(path, "w") as f:
            json.dump({"device": info.name, "jax": jax.__version__, "date": date, "results": results}, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
