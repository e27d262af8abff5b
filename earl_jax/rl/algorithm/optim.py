"""The optimizer: AdamW with warm-up and cosine decay (or a constant rate), global-norm clipping, and its settings.

The decay runs over the run's iterations (`--run.steps`), or, when the run has a wall-time limit
(`--run.max-minutes`), over that time: the share of it spent is a scalar in the optimizer's state
(`RunClockState`), which the trainer sets before each iteration (`with_run_fraction`) and which a checkpoint
carries, so a run resumed in parts continues its schedule. Why: a step count that the time limit cuts
short leaves the learning rate high and later rungs unreached (docs/learning.md).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from earl_jax.cli import field_help as _f

SCHEDULES = ("cosine", "constant")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """optim: the policy's optimizer and the PPO passes over a batch"""

    learning_rate: float = _f(1e-3, "AdamW peak learning rate")
    warmup_steps: int = _f(5, "linear warm-up iterations of the learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    grad_clip: float = _f(1.0, "global gradient-norm clip")
    ppo_epochs: int = _f(1, "passes over each iteration's batch")
    ppo_mini_batches: int = _f(1, "optimizer updates per pass, each on 1/N of the iteration's games in whole GRPO "
                                  "groups (veRL's ppo_mini_batch_size = games / N)")
    schedule: str = _f("cosine", "the learning rate after the warm-up: cosine (decays to 0.1x over the run's "
                                 "iterations, or its minutes with --run.max-minutes) or constant (veRL's default)")

    def __post_init__(self):
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        need(self.learning_rate > 0, "learning_rate", "must be > 0")  # NaN fails this too
        need(self.grad_clip > 0, "grad_clip", "must be > 0")
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.ppo_epochs > 0, "ppo_epochs", "must be positive")
        need(self.ppo_mini_batches > 0, "ppo_mini_batches", "must be positive")
        need(self.schedule in SCHEDULES, "schedule", f"must be one of {', '.join(SCHEDULES)}")

    @property
    def updates_per_iteration(self) -> int:
        return self.ppo_epochs * self.ppo_mini_batches

    def make(self, iterations: int, minutes: float = 0.0) -> optax.GradientTransformation:
        """The optimizer of a run of `iterations` (its schedule counts optimizer updates), or of `minutes` of wall
        time when > 0 (its warm-up counts updates, its decay the share of the time spent: `with_run_fraction`)."""
        n, decay = self.updates_per_iteration, self.schedule == "cosine"
        if minutes > 0:
            return make_timed_optimizer(self.learning_rate, self.warmup_steps * n, self.weight_decay, self.grad_clip,
                                        decay=decay)
        return make_optimizer(self.learning_rate, self.warmup_steps * n, iterations * n, self.weight_decay,
                              self.grad_clip, decay=decay)


def make_optimizer(learning_rate: float, warmup_steps: int, total_steps: int, weight_decay: float,
                   grad_clip: float, decay: bool = True) -> optax.GradientTransformation:
    # Warm-up starts above zero: a first step at learning rate 0 would waste a whole RL iteration.
    start, warmup = learning_rate / max(warmup_steps, 1), max(warmup_steps, 1)
    if decay:
        schedule = optax.warmup_cosine_decay_schedule(start, learning_rate, warmup,
                                                      max(total_steps, warmup_steps + 1), end_value=0.1 * learning_rate)
    else:
        schedule = optax.warmup_constant_schedule(start, learning_rate, warmup)
    return optax.chain(optax.clip_by_global_norm(grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay))


class RunClockState(NamedTuple):
    count: jax.Array  # updates so far: the warm-up counts them
    fraction: jax.Array  # share of the run's wall time spent, in [0, 1]: the decay reads it


def timed_learning_rate(learning_rate: float, warmup_steps: int, count, fraction, decay: bool = True):
    """The warm-up of `make_optimizer` over the first `warmup_steps` updates, then its cosine decay to 0.1x over the
    share of the run's time spent (`fraction`), not over updates (`decay=False`: the peak rate after the warm-up)."""
    warmup = max(warmup_steps, 1)
    start = learning_rate / warmup
    rising = start + (learning_rate - start) * jnp.minimum(count, warmup) / warmup
    after = 0.1 * learning_rate + 0.9 * learning_rate * 0.5 * (1 + jnp.cos(jnp.pi * jnp.clip(fraction, 0.0, 1.0)))
    return jnp.where(count < warmup_steps, rising, after if decay else learning_rate)


def scale_by_run_time(learning_rate: float, warmup_steps: int, decay: bool = True) -> optax.GradientTransformation:
    """-timed_learning_rate(...) x updates; its state holds the update count and the run's time share."""

    def init(params):
        del params
        return RunClockState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32))

    def update(updates, state, params=None):
        del params
        lr = timed_learning_rate(learning_rate, warmup_steps, state.count, state.fraction, decay)
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        return updates, RunClockState(optax.safe_increment(state.count), state.fraction)

    return optax.GradientTransformation(init, update)


def make_timed_optimizer(learning_rate: float, warmup_steps: int, weight_decay: float, grad_clip: float,
                         decay: bool = True) -> optax.GradientTransformation:
    """`make_optimizer`'s AdamW (the same moments, decay and clip) with the learning rate of `scale_by_run_time`."""
    return optax.chain(optax.clip_by_global_norm(grad_clip), optax.scale_by_adam(b1=0.9, b2=0.99),
                       optax.add_decayed_weights(weight_decay), scale_by_run_time(learning_rate, warmup_steps, decay))


def with_run_fraction(opt_state, fraction: float):
    """`opt_state` with the run's time share set to `fraction` (the same value on every process), on the sharding the
    old value had; unchanged for an optimizer without a `RunClockState`."""
    from earl_jax.distributed import host_to_global

    def put(x):
        if isinstance(x, RunClockState):
            return x._replace(fraction=host_to_global(np.float32(fraction), x.fraction.sharding))
        return x

    return jax.tree.map(put, opt_state, is_leaf=lambda x: isinstance(x, RunClockState))


def run_fraction(opt_state) -> float | None:
    """The time share an optimizer state holds, None without one."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, RunClockState))
             if isinstance(x, RunClockState)]
    return float(np.asarray(found[0].fraction)) if found else None
