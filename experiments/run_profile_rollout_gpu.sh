#!/usr/bin/env bash
# Where one GPU's rollout time goes (experiments/profile_rollout.py), 2048 then 512 compact free-text games, tiny
# model, one device call (nvidia-h100-x1). Carry .whl_env (open_spiel, gymnasium wheels) and .earl_cc.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1 EARL_COMPILE_CACHE=/tmp/earl_cc
[ -d .earl_cc ] && cp -r .earl_cc /tmp/earl_cc
nvidia-smi --query-gpu=name,memory.total --format=csv
for games in 256 64; do
  timeout 270 python3 experiments/profile_rollout.py --out "$OUT/g$games" -- --groups $games --group-size 8 \
    --prompt-style compact --constrain-moves false 2>&1 | tee "$OUT/profile_g$games.log" | grep -vE "^ +[0-9]" | tail -30
done
