"""Dilated attention (LongNet): `reference` (the definition, eager PyTorch)."""
