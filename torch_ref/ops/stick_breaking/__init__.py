"""Stick-breaking attention (ExpoSB): `reference` (the definition, eager PyTorch) and `triton` (the
kernels, their launchers and the autograd Function; imports triton)."""
