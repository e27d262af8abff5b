"""How strong and how fast Connect Four's teachers are: each player against each opponent, and its time a move.

    python experiments/solver_strength.py                                   # solver and alphabeta:5, 64 games each
    python experiments/solver_strength.py --players solver:20 --games 256   # a larger budget, more games

Every game is an OpenSpiel state played by two `envs.opponents` players (the player in seat g % 2 of game g, both
seeded from g), so the numbers are the opponents the RL job plays and evaluates against. The player's time a move
is measured in the same games (its own moves only; the opponent's are not counted), on this machine's CPU, one core.
Writes experiments/results/solver_strength_<device>.json (the device named in it).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone: no install needed

from earl_jax.envs.opponents import make_opponent  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def match(player: str, opponent: str, games: int) -> dict:
    """`games` games of `player` against `opponent`, seats alternating; results from the player's side."""
    import pyspiel

    game = pyspiel.load_game("connect_four")
    outcomes, times = [], []
    for g in range(games):
        seat = g % 2
        bots = {seat: make_opponent(player, game, seed=g), 1 - seat: make_opponent(opponent, game, seed=10_000 + g)}
        state = game.new_initial_state()
        while not state.is_terminal():
            mover = state.current_player()
            t0 = time.perf_counter()
            action = bots[mover].act(state)
            if mover == seat:
                times.append(time.perf_counter() - t0)
            state.apply_action(action)
        outcomes.append(int(np.sign(state.returns()[seat])))
    o = np.array(outcomes)
    return {"games": games, "win": float(np.mean(o > 0)), "draw": float(np.mean(o == 0)),
            "loss": float(np.mean(o < 0)), "win_se": float(np.std(o > 0) / np.sqrt(games)),
            "ms_per_move_mean": 1000 * float(np.mean(times)), "ms_per_move_p90": 1000 * float(np.percentile(times, 90)),
            "moves": len(times)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--players", default="solver,alphabeta:5", help="comma-separated players to measure")
    p.add_argument("--opponents", default="alphabeta:3,mcts:100", help="comma-separated opponents")
    p.add_argument("--games", type=int, default=64, help="games per player and opponent")
    p.add_argument("--out", type=Path, default=None, help="the JSON file (default: experiments/results/...)")
    args = p.parse_args(argv)
    device = cpu_name()
    result = {"device": device, "command": " ".join(["python experiments/solver_strength.py", *(argv or sys.argv[1:])]),
              "results": {}}
    for player in args.players.split(","):
        for opponent in args.opponents.split(","):
            t0 = time.perf_counter()
            r = match(player, opponent, args.games)
            r["wall_s"] = time.perf_counter() - t0
            result["results"][f"{player} vs {opponent}"] = r
            print(f"{player} vs {opponent}: win {r['win']:.3f} draw {r['draw']:.3f} loss {r['loss']:.3f} "
                  f"({r['games']} games), {r['ms_per_move_mean']:.1f} ms a move", flush=True)
    out = args.out or ROOT / "experiments" / "results" / "solver_strength_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"solver_strength: wrote {out}")
    return result


if __name__ == "__main__":
    main()
