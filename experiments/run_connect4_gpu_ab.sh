#!/usr/bin/env bash
# Issue 14, `connect4.py --preset gpu` runs side by side on the GPUs of one machine, one device call: run A on GPU 0
# with A's flags, run B on GPU 1 with B's flags (nvidia-h100-x2), and C, D on GPUs 2, 3 when set (nvidia-h100-x4),
# MINUTES of training each, then each run's newest checkpoint against the ladder (evaluate_run.py). Same code, same
# host, same minutes: a paired comparison of learning settings. Carry .whl_env.
#   A="" B="--group-seeds per_game" experiments/run_connect4_gpu_ab.sh 7
#   A="" B="--ppo-mini-batches 4" C="--model-logit-scale 4" D="..." experiments/run_connect4_gpu_ab.sh 5
# Back in $OUT: {a,b}/metrics.jsonl, {a,b}/evaluation.json, {a,b}/log_tail.txt, device.txt (7 files); with C or D
# set, all of it in runs.tgz (only 8 files come back from a call). Then experiments/summarize_connect4_gpu_ab.py.
# Longer than one call (600 s) allows, in parts: SAVE=1 skips the evaluation and returns each run (its newest
# checkpoint and metrics; not the compile cache, which would pass the 16 MiB a returned file may have) as
# $OUT/NAME/state.tgz; copy those into an ignored folder here and carry it into the next call as STATE="that/*.tgz",
# which continues each run (--resume; MINUTES more of training, compiles included) from where it stopped:
#   SAVE=1 A="" B="..." experiments/run_connect4_gpu_ab.sh 7.5        # then, carrying gpu_state/:
#   STATE="gpu_state/*.tgz" A="" B="..." experiments/run_connect4_gpu_ab.sh 7
# ONLY_A=1 runs A alone (one GPU, the whole host to itself: the setting of the one-GPU target).
# SAME_GPU=1 runs every run on GPU 0 (one-GPU machine; each process gets 45% of its memory): a paired comparison of
# learning per iteration, not of speed (the runs share the GPU and the host).
set -u
MINUTES=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"  # each run's folder is made below
NAMES="a b"
[ -n "${ONLY_A:-}" ] && NAMES="a"
[ -n "${C+x}" ] && NAMES="$NAMES c"
[ -n "${D+x}" ] && NAMES="$NAMES d"
source experiments/gpu_wheels.sh; install_wheels
RESUME=()
if [ -n "${STATE:-}" ]; then  # runs/connect4-gpu-* from the previous part
  for f in $STATE; do tar xzf "$f" || { echo "STATE: $f did not unpack" >&2; exit 1; }; done
  RESUME=(--resume)
fi
export PYTHONUNBUFFERED=1
[ -n "${SAME_GPU:-}" ] && export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45  # two processes under jax's default 75% each
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 | tee "$OUT/device.txt"
one() {  # one() NAME GPU FLAGS...
  local name=$1 gpu=$2; shift 2
  local run=runs/connect4-gpu-$name
  CUDA_VISIBLE_DEVICES=$gpu EARL_COMPILE_CACHE=/tmp/cc_$name python3 experiments/connect4.py --preset gpu \
    --max-minutes "$MINUTES" --wandb-mode disabled --eval-opponents random,alphabeta:2 --run-dir "$run" \
    "${RESUME[@]}" "$@" \
    >> "/tmp/$name.log" 2>&1
  if [ -n "${SAVE:-}" ]; then  # a part: the evaluation comes after the last one
    tail -n 200 "/tmp/$name.log" > "$OUT/$name/log_tail.txt"; cp "$run/metrics.jsonl" "$OUT/$name/"; return
  fi
  CUDA_VISIBLE_DEVICES=$gpu timeout 150 python3 experiments/evaluate_run.py "$run" --games 64 \
    --opponents random,alphabeta:1,alphabeta:2,alphabeta:3,mcts:100 >> "/tmp/$name.log" 2>&1
  cp "$run/metrics.jsonl" "$run/evaluation.json" "$OUT/$name/" 2>/dev/null
  tail -n 200 "/tmp/$name.log" > "$OUT/$name/log_tail.txt"
}
gpu=0
for n in $NAMES; do
  flags_var=${n^^}
  mkdir -p "$OUT/$n"
  # shellcheck disable=SC2086
  one "$n" "$gpu" ${!flags_var:-} &
  [ -n "${SAME_GPU:-}" ] || gpu=$((gpu + 1))
done
wait
for n in $NAMES; do echo "== $n"; grep -E "first RL iteration|promot|no learning signal" "/tmp/$n.log" | head -8; tail -n 8 "/tmp/$n.log"; done
if [ -n "${SAVE:-}" ]; then  # each run with its newest checkpoint only (orbax keeps 3)
  for n in $NAMES; do
    ls -d "runs/connect4-gpu-$n/checkpoints"/*/ 2>/dev/null | sort -V | head -n -1 | xargs -r rm -rf
    tar czf "$OUT/$n/state.tgz" "runs/connect4-gpu-$n" && ls -la "$OUT/$n/state.tgz"
  done
fi
if [ "$NAMES" != "a b" ]; then (cd "$OUT" && tar czf /tmp/runs.tgz $NAMES device.txt && rm -rf $NAMES device.txt && mv /tmp/runs.tgz .); fi
