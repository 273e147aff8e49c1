#!/usr/bin/env python3
"""Stick-breaking (ExpoSB) benchmark (GPU): our kernels against our causal softmax kernel and the
plain-jnp stick-breaking, plus the torch_ref Triton twin.

Run from the repository root: `PYTHONPATH=. python3 benchmarks/stick_breaking.py --out benchmarks/results`.

Rows (bf16, forward and forward+backward; default shape 2x8192x16x128, decay 0.01 per head,
learnable: its gradient is computed too):
  softmax       jax_attn.flash_attention(causal=True)                (the reference speed)
  sb            jax_attn.stick_breaking_attention, the default implementation (the Pallas
                Triton kernels, on Hopper too since session 12)
  sb_triton     the same, named (implementation="pallas_triton")
  sb+rope       the same with fused RoPE (the ExpoSB layer's call)
  sb_xla        the plain-jnp stick-breaking ([B, H, S, S] fp32 arrays in memory) at S=2048 and
                at the shape's own S, --xla-seq. Forward+backward at 2x8192x16x128 peaks at 36 GB:
                on an 80 GB GPU it runs with JAX's allocator preallocating,
                `XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 ... --no-torch`
                (torch needs memory JAX then holds); growing on demand, the benchmarks' default
                (benchmarks/attention.py), it runs out of memory and the row records the error
  torch_sb      torch_ref.stick_breaking_attention (Triton kernels), timed with CUDA events
Targets (issue 4): sb fwd+bwd >= 0.6x the TFLOP/s of causal softmax; >= 20x the plain-jnp path.

Two kinds of data, because the kernels skip the tiles of spent sticks (`_Static.spent`: where a
row's softplus sum reaches 128 in base 2, every A left of it is below 2^-128, which the GPU's
ex2.approx.ftz flushes to exactly 0):
  normal   q, k, v ~ N(0, 1): logits ~ N(0, 1), a near key's softplus ~0.8 nats; at decay 0.01
           a row's stick is spent 165-285 keys left of it (5th-95th percentile, NumPy; 0.2 % of
           the rows never spend theirs), and most tiles of a long row are skipped;
  unspent  the same, with features 63 and 127 of q set to 8 and of k to -8: logits ~ N(-11.3, 1)
           (with RoPE "half" those features are the slowest pair, 0.94 rad over 8192 positions:
           logits ~ N(-6.7, 1) or lower), softplus < 0.002 nats, sums far below 128 base 2 over
           8192 keys: no stick is spent, every tile is walked (the kernels' dense speed). Rows
           "sb", "sb_triton", "sb+rope" run on both ("<impl>@unspent").
FLOPs counted as for causal attention (2*B*S*S*H*D fwd, x3.5 for fwd+bwd), so the TF/s compare
directly with benchmarks/attention.py (the extra cumsum and transcendentals are not counted).
"""
from __future__ import annotations

import argparse
import time

from benchmarks.attention import _make_fwdbwd, device_info, flops, log, ms_table_row, save_run, time_jax

import jax  # noqa: E402  (benchmarks.attention configured the allocator before importing jax)
import jax.numpy as jnp  # noqa: E402

import jax_attn  # noqa: E402
from jax_attn import Rope, StickBreakingBlocks, flash_attention, stick_breaking_attention  # noqa: E402
from jax_attn.ops.common.spec import AttentionSpec  # noqa: E402
from jax_attn.ops.stick_breaking.triton import stick_breaking_pallas  # noqa: E402

SWEEP = [  # block_q, block_k, block_q_dkv, num_warps, num_stages (--sweep)
    (64, 64, 32, 4, 2), (64, 64, 64, 4, 2), (64, 64, 64, 4, 3), (64, 64, 64, 8, 2), (128, 64, 64, 8, 2), (64, 32, 64, 4, 2),
    (32, 64, 32, 4, 2), (128, 32, 128, 8, 2),
]


def candidates(heads: int):
    decay = jnp.full((heads,), 0.01, jnp.float32)
    return {
        "softmax": lambda q, k, v: flash_attention(q, k, v, causal=True),
        "sb": lambda q, k, v: stick_breaking_attention(q, k, v, decay=decay),
        "sb_triton": lambda q, k, v: stick_breaking_attention(q, k, v, decay=decay, implementation="pallas_triton"),
        "sb+rope": lambda q, k, v: stick_breaking_attention(q, k, v, decay=decay, rope=Rope(style="half")),
        "sb_xla": lambda q, k, v: stick_breaking_attention(q, k, v, decay=decay, implementation="xla"),
    }


