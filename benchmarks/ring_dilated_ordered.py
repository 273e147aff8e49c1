#!/usr/bin/env python3
"""Sequence-parallel dilated attention with a Hilbert ordering within each shard, on every visible
GPU, against the one-GPU dilated attention of the same definition and the unordered sharded call.

Run on the GPU machine from the repository root (uses `jax.devices()`: 1, 2, 4 or 8 GPUs):

    PYTHONPATH=. python3 benchmarks/ring_dilated_ordered.py --out benchmarks/results [--quick]

Case: bf16, B=1, 16 heads of 128 (GQA 16/4), a (S / 128) x 128 patch grid, segments
(2048, 8192, S) at rates (1, 2, 4) (the first two inside a shard for S / P >= 8192, the last over
all shards), causal and not, forward and forward+backward, S = 32k and 128k (--quick: 32k;
--smoke: S = 512, 4 heads of 32, float32 on 4 CPU devices, the code paths only).

Columns:
    one_gpu_ordered   dilated_attention(ordering=<the shards' Hilbert orders concatenated>) on one GPU
    sharded_ordered   ring_dilated_attention(ordering="hilbert", grid=...) under shard_map, all GPUs
    sharded_plain     ring_dilated_attention without an ordering (the cost of the ordering)
The sharded columns take their inputs already sharded (placement outside the timing). relerr: the
sharded ordered output against the one-GPU ordered output.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--smoke" in sys.argv:  # four CPU devices, before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
from benchmarks import harness  # noqa: E402  (before jax: allocator and platform settings)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def main(argv=None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0])
    opts = harness.finish_options(p.parse_args(argv))
    import jax_attn
    from attn_spec import orderings

    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("sp",))
    sharding = NamedSharding(mesh, P(None, "sp"))
    heads, kv_heads, dim, cols = (4, 2, 32, 16) if opts.smoke else (16, 4, 128, 128)
    lengths = [512] if opts.smoke else ([32768] if opts.quick else [32768, 131072])
    dtype = jnp.float32 if opts.smoke else jnp.bfloat16
    doc, stem = harness.new_document("ring_dilated_ordered", opts, anchors={}, devices=n,
                                     device_names=[d.device_kind for d in devices])
    rows = []
    for seq in lengths:
        grid = (seq // cols, cols)
        local = orderings.permutation("hilbert", seq // n, (grid[0] // n, cols))
        perm = jnp.asarray(np.concatenate([d * (seq // n) + local for d in range(n)]))
        segs = (64, 128, seq) if opts.smoke else (2048, 8192, seq)
        keys = jax.random.split(jax.random.key(opts.seed), 4)
        shapes = [(1, seq, heads, dim), (1, seq, kv_heads, dim), (1, seq, kv_heads, dim), (1, seq, heads, dim)]
        host = [jax.random.normal(key, s, jnp.float32).astype(dtype) for key, s in zip(keys, shapes)]
        sharded_args = [jax.device_put(x, sharding) for x in host]
        for causal in (False, True):
            config = dict(segment_lengths=segs, dilation_rates=(1, 2, 4), causal=causal)

            def sharded(**kw):
                body = lambda q, k, v: jax_attn.ring_dilated_attention(q, k, v, axis_name="sp", **config, **kw)
                return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"),
                                     check_vma=False)

            columns = {"one_gpu_ordered": (lambda q, k, v: jax_attn.dilated_attention(q, k, v, ordering=perm,
                                                                                      **config), host),
                       "sharded_ordered": (sharded(ordering="hilbert", grid=grid), sharded_args),
                       "sharded_plain": (sharded(), sharded_args)}
            for mode in harness.MODES:
                outs = {}
                for name, (f, args) in columns.items():
                    g = harness.jax_forward(f) if mode == "fwd" else harness.jax_forward_backward(f)
                    ms, out, first_s = harness.time_jax(g, args if mode == "fwdbwd" else args[:3], opts.target_ms,
                                                        opts.repeats)
                    outs[name] = out
                    row = dict(seq=seq, causal=causal, mode=mode, column=name, ms=ms, devices=n, compile_s=first_s)
                    if name == "sharded_ordered":
                        a, b = (jax.tree.leaves(outs[c]) for c in ("sharded_ordered", "one_gpu_ordered"))
                        row["relerr"] = max(float(jnp.linalg.norm((x - y).astype(jnp.float32))
                                                  / jnp.linalg.norm(y.astype(jnp.float32))) for x, y in zip(a, b))
                    harness.log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in row.items()))
                    rows.append(row)
    doc["rows"] = rows
    harness.write_json(f"{stem}.json", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
