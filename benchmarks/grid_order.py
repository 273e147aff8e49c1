#!/usr/bin/env python3
"""The Hopper (Mosaic) forward under two grid orders in one run: query tiles fastest (the library's
`mosaic_frame.FORWARD_GRID`) and batch fastest (its order before), on batches that do and do not
fit their K, V in L2. Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/grid_order.py

Prints ms per call (median of 5 repeats of 10 calls; forward+backward for the library's order only:
the backward grids are not switchable from here). Result: benchmarks/results/mosaic-grid-order-*.txt.
"""
import time
import warnings

warnings.filterwarnings("ignore", message=r"The Pallas Triton backend is deprecated")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_attn  # noqa: E402
from jax_attn.ops.softmax import mosaic  # noqa: E402

SHAPES = [((64, 2048, 16, 128), False), ((32, 2048, 32, 128), False), ((2, 8192, 16, 128), False),
          ((2, 8192, 16, 128), True), ((16, 8192, 16, 64), True)]
ORDERS = (("heads", "batch", "q_tiles"), ("heads", "q_tiles", "batch"))


def bench(f, *args, n=10):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            r = f(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t) / n * 1e3)
    return float(np.median(times))


def main():
    for order in ORDERS:
        mosaic.FORWARD_GRID = order
        for shape, causal in SHAPES:
            q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 3))
            f = lambda q, k, v: jax_attn.flash_attention(q, k, v, causal=causal, implementation="mosaic_gpu")
            line = f"grid {order} {shape} causal={causal}: fwd {bench(jax.jit(f), q, k, v):.3f} ms"
            if order == ORDERS[0]:
                loss = lambda q, k, v: f(q, k, v).astype(jnp.float32).sum()
                line += f", fwdbwd {bench(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v):.3f} ms"
            print(line, flush=True)


if __name__ == "__main__":
    main()
