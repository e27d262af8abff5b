#!/usr/bin/env bash
# Issue 13 on a 4-GPU machine (nvidia-h100-x4), one device call:
#  1. one GPU per job, two jobs at once (GPUs 0 and 1): the agent loop before (commit 4fdd9ec at .baseline: carry it)
#     and after, 512 and 2048 compact games, tiny model, pgx's batched Connect Four beside;
#  2. all four GPUs, 2048 games: the rollout as device groups (the default) and as one SPMD decode.
# Carry .whl_env (open_spiel, gymnasium, pgx wheels for the image's Python), .baseline and .earl_cc (compile cache).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links .whl_env --no-deps --no-compile --no-cache-dir --target /tmp/site \
  open_spiel gymnasium farama-notifications ml_collections cloudpickle pgx svgwrite && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 EARL_COMPILE_CACHE=/tmp/earl_cc
[ -d .earl_cc ] && cp -r .earl_cc /tmp/earl_cc
nvidia-smi --query-gpu=name,memory.total --format=csv
B=experiments/bench_agent_loop.py
CUDA_VISIBLE_DEVICES=0 timeout 340 python3 $B --gpu --cases gpu512 --timeout 170 --out "$OUT/one_gpu512" > "$OUT/one_gpu512.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 330 python3 $B --gpu --cases gpu2048 --timeout 160 --out "$OUT/one_gpu2048" > "$OUT/one_gpu2048.log" 2>&1 &
wait
grep -hE "^gpu|speedup" "$OUT"/one_gpu*.log
timeout 230 python3 $B --gpu --cases gpu2048,gpu2048_spmd --codes current --timeout 110 --out "$OUT/four" 2>&1 \
  | tee "$OUT/four.log" | grep -E "^gpu|wrote|Error"
