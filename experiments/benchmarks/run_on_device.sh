#!/usr/bin/env bash
# One device call of a figure or benchmark, from the repository root of a GPU machine:
#   bash experiments/benchmarks/run_on_device.sh SUBCOMMAND [ARGS...]
# Results and logs go to $OUT (default /tmp/out); copy the JSON/PNG you keep into experiments/results/.
# The GPU image lacks open_spiel and gymnasium: carry their wheels in .whl_env (install_wheels, gpu_wheels.sh).
# Settings are environment variables named per subcommand below; docs/results.md gives each figure's command.
#
#   train [bench_train.py args]  bench_train.py on GPU 0, tunix's step (.peer/peer_train.py, if carried) on GPU 1
#   fig1 [args]                  fig1_context_growth.py --gpu: static plan against the selector, 5 GiB cap
#   fig3 [args]                  fig3_selector_heatmap.py (e.g. --gpu4 --model qwen2.5-7b --remeasure); a cell that
#                                hangs (exit 75) is recorded and the run goes on from the saved table until LIMIT s
#                                (CONTINUE=table.json continues a table an earlier call saved; RETRY_HUNG=1)
#   fig4 [args]                  fig4_dispatch_latency.py --repeats 20
#   e2e                          fig_e2e_adaptivity.py --gpu4: RUNS (comma list), BUDGET, MODEL, SCHEDULE, STEPS,
#                                RERUN=1; the figure's JSON chains calls through E2E_STATE (/tmp/e2e_state) or a
#                                carried e2e_state/
#   agent-loop [args]            bench_agent_loop.py --gpu on one GPU (e.g. --cases gpu512)
#   agent-loop-4gpu              JOBS="case ..." one-GPU jobs side by side (GPU k runs job k), then
#                                FOUR="case:seconds ..." jobs over all four GPUs; EXTRA / JEXTRA add connect4.py flags
#   pod-first-iteration          command to first finished iteration of `connect4.py --preset pod`, one run after
#                                another from its own empty compile cache: RUNS="name:timeout_s[:flags,..[:env,..]]",
#                                STEPS (2), EVAL_GAMES (64), MODEL (qwen2.5-1.5b)
#   programs                     `--preset pod` (the model it picks, or MODEL) for STEPS (10) iterations from an empty compile cache, then
#                                again warm (the same cache); then `--preset gpu` for GPU_S seconds (90): per iteration
#                                the seconds, foreground compiles and the log's program lines (the bounded-programs check)
#   steady                       the 512-game compact free-text job on two GPUs side by side, STEPS iterations:
#                                A_FLAGS against B_FLAGS (e.g. A_FLAGS="--rollout.compile-ahead false")
#   bases                        experiments/pretrain.py builds side by side on GPU 0: BASES="name:game:flag,flag ..."
#                                (each base, its JSON/PNG and log in $OUT/name.tgz; the expert games from runs/pretrain/
#                                <game>_games.npz when carried); MEM (0.2) the memory share each, LIMIT (540) seconds;
#                                a copy stays in /tmp/bases/name for later calls (--model.hf-checkpoint)
#   games                        expert games for bases, one process a core: EXPERT="name:procs:games:flag,flag ..."
#                                (games per process; seeds SEED0 (100) up) into /tmp/games/name_SEED.npz, kept on a warm
#                                machine for a later call's BASES (--games-from,/tmp/games/name_*.npz); LIMIT (540) s
#   first-iteration [args]       first_iteration.py --gpu (command to first iteration, empty compile cache)
#   init [args]                  bench_init.py (random init in fresh processes, no compile cache)
#   profile-rollout              profile_rollout.py at 2048 and 512 compact free-text games
#   sweep                        experiments/sweep.py launch/sweep_selector.yaml offline: TRIALS, TRIAL_S, ONLY
#   cpu-seeds                    CPU jobs beside the GPU work, each seed on two cores of its own (taskset from core
#                                CORE0, 4): JOBS="name|game|seeds|flag,flag ..." (seeds comma-separated); then
#                                evaluate_run.py over each job's seeds (GAMES, 256; OPPONENTS, the game's ladder) and
#                                over BASE_<name> when set; runs stop at LIMIT (520) s; results in $OUT/seeds.tgz
#   presets                      preset runs side by side on GPU 0, in parts: RUNS="name|script|preset|seed[|flag,flag]
#                                ..." (script: train, connect4 or tictactoe); run folders in /tmp/runs, kept on a warm
#                                machine between calls, so the next call resumes them (--resume auto) until their
#                                --run.max-minutes ends them; a part ends at LIMIT (540) s with SIGTERM (a checkpoint);
#                                no memory is preallocated (MEM, 0.3: each process's cap); EVAL=1 instead evaluates each
#                                finished run (GAMES, 256; OPPONENTS, the game's ladder; none for a task) and DRAFTS=1
#                                runs bench_drafts.py beside it; results in $OUT/presets.tgz
#   connect4 MINUTES             `connect4.py --preset gpu` runs side by side, one GPU each, flags in A, B (C, D),
#                                then evaluate_run.py against the ladder; ONLY_A=1 (one run), SAME_GPU=1 (all on GPU 0),
#                                SAVE=1 (return each run as NAME/state.tgz) and STATE="dir/*.tgz" (resume them):
#                                runs longer than one call go in parts
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$HERE/gpu_wheels.sh"
BENCH=experiments/benchmarks
QUIET_XLA="IOTA device assignment|not expected as JAX|Involuntary full rematerialization"
POD_FLAGS="--sft.steps 0 --run.wandb-mode disabled --run.progress false --run.checkpoint-every 0"
POD_FLAGS="$POD_FLAGS --run.keep-checkpoints 0"

device() { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 | tee "$OUT/device.txt"; }

check_flags() {  # check_flags FLAGS...: fails naming a flag connect4.py does not take, so no run starts without it
  PYTHONPATH="$REPO:${PYTHONPATH:-}" python3 - "$@" <<'PY'
import sys
from earl_jax.cli import fields_of
from earl_jax.rl.loop.job_config import JobConfig
from earl_jax.rl.job.entry import ALIASES
known = {f.flag for f in fields_of(JobConfig())} | set(ALIASES) | {"--preset", "--config", "--debug"}
bad = [a.split("=")[0] for a in sys.argv[1:] if a.startswith("--") and a.split("=")[0].replace("_", "-") not in known]
if bad:
    sys.exit(f"run_on_device.sh: connect4.py takes no {' '.join(bad)} (--help lists its flags)")
PY
}

metrics_lines() {  # metrics_lines FILE: per iteration, the seconds and compiles a start-up comparison reads
  python3 - "$1" <<'PY'
import json, sys
keys = ("time/iteration_s", "time/rollout_s", "time/compile_s")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "time/rollout_s" in r:
        print(r["step"], *(round(r.get(k) or 0, 3) for k in keys), r.get("compile/lowered"), r.get("compile/ahead"),
              r.get("compile/ahead_submitted"), r.get("compile/ahead_used"), r.get("compile/slowest"))
PY
}

