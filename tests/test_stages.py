"""Experience and train stages: micro-batching equals one big batch; NaN never reaches the weights."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from earl_jax.models.config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.rl.losses import LossConfig
from earl_jax.rl.stages import ExperienceBatch, experience_stage, make_optimizer, train_stage

CFG = ModelConfig.tiny(vocab_size=32).replace(num_hidden_layers=2, hidden_size=64, intermediate_size=128)


def _setup(n=8, t=16, seed=0):
    graphdef, params = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(seed), dtype=jnp.float32))
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, (n, t)), jnp.int32)
    mask = np.zeros((n, t), bool)
    mask[:, t // 2:] = True
    rewards = np.zeros((n, t), np.float32)
    rewards[:, -1] = rng.choice([-1.0, 0.0, 1.0], n)
    group_ids = np.repeat(np.arange(n // 2), 2)
    return graphdef, params, tokens, jnp.asarray(mask), jnp.asarray(rewards), jnp.asarray(group_ids)


def _batch():
    graphdef, params, tokens, mask, rewards, gids = _setup()
    batch, _ = experience_stage(params, None, tokens, mask, rewards, gids, graphdef=graphdef, num_groups=4,
                                loss_cfg=LossConfig(algorithm="grpo"), micro_batches=1, shards=1, chunk=5,
                                filter_constant_groups=False)
    return graphdef, params, batch


def test_experience_old_logp_equals_full_forward_logprobs():
    graphdef, params, batch = _batch()
    logits, _ = nnx.merge(graphdef, params)(batch.tokens)
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), batch.tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(batch.old_logp[:, 1:], ref, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(batch.advantages)[~np.asarray(batch.loss_mask)] == 0)


def test_micro_batches_equal_one_batch():
    graphdef, params, batch = _batch()
    opt = optax.sgd(0.1)  # linear in the gradient, so the comparison checks the accumulated gradient itself
    outs = []
    for mb in (1, 2, 4):
        p, _, m = jax.jit(lambda p, s, b: train_stage(p, s, b, graphdef=graphdef, optimizer=opt, loss_cfg=LossConfig(),
                                                      micro_batches=mb, chunk=4))(params, opt.init(params), batch)
        outs.append((p, m))
    for p, m in outs[1:]:
        np.testing.assert_allclose(m["loss"], outs[0][1]["loss"], rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(outs[0][0])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    changed = any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(params)))
    assert changed, "a step with non-zero advantages must move the weights"


def test_non_finite_loss_skips_the_update():
    graphdef, params, batch = _batch()
    bad = ExperienceBatch(batch.tokens, batch.loss_mask, batch.old_logp,
                          batch.ref_logp, batch.advantages.at[0, -1].set(jnp.nan))
    opt = make_optimizer(1e-2, 1, 10, 0.0, 1.0)
    state = opt.init(params)
    new_params, new_state, m = train_stage(params, state, bad, graphdef=graphdef, optimizer=opt, loss_cfg=LossConfig(),
                                           micro_batches=2, chunk=4)
    assert float(m["skipped"]) == 1.0
    for a, b in zip(jax.tree.leaves((new_params, new_state)), jax.tree.leaves((params, state))):
        np.testing.assert_array_equal(a, b)
