#!/usr/bin/env bash
# Compiling ahead after the first iteration (two GPUs, one device call): the 512-game compact free-text job (tiny
# model) for 12 iterations, --compile-ahead false / true side by side (one GPU each, empty compile caches); per
# iteration: rollout seconds, foreground compile seconds and programs, ahead compiles (submitted / used).
# Carry .whl_env.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links .whl_env --no-deps --no-compile --no-cache-dir --target /tmp/site \
  open_spiel gymnasium farama-notifications ml_collections cloudpickle 2>/dev/null && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
JOB="--groups 64 --group-size 8 --prompt-style compact --constrain-moves false --format-warmup-steps 0 --eval-every 0
     --eval-games 8 --checkpoint-every 0 --steps ${STEPS:-12} --wandb-mode disabled --progress false --compile-cache off"
i=0
for ahead in false true; do
  CUDA_VISIBLE_DEVICES=$i timeout ${JOB_S:-400} python3 experiments/connect4.py $JOB --compile-ahead $ahead \
    --run-dir /tmp/steady_$ahead > "$OUT/steady_$ahead.log" 2>&1 &
  i=$((i + 1))
done
wait
for ahead in false true; do
  echo "=== --compile-ahead $ahead"; grep -E "first RL iteration|Error" "$OUT/steady_$ahead.log" | tail -2
  cp /tmp/steady_$ahead/metrics.jsonl "$OUT/steady_$ahead.jsonl"
  python3 - "$ahead" <<'PY'
import json, sys
for line in open(f"/tmp/steady_{sys.argv[1]}/metrics.jsonl"):
    r = json.loads(line)
    if "time/rollout_s" in r:
        print(r["step"], *(round(r.get(k) or 0, 3) for k in ("time/iteration_s", "time/rollout_s", "time/compile_s")),
              r.get("compile/lowered"), r.get("compile/ahead"), r.get("compile/ahead_submitted"), r.get("compile/ahead_used"),
              r.get("compile/slowest"))
PY
done
