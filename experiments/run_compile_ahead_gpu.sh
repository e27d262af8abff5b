#!/usr/bin/env bash
# Compiling ahead (rollout/compile_ahead.py) on two GPUs (nvidia-h100-x2 / nvidia-h200-x2), one device call, every
# run from an empty compile cache:
# 1. first_iteration.py --gpu: 512 compact free-text games, tiny model, --compile-ahead false / true side by side
#    (one GPU each);
# 2. the pod preset, --model qwen2.5-1.5b on both GPUs, command to first finished iteration, false then true.
# Carry .whl_env (open_spiel, gymnasium for the image's Python).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z_' | sed 's/nvidia_//; s/_80gb.*//; s/_hbm.*//; s/_nvl.*//')
timeout 200 python3 experiments/first_iteration.py --gpu --flag compile-ahead --values false true --repeats 1 \
  --out "$OUT/first_iteration_compile_ahead_${DEV}x2.json" 2>&1 | tail -4
POD="--preset pod --model qwen2.5-1.5b --steps 2 --eval-games 16 --format-warmup-steps 0 --wandb-mode disabled --progress false --checkpoint-every 0 --keep-checkpoints 0"
for ahead in ${AHEAD:-false true}; do
  echo "=== pod 1.5B on 2 GPUs, cold, --compile-ahead $ahead"
  timeout ${POD_S:-170} python3 experiments/connect4.py $POD --compile-cache /tmp/cc_pod_$ahead --compile-ahead $ahead \
    --run-dir /tmp/pod_$ahead > "$OUT/pod_$ahead.log" 2>&1
  echo "rc=$?"; grep -E "first RL iteration|iteration [0-9]/|model:|out of memory|RESOURCE|Error" "$OUT/pod_$ahead.log" | tail -5
  python3 - "$ahead" <<'PY'
import json, sys
for line in open(f"/tmp/pod_{sys.argv[1]}/metrics.jsonl"):
    r = json.loads(line)
    print({k: r.get(k) for k in ("step", "time/rollout_s", "time/compile_s", "compile/lowered", "compile/ahead",
                                 "time/compile_ahead_s", "time/compile_ahead_waited_s", "compile/ahead_failed",
                                 "compile/ahead_submitted", "compile/ahead_used", "compile/slowest")})
PY
done
