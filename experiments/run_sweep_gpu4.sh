#!/usr/bin/env bash
# Issue 12 item 5 on 4 GPUs (nvidia-h100-x4), one device call: the selector sweep (launch/sweep_selector.yaml,
# random search, seed 0) for TRIALS trials of at most TRIAL_S seconds each, offline (no wandb). Carry .whl_env.
#   TRIALS=4 TRIAL_S=135 bash experiments/run_sweep_gpu4.sh
#   ONLY=2,3 TRIAL_S=270 bash experiments/run_sweep_gpu4.sh        # two of them, each with time for 3+ iterations
# Back in $OUT: summary.csv, trials.jsonl, the printed table (sweep.log) and every trial's metrics (trials.tgz).
# A trial cut by its timeout keeps the iterations it finished (sweep.py summarizes the run folder either way).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TRIALS=${TRIALS:-4}; TRIAL_S=${TRIAL_S:-135}
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 EARL_COMPILE_CACHE=${EARL_COMPILE_CACHE:-/tmp/sweep_cc}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
SW=/tmp/sweep_selector
timeout 585 python3 experiments/sweep.py launch/sweep_selector.yaml --trials "$TRIALS" --timeout "$TRIAL_S" ${ONLY:+--only "$ONLY"} \
  --out "$SW" -- --wandb-mode disabled 2>&1 | tee "$OUT/sweep.log"
cp "$SW/summary.csv" "$SW/trials.jsonl" "$OUT/" 2>/dev/null
tar czf "$OUT/trials.tgz" -C "$SW" --exclude checkpoints . 2>/dev/null
for f in "$SW"/*.log; do echo "== $(basename "$f")"; grep -E "first RL iteration|iteration [0-9]+/|out of memory|Error|plan" "$f" | tail -6; done
