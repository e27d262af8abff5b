"""The vector interface over a list of per-game envs, and `make_vector_env`, which picks the path.

Any game OpenSpiel has, mcts opponents, and user envs (anything with `reset(seed=...)` and
`step(text)`, such as tests' SayDigitEnv) go through `PerGameVectorEnv`: the same calls and the
same `VectorStep` as `VectorTextEnv`, with the envs stepped one by one.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np
from jaxtyping import Bool, Int

from earl_jax.envs.games import game_names, spec_for
from earl_jax.envs.openspiel_env import EnvConfig, OpenSpielTextEnv
from earl_jax.envs.outcomes import WINNERS
from earl_jax.envs.vector.env import VectorTextEnv
from earl_jax.envs.vector.per_game_opponents import any_opponent
from earl_jax.envs.vector.step import NO_WINNER, VectorStep, check_answers, check_reset, check_rows


class PerGameVectorEnv:
    """Row i is `envs[i]`. Fills the flags of `VectorStep`; `infos()` returns the envs' own dicts. `workers` > 1
    steps the rows' envs on that many threads (results in row order, so the same step as one by one)."""

    def __init__(self, envs: Sequence[Any], workers: int = 1):
        if not len(envs):
            raise ValueError("no envs")
        if workers < 1:
            raise ValueError(f"step_workers: must be >= 1 (got {workers})")
        self.envs = list(envs)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="env-step") if workers > 1 else None
        self.num_games = len(self.envs)
        self.num_actions = getattr(self.envs[0], "num_actions", None)  # answers 0 .. num_actions - 1, if known
        self.live = np.zeros(self.num_games, bool)
        # Moves stand for their decimal text only where the env reads answers with parse_action.
        self.accepts_moves = all(isinstance(e, OpenSpielTextEnv) for e in self.envs)
        # envs that want to know whether each answer ended on the stop token (tasks: a chat template's turn end)
        self.takes_stopped = all(getattr(e, "takes_stopped", False) for e in self.envs)

    def reset(self, seeds: Sequence[int | None], rows: Sequence[int] | None = None,
              histories: Sequence[Sequence[int]] | None = None) -> VectorStep:
        rows = check_rows(np.arange(self.num_games) if rows is None else rows, self.num_games, self.live, False)
        check_reset(rows, seeds, histories)
        obs, infos = [], []
        self.live[rows] = False  # until each env's reset has returned: a failing one is not stepped half-reset
        for k, (i, seed) in enumerate(zip(rows.tolist(), seeds)):
            kwargs = {"options": {"history": list(histories[k])}} if histories is not None else {}
            o, info = self.envs[i].reset(seed=None if seed is None else int(seed), **kwargs)
            obs.append(o), infos.append(info)
        # A game can end at reset (a history, or a game where the agent never moves): it says so by a winner.
        terminated = np.array([info.get("winner") is not None for info in infos], bool)
        self.live[rows] = ~terminated
        return _step(rows, obs, np.zeros(len(rows)), terminated, np.zeros(len(rows), bool), infos)

    def step(self, rows: Sequence[int], answers: Sequence[str] | None = None, *,
             moves: Int[np.ndarray, " r"] | None = None, stopped: Bool[np.ndarray, " r"] | None = None) -> VectorStep:
        """`stopped` (envs that take it): whether each answer ended on the stop token."""
        rows = check_rows(rows, self.num_games, self.live, True)
        answers, moves = check_answers(rows, answers, moves)
        if moves is not None:
            if not self.accepts_moves:
                raise ValueError("these envs read their own answer texts: step(rows, answers=...)")
            answers = [str(m) if m >= 0 else "" for m in moves.tolist()]  # parse_action(str(m)) == m; "" is no move
        obs, reward, terminated, truncated, infos = [], [], [], [], []
        kw = [{} for _ in answers] if stopped is None else [{"stopped": bool(s)} for s in np.asarray(stopped).tolist()]
        calls = [(self.envs[i].step, answer, k) for i, answer, k in zip(rows.tolist(), answers, kw)]
        done = (self._pool.map(lambda c: c[0](c[1], **c[2]), calls) if self._pool is not None and len(calls) > 1
                else (fn(answer, **k) for fn, answer, k in calls))
        for o, r, term, trunc, info in done:
            obs.append(o), reward.append(r), terminated.append(term), truncated.append(trunc), infos.append(info)
        terminated, truncated = np.array(terminated, bool), np.array(truncated, bool)
        self.live[rows] = ~(terminated | truncated)
        return _step(rows, obs, np.array(reward, np.float64), terminated, truncated, infos)


def _step(rows, obs, reward, terminated, truncated, infos) -> VectorStep:
    winner = np.array([WINNERS.index(w) if w in WINNERS else NO_WINNER for w in (i.get("winner") for i in infos)],
                      np.int8)
    invalid = np.array([bool(i.get("invalid", False)) for i in infos], bool)
    return VectorStep(rows=rows, _obs=obs, reward=reward, terminated=terminated, truncated=truncated,
                      invalid=invalid, winner=winner.reshape(len(rows)), _infos=infos)


def make_vector_env(config: EnvConfig, num_games: int, env_factory: Callable[[EnvConfig], Any] | None = None,
                    per_game_opponents: bool = False) -> VectorTextEnv | PerGameVectorEnv:
    """The batched env where there is one (a registered game, envs/games/, with its default parameters against
    random or one of its batched opponents; with `per_game_opponents` against any opponent, mcts:N stepped one game
    at a time inside it), else the per-game wrapper: over `env_factory(config)` per game when given (the trainer's
    hook), else over OpenSpielTextEnv(config). Both have the same interface."""
    if env_factory is not None:
        return PerGameVectorEnv([env_factory(config) for _ in range(num_games)], workers=config.step_workers)
    reference = OpenSpielTextEnv(config)  # a bad config fails here, with the reference's message
    short = reference.game.get_type().short_name
    try:
        any_opponent(reference.config.opponent, short, 1, per_game_opponents)
        batched = reference.text.is_preset and spec_for(reference.game) is not None
    except ValueError:
        batched = False
    if batched:
        return VectorTextEnv(config, num_games, per_game_opponents)
    if config.blunder_penalty:
        raise ValueError(f"blunder_penalty needs the batched env (standard {' / '.join(game_names())} against random "
                         f"or the game's batched opponents); {config.game!r} against {config.opponent!r} "
                         "plays per game")
    return PerGameVectorEnv([reference] + [OpenSpielTextEnv(config) for _ in range(num_games - 1)])
