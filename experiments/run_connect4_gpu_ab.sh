#!/usr/bin/env bash
# Issue 14, two `connect4.py --preset gpu` runs side by side on two GPUs of one machine (nvidia-h100-x2), one
# device call: run A on GPU 0 with A's flags, run B on GPU 1 with B's flags, MINUTES of training each, then each
# run's newest checkpoint against the ladder (evaluate_run.py). Same code, same host, same minutes: a paired
# comparison of a learning setting. Carry .whl_env.
#   A="" B="--group-seeds per_game" experiments/run_connect4_gpu_ab.sh 7
# Back in $OUT: {a,b}/metrics.jsonl, {a,b}/evaluation.json, {a,b}/log_tail.txt, device.txt (7 files).
set -u
MINUTES=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/a" "$OUT/b"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 | tee "$OUT/device.txt"
one() {  # one() NAME GPU FLAGS...
  local name=$1 gpu=$2; shift 2
  local run=runs/connect4-gpu-$name
  CUDA_VISIBLE_DEVICES=$gpu EARL_COMPILE_CACHE=/tmp/cc_$name python3 experiments/connect4.py --preset gpu \
    --max-minutes "$MINUTES" --wandb-mode disabled --eval-opponents random,alphabeta:2 --run-dir "$run" "$@" \
    > "/tmp/$name.log" 2>&1
  CUDA_VISIBLE_DEVICES=$gpu timeout 150 python3 experiments/evaluate_run.py "$run" --games 64 \
    --opponents random,alphabeta:1,alphabeta:2,alphabeta:3,mcts:100 >> "/tmp/$name.log" 2>&1
  cp "$run/metrics.jsonl" "$run/evaluation.json" "$OUT/$name/" 2>/dev/null
  tail -n 200 "/tmp/$name.log" > "$OUT/$name/log_tail.txt"
}
# shellcheck disable=SC2086
one a 0 ${A:-} &
# shellcheck disable=SC2086
one b 1 ${B:-} &
wait
for n in a b; do echo "== $n"; grep -E "first RL iteration|promot|no learning signal" "/tmp/$n.log" | head -8; tail -n 8 "/tmp/$n.log"; done
