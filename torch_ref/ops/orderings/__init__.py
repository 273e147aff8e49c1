"""Space-filling-curve orderings in the kernels: `reference` (the explicit composite, eager PyTorch;
the kernels themselves are the softmax engine's, gathering rows through the permutation)."""
