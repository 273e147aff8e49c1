"""The ranges case's stages (1024 tokens, 8 query heads on one kv head, D=128, 256 keys per row as R
ranges, not causal): torch_ref (stage timings and a torch profiler table) and jax_attn (stage timings, the
dK/dV stepping over several tokens against one token a step, the masked dense call).
Usage on the GPU machine: PYTHONPATH=. python3 scripts/nsa_ranges_stages.py [torch] [jax]"""
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
import torch

N, H, D, L = 1024, 8, 128, 256
dev = "cuda"


def timed(f, reps=50, warm=5):
    for _ in range(warm):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def ranges_for(R, gen):
    width, span = L // R, N // R
    off = torch.randint(0, span - width + 1, (1, N, 1, R), device=dev, generator=gen)
    start = off + torch.arange(R, device=dev) * span
    return torch.stack([start, start + width], dim=-1).to(torch.int32)


def torch_part():
    import torch_ref
    from torch_ref.ops.nsa import reference as ref, triton as kern
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, N, H, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(1, N, 1, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(1, N, 1, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
    for R in (1, 8):
        rg = ranges_for(R, gen)
        spans = ref.canonical_ranges(rg, False, N)
        fwd = lambda: torch_ref.selection_attention(q, k, v, ranges=rg, causal=False)
        out = fwd()
        do = torch.randn_like(out)
        both = lambda: torch.autograd.grad(fwd(), (q, k, v), do)
        kern_only = lambda: kern.selection(q, k, v, spans, scale=D ** -0.5)
        kern_both = lambda: torch.autograd.grad(kern.selection(q, k, v, spans, scale=D ** -0.5)[0], (q, k, v), do)
        with torch.no_grad():
            rows = dict(fwd=timed(lambda: torch_ref.selection_attention(q, k, v, ranges=rg, causal=False)),
                        canonical=timed(lambda: ref.canonical_ranges(rg, False, N)),
                        kernel_fwd=timed(lambda: kern.selection(q, k, v, spans, scale=D ** -0.5)))
        rows.update(fwd_grad=timed(fwd), fwd_bwd=timed(both), kernel_fwd_bwd=timed(kern_both))
        print(f"torch R={R}", {a: round(b, 4) for a, b in rows.items()}, flush=True)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                both()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))


def jax_part():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import jax_attn
    from jax_attn.ops.nsa import plan

    from jax_attn.autotune import time_call

    def jt(f, *a):  # jitted, median of 50 calls after 5 untimed ones
        return time_call(f, a, warmup=5, reps=50)

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, N, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, N, 1, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, N, 1, D)), jnp.bfloat16)
    for R in (1, 8):
        width, span = L // R, N // R
        off = rng.integers(0, span - width + 1, (1, N, 1, R))
        start = off + np.arange(R) * span
        rg = jnp.asarray(np.stack([start, start + width], -1), jnp.int32)
        f = lambda q, k, v, rg: jax_attn.selection_attention(q, k, v, ranges=rg, causal=False)
        loss = lambda q, k, v, rg: jnp.sum(f(q, k, v, rg).astype(jnp.float32))
        f1 = lambda q, k, v, rg: jax_attn.selection_attention(q, k, v, ranges=rg, causal=False,
                                                               config=jax_attn.NSABlockSizes(tokens=1))
        loss1 = lambda q, k, v, rg: jnp.sum(f1(q, k, v, rg).astype(jnp.float32))
        mask = jnp.any((jnp.arange(N)[None, None, None, :] >= rg[..., 0:1]) & (jnp.arange(N) < rg[..., 1:2]), 3)
        mask = jnp.transpose(mask, (0, 2, 1, 3))  # [1, 1, N, N]
        fm = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask)
        lossm = lambda q, k, v: jnp.sum(fm(q, k, v).astype(jnp.float32))
        rows = dict(fwd=jt(f, q, k, v, rg), disjoint=jt(lambda rg: plan.disjoint_ranges(rg, N, False), rg),
                    fwd_bwd=jt(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, rg),
                    fwd_bwd_one_token_steps=jt(jax.grad(loss1, argnums=(0, 1, 2)), q, k, v, rg),
                    mask_fwd=jt(fm, q, k, v), mask_fwd_bwd=jt(jax.grad(lossm, argnums=(0, 1, 2)), q, k, v))
        print(f"jax R={R}", {a: round(b, 4) for a, b in rows.items()}, flush=True)
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, rg).compile().as_text()
        print("  fwd+bwd HLO: fusions", hlo.count("fusion("), "custom-calls", hlo.count("custom-call("),
              "sorts", hlo.count(" sort("), flush=True)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["torch", "jax"]
    if "torch" in parts:
        torch_part()
    if "jax" in parts:
        jax_part()
