"""Attention benchmarks (GPU; `--smoke` on a CPU): harness.py, one script per variant, run_all.py."""
