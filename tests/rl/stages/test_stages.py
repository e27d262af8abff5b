"""Experience and train stages as the trainer runs them (rl/stages/experience_stage.py, rl/stages/train_stage.py): old
log-probs equal a full
forward pass; micro-batching equals one big batch; NaN never reaches the weights; an estimator and a loss registered by
a fork run in the job's stages."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from earl_jax.models.init import init_sharded
from earl_jax.models.model_config import ModelConfig
from earl_jax.parallel.dispatch import Dispatcher
from earl_jax.parallel.plan import StageLayout
from earl_jax.parallel.planner import ProgramCache, StageRun
from earl_jax.rl.algorithm.advantages import ESTIMATORS, register_estimator
from earl_jax.rl.algorithm.logprobs import token_logprobs
from earl_jax.rl.algorithm.losses import POLICY_LOSSES, LossConfig, register_policy_loss
from earl_jax.rl.algorithm.micro_steps import ExperienceBatch, advantage_step
from earl_jax.rl.algorithm.optim import make_optimizer
from earl_jax.rl.algorithm.packing import grouped_update, scored_spans
from earl_jax.rl.stages.experience_stage import ExperienceResult, RolloutBatch, experience_stage
from earl_jax.rl.stages.train_stage import train_stage
from earl_jax.sharding.mesh import MeshShape, make_mesh
from earl_jax.sharding.stage_registry import STAGE_RULES

CFG = ModelConfig.tiny(vocab_size=32).replace(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
N = 8  # rows


def _run(stage: str, rows_per_micro_batch: int = N, chunk: int = 5) -> StageRun:
    shape = MeshShape.parse("d1f1t1")
    return StageRun(stage, StageLayout(shape, rows_per_micro_batch, chunk), make_mesh(shape, jax.devices()[:1]),
                    STAGE_RULES[stage], ProgramCache())


def _setup(n=N, t=16, seed=0):
    run = _run("train")
    graphdef, params = nnx.split(init_sharded(CFG, run.mesh, run.rules, seed=seed, dtype=jnp.float32))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, CFG.vocab_size, (n, t)).astype(np.int32)
    mask = np.zeros((n, t), bool)
    mask[:, t // 2:] = True
    rewards = np.zeros((n, t), np.float32)
    rewards[:, -1] = rng.choice([-1.0, 0.0, 1.0], n)
    group_ids = np.repeat(np.arange(n // 2), 2).astype(np.int32)
    return graphdef, params, tokens, mask, rewards, group_ids


def _batch() -> tuple[Any, Any, ExperienceResult]:
    """The experience stage's result: its batch (rows in its arrangement), that arrangement, the rows' spans."""
    graphdef, params, tokens, mask, rewards, gids = _setup()
    result = experience_stage(_run("experience"), params, None, RolloutBatch(tokens, mask, rewards, gids),
                              scored_spans(mask), graphdef=graphdef, loss=LossConfig(filter_constant_groups=False),
                              num_groups=4)
    return graphdef, params, result


def _train(graphdef, params, experience: ExperienceResult, optimizer, rows_per_micro_batch):
    """rl/stages/train_stage.py's one update (one epoch, one mini-batch) on copies of the weights (it donates them)."""
    params = jax.tree.map(jnp.copy, params)
    return train_stage(_run("train", rows_per_micro_batch, chunk=4), params, optimizer.init(params), experience,
                       Dispatcher(), graphdef=graphdef, loss=LossConfig(), optimizer=optimizer, epochs=1,
                       mini_batches=1)


def test_experience_old_logp_equals_full_forward_logprobs():
    graphdef, params, result = _batch()
    batch, perm = result.batch, result.arranged
    tokens = np.asarray(batch.tokens)
    _, _, original, *_ = _setup()
    np.testing.assert_array_equal(tokens, original[perm])  # rows in the stage's arrangement
    logits, _ = nnx.merge(graphdef, params)(jnp.asarray(tokens))
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), jnp.asarray(tokens)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(batch.old_logp)[:, 1:], ref, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(batch.advantages)[~np.asarray(batch.loss_mask)] == 0)


def test_the_experience_stage_refuses_a_rollout_batch_that_breaks_its_annotations():
    """A RolloutBatch's columns share one n and one t, each of its dtype kind: a column of another width or length, or
    of another kind, is refused where the stage takes it, in one line naming the field."""
    graphdef, params, tokens, mask, rewards, gids = _setup()
    good = RolloutBatch(tokens, mask, rewards, gids, sampler_logp=-rewards ** 2, choices=tokens)
    assert good.check() is good
    bad = {"loss_mask": mask.astype(np.float32), "rewards": rewards[:, :-1], "group_ids": gids[:-1],
           "sampler_logp": tokens, "choices": tokens[:, :-1]}
    for field, value in bad.items():
        with pytest.raises(TypeError, match=rf"^RolloutBatch\.{field} is not [^\n]*\(tokens int32\[8, 16\], [^\n]*\)$"):
            experience_stage(_run("experience"), params, None, dataclasses.replace(good, **{field: value}),
                             scored_spans(mask), graphdef=graphdef, loss=LossConfig(), num_groups=4)


