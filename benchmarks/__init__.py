"""Benchmarks for the attention kernels (GPU only; see benchmarks/attention.py)."""
