"""Native Sparse Attention (attn_spec.nsa): `reference` (the definition, eager PyTorch, dense
masks), `validation` (argument checks) and `triton` (the group-centric selection kernels, the
compression branch and the importance; imports triton)."""
