"""Cross-framework parity: the same attention in JAX and PyTorch, checked against a float64 golden."""
