#!/usr/bin/env bash
# Fig. 3 at real size on two GPUs (nvidia-h100-x2): Qwen2.5-7B shape (random init, bf16), rollout TP1 (d2f1t1)
# vs TP2 (d1f1t2), split over two device calls that share a compile cache and the first call's table:
#   PASS=first  bash experiments/run_fig3_2gpu.sh   # first measurement, context rows in CONTEXTS' order, the
#                                                   # table saved after each row; no new row after BUDGET s
#   PASS=second bash experiments/run_fig3_2gpu.sh   # rows the first call left (if started within BUDGET s),
#                                                   # then the independent second measurement the selector is
#                                                   # scored on (no new row after RBUDGET s); the figure
# The first call's table and compile cache stay in /tmp on a warm machine; on a fresh one the second call
# reads them from ./fig3_state/ (table1.json, cc.tgz copied there from the first call's $OUT). A call cut
# short leaves its tables in $OUT: draw them on the CPU with fig3_selector_heatmap.py --table/--eval-table.
# CPU dry run: JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 MODEL=tiny CONTEXTS=64,256 ...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PASS=${PASS:-first}
MODEL=${MODEL:-qwen2.5-7b}
CONTEXTS=${CONTEXTS:-1K,32K,8K,16K,4K}
RESPONSES=${RESPONSES:-8,32,128}
BUDGET=${BUDGET:-150}      # start no new context row of the first measurement after this many seconds
RBUDGET=${RBUDGET:-60}     # the same for the second measurement (PASS=second)
LIMIT=${LIMIT:-215}        # hard wall for the python process: keep it under the device call's timeout_s
PY=${PY:-python3}
STATE=${STATE:-/tmp/fig3_state}; mkdir -p "$STATE"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EARL_COMPILE_CACHE=${EARL_COMPILE_CACHE:-/tmp/fig3_cc}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
COMMON=(--gpu --model "$MODEL" --tp-a 1 --tp-b 2 --contexts "$CONTEXTS" --responses "$RESPONSES" --decode-steps 16
        --no-progress --out "$OUT" --save-table "$STATE/table1.json" --time-budget "$BUDGET")
if [[ "$PASS" == first ]]; then
  timeout "$LIMIT" "$PY" experiments/fig3_selector_heatmap.py "${COMMON[@]}" 2>&1 \
    | grep --line-buffered -v -E "IOTA device assignment|not expected as JAX" | tee "$OUT/fig3_first.log"
  rc=${PIPESTATUS[0]}
else
  if [[ ! -f "$STATE/table1.json" && -f fig3_state/table1.json ]]; then cp fig3_state/table1.json "$STATE/"; echo "table1 from fig3_state/"; fi
  if [[ ! -d "$EARL_COMPILE_CACHE" && -f fig3_state/cc.tgz ]]; then
    mkdir -p "$EARL_COMPILE_CACHE" && tar -xzf fig3_state/cc.tgz -C "$EARL_COMPILE_CACHE" && echo "compile cache from fig3_state/"
  fi
  timeout "$LIMIT" "$PY" experiments/fig3_selector_heatmap.py "${COMMON[@]}" --continue-table "$STATE/table1.json" \
    --remeasure --remeasure-budget "$RBUDGET" --save-remeasure-table "$STATE/table2.json" 2>&1 \
    | grep --line-buffered -v -E "IOTA device assignment|not expected as JAX" | tee "$OUT/fig3_second.log"
  rc=${PIPESTATUS[0]}
fi
echo "rc=$rc (124: cut at ${LIMIT} s)"
cp "$STATE"/table*.json "$OUT/" 2>/dev/null
# the compile cache, for a second call on a fresh machine (only if it is small enough to come back)
if [[ "$PASS" == first && -d "$EARL_COMPILE_CACHE" ]]; then
  tar -I "gzip -1" -cf "$STATE/cc.tgz" -C "$EARL_COMPILE_CACHE" . && sz=$(stat -c %s "$STATE/cc.tgz")
  echo "compile cache: $(ls "$EARL_COMPILE_CACHE" | wc -l) files, $((sz / 1048576)) MiB compressed"
  (( sz < 15 * 1048576 )) && cp "$STATE/cc.tgz" "$OUT/"
fi
ls -la "$OUT"
