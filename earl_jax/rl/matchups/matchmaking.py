"""Who the agent plays: the fixed `--env.opponent` or the curriculum's current rung, and, with a league, frozen
snapshots of itself for a share of the groups. The trainer asks this object for its training env, the
opponents to evaluate against and the league games of an iteration, and hands it every evaluation.

Decisions:
- A rung change builds a new vector env for the batch (a few ms; envs hold no model state), so the
  rollout path is the same for every opponent.
- Every opponent plays whole GRPO groups (games compared in a group face the same kind of opponent), laid out by
  `rl/matchups/group_plan.py`: from the batch's end the league's round(share x groups) groups, then the rehearsal's,
  then the
  rung's. A rung may name several opponents joined by '+' (alphabeta:3+mcts:50): its groups are split among them,
  and an opponent that searches one game at a time (mcts:N, Connect Four's solver) gets at most
  round(--curriculum.per-game-share x groups) of them, the rest going to the strongest batched rung below.
- `--curriculum.mix-opponent S --curriculum.mix-share p`: the last round(p x groups) groups play the scripted
  opponent S in the same batched env (`VectorTextEnv.assign_opponent`), the others the fixed opponent or the current
  rung: a policy that learns to draw against the Tic-Tac-Toe solver but to win against random needs both in its
  batches (docs/learning.md).
- `--curriculum.rehearsal-share p` (with the curriculum): the last round(p x groups) groups replay the rungs below the
  current one, one rung an iteration in turn (iteration i: rung i mod k of the k below), through the same
  second-opponent slot as the mixed opponent (a rung of several opponents: its first). On one GPU a policy promoted by
  stall from alphabeta:2 (best 0.52-0.55 against it) to alphabeta:3 fell to 0.00-0.11 against alphabeta:1 and 2
  within 35-85 iterations (docs/learning.md): what a rung taught is lost unless it stays in the batch. On rung 0
  there is nothing to replay and every group plays the rung. Rehearsal and the league share a batch: their groups
  are apart, so self-play against snapshots is mixed with the rungs below.
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
from earl_jax.rl.matchups.curriculum import Curriculum, parse_ladder
from earl_jax.rl.matchups.group_plan import GroupPlan, plan_groups
from earl_jax.rl.matchups.league import League
from earl_jax.tasks import TaskEnvs
from earl_jax.tasks.chat import task_chat

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
                                      cfg.rung_max_iterations, cfg.rung_max_share)
                           if env_cfg.opponent == "curriculum" else None)
        self.run_fraction = 0.0  # the share of --run.max-minutes spent (the trainer sets it): rung budgets read it
        self.league = League(cfg.league_size, cfg.league_every, to_host) if cfg.league_size else None
        self._env, self._env_opponent = None, None
        self._assigned: tuple | None = None  # the scripted opponents the env's other groups play now (GroupPlan)
        self._plan: GroupPlan | None = None
        self._per_game: dict[str, bool] = {}
        if self.league is not None or cfg.rehearsal_share or cfg.mix_opponent:
            # refuse a setup whose envs cannot host its groups now, not at a later promotion
            for rung in range(len(self.curriculum.ladder)) if self.curriculum else (None,):
                plan = self.plan(0, rung)
                if self.league is not None:
                    self._build(plan.main)
                else:
                    self._check_assignable(plan)

    @property
    def opponent(self) -> str:
        """The scripted opponent of this iteration's training games (a curriculum rung: its opponents joined by +)."""
        return self.curriculum.opponent if self.curriculum else self.env_cfg.opponent

    def plan(self, step: int, rung: int | None = None) -> GroupPlan:
        """Which groups play which scripted opponent at iteration `step` (on rung `rung`: default the current one)."""
        c, cfg = self.curriculum, self.cfg
        if c is None or rung is None:
            rung = c.rung if c else 0
        members = tuple(c.ladder[rung].split("+")) if c else (self.env_cfg.opponent,)
        tail = self._league_groups() if self.league is not None else 0
        rehearsal = None
        if cfg.mix_opponent:  # the mixed opponent's groups are the batch's last, as the rehearsal's
            rehearsal = (cfg.mix_opponent, self._share_groups(cfg.mix_share))
        elif cfg.rehearsal_share and c is not None and rung > 0:
            rehearsal = (c.ladder[step % rung].split("+")[0], self._share_groups(cfg.rehearsal_share))
        return plan_groups(groups=self.groups, rung=members, per_game={o: self._is_per_game(o) for o in members},
                           anchor=self._anchor(rung), per_game_share=cfg.per_game_share, tail=tail,
                           rehearsal=rehearsal)

    def train_env(self, step: int = 0):
        """The training batch's vector env for iteration `step`: rebuilt when its own opponent changed, its other
        groups given this iteration's opponents (the rung's others, --curriculum.mix-opponent, the rung rehearsed)."""
        plan = self._plan = self.plan(step)
        if self._env is None or self._env_opponent != plan.main:
            self._env, self._env_opponent, self._assigned = self._build(plan.main), plan.main, ()  # a new env: none
        if plan.assigned != self._assigned:
            if not hasattr(self._env, "assign_opponents"):
                raise ValueError(f"{self._second_flag()} needs the built-in batched game env (standard connect_four "
                                 f"or tic_tac_toe), not {type(self._env).__name__}")
            rows = [(spec, self._group_rows(g)) for spec, g in plan.assigned]
            try:
                self._env.assign_opponents(rows)
            except ValueError as e:
                raise ValueError(f"{self._second_flag()} {', '.join(s for s, _ in rows)}: {e}") from None
            self._assigned = plan.assigned
        return self._env

    def second_opponent(self, step: int) -> str | None:
        """The opponent of this iteration's mixed groups: --curriculum.mix-opponent, the rung
        --curriculum.rehearsal-share replays (the rungs below the current one in turn), or None."""
        plan = self.plan(step)
        return self.cfg.mix_opponent or plan.rehearsed

    def mix_games(self) -> np.ndarray | None:
        """Which rows of the batch play the mixed opponent or the rehearsed rung the last train_env gave them (whole
        groups, the last ones before the league's), or None: what the iteration's games played."""
        plan = self._plan
        if plan is None or not (self.cfg.mix_opponent or plan.rehearsed):
            return None
        return self._group_rows(plan.assigned[-1][1])

    def _share_groups(self, share: float) -> int:
        return min(self.groups - 1, max(1, round(share * self.groups)))  # at least one, and one left

    def _league_groups(self) -> int:
        return max(1, round(self.cfg.league_share * self.groups))

    def _check_assignable(self, plan: GroupPlan) -> None:
        """Refuse a plan that gives some groups another opponent while the env's own opponent has no batched env to
        host them (a rung that searches one game at a time, or a custom env), before the job starts."""
        if not plan.assigned:
            return
        if self.env_factory is not None:
            raise ValueError(f"{self._second_flag()} needs the built-in batched game env (standard connect_four or "
                             "tic_tac_toe), not a custom env")
        if self._is_per_game(plan.main):
            off = "--curriculum.rehearsal-share 0" if self.cfg.rehearsal_share else "no --curriculum.mix-opponent"
            raise ValueError(f"{self._second_flag()}: the env against {plan.main!r} plays one game at a time (a search "
                             f"opponent, or a game without the batched env), so it cannot give other groups "
                             f"{', '.join(o for o, _ in plan.assigned)}: for a search rung set "
                             f"--curriculum.per-game-share below 1 (its groups then play inside the batched env), or "
                             f"{off}")

    def _second_flag(self) -> str:
        return ("--curriculum.mix-opponent" if self.cfg.mix_opponent else "--curriculum.rehearsal-share"
                if self.cfg.rehearsal_share else "--curriculum.ladder")

    def _is_per_game(self, opponent: str) -> bool:
        """Whether `opponent` searches one game at a time (mcts:N; Connect Four's solver) in this job's game."""
        if opponent not in self._per_game:
            from earl_jax.envs.vector.batched_opponents import make_vector_opponent

            try:
                made = make_vector_opponent(opponent, self.env_cfg.game, 1)
                self._per_game[opponent] = bool(getattr(made, "per_game", False))
            except ValueError:  # no batched version at all (mcts), or not a batched game
                self._per_game[opponent] = True
        return self._per_game[opponent]

    def _anchor(self, rung: int) -> str | None:
        """The strongest rung below `rung` whose lead plays batched (what a slow rung's spare groups play)."""
        if self.curriculum is None or self.cfg.per_game_share >= 1:
            return None
        for below in reversed(self.curriculum.ladder[:rung]):
            lead = below.split("+")[0]
            if not self._is_per_game(lead):
                return lead
        return None

    def _group_rows(self, groups: tuple[int, ...]) -> np.ndarray:
        """The batch's rows in these GRPO groups (group g holds rows g*G .. (g+1)*G - 1)."""
        mask = np.zeros(self.batch_size, bool)
        for g in groups:
            mask[g * self.group_size:(g + 1) * self.group_size] = True
        return mask

    def _last_groups(self, groups: int) -> np.ndarray:
        """The batch's rows in its last `groups` GRPO groups (league games are whole groups)."""
        return self._group_rows(tuple(range(self.groups - groups, self.groups)))

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
        """--eval.opponents, and the current rung's opponents that are not among them."""
        extra = tuple(o for o in self.curriculum.members if o not in self._eval_opponents) if self.curriculum else ()
        return self._eval_opponents + extra

    def after_evaluation(self, rung_win_rate: float, step: int) -> str | None:
        """The greedy win rate against the current rung (the lowest over its opponents): promotes when it reaches
        --curriculum.promote-at, logging a line (returned too)."""
        if self.curriculum is None:
            return None
        line = self.curriculum.observe(rung_win_rate, step, self.run_fraction)
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
        mask = self._last_groups(self._league_groups())
        snap_step, snap = self.league.sample(self.seed, step)
        return mask, snap_step, snap

    def metrics(self) -> dict[str, Any]:
        out = self.curriculum.metrics() if self.curriculum else {}
        plan = self._plan
        if self.cfg.rehearsal_share and self.curriculum is not None:  # the rung replayed; -1: none (rung 0)
            rehearsed = plan.rehearsed if plan is not None else None
            out["rehearsal/rung"] = -1 if rehearsed is None else self.curriculum.lead_index(rehearsed)
        if plan is not None and self.curriculum is not None:
            out["curriculum/rung_games_frac"] = plan.rung_groups / self.groups
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


def job_matchmaker(cfg, policy, env_factory: Callable | None = None
                   ) -> tuple[TaskEnvs | None, Callable | None, Matchmaker]:
    """(task, env factory, matchmaker) of a job: a text task (--env.task) trains on its train split, is evaluated on
    its held-out split, its turns through the checkpoint's chat template when it has one (--env.chat-template); else
    `env_factory`'s games (None: the built-in batched games) against the opponent or the curriculum's rung."""
    eos = policy.tokenizer.id_to_token(policy.ids.eos_id)
    task = (TaskEnvs(cfg.env.task, cfg.env.task_args, task_chat(cfg.env.chat_template, cfg.model.hf_checkpoint, eos))
            if cfg.env.task and env_factory is None else None)
    env_factory = task.train_factory if task else env_factory
    return task, env_factory, Matchmaker(cfg.curriculum, cfg.env, groups=cfg.rollout.groups,
                                         group_size=cfg.rollout.group_size, seed=cfg.run.seed,
                                         eval_opponents=("held-out",) if task else cfg.eval.opponents,
                                         env_factory=env_factory, to_host=policy.weights.host_snapshot)
