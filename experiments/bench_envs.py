"""Env stepping speed: random-vs-random games at batch 64, plus per-move cost of each opponent.

The agent loop steps one env per rollout row after every decoded answer, so what matters is the
wall time of one lock-step batch of `env.step(text)` calls (parse + OpenSpiel move + opponent
reply + observation text + info). Only the env calls are timed, not the scripted answers.

    python experiments/bench_envs.py [--batch 64] [--steps 20000]

Writes experiments/results/bench_envs.json (machine named via platform.processor()/node()).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import pyspiel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed

from earl_jax.envs import EnvBatch, EnvConfig, canonical_action_text, make_opponent, parse_action


def bench_batch(game: str, style: str, batch: int, min_steps: int, seed: int = 0) -> dict:
    """Random agent vs random opponent, `batch` games in lock-step; finished rows are reset."""
    envs = EnvBatch(batch, EnvConfig(game=game, opponent="random", prompt_style=style)).envs
    rng = random.Random(seed)
    infos = [env.reset(seed=seed + i)[1] for i, env in enumerate(envs)]
    next_seed = seed + batch
    steps, env_time, batch_times = 0, 0.0, []
    while steps < min_steps:
        answers = [canonical_action_text(rng.choice(info["legal_actions"])) for info in infos]
        t0 = time.perf_counter()
        for i, env in enumerate(envs):
            _, _, term, trunc, infos[i] = env.step(answers[i])
            if term or trunc:
                infos[i] = env.reset(seed=next_seed)[1]  # resets are part of the cost
                next_seed += 1
        dt = time.perf_counter() - t0
        env_time += dt
        batch_times.append(dt)
        steps += batch
    return {
        "game": game,
        "prompt_style": style,
        "batch": batch,
        "env_steps": steps,
        "env_steps_per_s": steps / env_time,
        "us_per_env_step": 1e6 * env_time / steps,
        "ms_per_batch_step_median": 1e3 * statistics.median(batch_times),
    }


def bench_parser(n: int = 200_000) -> dict:
    texts = ["3", "[3]", "column 3\n", " 3 because the centre is strong", "I play 3", "no idea"]
    t0 = time.perf_counter()
    for i in range(n):
        parse_action(texts[i % len(texts)])
    return {"us_per_parse": 1e6 * (time.perf_counter() - t0) / n}


def bench_opponent(game: str, spec: str, games: int = 10, seed: int = 0) -> dict:
    """Opponent vs a random mover; time per opponent move."""
    g = pyspiel.load_game(game)
    opponent = make_opponent(spec, g, seed)
    opponent.act(g.new_initial_state())  # warm caches (solver memo) before timing
    rng = random.Random(seed)
    times = []
    for k in range(games):
        state = g.new_initial_state()
        while not state.is_terminal():
            if len(state.history()) % 2 == k % 2:
                t0 = time.perf_counter()
                action = opponent.act(state)
                times.append(time.perf_counter() - t0)
            else:
                action = rng.choice(state.legal_actions())
            state.apply_action(action)
    return {
        "game": game,
        "opponent": spec,
        "moves": len(times),
        "ms_per_move_mean": 1e3 * statistics.mean(times),
        "ms_per_move_max": 1e3 * max(times),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_envs.json"))
    args = ap.parse_args()

    results = {
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "node": platform.node(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
        "batch": [
            bench_batch(game, style, args.batch, args.steps)
            for game in ("connect_four", "tic_tac_toe")
            for style in ("compact", "chat")
        ],
        "parser": bench_parser(),
        "opponents": [
            bench_opponent("connect_four", "random"),
            bench_opponent("connect_four", "alphabeta:4"),
            bench_opponent("connect_four", "alphabeta:5"),
            bench_opponent("connect_four", "mcts:200", games=3),
            bench_opponent("tic_tac_toe", "solver"),
            bench_opponent("tic_tac_toe", "mcts:200", games=3),
        ],
    }
    for row in results["batch"]:
        print(
            f"{row['game']:13s} {row['prompt_style']:8s} batch {row['batch']}: "
            f"{row['env_steps_per_s']:,.0f} env steps/s, {row['us_per_env_step']:.1f} us/step, "
            f"{row['ms_per_batch_step_median']:.2f} ms per batch step"
        )
    print(f"parser: {results['parser']['us_per_parse']:.2f} us/answer")
    for row in results["opponents"]:
        print(
            f"{row['game']:13s} {row['opponent']:12s} {row['ms_per_move_mean']:8.3f} ms/move mean, "
            f"{row['ms_per_move_max']:8.3f} max ({row['moves']} moves)"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out} ({results['machine']['processor']}, {results['machine']['node']})")


if __name__ == "__main__":
    main()
