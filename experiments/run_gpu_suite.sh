#!/usr/bin/env bash
# One device call on two GPUs (nvidia-h100-x2): train-stage benchmark and its peer baseline side by side
# (one GPU each), then the dispatch-latency figure (Fig. 4) and the selector heat map (Fig. 3) on both.
# Results land in $OUT (the device tool brings them back) and are copied into experiments/results/ by hand.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
LOG=$OUT/gpu_suite.log
if [ -d .whl ]; then  # tunix for the peer baseline (carried wheels, no internet there)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PEER_PYTHONPATH=/tmp/site
fi
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  CUDA_VISIBLE_DEVICES=0 timeout 230 python3 experiments/bench_train.py --time-budget 150 --case-timeout 150 \
     --remat dots --out "$OUT" > "$OUT/bench_train.log" 2>&1 &
  ( for bt in "8 4096" "16 2048"; do set -- $bt
      CUDA_VISIBLE_DEVICES=1 B=$1 T=$2 PYTHONPATH=${PEER_PYTHONPATH:-} timeout 110 python3 .peer/peer_train.py
    done ) > "$OUT/peer_train.log" 2>&1
  wait
  cat "$OUT/bench_train.log" "$OUT/peer_train.log"; rm -f "$OUT/bench_train.log" "$OUT/peer_train.log"
  echo "=== fig4"; timeout 120 python3 experiments/fig4_dispatch_latency.py --repeats 20 --out "$OUT"
  echo "=== fig3"; timeout 250 python3 experiments/fig3_selector_heatmap.py --gpu --no-progress --time-budget 170 \
     --out "$OUT"
} 2>&1 | tee "$LOG"
ls -la "$OUT"
