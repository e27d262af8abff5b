#!/usr/bin/env bash
# The end-to-end adaptivity figure on 4 GPUs (nvidia-h100-x4), split over device calls that chain on a warm
# machine: each call does the runs in RUNS (fig_e2e_adaptivity.py --runs), each capped at BUDGET seconds, and
# leaves the figure's JSON and the compile cache in /tmp for the next call. Carry .whl_env (and e2e_state/ when
# the machine may be fresh: the JSON of the previous call, copied there from its $OUT).
#   RUNS=static_d4f1t1,static_d2f1t2 bash experiments/run_e2e_gpu4.sh     # call 1
#   RUNS=static_d1f1t4,auto bash experiments/run_e2e_gpu4.sh              # call 2 (auto reads the static runs)
# MODEL / SCHEDULE / STEPS trim the setting (the figure then is named ..._custom, see fig_e2e_adaptivity.py).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUNS=${RUNS:?RUNS=comma list of runs}
BUDGET=${BUDGET:-280}
MODEL=${MODEL:-qwen2.5-1.5b}
SCHEDULE=${SCHEDULE:-0:480,2:3968,4:16000}
STEPS=${STEPS:-5}
STATE=${STATE:-/tmp/e2e_state}; mkdir -p "$STATE"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EARL_COMPILE_CACHE=${EARL_COMPILE_CACHE:-/tmp/e2e_cc}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
# a fresh machine: continue from the JSON the previous call returned
if ! ls "$STATE"/*.json >/dev/null 2>&1 && ls e2e_state/*.json >/dev/null 2>&1; then
  cp e2e_state/*.json "$STATE/" && echo "figure so far from e2e_state/"
fi
echo "compile cache: $(ls "$EARL_COMPILE_CACHE" 2>/dev/null | wc -l) entries"
timeout 590 python3 experiments/fig_e2e_adaptivity.py --gpu4 --model "$MODEL" --schedule "$SCHEDULE" --steps "$STEPS" \
  --runs "$RUNS" --budget-s "$BUDGET" ${RERUN:+--rerun} --out "$STATE" --keep-runs "/tmp/e2e_runs_$(date +%s)" 2>&1 | tee "$OUT/e2e.log"
cp "$STATE"/*.json "$STATE"/*.png "$OUT/" 2>/dev/null
# the last run's output tail, for a run that died
for d in /tmp/e2e_runs_*/*/; do [[ -f "$d/output.log" ]] && grep -E "first RL iteration|iteration [0-9]+/|out of memory|Error" "$d/output.log" | tail -8 | sed "s|^|$(basename "$d"): |"; done
ls -l "$OUT"
