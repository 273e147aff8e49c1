"""Softmax attention (FlashAttention): `reference` (eager PyTorch) and `triton` (the kernels, their
launchers and the autograd Function; imports triton)."""
