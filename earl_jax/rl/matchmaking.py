"""Who the agent plays: the fixed `--env.opponent` or the curriculum's current rung, and, with a league, frozen
snapshots of itself for a share of the groups. The trainer asks this object for its training env, the
opponents to evaluate against and the league games of an iteration, and hands it every evaluation.

Decisions:
- A rung change builds a new vector env for the batch (a few ms; envs hold no model state), so the
  rollout path is the same for every opponent.
- League games are whole GRPO groups (the last round(share x groups) groups): games compared in a group
  face the same kind of opponent. The other groups play the scripted opponent / current rung.
- `--curriculum.mix-opponent S --curriculum.mix-share p`: the last round(p x groups) groups play the scripted
  opponent S in the same batched env (`VectorTextEnv.assign_opponent`), the others the fixed opponent or the current
  rung: a policy that learns to draw against the Tic-Tac-Toe solver but to win against random needs both in its
  batches (docs/learning.md).
- `--curriculum.rehearsal-share p` (with the curriculum): the last round(p x groups) groups replay the rungs below the
  current one, one rung an iteration in turn (iteration i: rung i mod k of the k below), through the same
  second-opponent slot as the mixed opponent. On one GPU a policy promoted by stall from alphabeta:2 (best 0.52-0.55
  against it) to alphabeta:3 fell to 0.00-0.11 against alphabeta:1 and 2 within 35-85 iterations (docs/learning.md):
  what a rung taught is lost unless it stays in the batch. On rung 0 there is nothing to replay and every group
  plays the rung.
- League games need the batched env (standard Connect Four / Tic-Tac-Toe, a batched scripted opponent):
  the frozen policy plays inside its step (`envs/vector/model_opponent.py`); other setups are refused at
  start, naming the flag.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import numpy as np

from earl_jax.envs import EnvConfig
from earl_jax.envs.vector import make_vector_env
from earl_jax.envs.vector.model_opponent import ModelOpponentEnv
from earl_jax.rl.curriculum import Curriculum, parse_ladder
from earl_jax.rl.league import League

log = logging.getLogger("earl_jax")


class Matchmaker:
    def __init__(self, cfg, env_cfg: EnvConfig, *, groups: int, group_size: int, seed: int,
                 eval_opponents: tuple[str, ...], env_factory: Callable[[EnvConfig], Any] | None = None,
                 to_host: Callable[[Any], Any] | None = None):
        """`cfg`: the job's CurriculumConfig; `env_cfg`: its EnvConfig (opponent "curriculum": climb the ladder)."""
        self.cfg, self.env_cfg, self.env_factory = cfg, env_cfg, env_factory
        self.groups, self.group_size, self.batch_size, self.seed = groups, group_size, groups * group_size, seed
        self._eval_opponents = tuple(eval_opponents)
        self.curriculum = (Curriculum(parse_ladder(cfg.ladder, env_cfg.game), cfg.promote_at, cfg.promote_on_stall,
                                      cfg.rung_max_iterations) if env_cfg.opponent == "curriculum" else None)
        self.league = League(cfg.league_size, cfg.league_every, to_host) if cfg.league_size else None
        self._env, self._env_opponent = None, None
        self._second: str | None = None  # the second opponent the env's mixed games play now (mix or rehearsal)
        if self.league is not None:  # refuse a setup without the batched env now, not at a later promotion
            for rung in self.curriculum.ladder if self.curriculum else (env_cfg.opponent,):
                self._build(rung)

    @property
    def opponent(self) -> str:
        """The scripted opponent of this iteration's training games."""
        return self.curriculum.opponent if self.curriculum else self.env_cfg.opponent

    def train_env(self, step: int = 0):
        """The training batch's vector env for iteration `step`: rebuilt when the rung changed, its mixed groups
        given this iteration's second opponent (--curriculum.mix-opponent, or the rung --curriculum.rehearsal-share
        replays)."""
        if self._env is None or self._env_opponent != self.opponent:
            self._env, self._env_opponent, self._second = self._build(self.opponent), self.opponent, None
        second = self.second_opponent(step)
        if second != self._second:
            if not hasattr(self._env, "assign_opponent"):
                raise ValueError(f"{self._second_flag()} needs the built-in batched game env (standard connect_four "
                                 f"or tic_tac_toe, batched scripted opponents), not {type(self._env).__name__}")
            try:
                self._env.assign_opponent(second, None if second is None else self._mixed_rows())
            except ValueError as e:  # e.g. mcts:N, which has no batched version
                raise ValueError(f"{self._second_flag()} {second!r}: {e}") from None
            self._second = second
        return self._env

    def second_opponent(self, step: int) -> str | None:
        """The opponent of this iteration's mixed groups: --curriculum.mix-opponent, the rung
        --curriculum.rehearsal-share replays (the rungs below the current one in turn), or None."""
        if self.cfg.mix_opponent:
            return self.cfg.mix_opponent
        if self.cfg.rehearsal_share and self.curriculum is not None and self.curriculum.rung > 0:
            return self.curriculum.ladder[step % self.curriculum.rung]
        return None

    def mix_games(self) -> np.ndarray | None:
        """Which rows of the batch play the second opponent the last train_env gave them (whole groups, the last
        ones), or None: what the iteration's games played, whatever an evaluation since then promoted."""
        return None if self._second is None else self._mixed_rows()

    def _mixed_rows(self) -> np.ndarray:
        cfg = self.cfg
        share = cfg.mix_share if cfg.mix_opponent else cfg.rehearsal_share
        return self._last_groups(min(self.groups - 1, max(1, round(share * self.groups))))  # both keep one

    def _second_flag(self) -> str:
        return "--curriculum.mix-opponent" if self.cfg.mix_opponent else "--curriculum.rehearsal-share"

    def _last_groups(self, groups: int) -> np.ndarray:
        """The batch's rows in its last `groups` GRPO groups (league and mixed-opponent games are whole groups)."""
        mask = np.zeros(self.batch_size, bool)
        mask[(self.groups - groups) * self.group_size:] = True  # group g holds rows g*G .. (g+1)*G - 1
        return mask

    def _build(self, opponent: str):
        env_cfg = dataclasses.replace(self.env_cfg, opponent=opponent)
        if self.league is None:
            return make_vector_env(env_cfg, self.batch_size, self.env_factory)
        if self.env_factory is not None:
            raise ValueError("--curriculum.league-size: self-play needs the built-in batched game env, not a custom "
                             "env_factory")
        try:
            return ModelOpponentEnv(env_cfg, self.batch_size)
        except ValueError as e:
            raise ValueError(f"--curriculum.league-size: self-play needs standard connect_four or tic_tac_toe with a "
                             f"batched scripted opponent (random, alphabeta:D, solver), here {opponent!r}: "
                             f"{e}") from None

    def eval_opponents(self) -> tuple[str, ...]:
        """--eval.opponents, and the current rung when it is not among them."""
        extra = (self.curriculum.opponent,) if self.curriculum and self.curriculum.opponent not in \
            self._eval_opponents else ()
        return self._eval_opponents + extra

    def after_evaluation(self, rung_win_rate: float, step: int) -> str | None:
        """The greedy win rate against the current rung: promotes when it reaches --curriculum.promote-at, logging a
        line (returned too)."""
        if self.curriculum is None:
            return None
        line = self.curriculum.observe(rung_win_rate, step)
        if line:
            log.info(line)
        return line

    # ---- league -------------------------------------------------------------------------------
    def league_games(self, step: int, params: Any) -> tuple[np.ndarray, int, Any] | None:
        """Snapshot the weights when due; then (mask of the batch's league games, snapshot step, host weights),
        or None without a league."""
        if self.league is None:
            return None
        self.league.maybe_add(step, params)
        mask = self._last_groups(max(1, round(self.cfg.league_share * self.groups)))
        snap_step, snap = self.league.sample(self.seed, step)
        return mask, snap_step, snap

    def metrics(self) -> dict[str, Any]:
        out = self.curriculum.metrics() if self.curriculum else {}
        if self.cfg.rehearsal_share and self.curriculum is not None:  # the rung replayed; -1: none (rung 0)
            out["rehearsal/rung"] = -1 if self._second is None else self.curriculum.ladder.index(self._second)
        if self.league is not None:
            out["league/size"] = len(self.league)
        return out

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"curriculum": self.curriculum.state_dict() if self.curriculum else None,
                "league": self.league.state_dict() if self.league else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.curriculum is not None and state.get("curriculum"):
            self.curriculum.load_state_dict(state["curriculum"])
