"""Length-grouped micro-batches compute on real tokens and change no number: log-probs, loss and the update
equal the padded one-program computation (tests/reference_stages.py; 8 fake CPU devices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import reference_stages
from earl_jax.models.init import init_sharded
from earl_jax.models.model_config import ModelConfig
from earl_jax.parallel.plan import StageLayout
from earl_jax.parallel.planner import ProgramCache, StageRun
from earl_jax.parallel.shapes import limit_new_widths
from earl_jax.rl.algorithm.losses import LossConfig
from earl_jax.rl.algorithm.packing import (
    MIN_SPLIT_ROWS,
    WIDTH_BUCKETS,
    grouped_logprobs,
    grouped_update,
    length_order,
    length_split,
    micro_batch_widths,
    mini_batch_rows,
    rearrange,
)
from earl_jax.sharding.mesh import MeshShape, make_mesh
from earl_jax.sharding.stage_registry import STAGE_RULES

CFG = ModelConfig.tiny(vocab_size=32).replace(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
N, T = 16, 256


def test_length_order_puts_similar_lengths_in_each_micro_batch():
    lengths = np.array([5, 250, 40, 70, 130, 9, 66, 12, 100, 31, 200, 7, 90, 64, 3, 180])
    for shards, count in ((8, 2), (4, 2), (2, 4), (1, 4)):
        perm = length_order(lengths, shards)
        assert sorted(perm.tolist()) == list(range(N))
        arranged = lengths[perm]
        micro = type("M", (), {"count": count, "shards": shards})()
        split = arranged.reshape(shards, count, -1).swapaxes(0, 1).reshape(count, -1)
        ranks = np.sort(lengths)[::-1].reshape(count, -1)  # micro-batch j = the j-th run of ranks, longest first
        np.testing.assert_array_equal(np.sort(split, 1), np.sort(ranks, 1))
        widths = micro_batch_widths(arranged, micro, T)
        assert widths == sorted(widths, reverse=True) and widths[0] == 256 and widths[-1] < 256
    with pytest.raises(ValueError, match="do not split"):
        length_order(lengths[:10], 4)


def test_mini_batches_are_contiguous_slices_of_whole_shards():
    parts = mini_batch_rows(16, 4, 2)
    assert [p.tolist() for p in parts] == [list(range(k, k + 4)) for k in range(0, 16, 4)]
    with pytest.raises(ValueError, match="--optim.ppo-mini-batches 4"):
        mini_batch_rows(16, 4, 8)  # 4 rows a mini-batch over 8 shards


def _batch(rng):
    lengths = rng.integers(20, T, N)
    lengths[0] = T  # the longest row fills the padded width
    tokens = rng.integers(1, CFG.vocab_size, (N, T)).astype(np.int32)
    tokens[np.arange(T)[None] >= lengths[:, None]] = 0
    mask = (np.arange(T)[None] >= 8) & (np.arange(T)[None] < lengths[:, None])
    rewards = np.zeros((N, T), np.float32)
    rewards[np.arange(N), lengths - 1] = rng.choice([-1.0, 1.0], N)
    return lengths, {"tokens": tokens, "loss_mask": mask, "rewards": rewards,
                     "group_ids": np.repeat(np.arange(N // 2), 2).astype(np.int32)}


@pytest.mark.parametrize("stage, mesh, mb", [("experience", "d8f1t1", 1), ("experience", "d2f1t4", 2),
                                             ("train", "d2f2t2", 1), ("train", "d1f8t1", 1)])
def test_grouped_equals_padded(stage, mesh, mb):
    shape = MeshShape.parse(mesh)
    jmesh = make_mesh(shape)
    run = StageRun(stage, StageLayout(shape, mb, 32), jmesh, STAGE_RULES[stage], ProgramCache())
    graphdef, params = nnx.split(init_sharded(CFG, jmesh, run.rules, seed=0, dtype=jnp.float32))
    lengths, arrays = _batch(np.random.default_rng(1))
    perm = length_order(lengths, run.batch_shards)
    x = run.put_rows({k: v[perm] for k, v in arrays.items()})
    micro = run.micro_batches(N)
    widths = micro_batch_widths(lengths[perm], micro, T)
    assert len(set(widths)) > 1  # the test needs micro-batches of several widths
    padded_old, _ = jax.jit(lambda p, *a: reference_stages.experience_stage(
        p, None, *a, graphdef=graphdef, num_groups=N // 2, loss_cfg=LossConfig(filter_constant_groups=False),
        micro_batches=1, shards=1, chunk=64))(
        params, x["tokens"], x["loss_mask"], x["rewards"], x["group_ids"])
    if stage == "experience":
        grouped = grouped_logprobs(run, params, x["tokens"], widths, micro, graphdef=graphdef)
        real = np.asarray(x["loss_mask"])  # compare where tokens are real (padding columns are 0 in both)
        np.testing.assert_allclose(np.asarray(grouped)[real], np.asarray(padded_old.old_logp)[real], rtol=1e-5,
                                   atol=1e-5)
        return
    opt = optax.sgd(0.1)  # linear in the gradient: compares the accumulated gradient itself
    padded = jax.jit(lambda p, s, b: reference_stages.train_stage(p, s, b, graphdef=graphdef, optimizer=opt,
                                                                   loss_cfg=LossConfig(), micro_batches=1, chunk=64))
    p_ref, _, m_ref = padded(jax.tree.map(jnp.copy, params), opt.init(params), padded_old)
    p_grp, _, m_grp = grouped_update(run, jax.tree.map(jnp.copy, params), opt.init(params), padded_old, widths, micro,
                                     graphdef=graphdef, loss="policy", loss_cfg=LossConfig(), optimizer=opt,
                                     token_weighted=True)
    assert float(m_grp["loss"]) == pytest.approx(float(m_ref["loss"]), rel=1e-5, abs=1e-6)
    for a, b in zip(jax.tree.leaves(p_grp), jax.tree.leaves(p_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # a different arrangement of the same rows (another layout's) after `rearrange` gives the same update
    other = length_order(lengths, 1)
    moved = rearrange(run, padded_old, np.argsort(perm)[other])
    np.testing.assert_array_equal(np.asarray(moved.tokens), arrays["tokens"][other])


def test_length_split_cuts_padding_and_never_exceeds_the_plan():
    """One long game no longer widens every row; equal lengths stay in the plan's micro-batches."""
    def run_for(mesh, mb):
        shape = MeshShape.parse(mesh)
        return StageRun("train", StageLayout(shape, mb, 32), make_mesh(shape, jax.devices()[:shape.size]),
                        STAGE_RULES["train"], ProgramCache())

    rng = np.random.default_rng(0)
    for mesh, mb in (("d1f1t1", 64), ("d4f1t2", 16), ("d8f1t1", 8), ("d8f1t1", 2)):
        run = run_for(mesh, mb)
        n = 64
        plan = run.micro_batches(n)
        skewed = rng.integers(100, 200, n)
        skewed[3] = 460  # the CPU default's shape: mean ~200, one game past 256
        arranged = skewed[length_order(skewed, run.batch_shards)]
        micro, widths = length_split(run, arranged, 512)
        assert micro.count >= plan.count and micro.rows_per_shard <= mb  # the plan's memory bound holds
        assert micro.count == plan.count or micro.rows_per_shard >= MIN_SPLIT_ROWS
        assert widths == micro_batch_widths(arranged, micro, 512) and set(widths) <= set(WIDTH_BUCKETS)
        padded = micro.rows * sum(widths)
        assert padded >= arranged.sum()
        off, off_widths = length_split(run, arranged, 512, enabled=False)
        assert off == plan
        if plan.rows_per_shard >= 2 * MIN_SPLIT_ROWS:  # room to split: the long row pads only its own group
            assert micro.count > plan.count and padded <= 0.7 * off.rows * sum(off_widths), (mesh, widths)
        equal = np.full(n, 150)
        assert length_split(run, equal, 256)[0] == plan  # nothing to gain: no extra launches


def test_limit_new_widths_keeps_the_widest_new_ones_and_rounds_the_rest_up():
    assert limit_new_widths([512, 256, 128, 64], set(), 1) == [512] * 4  # a cold start: one program
    assert limit_new_widths([512, 256, 128, 64], {128}, 1) == [512, 512, 128, 128]
    assert limit_new_widths([512, 256, 128, 64], {128}, 2) == [512, 256, 128, 128]
    assert limit_new_widths([256, 128, 64], {512, 128}, 1) == [256, 128, 128]  # the narrowest that fits serves
    assert limit_new_widths([512, 256, 128, 64], set(), 0) == [512, 256, 128, 64]  # 0: no limit
