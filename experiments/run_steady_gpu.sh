#!/usr/bin/env bash
# Two versions or settings of the 512-game compact free-text job (tiny model) side by side on two GPUs (one each,
# empty compile caches), STEPS iterations; per iteration: iteration and rollout seconds, foreground compile seconds
# and programs, ahead compiles (submitted / used), the slowest compiles. Used for calls 43-44 (NOTES.md).
#   A_DIR=. A_FLAGS="--compile-ahead false" B_DIR=. B_FLAGS="--compile-ahead true" bash experiments/run_steady_gpu.sh
#   A_DIR=.baseline B_DIR=. bash experiments/run_steady_gpu.sh      # a baseline commit checked out at .baseline (carry it)
# Carry .whl_env.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1
JOB="--groups 64 --group-size 8 --prompt-style compact --constrain-moves false --format-warmup-steps 0 --eval-every 0"
JOB="$JOB --eval-games 8 --checkpoint-every 0 --steps ${STEPS:-12} --wandb-mode disabled --progress false --compile-cache off"
ROOT=$(pwd)
CUDA_VISIBLE_DEVICES=0 bash -c "cd ${A_DIR:-.} && PYTHONPATH=/tmp/site:. timeout ${JOB_S:-400} python3 experiments/connect4.py $JOB ${A_FLAGS:-} --run-dir /tmp/steady_a" > "$OUT/steady_a.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 bash -c "cd ${B_DIR:-.} && PYTHONPATH=/tmp/site:. timeout ${JOB_S:-400} python3 experiments/connect4.py $JOB ${B_FLAGS:-} --run-dir /tmp/steady_b" > "$OUT/steady_b.log" 2>&1 &
wait
for side in a b; do
  echo "=== $side"; grep -E "first RL iteration|Error" "$OUT/steady_$side.log" | tail -2
  cp /tmp/steady_$side/metrics.jsonl "$OUT/steady_$side.jsonl"
  python3 - "$side" <<'PY'
import json, sys
for line in open(f"/tmp/steady_{sys.argv[1]}/metrics.jsonl"):
    r = json.loads(line)
    if "time/rollout_s" in r:
        print(r["step"], *(round(r.get(k) or 0, 3) for k in ("time/iteration_s", "time/rollout_s", "time/compile_s")),
              r.get("compile/lowered"), r.get("compile/ahead"), r.get("compile/ahead_submitted"), r.get("compile/ahead_used"),
              r.get("compile/slowest"))
PY
done
