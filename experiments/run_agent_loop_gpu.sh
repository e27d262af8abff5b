#!/usr/bin/env bash
# Issue 13 on one GPU (nvidia-h100-x1), one device call: the agent loop before (commit 4fdd9ec, checked out at
# .baseline: carry it) and after, 512 and 2048 compact games, tiny model; pgx's batched Connect Four beside.
# Carry .whl_env (open_spiel, gymnasium, pgx wheels for the image's Python) and .baseline.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source experiments/gpu_wheels.sh; install_wheels pgx svgwrite
export PYTHONUNBUFFERED=1 EARL_COMPILE_CACHE=/tmp/earl_cc
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 570 python3 experiments/bench_agent_loop.py --gpu --timeout 200 --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_agent_loop.log"
