"""Per-game search opponents over worker processes (`--env.search-workers W`): seconds for whole games against mcts:N.

The agent plays uniformly random legal moves from one seeded stream, so every setting plays the same games (checked:
the same outcomes); only the opponent's searches differ in where they run. The workers' start (spawned processes)
is timed apart from the games.

    python experiments/benchmarks/bench_search_workers.py                      # 64 games, mcts:50, W 0 and 2
    python experiments/benchmarks/bench_search_workers.py --workers 0 4 8 16   # a GPU host's cores

Writes experiments/results/bench_search_workers_<N>cpu.json (N: the host's CPU count).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def play(spec: str, games: int, workers: int) -> dict:
    from earl_jax.envs import EnvConfig
    from earl_jax.envs.vector import VectorTextEnv

    env = VectorTextEnv(EnvConfig.connect_four(opponent=spec, search_workers=workers), games, per_game_opponents=True)
    t0 = time.perf_counter()
    env.reset(list(range(games)))  # the workers start here (W > 1)
    start_s = time.perf_counter() - t0
    rng, winners, t0 = np.random.default_rng(0), [], time.perf_counter()
    env.reset(list(range(1000, 1000 + games)))
    while env.live.any():
        rows = np.flatnonzero(env.live)
        step = env.step(rows, moves=np.array([rng.choice(np.flatnonzero(env.legal[r])) for r in rows]))
        winners += [w for w in step.winners if w is not None]
    seconds = time.perf_counter() - t0
    env.opponent.close()
    return {"workers": workers, "seconds": seconds, "start_s": start_s, "outcomes": winners}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opponent", default="mcts:50")
    p.add_argument("--games", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    rows = [play(a.opponent, a.games, w) for w in a.workers]
    base = rows[0]["seconds"]
    for r in rows:
        same = r["outcomes"] == rows[0]["outcomes"]
        print(f"workers {r['workers']:>2}: {r['seconds']:.2f} s for {a.games} games ({base / r['seconds']:.2f}x), "
              f"start {r['start_s']:.2f} s, the same outcomes: {same}", flush=True)
        if not same:
            sys.exit("bench_search_workers: the workers played other games than one process (a bug)")
    host = platform.node() or "host"
    out = a.out or ROOT / "experiments" / "results" / f"bench_search_workers_{os.cpu_count()}cpu.json"
    out.write_text(json.dumps({"script": "experiments/benchmarks/bench_search_workers.py", "argv": sys.argv[1:],
                               "host": host, "processor": platform.processor(), "cpu_count": os.cpu_count(),
                               "opponent": a.opponent, "games": a.games,
                               "rows": [{k: v for k, v in r.items() if k != "outcomes"} for r in rows]},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