cmd_train() {
  CUDA_VISIBLE_DEVICES=0 timeout 230 python3 $BENCH/bench_train.py --time-budget 150 --case-timeout 150 --remat dots \
    --out "$OUT" "$@" > "$OUT/bench_train.log" 2>&1 &
  if [ -f .peer/peer_train.py ]; then  # tunix's step at the same shapes, its wheels carried in .whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer .whl/*.whl
    for bt in "8 4096" "16 2048"; do set -- $bt
      CUDA_VISIBLE_DEVICES=1 B=$1 T=$2 PYTHONPATH=/tmp/peer timeout 110 python3 .peer/peer_train.py
    done > "$OUT/peer_train.log" 2>&1
  fi
  wait
  cat "$OUT"/*train.log
}

cmd_fig1() { install_wheels; timeout 580 python3 experiments/fig1_context_growth.py --gpu --timeout 420 --out "$OUT" "$@"; }

cmd_fig3() {
  [ -d .whl_env ] && install_wheels  # the rollout cells need no game; the wheels only if carried
  local deadline=$(( SECONDS + ${LIMIT:-540} )) more=() rc
  if [ -n "${CONTINUE:-}" ]; then
    cp "$CONTINUE" "$OUT/table1.json"; more=(--continue-table "$OUT/table1.json")
    [ -n "${RETRY_HUNG:-}" ] && more+=(--retry-hung)
  fi
  while (( deadline - SECONDS > 30 )); do
    timeout "$(( deadline - SECONDS ))" python3 experiments/fig3_selector_heatmap.py --no-progress --out "$OUT" \
      --cell-timeout "${CELL_TIMEOUT:-240}" --save-table "$OUT/table1.json" "$@" "${more[@]}" 2>&1 \
      | grep --line-buffered -v -E "$QUIET_XLA" | tee -a "$OUT/fig3.log"
    rc=${PIPESTATUS[0]}; echo "fig3 rc=$rc"
    (( rc == 75 )) || break  # 75: a cell hung and was recorded; anything else: done, cut by the limit, or an error
    more=(--continue-table "$OUT/table1.json")
  done
}

cmd_fig4() { timeout 150 python3 experiments/fig4_dispatch_latency.py --repeats 20 --out "$OUT" "$@"; }

cmd_e2e() {
  install_wheels
  local state=${E2E_STATE:-/tmp/e2e_state}; mkdir -p "$state"
  export EARL_COMPILE_CACHE=${EARL_COMPILE_CACHE:-/tmp/e2e_cc}
  if ! ls "$state"/*.json >/dev/null 2>&1 && ls e2e_state/*.json >/dev/null 2>&1; then
    cp e2e_state/*.json "$state/" && echo "figure so far from e2e_state/"  # a fresh machine: the last call's JSON
  fi
  echo "compile cache: $(ls "$EARL_COMPILE_CACHE" 2>/dev/null | wc -l) entries"
  timeout 590 python3 experiments/fig_e2e_adaptivity.py --gpu4 --model "${MODEL:-qwen2.5-1.5b}" \
    --schedule "${SCHEDULE:-0:480,2:3968,4:16000}" --steps "${STEPS:-5}" --runs "${RUNS:?RUNS=comma list of runs}" \
    --budget-s "${BUDGET:-280}" ${RERUN:+--rerun} --out "$state" --keep-runs "/tmp/e2e_runs_$(date +%s)" 2>&1 \
    | tee "$OUT/e2e.log"
  cp "$state"/*.json "$state"/*.png "$OUT/" 2>/dev/null || echo "e2e: no figure written yet"
}

cmd_agent_loop() {
  install_wheels pgx svgwrite
  EARL_COMPILE_CACHE=/tmp/earl_cc timeout 570 python3 $BENCH/bench_agent_loop.py --gpu --timeout 200 --out "$OUT" "$@"
}

cmd_agent_loop_4gpu() {
  install_wheels pgx svgwrite
  export EARL_COMPILE_CACHE=/tmp/earl_cc
  local bench="python3 $BENCH/bench_agent_loop.py --gpu --timeout 220" k=0 j c code
  for c in ${JOBS-"gpu512 gpu2048 gpu512_constrained gpu2048_constrained"}; do  # one GPU each
    CUDA_VISIBLE_DEVICES=$k timeout 250 $bench --cases "$c" --out "$OUT/one_$c" \
      ${JEXTRA:+-- $JEXTRA} > "$OUT/one_$c.log" 2>&1 &
    k=$((k + 1))
  done
  wait
  grep -hE "^gpu" "$OUT"/one_*.log 2>/dev/null | cut -c1-600
  for c in ${FOUR-"gpu2048_4proc:170 gpu2048_4proc_nosplit:150 gpu2048:130"}; do
    timeout $((${c#*:} + 10)) $bench --cases "${c%:*}" --timeout "${c#*:}" --out "$OUT/four_${c%:*}" \
      ${EXTRA:+-- $EXTRA} > "$OUT/four_${c%:*}.log" 2>&1
    grep -hE "^gpu|Error" "$OUT/four_${c%:*}.log" | cut -c1-600
  done
  (cd "$OUT" && tar czf /tmp/agent_loop.tgz --exclude='*.png' . && rm -rf ./* && mv /tmp/agent_loop.tgz .)  # few files
}

cmd_pod_first_iteration() {
  install_wheels
  local pod="--preset pod --model ${MODEL:-qwen2.5-1.5b} --steps ${STEPS:-2} --eval.games ${EVAL_GAMES:-64} $POD_FLAGS"
  local spec name limit flags envs start
  for spec in ${RUNS:?RUNS=\"name:timeout_s[:flags[:env]] ...\"}; do
    IFS=: read -r name limit flags envs <<< "$spec"
    flags=${flags//,/ }; envs=${envs//,/ }
    echo "=== $name (${limit}s, flags: ${flags:-none}, env: ${envs:-none})"
    # shellcheck disable=SC2086
    check_flags $pod $flags || exit 1
    start=$(date +%s)
    # shellcheck disable=SC2086
    EARL_COMPILE_CACHE=/tmp/cc_$name env $envs timeout "$limit" \
      python3 experiments/connect4.py $pod $flags --run-dir /tmp/pod_$name > "$OUT/pod_$name.log" 2>&1
    echo "rc=$? wall $(( $(date +%s) - start )) s"
    grep -E "first RL iteration|iteration [0-9]+/|out of memory|RESOURCE|Error" "$OUT/pod_$name.log" | tail -12
    cp /tmp/pod_$name/metrics.jsonl "$OUT/pod_$name.jsonl" 2>/dev/null
  done
}

cmd_programs() {
  install_wheels
  local pod="--preset pod ${MODEL:+--model $MODEL} --steps ${STEPS:-10} --eval.games 64 --eval.every 0"
  pod="$pod --sft.steps 0 --run.wandb-mode disabled --run.progress false --run.keep-checkpoints 0"
  local run start
  for run in cold warm; do
    start=$(date +%s)
    # shellcheck disable=SC2086
    EARL_COMPILE_CACHE=/tmp/cc_programs timeout ${POD_S:-330} python3 experiments/connect4.py $pod \
      --run-dir /tmp/pod_$run > "$OUT/programs_pod_$run.log" 2>&1
    echo "=== pod $run: rc=$? command to iteration ${STEPS:-10}: $(( $(date +%s) - start )) s"
    grep -cE "first call \(compile" "$OUT/programs_pod_$run.log" | sed 's/^/program lines in the log: /'
    grep -E "first RL iteration|out of memory|Error" "$OUT/programs_pod_$run.log" | tail -3
    cp /tmp/pod_$run/metrics.jsonl "$OUT/programs_pod_$run.jsonl" && metrics_lines "$OUT/programs_pod_$run.jsonl"
  done
  start=$(date +%s)
  EARL_COMPILE_CACHE=/tmp/cc_gpu timeout ${GPU_S:-90} python3 experiments/connect4.py --preset gpu --run.max-minutes 1 \
    --run.wandb-mode disabled --run.progress false --run-dir /tmp/gpu_preset > "$OUT/programs_gpu.log" 2>&1
  echo "=== gpu preset: rc=$? $(( $(date +%s) - start )) s"
  grep -E "first RL iteration|Error" "$OUT/programs_gpu.log" | tail -2
  cp /tmp/gpu_preset/metrics.jsonl "$OUT/programs_gpu.jsonl" && metrics_lines "$OUT/programs_gpu.jsonl" | tail -15
}

cmd_steady() {
  install_wheels
  local job="--rollout.groups 64 --rollout.group-size 8 --env.prompt-style compact --rollout.constrain-moves false"
  job="$job --sft.steps 0 --eval.every 0 --eval.games 8 --run.checkpoint-every 0 --steps ${STEPS:-12}"
  job="$job --run.wandb-mode disabled --run.progress false --run.compile-cache off"
  local gpu=0 side flags
  for side in a b; do
    flags=A_FLAGS; [ $side = b ] && flags=B_FLAGS
    # shellcheck disable=SC2086
    check_flags $job ${!flags:-} || exit 1
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$gpu timeout ${JOB_S:-400} python3 experiments/connect4.py $job ${!flags:-} \
      --run-dir /tmp/steady_$side > "$OUT/steady_$side.log" 2>&1 &
    gpu=$((gpu + 1))
  done
  wait
  for side in a b; do
    echo "=== $side"; grep -E "first RL iteration|Error" "$OUT/steady_$side.log" | tail -2
    cp /tmp/steady_$side/metrics.jsonl "$OUT/steady_$side.jsonl" && metrics_lines "$OUT/steady_$side.jsonl"
  done
}

cmd_first_iteration() { install_wheels; timeout 570 python3 $BENCH/first_iteration.py --gpu --out "$OUT/first_iteration.json" "$@"; }

cmd_init() { timeout 570 python3 $BENCH/bench_init.py --out "$OUT/bench_init.json" "$@"; }

cmd_profile_rollout() {
  install_wheels
  local groups
  for groups in 256 64; do
    EARL_COMPILE_CACHE=/tmp/earl_cc timeout 270 python3 $BENCH/profile_rollout.py --out "$OUT/g$groups" -- \
      --rollout.groups $groups --rollout.group-size 8 --env.prompt-style compact --rollout.constrain-moves false 2>&1 \
      | tee "$OUT/profile_g$groups.log" \
      | grep -vE "^ +[0-9]" | tail -30
  done
}

cmd_sweep() {
  install_wheels
  export EARL_COMPILE_CACHE=${EARL_COMPILE_CACHE:-/tmp/sweep_cc}
  local sw=/tmp/sweep_selector
  timeout 585 python3 experiments/sweep.py launch/sweep_selector.yaml --trials "${TRIALS:-4}" --timeout "${TRIAL_S:-135}" \
    ${ONLY:+--only "$ONLY"} --out "$sw" -- --run.wandb-mode disabled 2>&1 | tee "$OUT/sweep.log"
  cp "$sw/summary.csv" "$sw/trials.jsonl" "$OUT/" 2>/dev/null
  tar czf "$OUT/trials.tgz" -C "$sw" --exclude checkpoints . 2>/dev/null  # then sweep_table.py on the unpacked folders
}

connect4_one() {  # connect4_one NAME GPU MINUTES FLAGS...
  local name=$1 gpu=$2 minutes=$3; shift 3
  local run=runs/connect4-gpu-$name job
  job=(--preset gpu --run.max-minutes "$minutes" --run.wandb-mode disabled --eval.opponents random,alphabeta:2
       --run-dir "$run" "${RESUME[@]}" "$@")
  check_flags "${job[@]}" || exit 1
  CUDA_VISIBLE_DEVICES=$gpu EARL_COMPILE_CACHE=/tmp/cc_$name python3 experiments/connect4.py "${job[@]}" \
    >> "/tmp/$name.log" 2>&1
  if [ -z "${SAVE:-}" ]; then  # the last part: the newest checkpoint against the ladder
    CUDA_VISIBLE_DEVICES=$gpu timeout 150 python3 experiments/evaluate_run.py "$run" --games 64 \
      --opponents random,alphabeta:1,alphabeta:2,alphabeta:3,mcts:100 >> "/tmp/$name.log" 2>&1
    cp "$run/evaluation.json" "$OUT/$name/" 2>/dev/null
  fi
  cp "$run/metrics.jsonl" "$OUT/$name/"; tail -n 200 "/tmp/$name.log" > "$OUT/$name/log_tail.txt"
}

cmd_bases() {
  install_wheels
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM:-0.2} EARL_COMPILE_CACHE=/tmp/cc_bases
  local spec name game flags
  for spec in ${BASES:?BASES=\"name:game:flag,flag ...\"}; do
    IFS=: read -r name game flags <<< "$spec"; mkdir -p "$OUT/$name"
    # shellcheck disable=SC2086
    timeout "${LIMIT:-540}" python3 experiments/pretrain.py "$game" ${flags//,/ } --games-cache "runs/pretrain/${game}_games.npz" \
      --out "$OUT/$name" --results "$OUT/$name" > "$OUT/$name/log.txt" 2>&1 &
  done
  wait
  for spec in $BASES; do name=${spec%%:*}; echo "== $name"; grep -E "^pretrain: (step|held)" "$OUT/$name/log.txt" | tail -n 12
    mkdir -p /tmp/bases && rm -rf "/tmp/bases/$name" && cp -r "$OUT/$name" /tmp/bases/  # a later call's runs start from it
    tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"; done  # few files come back: one archive each
}

cmd_games() {
  install_wheels
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""  # the searches are host work: keep the GPU out of 16 processes
  local spec name procs games flags k seed=${SEED0:-100}
  mkdir -p /tmp/games "$OUT/games"
  for spec in ${EXPERT:?EXPERT=\"name:procs:games:flag,flag ...\"}; do
    IFS=: read -r name procs games flags <<< "$spec"
    for ((k = 0; k < procs; k++)); do
      # shellcheck disable=SC2086
      timeout "${LIMIT:-540}" python3 experiments/pretrain.py connect4 --expert-only --games "$games" --run.seed "$seed" \
        ${flags//,/ } --games-cache "/tmp/games/${name}_$seed.npz" --out "/tmp/games/out_$seed" \
        --results "/tmp/games/out_$seed" > "$OUT/games/${name}_$seed.log" 2>&1 &
      seed=$((seed + 1))
    done
  done
  wait
  ls -la /tmp/games/*.npz; grep -h "seconds_per_game" "$OUT"/games/*.log | cut -c1-240
  (cd "$OUT" && tar czf games_logs.tgz games && rm -rf games)
}

cmd_cpu_seeds() {
  install_wheels
  local spec name game seeds flags s core=${CORE0:-4} dirs opponents base
  for spec in ${JOBS:?JOBS=\"name|game|seeds|flag,flag ...\"}; do
    IFS='|' read -r name game seeds flags <<< "$spec"; mkdir -p "$OUT/seeds/$name"
    for s in ${seeds//,/ }; do
      # shellcheck disable=SC2086
      (start=$SECONDS; JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES="" taskset -c "$core,$((core + 1))" timeout "${LIMIT:-520}" \
        python3 experiments/$game.py --seed "$s" --run-dir "runs/seeds/$name/seed$s" --run.wandb-mode disabled \
        --run.progress false ${flags//,/ } > "$OUT/seeds/$name/seed$s.log" 2>&1
       echo "command seconds: $((SECONDS - start)) (exit $?)" >> "$OUT/seeds/$name/seed$s.log") &
      core=$((core + 2))
    done
  done
  wait
  core=${CORE0:-4}
  for spec in $JOBS; do
    IFS='|' read -r name game seeds flags <<< "$spec"; dirs=()
    for s in ${seeds//,/ }; do dirs+=("runs/seeds/$name/seed$s"); done
    case $game in connect4) opponents=${OPPONENTS:-random,alphabeta:1,alphabeta:2,alphabeta:3} ;; *) opponents=${OPPONENTS:-random,solver} ;; esac
    JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES="" taskset -c "$core,$((core + 1))" python3 experiments/evaluate_run.py \
      "${dirs[@]}" --opponents "$opponents" --games "${GAMES:-256}" --out "$OUT/seeds/$name.json" \
      > "$OUT/seeds/$name.eval.log" 2>&1 &
    base=BASE_$name
    if [ -n "${!base:-}" ]; then
      JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES="" taskset -c "$((core + 2)),$((core + 3))" python3 \
        experiments/evaluate_run.py "${!base}" --opponents "$opponents" --games "${GAMES:-256}" \
        --out "$OUT/seeds/${name}_base.json" > "$OUT/seeds/$name.base.log" 2>&1 &
    fi
    core=$((core + 4))
  done
  wait
  for spec in $JOBS; do echo "== ${spec%%|*}"; tail -n 6 "$OUT/seeds/${spec%%|*}.eval.log"; done
  (cd "$OUT" && tar czf seeds.tgz seeds && rm -rf seeds)
}

cmd_presets() {
  install_wheels
  export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM:-0.3} CUDA_VISIBLE_DEVICES=0
  local spec name script preset seed flags run rc opponents
  mkdir -p /tmp/runs "$OUT/presets"
  for spec in ${RUNS:?RUNS=\"name|script|preset|seed[|flag,flag] ...\"}; do
    IFS='|' read -r name script preset seed flags <<< "$spec"; run=/tmp/runs/$name
    if [ -n "${EVAL:-}" ]; then
      [ -f "$run/DONE" ] || echo "$name: not finished (evaluating its newest checkpoint)"
      case $script in connect4) opponents=${OPPONENTS:-random,alphabeta:1,alphabeta:2,alphabeta:3,mcts:100} ;;
        tictactoe) opponents=${OPPONENTS:-random,solver} ;; *) opponents="" ;; esac  # a task: its held-out split
      timeout "${LIMIT:-540}" python3 experiments/evaluate_run.py "$run" ${opponents:+--opponents "$opponents"} \
        --games "${GAMES:-256}" > "$OUT/presets/$name.eval.log" 2>&1 &
      continue
    fi
    [ -f "$run/DONE" ] && { echo "$name: finished in an earlier part"; continue; }
    # shellcheck disable=SC2086
    ( EARL_COMPILE_CACHE=/tmp/cc_$preset timeout -s TERM -k 60 "${LIMIT:-540}" python3 "experiments/$script.py" \
        --preset "$preset" --seed "$seed" --resume auto --run.wandb-mode disabled --run.progress false \
        --run-dir "$run" ${flags//,/ } >> "/tmp/runs/$name.log" 2>&1
      rc=$?; echo "$name: exit $rc"; [ $rc -eq 0 ] && touch "$run/DONE" ) &
  done
  if [ -n "${DRAFTS:-}" ]; then
    for args in "tiny-cpu --groups 128 --group-size 8" "arithmetic --drafts 16 --sft-steps 300 --groups 128 --group-size 8"
    do  # shellcheck disable=SC2086
      python3 experiments/benchmarks/bench_drafts.py --preset $args --out "$OUT/presets/drafts_${args%% *}.json" \
        > "$OUT/presets/drafts_${args%% *}.log" 2>&1
    done &
  fi
  wait
  for spec in $RUNS; do
    name=${spec%%|*}; run=/tmp/runs/$name
    for f in metrics.jsonl config.json evaluation.json; do
      [ -f "$run/$f" ] && cp "$run/$f" "$OUT/presets/$name.$f"; done
    tail -n 60 "/tmp/runs/$name.log" > "$OUT/presets/$name.log_tail.txt" 2>/dev/null
    echo "== $name"; grep -E "^train:|Traceback|Error|promot" "/tmp/runs/$name.log" | tail -n 4
    [ -f "$OUT/presets/$name.eval.log" ] && tail -n 8 "$OUT/presets/$name.eval.log"
  done
  (cd "$OUT" && tar czf presets.tgz presets && rm -rf presets)
}

cmd_connect4() {
  local minutes=${1:?connect4 MINUTES} names="a b" n gpu=0 flags_var f
  [ -n "${ONLY_A:-}" ] && names="a"
  [ -n "${C+x}" ] && names="$names c"
  [ -n "${D+x}" ] && names="$names d"
  install_wheels
  RESUME=()
  if [ -n "${STATE:-}" ]; then  # runs/connect4-gpu-* from the previous part
    for f in $STATE; do tar xzf "$f" || { echo "STATE: $f did not unpack" >&2; exit 1; }; done
    RESUME=(--resume)
  fi
  [ -n "${SAME_GPU:-}" ] && export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45  # two processes on one GPU
  for n in $names; do
    flags_var=${n^^}; mkdir -p "$OUT/$n"
    # shellcheck disable=SC2086
    connect4_one "$n" "$gpu" "$minutes" ${!flags_var:-} &
    [ -n "${SAME_GPU:-}" ] || gpu=$((gpu + 1))
  done
  wait
  for n in $names; do echo "== $n"; grep -E "first RL iteration|promot|no learning signal" "/tmp/$n.log" | head -8; done
  if [ -n "${SAVE:-}" ]; then  # each run with its newest checkpoint only, small enough to come back
    for n in $names; do
      ls -d "runs/connect4-gpu-$n/checkpoints"/*/ 2>/dev/null | sort -V | head -n -1 | xargs -r rm -rf
      tar czf "$OUT/$n/state.tgz" "runs/connect4-gpu-$n"
    done
  fi
  if [ "$names" != "a b" ]; then (cd "$OUT" && tar czf /tmp/runs.tgz $names device.txt && rm -rf $names device.txt \
    && mv /tmp/runs.tgz .); fi  # few files come back from a call: one archive
  echo "then: python experiments/lab/summarize_connect4_gpu_ab.py OUT_DIR --labels ..."
}

sub=${1:-}; shift || true
case "$sub" in
  train|fig1|fig3|fig4|e2e|sweep|init|steady|programs|connect4|bases|games|presets) device; "cmd_$sub" "$@" ;;
  agent-loop|agent-loop-4gpu|pod-first-iteration|first-iteration|profile-rollout|cpu-seeds) device; "cmd_${sub//-/_}" "$@" ;;
  *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; [ -z "$sub" ] || echo "run_on_device.sh: unknown subcommand '$sub'" >&2; exit 2 ;;
esac
