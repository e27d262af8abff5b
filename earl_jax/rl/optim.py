"""The optimizer: AdamW with warm-up and cosine decay, global-norm clipping, and its settings."""

from __future__ import annotations

import dataclasses

import optax

from earl_jax.cli import field_help as _f


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

    @property
    def updates_per_iteration(self) -> int:
        return self.ppo_epochs * self.ppo_mini_batches

    def make(self, iterations: int) -> optax.GradientTransformation:
        """The optimizer of a run of `iterations`: its schedule counts optimizer updates."""
        n = self.updates_per_iteration
        return make_optimizer(self.learning_rate, self.warmup_steps * n, iterations * n, self.weight_decay,
                              self.grad_clip)


def make_optimizer(learning_rate: float, warmup_steps: int, total_steps: int, weight_decay: float,
                   grad_clip: float) -> optax.GradientTransformation:
    # Warm-up starts above zero: a first step at learning rate 0 would waste a whole RL iteration.
    schedule = optax.warmup_cosine_decay_schedule(
        learning_rate / max(warmup_steps, 1), learning_rate, max(warmup_steps, 1), max(total_steps, warmup_steps + 1),
        end_value=0.1 * learning_rate)
    return optax.chain(optax.clip_by_global_norm(grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay))
