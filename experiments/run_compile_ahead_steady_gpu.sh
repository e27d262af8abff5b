#!/usr/bin/env bash
# Compiling ahead after the first iteration (two GPUs, one device call, call 42 in NOTES.md): the 512-game compact
# free-text job (tiny model) for 12 iterations, --compile-ahead false (A) / true (B) side by side, one GPU each, empty
# compile caches. Then: python experiments/summarize_compile_ahead.py --first CALL_41_DIR --steady THIS_CALL_DIR ...
# Carry .whl_env.
A_FLAGS="--compile-ahead false" B_FLAGS="--compile-ahead true" STEPS=${STEPS:-12} \
  exec bash "$(dirname "$0")/run_steady_gpu.sh"
