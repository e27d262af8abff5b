"""Pallas GPU kernels (Triton lowering) for the single-device decode step.

`linear`: a skinny matmul (a few rows of activations against a whole weight matrix) with the decode
step's neighbours fused into it: the RMS norm's row scale, bias, SwiGLU, the residual add.
`decode_attention`: RoPE + the new token's cache write + flash-decoding attention over each row's
valid cache prefix, split along the cache for long contexts.
`tuning`: the launch parameters per shape, and which op runs in Pallas or XLA, as measured.

Every kernel runs under `interpret=True` on CPU (tests/models/test_kernels.py compares it with XLA there).
"""
