"""Shared by the token-exact tests and their neighbours (chat templates, the rollout pool and pipeline): three kinds
of job (a constrained game, a free-text task, a tool task whose answers call `echo`), and one rollout with its
experience batch."""
from __future__ import annotations

import gymnasium
import numpy as np

from earl_jax.rl.algorithm.packing import scored_spans
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rl.stages.experience_stage import rollout_batch
from earl_jax.tasks.tools import Tool, ToolCall, ToolUse, register_call_parser
from jobs import job, with_fields

BASE = dict(rollout__groups=4, rollout__group_size=2, run__steps=1, sft__steps=0, planner__devices=1,
            eval__games=4, run__checkpoint_every=0, rollout__max_context=256, rollout__cache_dtype="float32",
            run__progress=False, run__wandb_mode="disabled")
KINDS = {
    "game": dict(env__game="connect_four", rollout__constrain_moves=True, env__opponent="random"),
    "text_task": dict(env__task="earl_jax/GuessNumber-v0", rollout__max_turn_tokens=6),
    "tool_task": dict(env__task="exact_cases:make_echo_task", rollout__max_turn_tokens=5),
}


@register_call_parser("token_exact_test")
def _every_answer_without_a_digit_is_a_call(answer: str) -> ToolCall | None:
    """Random weights rarely write a call: here every answer without a digit calls `echo`, so tools run mid-episode."""
    return None if any(c.isdigit() for c in answer) else ToolCall("echo", answer)


class _Count(gymnasium.Env):
    """Answer the number shown (after up to three tool calls)."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.n = int(self.np_random.integers(10))
        return f"n {self.n}\n> ", {}

    def step(self, answer: str):
        right = answer.strip().startswith(str(self.n))
        return "", float(right), True, False, {"success": right}


def make_echo_task(split: str = "train") -> gymnasium.Env:
    return ToolUse(_Count(), [Tool("echo", lambda args: f"{len(args)} chars")], parser="token_exact_test",
                   max_calls=3)


def _trainer(tmp_path, kind: str, **fields) -> Trainer:
    return Trainer(with_fields(job(), **{**BASE, **KINDS[kind], "run__run_dir": str(tmp_path), **fields}), log=False)


def _rollout_and_experience(trainer: Trainer):
    """One training rollout and its experience batch, the batch's rows put back in the rollout's order."""
    seeds, group_ids, rng = trainer.rollout_inputs()
    env = trainer.matchmaker.train_env(0)
    traj, _ = trainer.play(env, seeds, group_ids, rng, trainer.sampling)
    batch = rollout_batch(traj, trainer.policy.moves is not None)
    trainer._observe(batch, traj.stats.turn_context_len_mean, traj.num_games)
    spans = scored_spans(traj.loss_mask)
    out = trainer.policy.planner.run("experience", lambda run: trainer._experience(run, batch, spans, None))
    batch, metrics, arranged = out.batch, out.metrics, out.arranged
    width = traj.tokens.shape[1]
    old = np.empty(np.shape(batch.old_logp), np.float32)
    old[arranged] = np.asarray(batch.old_logp)
    tokens = np.empty(np.shape(batch.tokens), np.int32)
    tokens[arranged] = np.asarray(batch.tokens)
    return traj, old[:, :width], tokens[:, :width], {k: float(v) for k, v in metrics.items()}


def _runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """(start, end, value) of each run of equal mask values."""
    edges = [0, *(np.flatnonzero(np.diff(mask.astype(np.int8))) + 1).tolist(), len(mask)]
    return [(a, b, bool(mask[a])) for a, b in zip(edges[:-1], edges[1:])]