def test_micro_batches_equal_one_batch():
    graphdef, params, result = _batch()
    opt = optax.sgd(0.1)  # linear in the gradient, so the comparison checks the accumulated gradient itself
    outs = [_train(graphdef, params, result, opt, rows) for rows in (N, N // 2, N // 4)]  # 1, 2, 4
    for p, _, m in outs[1:]:
        assert m["loss"] == pytest.approx(outs[0][2]["loss"], rel=1e-5, abs=1e-6)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(outs[0][0])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    changed = any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(params)))
    assert changed, "a step with non-zero advantages must move the weights"


def test_non_finite_loss_skips_the_update():
    graphdef, params, result = _batch()
    batch = result.batch
    bad = ExperienceBatch(batch.tokens, batch.loss_mask, batch.old_logp,
                          batch.ref_logp, batch.advantages.at[0, -1].set(jnp.nan))
    opt = make_optimizer(1e-2, 1, 10, 0.0, 1.0)
    state = opt.init(params)
    new_params, new_state, m = _train(graphdef, params, dataclasses.replace(result, batch=bad), opt, N // 2)
    assert m["skipped"] == 1.0
    for a, b in zip(jax.tree.leaves((new_params, new_state)), jax.tree.leaves((params, state))):
        np.testing.assert_array_equal(a, b)


@pytest.fixture
def fork_names():
    """The names the fork test registers, unregistered after it (the registries are process-wide)."""
    yield
    ESTIMATORS.pop("always_one", None)
    POLICY_LOSSES.pop("tripled_reinforce", None)


def test_a_registered_estimator_and_loss_run_in_the_jobs_stages(fork_names):
    with pytest.raises(ValueError, match="^estimator: not a registered estimator"):
        LossConfig(estimator="always_one")

    # What a fork writes: one decorated function each.
    @register_estimator("always_one", grouped=False)
    def always_one(x, cfg):
        return jnp.where(x.loss_mask.astype(bool), 1.0, 0.0)

    @register_policy_loss("tripled_reinforce")
    def tripled_reinforce(logp, old_logp, advantages, loss_mask, cfg):
        return -3.0 * advantages * logp, {"triple": jnp.full(logp.shape, 3.0)}

    cfg = LossConfig(estimator="always_one", policy_loss="tripled_reinforce")
    with pytest.raises(ValueError, match="register_estimator: 'always_one' is already registered"):
        register_estimator("always_one", grouped=False)(always_one)

    shape = MeshShape.parse("d1f1t1")
    mesh = make_mesh(shape, jax.devices()[:1])
    run = StageRun("train", StageLayout(shape, 2, 8), mesh, STAGE_RULES["train"], ProgramCache())
    graphdef, params = nnx.split(init_sharded(CFG, mesh, run.rules, seed=0, dtype=jnp.float32))
    tokens, mask, rewards, gids = map(jnp.asarray, _setup()[2:])
    rewards = jnp.zeros_like(rewards)  # every group constant: a grouped estimator's filter would drop them all
    logp, _ = token_logprobs(nnx.merge(graphdef, params), tokens, chunk=8)

    # The experience stage's advantage step: the estimator's advantages, no group filter (not grouped).
    batch, metrics = jax.jit(advantage_step, static_argnames=("num_groups", "loss_cfg"))(
        logp, logp, tokens, mask, rewards, gids, num_groups=4, loss_cfg=cfg)
    np.testing.assert_array_equal(batch.advantages, np.asarray(mask, np.float32))
    np.testing.assert_array_equal(batch.loss_mask, mask)
    assert "filtered_frac" not in metrics

    # The train stage's update (what the trainer runs): loss -3 x mean log p, its gradient, the loss's metric.
    def want_loss(p):
        lp, _ = token_logprobs(nnx.merge(graphdef, p), tokens, chunk=8)
        return -3.0 * jnp.sum(jnp.where(mask, lp, 0.0)) / mask.sum()

    want_grad = jax.grad(want_loss)(params)
    opt = optax.sgd(0.1)
    micro = run.micro_batches(tokens.shape[0])
    assert micro.count == 4  # of 2 rows: the loss and its metric are accumulated over micro-batches
    new, _, m = grouped_update(run, jax.tree.map(jnp.copy, params), opt.init(params), batch,
                               [tokens.shape[1]] * micro.count, micro, graphdef=graphdef, loss="policy", loss_cfg=cfg,
                               optimizer=opt, token_weighted=True)
    assert float(m["loss"]) == pytest.approx(float(want_loss(params)), rel=1e-5)
    assert float(m["triple"]) == pytest.approx(3.0) and "clip_frac" not in m
    for p_new, p_old, g in zip(jax.tree.leaves(new), jax.tree.leaves(params), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(p_new, p_old - 0.1 * g, rtol=1e-4, atol=1e-6)
