"""Env stepping speed: the per-game path the agent loop used against the vector env, per lock-step turn.

The agent loop steps every live game after each decoded turn: parse the answer, play it, the
opponent's reply, the observation text, its token ids. `lockstep` times exactly that host work per
turn for a batch of random-vs-random games (all games reset together, then stepped in lock-step to
the end), both ways, with the character-level game tokenizer:

    per_game:       tokenizer.decode(answer ids) -> OpenSpielTextEnv.step(text) -> tokenizer.encode(obs)
    vector_strings: the same env read as the agent loop read it before observations became byte rows:
                    answer rows to lists -> codec.answers_to_moves -> VectorTextEnv.step(rows, moves=) -> every
                    observation's text -> codec.encode_padded of the games that go on (the env's own text path
                    is the present one, so this is not a measurement of the previous code)
    vector:         the agent loop now: codec.padded_answers_to_moves(answer array) -> VectorTextEnv.step ->
                    codec.encode_step(step, going) (byte rows to ids; a finished game's text is never built)
    vector_text:    answers decoded to text and parsed by the env, as a user env would need

Only the env / parse / encode work is timed, not the (scripted) choice of answers. Resets are
timed separately (once per episode). Also: batched vs per-game alpha-beta per depth at 512
positions, the opponents' per-move cost, the parser.

    python experiments/benchmarks/bench_envs.py [--batches 64 512 2048] [--rounds 3] [--quick]

Writes experiments/results/bench_envs.json (the machine named via platform.processor()/node(),
and its load average, which matters on a shared machine).
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

import numpy as np
import pyspiel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a clone: no install needed

from earl_jax.envs import EnvConfig, OpenSpielTextEnv, connect_four_search, make_opponent, parse_action  # noqa: E402
from earl_jax.envs.games import connect_four as vector_c4  # noqa: E402
from earl_jax.envs.vector import ObservationCodec, make_vector_env, parse_actions  # noqa: E402
from earl_jax.models.tokenizer import game_tokenizer  # noqa: E402


def _answer_ids(tok, moves) -> tuple[np.ndarray, np.ndarray]:
    """What a policy would have generated, as the decode batch holds it: the move's digit, then <eos>."""
    eos = tok.token_to_id("<eos>")
    digit = np.array([tok.token_to_id(str(a)) for a in range(10)], np.int32)
    ids = np.stack([digit[np.asarray(moves, np.int64)], np.full(len(moves), eos, np.int32)], 1)
    return ids, np.full(len(moves), 2, np.int64)


def _random_legal(legal: np.ndarray, rng: np.random.Generator) -> list[int]:
    counts = legal.sum(1)
    k = (rng.random(len(legal)) * counts).astype(np.int64)
    return (np.cumsum(legal, 1) > k[:, None]).argmax(1).tolist()


