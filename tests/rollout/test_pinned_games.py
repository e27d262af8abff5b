"""Generated games pinned to the bit: expert games (constrained and free text, games cut by the rollout limits), their
replays, and the format warm-up's games of random legal moves (batched, per game, a text task's answers, a chooser).
Each case's arrays are digested and compared with tests/fixtures/pinned_games.json, recorded from the code before
the game loops became one (`EARL_RECORD_PINNED=1 python -m pytest tests/rollout/test_pinned_games.py` records them
again; only a change of behaviour on purpose may do that, and says so in its commit)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from earl_jax.envs.env_config import EnvConfig
from earl_jax.envs.vector import ObservationCodec, VectorTextEnv, make_vector_env
from earl_jax.envs.vector.per_game import PerGameVectorEnv
from earl_jax.models.tokenizer import game_tokenizer, special_ids
from earl_jax.rl.supervised.expert_games import TOKEN_FIELDS, ExpertSpec, expert_games
from earl_jax.rl.supervised.expert_replay import replay_games
from earl_jax.rl.supervised.warmup import random_legal_games

FIXTURE = Path(__file__).parents[1] / "fixtures" / "pinned_games.json"
RECORD = os.environ.get("EARL_RECORD_PINNED") == "1"
TOK = game_tokenizer()
IDS = special_ids(TOK)
KW = dict(eos_id=IDS.eos_id, bos_id=IDS.bos_id)


def digest(a) -> str:
    a = np.ascontiguousarray(a)
    return hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()[:16]


def expert_digests(games) -> dict:
    out = {k: digest(getattr(games, k)) for k in TOKEN_FIELDS + ("lengths", "agent_player", "winner", "opening")}
    return {**out, "moves": [list(m) for m in games.moves[:3]], "moves_all": digest(np.array(
        [a for m in games.moves for a in m + (-9,)]))}


EXPERT_CASES = {  # game, style, constrained, ExpertSpec fields, rollout limits
    "c4_minimal_constrained": ("connect_four", "minimal", True, {"games": 24, "depth": 2}, {}),
    "c4_compact_free": ("connect_four", "compact", False, {"games": 16, "depth": 2, "seed": 1}, {}),
    "ttt_chat_free": ("tic_tac_toe", "chat", False, {"games": 16, "seed": 2}, {"max_turn_tokens": 8}),
    "ttt_compact_constrained": ("tic_tac_toe", "compact", True, {"games": 32, "seed": 4, "opening_plies": 3}, {}),
    "c4_cut_constrained": ("connect_four", "minimal", True, {"games": 24, "depth": 2, "seed": 5},
                           {"max_context": 120, "max_turns": 12}),
    "c4_cut_free": ("connect_four", "minimal", False, {"games": 24, "depth": 2, "seed": 6},
                    {"max_context": 110, "max_turn_tokens": 3}),
}


def _expert(name):
    game, style, constrained, spec, limits = EXPERT_CASES[name]
    cfg = EnvConfig(game=game, prompt_style=style)
    return cfg, constrained, limits, expert_games(ExpertSpec(**spec), cfg, TOK, constrained=constrained, **KW,
                                                 **limits)


def _cases():
    for name in EXPERT_CASES:
        yield f"expert_{name}", lambda name=name: expert_digests(_expert(name)[3])
    yield "replay_mirror_constrained", _replay_mirror
    yield "replay_labeled_free", _replay_labeled
    for name in WARMUP_CASES:
        yield f"warmup_{name}", lambda name=name: _warmup(name)


def _replay_mirror():
    cfg, constrained, limits, games = _expert("c4_minimal_constrained")
    return expert_digests(replay_games(games, cfg, TOK, constrained=constrained, mirror=True, **KW))


def _replay_labeled():
    cfg, constrained, limits, games = _expert("c4_compact_free")
    cfg = EnvConfig(game=cfg.game, prompt_style="labeled")
    return expert_digests(replay_games(games, cfg, TOK, constrained=False, max_context=400, **KW))


def _lowest_legal(env, rows, legal):
    return [m[0] for m in legal]


WARMUP_CASES = {  # env maker, games, random_legal_games keywords
    "c4_minimal": (lambda n: VectorTextEnv(EnvConfig(game="connect_four", prompt_style="minimal"), n), 32,
                   {"max_context": 2048}),
    "c4_compact_cut": (lambda n: VectorTextEnv(EnvConfig(game="connect_four", prompt_style="compact"), n), 48,
                       {"max_context": 300, "max_turns": 20}),
    "ttt_chat_chooser": (lambda n: VectorTextEnv(EnvConfig(game="tic_tac_toe", prompt_style="chat"), n), 16,
                         {"max_context": 2048, "choose": _lowest_legal}),
    "per_game_breakthrough": (lambda n: make_vector_env(EnvConfig(game="breakthrough"), n), 4,
                              {"max_context": 1500, "max_turns": 8}),
    "per_game_ttt_mcts": (lambda n: make_vector_env(EnvConfig(game="tic_tac_toe", opponent="mcts:4"), n), 8,
                          {"max_context": 2048}),
    "task_arithmetic_expert": (lambda n: _task_env("earl_jax/Arithmetic-v0", n), 12, {"max_context": 200}),
    "task_show_digit_format": (lambda n: _task_env("earl_jax/ShowDigit-v0", n), 12,
                               {"max_context": 64, "task_answers": "format"}),
    "task_guess_number_cut": (lambda n: _task_env("earl_jax/GuessNumber-v0", n), 12,
                              {"max_context": 50, "max_turns": 8}),  # 5 answers that do not fit
}


def _task_env(spec: str, n: int):
    from earl_jax.tasks import task_env_factory

    make = task_env_factory(spec, "{}", split="train")
    return PerGameVectorEnv([make() for _ in range(n)])


def _warmup(name):
    make, n, kw = WARMUP_CASES[name]
    env = make(n)
    tokens, mask, lengths = random_legal_games(env, TOK, [1000 + 7 * i for i in range(n)], np.random.default_rng(3),
                                               codec=ObservationCodec(TOK), **KW, **kw)
    return {"tokens": digest(tokens), "mask": digest(mask), "lengths": digest(lengths),
            "cut": int((lengths >= kw["max_context"] - 4).sum()), "first": tokens[0, :lengths[0]].tolist()}


CASES = dict(_cases())


@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_games_are_the_recorded_ones(case):
    got = json.loads(json.dumps(CASES[case]()))
    pinned = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    if RECORD:
        pinned[case] = got
        FIXTURE.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {case}")
    want = pinned[case]
    assert {k: v for k, v in got.items() if want.get(k) != v} == {}, f"{case}: differs from the recording"
