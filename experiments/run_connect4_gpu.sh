#!/usr/bin/env bash
# Issue 14 on one GPU (nvidia-h100-x1), one device call: `connect4.py --preset gpu` for MINUTES of training
# (a device call ends at 10 minutes), then the run's newest checkpoint against the ladder (evaluate_run.py).
# Carry .whl_env (open_spiel for mcts) and, if present, .earl_cc (the compile cache of an earlier call).
#   experiments/run_connect4_gpu.sh 8 [extra connect4.py flags]
# Only a few files come back from a device call: metrics.jsonl, evaluation.json, config.json and the log.
set -u
MINUTES=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1 EARL_COMPILE_CACHE=$PWD/.earl_cc
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
RUN=runs/connect4-gpu-$(date +%H%M%S)
python3 experiments/connect4.py --preset gpu --max-minutes "$MINUTES" --wandb-mode disabled \
  --eval-opponents random,alphabeta:2 --run-dir "$RUN" "$@" > "$OUT/connect4_gpu.log" 2>&1
grep -E "first RL iteration|promot|no learning signal" "$OUT/connect4_gpu.log" | head -20; tail -n 5 "$OUT/connect4_gpu.log"
timeout 150 python3 experiments/evaluate_run.py "$RUN" --games 64 \
  --opponents random,alphabeta:1,alphabeta:2,alphabeta:3,mcts:100 2>&1 | tail -n 8
cp "$RUN/metrics.jsonl" "$RUN/config.json" "$RUN/evaluation.json" "$OUT/" 2>/dev/null
tail -n 300 "$OUT/connect4_gpu.log" > "$OUT/log_tail.txt"; rm "$OUT/connect4_gpu.log"