def lockstep(game: str, style: str, batch: int, path: str, rounds: int, group: int = 1, seed: int = 0) -> dict:
    """Per-turn host time of one lock-step turn of `batch` games, and per-reset time, for one path.

    `group` games share a seed, as a GRPO group does (1: every game its own seed, as in evaluation).
    Wall time and this thread's CPU time are both kept: on a shared machine the CPU time is the
    steadier number.
    """
    tok = game_tokenizer()
    cfg = EnvConfig(game=game, opponent="random", prompt_style=style)
    rng = np.random.default_rng(seed)
    wall, cpu, reset_wall, turns_per_round, live_rows = [], [], [], [], []
    num_actions = 7 if game == "connect_four" else 9
    if path == "per_game":
        envs = [OpenSpielTextEnv(cfg) for _ in range(batch)]
    else:
        env, codec = make_vector_env(cfg, batch), ObservationCodec(tok)
        assert codec.fast
    for r in range(rounds):
        seeds = [seed + r * batch + i // group for i in range(batch)]
        t0 = time.perf_counter()
        if path == "per_game":
            firsts = [e.reset(seed=s) for e, s in zip(envs, seeds)]
            [tok.encode(o).ids for o, _ in firsts]
            legal = np.zeros((batch, num_actions), bool)
            for i, (_, info) in enumerate(firsts):
                legal[i, info["legal_actions"]] = True
            live = np.ones(batch, bool)
        else:
            first = env.reset(seeds)
            codec.encode(first.obs)
            legal = first.legal.copy()
        reset_wall.append(time.perf_counter() - t0)
        turns = 0
        while True:
            rows = np.flatnonzero(live if path == "per_game" else env.live)
            if not len(rows):
                break
            ids, counts = _answer_ids(tok, _random_legal(legal[rows], rng))
            t0, c0 = time.perf_counter(), time.thread_time()
            if path == "per_game":
                for k, (i, answer) in enumerate(zip(rows.tolist(), ids.tolist())):
                    obs, _, term, trunc, info = envs[i].step(tok.decode(answer, skip_special_tokens=True))
                    if term or trunc:
                        live[i] = False
                    else:
                        tok.encode(obs).ids
            elif path == "vector":
                step = env.step(rows, moves=codec.padded_answers_to_moves(ids, counts))
                going = ~(step.terminated | step.truncated)
                if going.any():
                    codec.encode_step(step, going)
            elif path == "vector_strings":
                answers = [row[:c] for row, c in zip(ids.tolist(), counts.tolist())]
                step = env.step(rows, moves=codec.answers_to_moves(answers))
                going = ~(step.terminated | step.truncated)
                codec.encode_padded([o for o, k in zip(step.obs, going.tolist()) if k])
            else:  # vector_text: answers decoded to text and parsed by the env, as a user env would need
                step = env.step(rows, codec.decode(ids.tolist()))
                codec.encode(step.obs)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
            live_rows.append(len(rows))
            if path == "per_game":
                for i in rows.tolist():
                    legal[i] = False
                    legal[i, envs[i]._legal] = True
            else:
                legal[rows] = step.legal
            turns += 1
        turns_per_round.append(turns)
    full = [t for t, n in zip(wall, live_rows) if n == batch]  # turns where every game was still playing
    return {
        "game": game, "prompt_style": style, "batch": batch, "path": path, "rounds": rounds, "seed_group": group,
        "turns": len(wall), "turns_per_round_mean": statistics.mean(turns_per_round),
        "ms_per_turn_median": 1e3 * statistics.median(wall),
        "ms_per_turn_mean": 1e3 * statistics.mean(wall),
        "cpu_ms_per_turn_median": 1e3 * statistics.median(cpu),
        "ms_per_full_turn_median": 1e3 * statistics.median(full) if full else None,
        "us_per_game_step": 1e6 * sum(wall) / sum(live_rows),
        "ms_per_reset_median": 1e3 * statistics.median(reset_wall),
    }


def alphabeta_depths(batch: int = 512, depths=(1, 2, 3, 4), per_game_limit: int = 64, seed: int = 0) -> list[dict]:
    """One batched best_moves call over `batch` random mid-game positions per depth, against
    connect_four_search.best_moves per position (timed on `per_game_limit` of them, scaled)."""
    rng = random.Random(seed)
    game = pyspiel.load_game("connect_four")
    histories = []
    while len(histories) < batch:
        state = game.new_initial_state()
        for _ in range(rng.randrange(4, 24)):
            if state.is_terminal():
                break
            state.apply_action(rng.choice(state.legal_actions()))
        if not state.is_terminal():
            histories.append(state.history())
    me, opp = [], []
    for h in histories:
        p0, p1 = connect_four_search.bitboards_from_history(h)
        me.append(p0 if len(h) % 2 == 0 else p1), opp.append(p1 if len(h) % 2 == 0 else p0)
    me, opp = np.array(me, np.uint64), np.array(opp, np.uint64)
    rows = []
    for depth in depths:
        times = []
        for _ in range(3 if depth < 4 else 1):
            t0 = time.perf_counter()
            vector_c4.best_moves(me, opp, depth)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for h in histories[:per_game_limit]:
            connect_four_search.best_moves(h, depth)
        per_game = (time.perf_counter() - t0) * batch / per_game_limit
        rows.append({"depth": depth, "positions": batch, "vector_ms": 1e3 * min(times),
                     "per_game_ms_estimated": 1e3 * per_game})
    return rows


def bench_parser(n: int = 100_000) -> dict:
    texts = ["3", "[3]", "column 3\n", " 3 because the centre is strong", "I play 3", "no idea"]
    t0 = time.perf_counter()
    for i in range(n):
        parse_action(texts[i % len(texts)])
    scalar = (time.perf_counter() - t0) / n
    batch = (texts * (512 // len(texts) + 1))[:512]
    t0 = time.perf_counter()
    for _ in range(200):
        parse_actions(batch)
    return {"us_per_parse": 1e6 * scalar, "us_per_parse_batched_512": 1e6 * (time.perf_counter() - t0) / 200 / 512}


def bench_opponent(game: str, spec: str, games: int = 10, seed: int = 0) -> dict:
    """Per-game opponent vs a random mover; time per opponent move."""
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
    return {"game": game, "opponent": spec, "moves": len(times),
            "ms_per_move_mean": 1e3 * statistics.mean(times), "ms_per_move_max": 1e3 * max(times)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--rounds", type=int, default=3, help="episodes (all games reset together) per measurement")
    ap.add_argument("--quick", action="store_true", help="compact style only, one round, no opponents")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "results", "bench_envs.json"))
    args = ap.parse_args(argv)
    styles = ("compact",) if args.quick else ("compact", "chat")
    rounds = 1 if args.quick else args.rounds

    results = {
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "node": platform.node(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
        },
        "lockstep": [],
    }
    for batch in args.batches:
        for game in ("connect_four", "tic_tac_toe"):
            for style in styles:
                pair = {}
                paths = ("per_game", "vector_strings", "vector") + (() if args.quick or style != "compact"
                                                                    else ("vector_text",))
                for path in paths:  # back to back: the same machine load for all
                    # The per-game path costs ~0.1 s a turn at 2048: one round is plenty there.
                    row = lockstep(game, style, batch, path, 1 if path == "per_game" and batch > 512 else rounds)
                    results["lockstep"].append(row)
                    pair[path] = row
                p, v, b = pair["per_game"], pair["vector"], pair["vector_strings"]
                print(f"{game:13s} {style:8s} batch {batch:5d}: per turn (median) per-game "
                      f"{p['ms_per_turn_median']:7.2f} ms, vector {v['ms_per_turn_median']:6.2f} ms wall / "
                      f"{v['cpu_ms_per_turn_median']:5.2f} ms cpu, "
                      f"x{p['ms_per_turn_median'] / v['ms_per_turn_median']:.0f}"
                      f" (with string observations {b['ms_per_turn_median']:6.2f} / {b['cpu_ms_per_turn_median']:5.2f})"
                      f"; reset {p['ms_per_reset_median']:.1f} vs {v['ms_per_reset_median']:.1f} ms", flush=True)
    # Resets as training does them (groups of 8 games share a seed) against evaluation (every game its own).
    # Seeds no earlier run used: the env caches what it drew per seed (a GRPO group's games share one).
    results["reset_512"] = [lockstep("connect_four", "compact", 512, "vector", rounds, group=g, seed=(1 + g) * 10**6)
                            for g in (1, 8)]
    for row in results["reset_512"]:
        print(f"vector reset of 512 games, {512 // row['seed_group']} distinct seeds: "
              f"{row['ms_per_reset_median']:.1f} ms")
    results["alphabeta_512"] = alphabeta_depths(depths=(1, 2, 3) if args.quick else (1, 2, 3, 4))
    for row in results["alphabeta_512"]:
        print(f"alphabeta depth {row['depth']}, 512 positions: vector {row['vector_ms']:8.1f} ms, "
              f"per-game {row['per_game_ms_estimated']:8.1f} ms", flush=True)
    results["parser"] = bench_parser()
    print(f"parser: {results['parser']['us_per_parse']:.2f} us/answer, batched "
          f"{results['parser']['us_per_parse_batched_512']:.3f} us/answer at 512")
    if not args.quick:
        results["opponents"] = [
            bench_opponent("connect_four", "random"),
            bench_opponent("connect_four", "alphabeta:4"),
            bench_opponent("connect_four", "alphabeta:5"),
            bench_opponent("connect_four", "mcts:200", games=3),
            bench_opponent("tic_tac_toe", "solver"),
            bench_opponent("tic_tac_toe", "mcts:200", games=3),
        ]
    results["machine"]["load_average_at_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out} ({results['machine']['processor']}, {results['machine']['node']}, "
          f"load {results['machine']['load_average_at_start']})")
    return results


if __name__ == "__main__":
    main()
