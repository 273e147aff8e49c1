"""Framework-free definitions shared by `jax_attn` and `torch_ref` (imports neither jax nor torch):
the RoPE config, the layers' argument checks, the sinusoidal table formula and the visit planner's
static part (NumPy)."""
