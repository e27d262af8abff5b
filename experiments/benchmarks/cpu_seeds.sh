#!/usr/bin/env bash
# A game's CPU default job over seeds chosen beforehand, one run after another, then evaluate_run.py over them
# (mean and spread) and over BASE (a base folder, evaluated on the same games) when set:
#   bash experiments/benchmarks/cpu_seeds.sh GAME "101 202 303" NAME [job flags...]
# GAME: connect4 or tictactoe. Runs go to runs/seeds/NAME/seed<S> (log: seed<S>.log, with the command's seconds);
# the summary to experiments/results/NAME.json. GAMES (256) greedy games per opponent; OPPONENTS the game's ladder.
set -euo pipefail
cd "$(dirname "$0")/../.."
game=$1 seeds=$2 name=$3; shift 3
case $game in
  connect4) opponents=${OPPONENTS:-random,alphabeta:1,alphabeta:2,alphabeta:3} ;;
  tictactoe) opponents=${OPPONENTS:-random,solver} ;;
  *) echo "cpu_seeds.sh: GAME is connect4 or tictactoe, not '$game'" >&2; exit 2 ;;
esac
out=runs/seeds/$name; mkdir -p "$out"; dirs=()
for s in $seeds; do
  dirs+=("$out/seed$s")
  start=$SECONDS
  python experiments/$game.py --seed "$s" --run-dir "$out/seed$s" --run.wandb-mode disabled --run.progress false "$@" \
    > "$out/seed$s.log" 2>&1
  echo "command seconds: $((SECONDS - start))" >> "$out/seed$s.log"
  echo "seed $s: $((SECONDS - start)) s"
done
python experiments/evaluate_run.py "${dirs[@]}" --opponents "$opponents" --games "${GAMES:-256}" \
  --out "experiments/results/$name.json"
if [ -n "${BASE:-}" ]; then
  python experiments/evaluate_run.py "$BASE" --opponents "$opponents" --games "${GAMES:-256}" \
    --out "experiments/results/${name}_base.json"
fi
