"""Learning that depends on the observation, and the train pass scoring exactly what the rollout sampled."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.envs.probe import ShowDigitEnv
from earl_jax.rl.config import RLConfig
from earl_jax.parallel.mesh import STAGE_RULES
from earl_jax.rl.trainer import Trainer
from earl_jax.rollout.sampler import Sampler

TINY = RLConfig(groups=4, group_size=4, steps=1, format_warmup_steps=0, devices=1, eval_games=8, checkpoint_every=0,
                max_context=512, micro_batch_tokens=8192, progress=False, wandb_mode="disabled")


def _sampled_and_recomputed(trainer: Trainer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rollout's sampler log-probs, the experience stage's old-policy log-probs of the same batch under
    the same weights, and the loss mask (generated tokens)."""
    cfg = trainer.cfg
    traj = trainer._rollout(trainer.envs, list(range(cfg.batch_size)), np.repeat(np.arange(cfg.groups), cfg.group_size),
                            jax.random.key(1), trainer.sampling)
    batch, _ = trainer._experience(trainer._batch_arrays(traj), trainer.planner.layout("experience"))
    return traj.logprobs, np.asarray(batch.old_logp)[:, :traj.tokens.shape[1]], traj.loss_mask


@pytest.mark.parametrize("env_factory, extra", [
    # Connect Four, minimal style: multi-turn cache extends, invalid answers and retries (random weights).
    (None, {"game": "connect_four"}),
    # The probe's digit arrives on turn 3, after two extends of generated and observed tokens.
    (functools.partial(ShowDigitEnv, reveal_turn=2), {"max_turn_tokens": 3, "max_context": 64}),
])
def test_train_pass_scores_exactly_the_sampled_tokens(tmp_path, env_factory, extra):
    """The sampler's log-prob of every generated token equals the experience stage's recomputation.

    With a float32 KV cache they agree to float tolerance; the Trainer's bf16 cache (its default) to ~2e-3.
    An off-by-one in positions, padding, BOS or the extend path would be off by nats: the same comparison
    one position over must fail.
    """
    trainer = Trainer(dataclasses.replace(TINY, run_dir=str(tmp_path), **extra), log=False, env_factory=env_factory)
    sampled, old, mask = _sampled_and_recomputed(trainer)  # the Trainer's own sampler (bf16 cache)
    assert mask.sum() > 50 and (mask.sum(1) > mask.sum(1).min()).any()  # many tokens, ragged rows
    np.testing.assert_allclose(sampled[mask], old[mask], atol=1e-2, rtol=0)
    shifted = np.abs(sampled[:, 1:] - old[:, :-1])[mask[:, 1:]]
    assert shifted.mean() > 0.1, shifted.mean()  # the comparison can tell a position apart

    mesh = trainer.planner.mesh("rollout")
    trainer._samplers[id(mesh)] = Sampler(trainer.graphdef, trainer.model_cfg, mesh=mesh, rules=STAGE_RULES["rollout"],
                                          cache_dtype=jnp.float32)
    sampled, old, mask = _sampled_and_recomputed(trainer)
    np.testing.assert_allclose(sampled[mask], old[mask], atol=1e-5, rtol=0)
