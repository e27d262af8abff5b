#!/usr/bin/env bash
# Fig. 3 at real size on two GPUs (nvidia-h100-x2): Qwen2.5-7B shape (random init, bf16), rollout TP1 (d2f1t1)
# vs TP2 (d1f1t2), measured (context rows in CONTEXTS' order, the table saved after each row, no new row after
# BUDGET s), then measured again (REMEASURE=1; no new row after RBUDGET s): the selector picks from the first
# table and is scored on the second. Results (figure JSON/PNG, both tables, the log) land in $OUT.
#   bash experiments/run_fig3_2gpu.sh                                   # first call
#   CONTEXTS=4K T2=table2b.json bash experiments/run_fig3_2gpu.sh       # a later call: only rows the saved
#       table lacks are measured; T2 keeps the first call's second table apart (merge them on the CPU, then
#       fig3_selector_heatmap.py --table table1.json --eval-table merged.json --devices 2 --device-kind ...)
# The first table and the compile cache stay in /tmp on a warm machine; on a fresh one a later call reads them
# from ./fig3_state/ (table1.json, cc.tgz copied there from the previous call's $OUT).
# CPU dry run: JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 MODEL=tiny CONTEXTS=64,256 \
#   PY=python OUT=/tmp/o STATE=/tmp/s EARL_COMPILE_CACHE=/tmp/cc bash experiments/run_fig3_2gpu.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-qwen2.5-7b}
CONTEXTS=${CONTEXTS:-1K,32K,8K,16K,4K}
RESPONSES=${RESPONSES:-8,32,128}
BUDGET=${BUDGET:-150}      # start no new context row of the first measurement after this many seconds
REMEASURE=${REMEASURE:-1}  # then the second, independent measurement of the same rows
RBUDGET=${RBUDGET:-70}     # start no new context row of the second measurement after this many seconds
T2=${T2:-table2.json}      # where the second measurement's table goes (in $STATE, copied to $OUT)
LIMIT=${LIMIT:-285}        # hard wall for the python process: keep it under the device call's timeout_s
PY=${PY:-python3}
STATE=${STATE:-/tmp/fig3_state}; mkdir -p "$STATE"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EARL_COMPILE_CACHE=${EARL_COMPILE_CACHE:-/tmp/fig3_cc}
[[ -f COMMIT ]] && echo "code: $(cat COMMIT)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
if [[ ! -f "$STATE/table1.json" && -f fig3_state/table1.json ]]; then cp fig3_state/table1.json "$STATE/"; echo "table1 from fig3_state/"; fi
if [[ ! -d "$EARL_COMPILE_CACHE" && -f fig3_state/cc.tgz ]]; then
  mkdir -p "$EARL_COMPILE_CACHE" && tar -xzf fig3_state/cc.tgz -C "$EARL_COMPILE_CACHE" && echo "compile cache from fig3_state/"
fi
ARGS=(--gpu --model "$MODEL" --tp-a 1 --tp-b 2 --contexts "$CONTEXTS" --responses "$RESPONSES" --decode-steps 16
      --no-progress --out "$OUT" --save-table "$STATE/table1.json" --time-budget "$BUDGET")
[[ -f "$STATE/table1.json" ]] && ARGS+=(--continue-table "$STATE/table1.json")
[[ "$REMEASURE" == 1 ]] && ARGS+=(--remeasure --remeasure-budget "$RBUDGET" --save-remeasure-table "$STATE/$T2")
echo "+ $PY experiments/fig3_selector_heatmap.py ${ARGS[*]}"
timeout "$LIMIT" "$PY" experiments/fig3_selector_heatmap.py "${ARGS[@]}" 2>&1 \
  | grep --line-buffered -v -E "IOTA device assignment|not expected as JAX" | tee "$OUT/fig3.log"
rc=${PIPESTATUS[0]}
echo "rc=$rc (124: cut at ${LIMIT} s)"
cp "$STATE/table1.json" "$OUT/" 2>/dev/null; cp "$STATE/$T2" "$OUT/" 2>/dev/null
# the compile cache, for a later call on a fresh machine (only if it is small enough to come back)
if [[ -d "$EARL_COMPILE_CACHE" && ! -f fig3_state/cc.tgz ]]; then
  tar -I "gzip -1" -cf "$STATE/cc.tgz" -C "$EARL_COMPILE_CACHE" . && sz=$(stat -c %s "$STATE/cc.tgz")
  echo "compile cache: $(ls "$EARL_COMPILE_CACHE" | wc -l) files, $((sz / 1048576)) MiB compressed"
  (( sz < 15 * 1048576 )) && cp "$STATE/cc.tgz" "$OUT/"
fi
ls -l "$OUT"
