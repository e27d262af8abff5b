#!/usr/bin/env bash
# Fig. 1 on one GPU (nvidia-h100-x1), one device call: the static and the selector training runs at once,
# each capped at 5 GiB of the card. Needs open_spiel, gymnasium (+ farama-notifications, ml_collections) as wheels
# in .whl_env (carry it). Results land in $OUT and are copied into experiments/results/ by hand.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_env/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 580 python3 experiments/fig1_context_growth.py --gpu --timeout 420 --out "$OUT" "$@" 2>&1 | tee "$OUT/fig1_gpu.log"
