"""The `mcts:N` opponent (OpenSpiel's C++ MCTSBot) against OpenSpiel's Python MCTSBot at the same settings: the
score of the C++ bot (seats alternate, each game its own seeds) and each bot's milliseconds a move, so that swapping
one for the other is shown to keep the opponent's strength while it buys the speed. `--env-games N` also times the
job's own env: N Connect Four games against mcts:`--env-simulations` played to their end with random agent moves,
with each bot (the Python one patched in for that run) and with 2 search workers.

    python experiments/benchmarks/bench_mcts.py --simulations 100 --games 200 [--game connect_four] [--env-games 512]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import numpy as np
import pyspiel
from open_spiel.python.algorithms import mcts

from earl_jax.envs.opponents import MCTSOpponent

RESULTS = Path(__file__).resolve().parents[1] / "results"


class PythonMCTS(MCTSOpponent):
    """The opponent as it was: OpenSpiel's Python MCTSBot at the same settings."""

    def reset(self, seed: int) -> None:
        rng = np.random.RandomState(seed % 2**32)
        self._bot = mcts.MCTSBot(self.game, self.uct_c, self.simulations, mcts.RandomRolloutEvaluator(1, rng),
                                 solve=True, random_state=rng)


def match(game_name: str, simulations: int, games: int) -> dict:
    game = pyspiel.load_game(game_name)
    scores, seconds, moves = [], {"cpp": 0.0, "python": 0.0}, {"cpp": 0, "python": 0}
    for g in range(games):
        cpp, py = MCTSOpponent(game, simulations, seed=1000 + g), PythonMCTS(game, simulations, seed=5000 + g)
        seat, state = g % 2, game.new_initial_state()
        while not state.is_terminal():
            who, bot = ("cpp", cpp) if state.current_player() == seat else ("python", py)
            t = time.perf_counter()
            action = bot.act(state)
            seconds[who] += time.perf_counter() - t
            moves[who] += 1
            state.apply_action(action)
        scores.append((state.returns()[seat] + 1) / 2)  # win 1, draw 0.5, loss 0
        if (g + 1) % 50 == 0:
            print(f"  {g + 1}/{games} games, C++ score so far {np.mean(scores):.3f}", flush=True)
    s = np.asarray(scores)
    return {"game": game_name, "simulations": simulations, "games": games,
            "cpp_score": float(s.mean()), "cpp_score_stderr": float(s.std() / math.sqrt(len(s))),
            "cpp_won": float((s == 1).mean()), "drawn": float((s == 0.5).mean()),
            "cpp_ms_per_move": 1e3 * seconds["cpp"] / moves["cpp"],
            "python_ms_per_move": 1e3 * seconds["python"] / moves["python"],
            "speedup": (seconds["python"] / moves["python"]) / (seconds["cpp"] / moves["cpp"])}


def env_seconds(games: int, simulations: int, workers: int, python_bot: bool) -> float:
    """Seconds for `games` games of the job's env against mcts:`simulations` to their end (random agent moves)."""
    from earl_jax.envs import EnvConfig, opponents
    from earl_jax.envs.vector import make_vector_env

    real = opponents.MCTSOpponent
    opponents.MCTSOpponent = PythonMCTS if python_bot else real  # workers import their own: only with workers 0
    try:
        env = make_vector_env(EnvConfig.connect_four(opponent="random", search_workers=workers), games)
        env.assign_opponents([(f"mcts:{simulations}", np.ones(games, bool))])
        rng = np.random.default_rng(0)
        t = time.perf_counter()
        env.reset([i // 8 for i in range(games)])
        while len(rows := np.flatnonzero(env.live)):
            env.step(rows, moves=np.array([rng.choice(np.flatnonzero(legal)) for legal in env.legal[rows]]))
        return time.perf_counter() - t
    finally:
        opponents.MCTSOpponent = real


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--game", default="connect_four")
    ap.add_argument("--simulations", type=int, default=100)
    ap.add_argument("--games", type=int, default=200)
    ap.add_argument("--env-games", type=int, default=0, help="also time the job's env for this many games (0: no)")
    ap.add_argument("--env-simulations", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON (default: experiments/results/bench_mcts_<game>_cpu.json)")
    a = ap.parse_args(argv)
    row = match(a.game, a.simulations, a.games)
    row["machine"] = {"processor": platform.processor() or platform.machine(), "python": platform.python_version()}
    print(f"{a.game}, mcts:{a.simulations}, {a.games} games: C++ score {row['cpp_score']:.3f} +- "
          f"{row['cpp_score_stderr']:.3f} (won {row['cpp_won']:.3f}, drawn {row['drawn']:.3f}); "
          f"{row['cpp_ms_per_move']:.2f} against {row['python_ms_per_move']:.2f} ms a move ({row['speedup']:.1f}x)")
    if a.env_games:
        runs = {"python_bot": (0, True), "cpp_bot": (0, False), "cpp_bot_2_workers": (2, False)}
        row["env"] = {"games": a.env_games, "simulations": a.env_simulations,
                      **{k: env_seconds(a.env_games, a.env_simulations, w, py) for k, (w, py) in runs.items()}}
        print(f"the job's env, {a.env_games} games against mcts:{a.env_simulations} to their end: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in row["env"].items() if k.endswith(("bot", "workers"))))
    out = a.out or RESULTS / f"bench_mcts_{a.game}_cpu.json"
    out.write_text(json.dumps({"script": "experiments/benchmarks/bench_mcts.py", **row}, indent=1) + "\n")
    return row


if __name__ == "__main__":
    main()
