#!/usr/bin/env bash
# One script for a lent GPU (no network, packages preinstalled): GPU tests, the parity check and
# the benchmarks, logs under $OUT. Usage: bash scripts/gpu_session.sh [warn|tests|parity|rope|bench|all]...
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
  timeout 240 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.txt" | tail -25
fi
if has parity; then
  timeout 300 python3 -m parity.check --json "$OUT/parity-gpu.json" > "$OUT/parity-gpu.txt" 2>&1
  echo "parity exit $?"; grep -E "FAIL|passed in|Error" "$OUT/parity-gpu.txt" | head -30
fi
if has rope; then
  timeout 300 python3 benchmarks/rope.py --out "$OUT" 2>&1 | tee "$OUT/rope-log.txt" | tail -12
fi
if has bench; then
  timeout 480 python3 benchmarks/attention.py --out "$OUT" 2>&1 | tee "$OUT/bench-log.txt" | tail -40
fi
