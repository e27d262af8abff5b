"""Batched text environments: every game of a rollout batch stepped by one call.

The agent loop used to step one `OpenSpielTextEnv` per game after each decoded turn, and that host
work was 55-60% of a 512-game rollout on an H100. Here Connect Four and Tic-Tac-Toe are array code
over a batch (uint64 bitboards, winning lines as tables), with batched opponents, a batched parser
and a table-driven tokenizer path, observationally identical to the per-game envs (tests replay
thousands of games through both, OpenSpiel being the reference). What is game-specific (the rules, among them
Connect Four's vectorized full-width negamax and Tic-Tac-Toe's perfect-play table, the text, the batched
opponents, the blunder classes) is the game's GameSpec in envs/games/; this package is the same for every game.

    batched_opponents.py  per-game seeded RNG streams, the batched opponents' base, random for any game
    blunders.py       the outcome classes a move gives away (--env.blunder-penalty), from the game's spec
    render.py         board text and observation strings for a batch
    batched_parser.py parse_actions: envs.parser.parse_action for a batch
    codec.py          ObservationCodec: observations -> token ids, answer ids -> moves
    env.py            VectorTextEnv
    per_game.py       PerGameVectorEnv (any OpenSpiel game, mcts, user envs) and make_vector_env
    model_opponent.py ModelOpponentEnv: a policy (a frozen snapshot) as the opponent of some games
    step.py           VectorStep, what reset and step return

The agent loop, per rollout:

    env = make_vector_env(env_config, n)                 # VectorTextEnv or the per-game wrapper
    codec = ObservationCodec(tokenizer)
    first = env.reset(seeds)                             # VectorStep over all n games
    ids, counts = codec.encode_padded(first.obs)         # right-padded ids, == tokenizer.encode(o).ids per row
    while env.live.any():
        rows = np.flatnonzero(env.live)
        answers, lengths = decoded[rows]                 # the decode batch's answer ids, padded
        if env.accepts_moves:
            step = env.step(rows, moves=codec.padded_answers_to_moves(answers, lengths))
        else:                                            # user envs read their own text
            step = env.step(rows, codec.decode([a[:k] for a, k in zip(answers, lengths)]))
        step.reward, step.terminated, step.truncated, step.winners, step.invalid  # arrays over rows
        going = ~(step.terminated | step.truncated)
        ids, counts = codec.encode_step(step, going)     # the games that go on: byte rows -> ids, no strings

`step.obs` (the texts) is built on first read: the loop never reads it for the batched games, so a finished
game's last text is never rendered.

Measured (experiments/benchmarks/bench_envs.py -> experiments/results/bench_envs.json; a shared 2-core x86 VM, load
~3-4, so wall times are inflated; random agent vs random opponent, compact style, median host time of one
lock-step turn: read the answer ids + step + token ids of the observations):

    games   per-game path (decode, OpenSpielTextEnv.step, tokenizer.encode)   vector
      64      3.8 ms (Connect Four)  3.0 ms (Tic-Tac-Toe)                   0.63 / 0.67 ms
     512     24 ms                  22 ms                                   1.0 / 1.2 ms
    2048     69 ms                  82 ms                                   1.2 / 3.0 ms

The same env read through its texts (`encode_padded(step.obs)`, answers as lists): 1.6 / 2.1 ms at 512,
2.5 / 4.7 ms at 2048 (chat style: 5.7 / 6.0 ms against 2.0 / 2.9). Resets: ~4 ms for 512 games with 64
distinct seeds (a GRPO batch), ~17 ms with 512 (gymnasium's Generator per new seed is most of it; cached per
seed).

Alpha-beta (Connect Four, 512 mid-game positions in one call): the batched search is full width
(exact: the same best set and score as the pruned per-game search), so it grows ~8x per ply:
depth 1: 0.5 ms, 2: 1.8 ms, 3: 15 ms, 4: 146 ms, against 32 / 81 / 299 / 945 ms for the per-game
search over the same positions. Depth <= 2 stays within a turn's budget at 512 games; depth 3
costs ~15x a random-opponent turn; depth 4 is still 6x faster than per game but dominates the
turn; at depth 5 both take ~2 s for 512 games (an earlier run).

The names below load on first use (PEP 562): the agent loop reads `ObservationCodec` without loading OpenSpiel.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_LAZY = {
    "ObservationCodec": "codec", "VectorTextEnv": "env", "parse_actions": "batched_parser",
    "PerGameVectorEnv": "per_game", "make_vector_env": "per_game", "NO_WINNER": "step", "VectorStep": "step",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from earl_jax.envs.vector.batched_parser import parse_actions
    from earl_jax.envs.vector.codec import ObservationCodec
    from earl_jax.envs.vector.env import VectorTextEnv
    from earl_jax.envs.vector.per_game import PerGameVectorEnv, make_vector_env
    from earl_jax.envs.vector.step import NO_WINNER, VectorStep


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
