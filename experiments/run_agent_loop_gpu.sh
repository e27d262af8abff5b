#!/usr/bin/env bash
# Issue 13 on one GPU (nvidia-h100-x1), one device call: the agent loop before (commit 4fdd9ec, checked out at
# .baseline: carry it) and after, 512 and 2048 compact games, tiny model; pgx's batched Connect Four beside.
# Carry .whl_env (open_spiel, gymnasium, pgx wheels for the image's Python) and .baseline.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links .whl_env --no-deps --no-compile --no-cache-dir --target /tmp/site \
  open_spiel gymnasium farama-notifications ml_collections cloudpickle pgx svgwrite && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 EARL_COMPILE_CACHE=/tmp/earl_cc
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 570 python3 experiments/bench_agent_loop.py --gpu --timeout 200 --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_agent_loop.log"
