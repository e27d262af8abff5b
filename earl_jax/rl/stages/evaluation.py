"""Greedy evaluation against fixed opponents and the curriculum's rung, and the promotion it decides.

Every evaluation plays the same seeds (20,000,000 + i), so evaluations of one run, and of runs with the same
`--eval.games`, are comparable. The rewards are outcomes only (blunder penalty off), but in the batched games every
greedy move is judged: `eval/<opponent>/blunder_rate` is the share of the agent's moves that missed a win in one or
a block of the opponent's win in one (`EVAL_BLUNDER_DEPTH`); mcts:N opponents play inside the batched env for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from earl_jax.envs.vector import make_vector_env
from earl_jax.progress import phase
from earl_jax.rl.stages.policy_setup import Policy
from earl_jax.rl.stages.rollout_stage import RolloutStage
from earl_jax.rollout.sampler import SamplingConfig

EVAL_SEED = 20_000_000
EVAL_BLUNDER_DEPTH = 1  # a missed win or a missed block: what a reader checks on the board
# play(env, seeds, group_ids, rng, sampling, training) -> trajectories
Play = Callable[..., Any]


class Evaluator:
    def __init__(self, cfg, env_cfg, matchmaker, play: Play, env_factory=None, task_log=None):
        """`cfg`: EvalConfig; `env_cfg`: the job's EnvConfig (its opponent replaced per evaluation opponent);
        `matchmaker`: the RL loop's (the curriculum's rung is evaluated too), or None (only `cfg.opponents`);
        `task_log`: a text task's episode log (its held-out episodes are reported as eval/success_rate, ...)."""
        self.cfg, self.env_cfg, self.matchmaker = cfg, env_cfg, matchmaker
        self.play, self.env_factory = play, env_factory
        self.task_log = task_log
        self.envs: dict[str, Any] = {}  # one per evaluation opponent, made on first use

    def __call__(self, opponents: tuple[str, ...] | None = None) -> dict[str, float]:
        """Greedy games against each evaluation opponent and the curriculum's current rung, or against `opponents`."""
        out: dict[str, float] = {}
        greedy = SamplingConfig(greedy=True)
        # none: only the curriculum's rung is played; a task plays its held-out split, reported as eval/
        first = "held-out" if self.task_log is not None else self.cfg.opponents[0] if self.cfg.opponents else None
        curriculum = self.matchmaker.curriculum if self.matchmaker else None
        rung: dict[str, float] = {}  # win rates against the current rung's opponents
        for name in opponents or (self.matchmaker.eval_opponents() if self.matchmaker else self.cfg.opponents):
            env = self.envs.get(name)
            if env is None:
                eval_cfg = dataclasses.replace(self.env_cfg, opponent=name, blunder_penalty=0.0)
                env = self.envs[name] = make_vector_env(eval_cfg, self.cfg.games, self.env_factory,
                                                        per_game_opponents=True)
                if getattr(env, "spec", None) is not None and env.spec.move_classes is not None:
                    env.judge_blunders = EVAL_BLUNDER_DEPTH
            seeds = [EVAL_SEED + i for i in range(env.num_games)]
            traj = self.play(env, seeds, None, jax.random.key(0), greedy, training=False)
            prefix = "eval" if name == first else f"eval_{name}"
            for k in ("win_rate", "draw_rate", "loss_rate", "invalid_rate"):
                out[f"{prefix}/{k}"] = getattr(traj.stats, k)
            if traj.stats.blunder_rate is not None:
                out[f"{prefix}/blunder_rate"] = traj.stats.blunder_rate
            if self.task_log is not None:
                out.update(self.task_log.drain(prefix))
            if curriculum and name in curriculum.members:
                rung[name] = traj.stats.win_rate
        if rung:  # the lowest over the rung's opponents decides
            out["curriculum/eval_win_rate"] = min(rung.values())
        return out

    def logged(self, step: int, status: Callable[[str], None] = lambda s: None) -> dict[str, float]:
        """An evaluation with its phase line; the curriculum promotes (and says so) when its rung is beaten."""
        opponents = ", ".join(self.matchmaker.eval_opponents())
        what = "the held-out split" if self.task_log is not None else opponents
        status(f"evaluation vs {what}")
        with phase(f"evaluation: {self.cfg.games} greedy {'episodes of' if self.task_log else 'games vs'} {what}") as p:
            out = self()
            p.note(", ".join(f"{k} {v:.2f}" for k, v in out.items() if k.endswith(("win_rate", "success_rate"))))
        if "curriculum/eval_win_rate" in out:
            self.matchmaker.after_evaluation(out["curriculum/eval_win_rate"], step)
        return out


def policy_evaluator(cfg, policy: Policy, state) -> Evaluator:
    """Greedy games of `policy` outside the RL loop (a base's build, experiments/pretrain.py), with the weights
    `state.params` holds when it plays, against the evaluation opponents of the JobConfig `cfg`: the trainer's
    rollout stage on the planned rollout layout, without a curriculum."""
    stage = RolloutStage(cfg.rollout, policy, cfg.rollout.max_context)

    def play(env, seeds, group_ids, rng, sampling: SamplingConfig, *, training: bool = True):
        return policy.planner.run("rollout", lambda run: stage(
            run, policy.weights.for_stage(run, state.params), env, seeds, group_ids, rng, sampling,
            turn_tokens=cfg.rollout.turn_tokens(0), training=training))

    return Evaluator(cfg.eval, cfg.env, None, play)
