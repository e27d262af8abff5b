"""Shared by the env tests and the curriculum's: boards drawn as text, and `replay`, which plays a batch through
VectorTextEnv and the per-game OpenSpielTextEnvs with the same seeds and answers and asserts every output equal.

Boards are drawn as the compact observation prints them, top row first; X moves first unless a test says otherwise.
"""
import dataclasses
import random

import numpy as np
import pyspiel

from earl_jax.envs import EnvConfig, OpenSpielTextEnv, canonical_action_text
from earl_jax.envs.vector import ObservationCodec, VectorTextEnv, make_vector_env
from earl_jax.models.tokenizer import game_tokenizer


# ---- helpers ----------------------------------------------------------------------------------
def drawing(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def history_from_drawing(game: str, text: str, first: str = "X") -> list[int]:
    """A move order that reaches the drawn position, `first` moving first, no earlier win.

    Connect Four actions are columns (a column is filled bottom-up); Tic-Tac-Toe actions are cells.
    """
    rows = drawing(text)
    g = pyspiel.load_game(game)
    ncols = len(rows[0])
    target = "\n".join(rows)
    second = "O" if first == "X" else "X"
    to_symbol = str.maketrans({"x": first, "o": second})

    def dfs(state, history):
        if str(state).strip().translate(to_symbol) == target:
            return history
        if state.is_terminal():
            return None
        symbol = first if state.current_player() == 0 else second
        for a in state.legal_actions():
            if game == "connect_four":
                height = sum(1 for r in rows if r[a] != ".")
                filled = [r[a] for r in reversed(rows)]
                level = history.count(a)
                if level >= height or filled[level] != symbol:
                    continue
            else:
                if rows[a // ncols][a % ncols] != symbol:
                    continue
            found = dfs(state.child(a), history + [a])
            if found is not None:
                return found
        return None

    found = dfs(g.new_initial_state(), [])
    assert found is not None, f"cannot reach\n{target}"
    return found


_TOK = game_tokenizer()
_CODEC = ObservationCodec(_TOK)


# ---- the replay ----------------------------------------------------------------------------------------
def stones_from_drawing(game: str, text: str) -> np.ndarray:
    """(1, 2) uint64: the X stones and the O stones of a drawn board, in the game's bit layout."""
    rows = drawing(text)
    stones = [0, 0]
    for r, line in enumerate(rows):
        for c, ch in enumerate(line):
            bit = 1 << (c * 7 + len(rows) - 1 - r) if game == "connect_four" else 1 << (r * 3 + c)
            if ch in "XO":
                stones["XO".index(ch)] |= bit
    return np.array([stones], np.uint64)


def assert_same_info(want: dict, got: dict):
    assert want.keys() == got.keys()
    for key, value in want.items():
        if key == "board":
            assert got[key].dtype == value.dtype and np.array_equal(got[key], value), (value, got[key])
        else:
            assert got[key] == value and type(got[key]) is type(value), (key, value, got[key])


def assert_same_step(step, k: int, want: tuple, info: dict):
    """Entry k of a VectorStep equals OpenSpielTextEnv.step's (obs, reward, terminated, truncated, info)."""
    obs, reward, terminated, truncated, want_info = want
    assert step.obs[k] == obs
    assert (step.reward[k], step.terminated[k], step.truncated[k]) == (reward, terminated, truncated)
    assert_same_info(want_info, info)


JUNK = ["", "no idea", "-3", "3.5", "12", "1234567", "I play", "x", "\n", "٣", "7 or 3", "[8]", None]


def mixed_answer(info: dict, rng: random.Random, num_actions: int):
    """Mostly a legal move in some wording, else an illegal number (full column, taken cell, off the
    board) or junk: the invalid, retry and forfeit paths all get exercised."""
    u = rng.random()
    if u < 0.72:
        move = rng.choice(info["legal_actions"])
        return rng.choice([canonical_action_text(move), f"{move}\n", f"I play {move}.", f"[{move}]"])
    if u < 0.86:
        return str(rng.randrange(num_actions + 2))
    return rng.choice(JUNK)


def replay(cfg: EnvConfig, num_games: int, seed: int, second: tuple[str, np.ndarray] | None = None) -> dict:
    """Plays num_games through VectorTextEnv and as many OpenSpielTextEnvs with the same seeds and
    answers, asserting every output equal. Steps random subsets of the live games and resets finished
    games with fresh seeds along the way. Returns counts of what happened, so callers can check coverage.
    `second`: (spec, mask) games that play another scripted opponent (`assign_opponent`), or a list of them
    (`assign_opponents`), their references too."""
    rng = random.Random(seed)
    seconds = second if isinstance(second, list) else [second] if second else []

    def config_of(i: int) -> EnvConfig:
        specs = [spec for spec, mask in seconds if mask[i]]
        return dataclasses.replace(cfg, opponent=specs[0]) if specs else cfg

    refs = [OpenSpielTextEnv(config_of(i)) for i in range(num_games)]
    env = make_vector_env(cfg, num_games)
    assert isinstance(env, VectorTextEnv)
    if seconds:
        env.assign_opponents(seconds)
    seeds = [seed * 10_000 + i for i in range(num_games)]
    infos = [None] * num_games

    def reset(rows, seeds):
        step = env.reset(seeds, rows=rows)
        for k, (i, s) in enumerate(zip(rows, seeds)):
            obs, info = refs[i].reset(seed=s)
            assert step.obs[k] == obs
            assert_same_info(info, step.infos()[k])
            infos[i] = info

    reset(list(range(num_games)), seeds)
    seen = {"games": num_games, "invalid": 0, "retries": 0, "winners": set(), "steps": 0, "from_bytes": 0}
    next_seed, extra_resets = seeds[-1] + 1, num_games // 2
    while env.live.any():
        live = np.flatnonzero(env.live)
        rows = live[np.array([rng.random() < 0.85 for _ in live])]  # not every game answers every call
        answers = [mixed_answer(infos[i], rng, env.num_actions) for i in rows]
        step = env.step(rows, answers)
        # what the agent loop reads first, before any text exists: the ids of the games that go on (from bytes),
        # or of any subset (finished games' texts: through the renderer)
        where = ~step.terminated if rng.random() < 0.5 else np.array([rng.random() < 0.7 for _ in rows], bool)
        ids, lengths = _CODEC.encode_step(step, where)
        got_infos = step.infos()
        wanted = []
        for k, i in enumerate(rows.tolist()):
            want = refs[i].step(answers[k])
            assert_same_step(step, k, want, got_infos[k])
            wanted += [_TOK.encode(want[0]).ids] if where[k] else []
            infos[i] = want[4]
            seen["invalid"] += want[4]["invalid"]
            seen["retries"] += want[4]["invalid"] and not want[2]
            if want[2]:
                seen["winners"].add(want[4]["winner"])
        assert [row[:n].tolist() for row, n in zip(ids, lengths)] == wanted and ids.dtype == np.int32
        assert ids.shape[1] == max(map(len, wanted), default=0)  # as wide as encode_padded's
        seen["from_bytes"] += step.obs_bytes(where) is not None
        seen["steps"] += 1
        done = np.flatnonzero(~env.live)
        if extra_resets and len(done):  # a finished game starts again while the others play on
            again = done[: min(extra_resets, 3)].tolist()
            reset(again, list(range(next_seed, next_seed + len(again))))
            next_seed, extra_resets = next_seed + len(again), extra_resets - len(again)
            seen["games"] += len(again)
    return seen
