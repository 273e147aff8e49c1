#!/usr/bin/env bash
# One script for a lent GPU (no network, packages preinstalled): GPU tests, the parity check and
# the benchmarks, logs under $OUT (the device tool returns at most 8 files: keep $OUT small, or
# cat the logs into one file). Usage: bash scripts/gpu_session.sh [warn|tests|parity|rope|sb|sweep|bench|all]...
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
stages=${*:-all}
has() { [[ " $stages " == *" $1 "* || " $stages " == *" all "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import jax, torch, triton, flax; print('jax', jax.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
if has warn; then  # which warnings does a Pallas Triton lowering raise here?
  python3 -W always -c "
import warnings, jax, jax.numpy as jnp
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter('always')
    import jax_attn
    x = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    jax_attn.flash_attention(x, x, x).block_until_ready()
print('warnings seen after the library filter:', [(type(i.message).__name__, str(i.message)[:200]) for i in w])
" 2>&1 | tail -5
fi
if has tests; then  # GPU tests, one pytest per file in parallel (compilation is CPU-bound)
  for f in ${GPU_TEST_FILES:-tests/test_jax_stick_breaking.py tests/test_torch_stick_breaking.py tests/test_jax_flash.py tests/test_jax_mosaic.py tests/test_jax_rope.py tests/test_torch_ref.py tests/test_torch_rope.py}; do
    n=$(basename "$f" .py)
    timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu "$f" -p no:cacheprovider > "$OUT/gpu-$n.txt" 2>&1 &
  done
fi
wait  # tests and parity side by side ran 13 processes and out of GPU memory (H100, 80 GB)
if has parity; then  # parity in shards of cases, in parallel; PARITY_CASES picks cases (default all)
  cases=${PARITY_CASES:-$(python3 -c "from parity.cases import CASES; from parity.layers import LAYER_CASES; print(' '.join(c.name for c in CASES + LAYER_CASES))")}
  shards=${PARITY_SHARDS:-4}; i=0
  declare -a shard
  for c in $cases; do shard[$((i % shards))]+="${shard[$((i % shards))]:+,}$c"; i=$((i+1)); done
  for s in "${!shard[@]}"; do
    timeout ${PARITY_TIMEOUT:-420} python3 -m parity.check --cases "${shard[$s]}" --json "$OUT/parity-gpu-$s.json" > "$OUT/parity-gpu-$s.txt" 2>&1 &
  done
fi
wait
if has tests; then tail -n 3 "$OUT"/gpu-test_*.txt; fi
if has parity; then grep -hE "FAIL|passed in|Error|: ok" "$OUT"/parity-gpu-*.txt | grep -v "│ ok" | head -80; fi
if has rope; then
  timeout 300 python3 benchmarks/rope.py --out "$OUT" 2>&1 | tee "$OUT/rope-log.txt" | tail -12
fi
if has sb; then  # with torch, JAX grows its memory: the plain-jnp fwd+bwd row at S=8192 (36 GB) then runs out of
  # memory; the second run, JAX preallocating and without torch, times it (benchmarks/stick_breaking.py)
  timeout 420 python3 benchmarks/stick_breaking.py --out "$OUT" ${SB_ARGS:-} 2>&1 | tee "$OUT/sb-log.txt" | tail -16
  XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 420 python3 benchmarks/stick_breaking.py \
    --out "$OUT/preallocated" --no-torch ${SB_ARGS:-} 2>&1 | tee "$OUT/sb-log-preallocated.txt" | tail -8
fi
if has sweep; then
  timeout ${SWEEP_TIMEOUT:-400} python3 benchmarks/sweep_blocks.py --out "$OUT" 2>&1 | tee "$OUT/sweep-log.txt" | grep BEST
fi
if has bench; then
  timeout 480 python3 benchmarks/attention.py --out "$OUT" 2>&1 | tee "$OUT/bench-log.txt" | tail -40
fi
