"""The SFT stage: supervised steps on transcripts in the environment's exact prompt format, under its own layout.

    metrics = run_sft(policy, state, batches, steps=100, optimizer=optax_optimizer)   # updates state.params

Token-level cross-entropy on the masked tokens: the model's own answers in a transcript (free text: the answer and
its end token; constrained moves: the move token, scored under the legal-move mask the rollout samples from, the
stop token after it unscored). It runs like every stage: `planner.plan_stage("sft")` picks its mesh and micro-batch from
the memory model for the first batch, `planner.run("sft", ...)` runs it there with the out-of-memory fallback, and
the weights move there and back through the dispatcher. Uses: the format warm-up (random legal moves,
rl/supervised/warmup.py) and a base policy built from expert games (experiments/pretrain.py).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Literal

import jax
import numpy as np

from earl_jax.cli import field_help as _f
from earl_jax.distributed import global_to_host
from earl_jax.parallel.plan import ContextStats
from earl_jax.parallel.planner import StageRun
from earl_jax.rl.algorithm.micro_steps import sft_batch
from earl_jax.rl.algorithm.packing import grouped_update, length_order
from earl_jax.rl.stages.policy_setup import Policy
from earl_jax.rl.stages.train_stage import TrainState


@dataclasses.dataclass(frozen=True)
class SftConfig:
    """sft: supervised steps before RL on random legal games (the format warm-up; free-text answers only)"""

    steps: int = _f(20, "supervised steps on uniformly random legal moves before RL (0: off); teaches the answer "
                        "format only; skipped with constrained moves, whose answers have no format")
    games: int = _f(8, "games per step (0: the RL batch)")
    answers: Literal["expert", "format"] = _f(
        "expert", "a text task's supervised answers: expert = its expert_answer() demonstrations; format = answers "
                  "drawn from its action_space (action_space.sample()): the answer's format, never the answer")
    learning_rate: float = _f(3e-3, "AdamW peak learning rate of the supervised steps")

    def __post_init__(self):
        for name in ("steps", "games"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (got {getattr(self, name)!r})")
        if self.answers not in ("expert", "format"):
            raise ValueError(f"answers: must be expert or format (got {self.answers!r})")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate: must be > 0 (got {self.learning_rate!r})")


def sft_step(run: StageRun, policy: Policy, state: TrainState, opt_state, arrays: dict[str, np.ndarray],
             lengths: np.ndarray, optimizer):
    """One supervised step of `arrays` (tokens, loss_mask, [choices]) on `run`'s layout; returns (opt_state, metrics).
    The weights arrive in the train dtype and go back into `state.params`."""
    weights = policy.weights
    state.params = weights.for_stage(run, state.params)
    opt_state = weights.opt_state_for(run, state.params, jax.jit(optimizer.init)(state.params)
                                      if opt_state is None else opt_state)
    perm = length_order(lengths, run.batch_shards)
    x = run.put_rows({k: v[perm] for k, v in arrays.items()})
    micro = run.micro_batches(len(perm))
    batch = run.jit("sft_batch", sft_batch)(x["tokens"], x["loss_mask"], x.get("choices"), x.get("targets"))
    width = x["tokens"].shape[1]
    state.params, opt_state, out = grouped_update(
        run, state.params, opt_state, batch, [width] * micro.count, micro, graphdef=policy.graphdef, loss="sft",
        loss_cfg=None, optimizer=optimizer, token_weighted=True, choice_tokens=policy.choice_tokens)
    return opt_state, jax.block_until_ready(out)


def run_sft(policy: Policy, state: TrainState, batches: Iterable[dict[str, np.ndarray]], *, steps: int, optimizer
            ) -> list[dict[str, float]]:
    """`steps` supervised steps, one per batch of `batches` (each: "tokens" [n, t], "loss_mask" [n, t], "lengths"
    [n], and for constrained moves "choices" [n, t] and optionally "targets" [n, t], the right moves' bitmasks to
    learn as a set; n a multiple of the devices). The stage is planned once, for the first batch. Updates
    `state.params` (only those: the steps keep an optimizer state of their own); returns each step's metrics (loss,
    sft_loss, grad_norm, skipped)."""
    opt_state, history = None, []
    for i, data in zip(range(steps), batches):
        arrays = {k: v for k, v in data.items() if k in ("tokens", "loss_mask", "choices", "targets")}
        if "choices" in arrays and not policy.choice_tokens:  # free-text runs score every token of the vocabulary
            arrays.pop("choices")
            if "targets" in arrays:
                raise ValueError("run_sft: a set of right moves (targets) needs constrained moves")
        lengths = np.asarray(data["lengths"])
        if i == 0:  # one plan for the supervised steps (their batches are alike)
            n, width = arrays["tokens"].shape
            policy.planner.observe(ContextStats(float(lengths.mean()), width, n))
            policy.planner.plan()
            policy.planner.plan_stage("sft")

        def step(run: StageRun):
            nonlocal opt_state
            opt_state, out = sft_step(run, policy, state, opt_state, arrays, lengths, optimizer)
            return out

        metrics = policy.planner.run("sft", step, rerun_after_success=False)
        history.append({k: float(v) for k, v in global_to_host(metrics).items()})
    return history
