#!/usr/bin/env bash
# Issue 13 on a 4-GPU machine (nvidia-h100-x4), one device call:
#  1. four one-GPU jobs at once (GPU k runs one of them): the agent loop before (commit 4fdd9ec at .baseline: carry it)
#     and after, at 512 and at 2048 compact games, tiny model, pgx's batched Connect Four beside;
#  2. all four GPUs, 2048 games, one case after another (FOUR="case:seconds ..."): by default four processes of one
#     job, one GPU each, with the rollout split by process (gpu2048_4proc) and not (gpu2048_4proc_nosplit), then one
#     process over the four GPUs (gpu2048, one SPMD decode). Calls 26-27 ran device groups and one SPMD decode.
# Carry .whl_env (open_spiel, gymnasium, pgx wheels for the image's Python), .baseline and .earl_cc (compile cache);
# JOBS= picks the one-GPU jobs; EXTRA= adds connect4.py flags to the four-GPU cases, JEXTRA= to the one-GPU jobs.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels pgx svgwrite
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 EARL_COMPILE_CACHE=/tmp/earl_cc
[ -d .earl_cc ] && cp -r .earl_cc /tmp/earl_cc
nvidia-smi --query-gpu=name,memory.total --format=csv
B="python3 experiments/bench_agent_loop.py --gpu --timeout 220"
JOBS=${JOBS-"gpu512:baseline gpu512:current gpu2048:baseline gpu2048:current"}  # case:code, one GPU each
k=0
for j in $JOBS; do
  c=${j%:*} code=${j#*:}
  CUDA_VISIBLE_DEVICES=$k timeout 250 $B --cases $c --codes $code --out "$OUT/one_${c}_$code" ${JEXTRA:+-- $JEXTRA} \
    > "$OUT/one_${c}_$code.log" 2>&1 &
  k=$((k + 1))
done
wait
[ -n "$JOBS" ] && grep -hE "^gpu" "$OUT"/one_*.log | cut -c1-600
FOUR=${FOUR-"gpu2048_4proc:170 gpu2048_4proc_nosplit:150 gpu2048:130"}
for c in $FOUR; do
  timeout $((${c#*:} + 10)) $B --cases ${c%:*} --codes current --timeout ${c#*:} --out "$OUT/four_${c%:*}" \
    ${EXTRA:+-- $EXTRA} > "$OUT/four_${c%:*}.log" 2>&1
  grep -hE "^gpu|Error" "$OUT/four_${c%:*}.log" | cut -c1-600
done
# only 8 files come back from a device call: every log and JSON in one archive
(cd "$OUT" && tar czf /tmp/agent_loop_out.tgz --exclude='*.png' . && rm -rf ./* && mv /tmp/agent_loop_out.tgz .)
