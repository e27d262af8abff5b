#!/usr/bin/env bash
# Fig. 1 on one GPU (nvidia-h100-x1), one device call: the static and the selector training runs at once,
# each capped at 5 GiB of the card. The device image lacks open_spiel and gymnasium: carry their wheels in
# .whl_env (pip download, see README "GPU machines"); pip picks the one for the image's Python.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels
export PYTHONUNBUFFERED=1
python3 -c 'import sys, jax; print(sys.version.split()[0], jax.__version__, jax.devices())'
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 580 python3 experiments/fig1_context_growth.py --gpu --timeout 420 --out "$OUT" "$@" 2>&1 | tee "$OUT/fig1_gpu.log"