def time_torch(B, S, H, D, mode, repeats):
    import torch
    import triton

    import torch_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda: torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v, do = make(), make(), make(), make()
    decay = torch.full((H,), 0.01, device="cuda", requires_grad=True)
    if mode == "fwdbwd":
        for t in (q, k, v):
            t.requires_grad_(True)

    def run():
        out = torch_ref.stick_breaking_attention(q, k, v, decay=decay)
        if mode == "fwdbwd":
            torch.autograd.grad(out, (q, k, v, decay), do)

    t0 = time.time()
    run()
    torch.cuda.synchronize()
    first = time.time() - t0
    ms = min(triton.testing.do_bench(run, warmup=25, rep=100) for _ in range(repeats))
    return ms, first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--shape", default="2,8192,16,128", help="B,S,H,D")
    parser.add_argument("--xla-seq", default="2048,8192", help="the S of the plain-jnp rows, comma-separated "
                        "(memory S^2); a length that does not fit records its error and the run goes on")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target-ms", type=float, default=30.0)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also time the kernels' tile grid SWEEP")
    args = parser.parse_args(argv)
    B, S, H, D = (int(x) for x in args.shape.split(","))
    xla_seqs = [int(x) for x in args.xla_seq.split(",")]
    name, kind, _ = device_info(False)
    rows = []

    def bench(impl, f, seq, mode, data="normal"):
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (B, seq, H, D), jnp.bfloat16) for kk in keys)
        if data == "unspent":  # logits ~ N(-11.3, 1): see the module doc
            q, k = (x.at[..., D // 2 - 1].set(a).at[..., D - 1].set(a) for x, a in ((q, 8.0), (k, -8.0)))
            impl = f"{impl}@unspent"
        row = dict(impl=impl, mode=mode, B=B, S=seq, H=H, D=D, causal=True, dtype="bfloat16", data=data)
        try:
            g = jax.jit(f) if mode == "fwd" else jax.jit(_make_fwdbwd(f))
            call_args = (q, k, v) if mode == "fwd" else (q, k, v, do)
            ms, _, first_s = time_jax(g, call_args, args.target_ms, args.repeats)
            row.update(ms=ms, tflops=flops(B, seq, H, D, True, mode) / (ms * 1e-3) / 1e12, first_call_s=first_s)
            log(f"S={seq:6d} {mode:7s} {impl:17s} {ms:9.3f} ms {row['tflops']:7.1f} TF/s")
        except Exception as e:  # recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            log(f"S={seq:6d} {mode:7s} {impl:17s} error {row['error'][:160]}")
        rows.append(row)

    for mode in ("fwd", "fwdbwd"):
        for impl, f in candidates(H).items():
            if impl == "sb_xla":
                for seq in xla_seqs:
                    if seq != S:  # the kernel at the plain-jnp row's length (at S: timed above)
                        bench("sb", candidates(H)["sb"], seq, mode)
                        bench("sb", candidates(H)["sb"], seq, mode, data="unspent")
                    bench(impl, f, seq, mode)
            else:
                bench(impl, f, S, mode)
                if impl.startswith("sb"):
                    bench(impl, f, S, mode, data="unspent")
        if not args.no_torch:
            row = dict(impl="torch_sb", mode=mode, B=B, S=S, H=H, D=D, causal=True, dtype="bfloat16")
            try:
                ms, first = time_torch(B, S, H, D, mode, args.repeats)
                row.update(ms=ms, tflops=flops(B, S, H, D, True, mode) / (ms * 1e-3) / 1e12, first_call_s=first)
                log(f"S={S:6d} {mode:7s} torch_sb  {ms:9.3f} ms {row['tflops']:7.1f} TF/s")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:500]
                log(f"torch_sb {mode} error {row['error'][:160]}")
            rows.append(row)

    if args.sweep:
        decay = jnp.full((H,), 0.01, jnp.float32)
        spec = AttentionSpec(scale=D ** -0.5, causal=True)
        for cfg in SWEEP:
            blocks = StickBreakingBlocks(*cfg)
            f = lambda q, k, v, blocks=blocks: stick_breaking_pallas(q, k, v, decay, spec, blocks=blocks)[0]
            for mode in ("fwd", "fwdbwd"):
                bench(f"sweep{cfg}", f, S, mode)

    ms = {(r["impl"], r["mode"], r["S"]): r.get("ms") for r in rows}
    print("\n| mode | data | softmax ms | sb ms | sb_triton ms | sb+rope ms | torch_sb ms "
          "| sb TF/s / softmax TF/s | " + " | ".join(f"sb_xla / sb (S={seq})" for seq in xla_seqs) + " |")
    print("|---" * (8 + len(xla_seqs)) + "|")
    for mode in ("fwd", "fwdbwd"):
        for data, tag in (("normal", ""), ("unspent", "@unspent")):
            t = [ms.get((i, mode, S)) for i in ("softmax", "sb" + tag, "sb_triton" + tag, "sb+rope" + tag)]
            t.append(ms.get(("torch_sb", mode, S)))
            against_xla = [(ms.get(("sb_xla", mode, seq)), ms.get(("sb" + tag, mode, seq))) for seq in xla_seqs]
            print(ms_table_row((mode, data), t, [(t[0], t[1]), *against_xla]))
    save_run(args.out, "stick-breaking", kind, name, rows, jax_attn_device=str(jax_attn.device_info()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
