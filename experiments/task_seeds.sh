#!/usr/bin/env bash
# The shipped tasks' CPU defaults over three seeds, side by side on one host's CPUs (two cores per run):
# step 0's evaluation is the SFT base (the preset's --sft.steps on the expert's episodes), the last one RL from it.
#   PRESETS="tiny-cpu arithmetic" EXTRA="--optim.learning-rate 5e-4" bash experiments/task_seeds.sh OUT [SEEDS] [STEPS] [MIN]
set -euo pipefail
out=${1:?OUT_DIR}; seeds=${2:-"1 2 3"}; steps=${3:-60}; minutes=${4:-7}
mkdir -p "$out"
[ -n "${TAG:-}" ] && out="$out/$TAG" && mkdir -p "$out"
core=0
for preset in ${PRESETS:-tiny-cpu arithmetic}; do
  for seed in $seeds; do
    JAX_PLATFORMS=cpu taskset -c "$core,$((core + 1))" python experiments/train.py --preset "$preset" --seed "$seed" \
      --steps "$steps" --run.max-minutes "$minutes" --eval.games 128 --eval.every 10 --run.progress false \
      --run.wandb-mode disabled ${EXTRA:-} --run-dir "$out/$preset-$seed" > "$out/$preset-$seed.log" 2>&1 &
    core=$((core + 2))
  done
done
wait
