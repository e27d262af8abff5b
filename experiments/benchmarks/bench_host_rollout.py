"""Host work of one rollout alone: `play_games` over Connect Four (compact prompts, random opponent) with a policy
that answers at once (a random digit and <eos>, no device), so what is timed is the agent loop's own host work: the
env's steps, parsing, tokenizing, the episode buffers. Median over --repeats rollouts per batch size.
`--moves constrained`: the policy answers like `SamplerPolicy` under `--rollout.constrain-moves` (the default of
connect4.py): a uniformly drawn LEGAL move's token, the stop token, and the move itself where `Decoded` carries it.

    python experiments/benchmarks/bench_host_rollout.py [--games 512 2048] [--repeats 9] [--moves constrained] \
        [--out FILE]
    python experiments/benchmarks/bench_host_rollout.py --trees OLD_CHECKOUT .  # the same in two checkouts, interleaved

Writes experiments/results/bench_host_rollout_cpu.json by default (with --trees: appends to its `comparisons`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure(games: int, repeats: int, moves: str = "free") -> dict:
    import jax
    import numpy as np

    from earl_jax.envs import EnvConfig
    from earl_jax.envs.vector import ObservationCodec, make_vector_env
    from earl_jax.models.tokenizer import game_tokenizer
    from earl_jax.rollout.agent_loop import Decoded, PlayConfig, play_games

    tok = game_tokenizer()
    eos = tok.token_to_id("<eos>")
    digits = np.array([tok.token_to_id(str(a)) for a in range(10)], np.int32)

    class Instant:
        rng = np.random.default_rng(0)

        def reset(self, batch, max_len): pass

        def extend(self, tokens, counts): pass

        def take_rows(self, rows, batch): pass

        def generate(self, budgets, rng, row_ids, legal=None):
            b = len(budgets)
            counts = np.where(budgets > 0, 2, 0).astype(np.int32)
            # constrained: a legal move, as rollout/policy.py answers (its move if Decoded has it)
            if legal is not None:
                action = (self.rng.random(legal.shape) * legal).argmax(1)
                toks = np.stack([digits[action], np.full(b, eos, np.int32)], 1)
                scored = np.zeros((b, 2), bool)
                scored[:, 0] = budgets > 0
                extra = {"moves": np.where(budgets > 0, action, -1)} if "moves" in Decoded.__dataclass_fields__ else {}
                return lambda: Decoded(toks, np.zeros((b, 2), np.float32), counts, budgets > 0, scored,
                                       np.zeros((b, 2), np.int32), **extra)
            toks = np.stack([digits[self.rng.integers(0, 7, b)], np.full(b, eos, np.int32)], 1)
            return lambda: Decoded(toks, np.zeros((b, 2), np.float32), counts, budgets > 0)

    env = make_vector_env(EnvConfig(game="connect_four", opponent="random", prompt_style="compact"), games)
    cfg = PlayConfig(max_turn_tokens=8, max_turns=32, max_context=4096, constrain_moves=moves == "constrained")
    codec, key = ObservationCodec(tok), jax.random.key(0)
    seeds = np.repeat(np.arange(games // 8), 8)
    play_games(Instant(), env, tok, cfg, key, seeds, codec=codec)  # warm
    wall, env_s = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        traj = play_games(Instant(), env, tok, cfg, key, seeds + r + 1, codec=codec)
        wall.append(time.perf_counter() - t0)
        env_s.append(traj.stats.env_s)
    return {"games": games, "repeats": repeats, "moves": moves, "rollout_ms_median": 1e3 * statistics.median(wall),
            "env_ms_median": 1e3 * statistics.median(env_s), "rollout_ms_all": [round(1e3 * w, 2) for w in wall]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--moves", choices=["free", "constrained"], default="free")
    ap.add_argument("--trees", type=Path, nargs="+", default=None)
    ap.add_argument("--rounds", type=int, default=3, help="with --trees: alternate the checkouts this many times")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child run: print one JSON line
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "bench_host_rollout_cpu.json")
    args = ap.parse_args(argv)
    if args.one or not args.trees:
        rows = [measure(g, args.repeats, args.moves) for g in args.games]
        if args.one:
            print(json.dumps(rows))
            return {"rows": rows}
        result = {"machine": f"{os.cpu_count()} CPU cores", "rows": rows}
    else:
        runs = []
        for r in range(args.rounds):
            for tree in args.trees:
                cmd = [sys.executable, str(ROOT / "experiments" / "benchmarks" / "bench_host_rollout.py"), "--one",
                       "--repeats", str(args.repeats), "--moves", args.moves, "--games", *map(str, args.games)]
                out = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree.resolve())},
                                     capture_output=True, text=True, check=True).stdout
                runs.append({"tree": str(tree), "round": r, "rows": json.loads(out.strip().splitlines()[-1])})
                print(runs[-1], flush=True)
        # one file for the benchmark: each comparison is appended (median_of_round_medians_ms added by hand)
        result = json.loads(args.out.read_text()) if args.out.exists() else {"machine": f"{os.cpu_count()} CPU cores"}
        result.setdefault("comparisons", []).append({"command": " ".join(sys.argv[1:]), "runs": runs})
    args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
