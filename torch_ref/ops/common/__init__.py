"""What the variants share: `validation` (argument checks), `rope` (the plain RoPE rotation; the
config is `attn_spec.rope.Rope`) and `triton_tiles` (the Triton tile toolkit; imports triton)."""
