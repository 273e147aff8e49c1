"""The attention variants, each with its plain reference beside its Triton kernels:
`softmax/` (flash attention) and `stick_breaking/` (ExpoSB); what they share is in `common/`.

Nothing here imports triton: import `torch_ref.ops.<variant>.triton` (or
`torch_ref.ops.common.triton_tiles`) only once the interpreter choice (TRITON_INTERPRET=1) is made.
"""
