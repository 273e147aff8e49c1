#!/usr/bin/env bash
# The GPU checks on a machine with an NVIDIA GPU (no network, packages preinstalled): the GPU tests,
# the parity check and the benchmarks, logs and JSON under $OUT (default /tmp/gpu_out).
# Usage: bash scripts/run_gpu_checks.sh [warn|tests|parity|bench|softmax|rope|sb|dilated|orderings|sweep|ring|ring_dilated|all]...
#   tests    pytest -m gpu, one process per test file, in parallel (compilation is CPU-bound)
#   parity   python -m parity.check, one process per variant, in parallel
#   bench    benchmarks/run_all.py (every benchmark, its --quick cases: run_all's default)
#   softmax, rope, sb, dilated, orderings, sweep   one full benchmark: benchmarks/softmax.py, rope.py,
#            stick_breaking.py, dilated.py, orderings.py, sweep_blocks.py (extra arguments: SOFTMAX_ARGS,
#            SB_ARGS, DILATED_ARGS, ORDERINGS_ARGS)
#   ring, ring_dilated   benchmarks/ring.py / ring_dilated.py on every visible GPU (RING_ARGS, e.g.
#            --quick; RING_DILATED_ARGS, e.g. --lengths 131072; only when named: they want several GPUs). The multi-GPU tests (tests/test_ring*.py -m gpu) compile S = 16k-32k
#            ring programs and their one-device references: more than 4 minutes; give them a call
#            of their own (GPU_TEST_FILES="tests/test_ring.py tests/test_ring_dilated_ordered.py").
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
if has tests; then
  for f in ${GPU_TEST_FILES:-tests/test_*.py}; do
    n=$(basename "$f" .py)
    timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu "$f" -p no:cacheprovider ${TEST_ARGS:-} > "$OUT/gpu-$n.txt" 2>&1 &
  done
fi
wait  # the tests and parity side by side run out of GPU memory: one stage at a time
if has parity; then
  for v in ${PARITY_VARIANTS:-softmax stick_breaking dilated nsa layers}; do
    timeout ${PARITY_TIMEOUT:-420} python3 -m parity.check --variant "$v" --json "$OUT/parity-gpu-$v.json" \
      > "$OUT/parity-gpu-$v.txt" 2>&1 &
  done
fi
wait
if has tests; then tail -n 3 "$OUT"/gpu-test_*.txt; fi
if has parity; then grep -hE "FAIL|passed in|Error|: ok" "$OUT"/parity-gpu-*.txt | grep -v "│ ok" | head -80; fi
if has bench; then
  timeout 900 python3 benchmarks/run_all.py --out "$OUT" 2>&1 | tee "$OUT/bench-log.txt" | tail -60
fi
if has softmax; then
  timeout ${SOFTMAX_TIMEOUT:-600} python3 benchmarks/softmax.py --out "$OUT" ${SOFTMAX_ARGS:-} 2>&1 | tee "$OUT/softmax-log.txt" | tail -40
fi
if has rope; then
  timeout 300 python3 benchmarks/rope.py --out "$OUT" 2>&1 | tee "$OUT/rope-log.txt" | tail -12
fi
if has sb; then  # with torch, JAX grows its memory and the plain-jnp fwd+bwd row at S=8192 (36 GB) runs
  # out of it; the second run, JAX preallocating and without the torch columns, times that row
  timeout 420 python3 benchmarks/stick_breaking.py --out "$OUT" ${SB_ARGS:-} 2>&1 | tee "$OUT/sb-log.txt" | tail -16
  XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 420 python3 benchmarks/stick_breaking.py \
    --out "$OUT/preallocated" --xla-max-seq 8192 --columns softmax_causal,pallas_triton,mosaic_gpu,triton_rope,xla \
    ${SB_ARGS:-} 2>&1 | tee "$OUT/sb-log-preallocated.txt" | tail -8
fi
if has dilated; then
  timeout ${DILATED_TIMEOUT:-600} python3 benchmarks/dilated.py --out "$OUT" ${DILATED_ARGS:-} 2>&1 | tee "$OUT/dilated-log.txt" | tail -30
fi
if [[ " $stages " == *" ring "* ]]; then
  timeout ${RING_TIMEOUT:-600} python3 benchmarks/ring.py --out "$OUT" ${RING_ARGS:-} 2>&1 | tee "$OUT/ring-log.txt" | tail -30
fi
if [[ " $stages " == *" ring_dilated "* ]]; then
  timeout ${RING_TIMEOUT:-600} python3 benchmarks/ring_dilated.py --out "$OUT" ${RING_DILATED_ARGS:-} 2>&1 | tee "$OUT/ring-dilated-log.txt" | tail -30
fi
if has orderings; then
  timeout ${ORDERINGS_TIMEOUT:-600} python3 benchmarks/orderings.py --out "$OUT" ${ORDERINGS_ARGS:-} 2>&1 | tee "$OUT/orderings-log.txt" | tail -40
fi
if has sweep; then
  timeout ${SWEEP_TIMEOUT:-400} python3 benchmarks/sweep_blocks.py --out "$OUT" 2>&1 | tee "$OUT/sweep-log.txt" | tail -20
fi
