"""Dilated attention (LongNet): `reference` (the definition, eager PyTorch) and `triton` (each branch
through the softmax kernels' row map, the merge and the autograd Function; imports triton)."""
