"""A rollout split by process plays the whole batch's games (one process here; two in test_multiprocess.py).

Each process of a split rollout plays a contiguous share of the games on a view of the env's rows, sampling
by the games' ids in the whole batch; `gather_trajectories` then joins the shares' per-row fields. Here the trainer's
own rollout is made to play each half of the batch as if it were one of two processes, and the halves, joined,
must be the unsplit rollout's games field by field.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from earl_jax.parallel.plan import StageLayout, StagePlan
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rl.stages import rollout_stage
from earl_jax.rl.stages.experience_stage import rollout_batch
from earl_jax.rollout import process_split
from earl_jax.rollout.agent_loop import Trajectories
from earl_jax.sharding.mesh import MeshShape
from jobs import job, with_fields

M = MeshShape.parse
CFG = job(groups=4, group_size=2, run__steps=1, eval__every=0, sft__steps=0, devices=2, max_turns=3,
          max_context=128, planner__mode="static", kl_coef=0.0, constrain_moves=False, max_turn_tokens=3,
          rollout__split_processes=True)
COLS = ("tokens", "loss_mask", "logprobs", "choices", "rewards")
ROWS = ("lengths", "returns", "num_turns", "truncated", "group_ids", "invalid")


def _join(parts: list[Trajectories]) -> dict:
    width = max(p.tokens.shape[1] for p in parts)
    out = {k: np.concatenate([np.pad(getattr(p, k), ((0, 0), (0, width - p.tokens.shape[1]))) for p in parts])
           for k in COLS}
    out.update({k: np.concatenate([getattr(p, k) for p in parts]) for k in ROWS})
    out["winners"] = [w for p in parts for w in p.winners]
    out["turn_context_lens"] = [t for p in parts for t in p.turn_context_lens]
    return out


def test_halves_played_apart_are_the_games_of_the_whole_batch_and_gather_back(tmp_path, monkeypatch):
    trainer = Trainer(with_fields(CFG, run_dir=str(tmp_path / "run")), log=False)
    other = StageLayout(M("d2f1t1"), 2, 64)
    trainer.policy.planner.current = StagePlan(rollout=StageLayout(M("d2f1t1")), experience=other, train=other,
                                               context_bucket=128)
    seeds, groups, rng = list(range(8)), np.repeat(np.arange(4), 2), jax.random.key(5)
    whole, _ = trainer.play(trainer.env, seeds, groups, rng, trainer.sampling)
    run = trainer.policy.planner.stage_run("rollout")
    params = trainer.policy.weights.for_stage(run, trainer.state.params)
    assert process_split.process_block(run.mesh, params, 8) is None  # one process: no split

    halves = []
    for half in (slice(0, 4), slice(4, 8)):  # "process" 0, then "process" 1, each on one device of the mesh
        def block(mesh, params, games, half=half):
            local = jax.sharding.Mesh(mesh.devices[half.start // 4:half.start // 4 + 1], mesh.axis_names)
            return process_split.ProcessBlock(local, jax.device_put(params, jax.sharding.NamedSharding(
                local, jax.sharding.PartitionSpec())), half)
        monkeypatch.setattr(rollout_stage, "process_block", block)
        monkeypatch.setattr(rollout_stage, "gather_trajectories", lambda t: t)
        part, _ = trainer.play(trainer.env, seeds, groups, rng, trainer.sampling)
        assert part.num_games == 4 and trainer.rollout.decode_groups == jax.process_count()
        halves.append(part)

    joined = _join(halves)
    assert whole.loss_mask.any() and len(set(map(tuple, whole.tokens.tolist()))) > 1  # real, varied games
    for k in COLS + ROWS:
        if k == "logprobs":
            np.testing.assert_allclose(joined[k], getattr(whole, k), rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(joined[k], getattr(whole, k), err_msg=k)
    assert joined["winners"] == whole.winners and joined["turn_context_lens"] == whole.turn_context_lens

    # on one process the gather returns the batch as it was, its statistics recomputed from the arrays alike
    got = process_split.gather_trajectories(whole)
    for k in COLS + ROWS:
        np.testing.assert_array_equal(getattr(got, k), getattr(whole, k), err_msg=k)
        assert getattr(got, k).dtype == getattr(whole, k).dtype, k
    assert got.winners == whole.winners and got.turn_context_lens == whole.turn_context_lens
    a, b = dataclasses.asdict(got.stats), dataclasses.asdict(whole.stats)
    assert a.pop("rollout_s") >= b["rollout_s"]  # the gather's own time is added
    assert a.pop("gather_s") >= a.pop("gather_wait_s") > 0 and b.pop("gather_s") == b.pop("gather_wait_s") == 0
    assert a.pop("process_rollout_s") == pytest.approx((b.pop("rollout_s"),), abs=1e-6)
    assert not b.pop("process_rollout_s")
    for k in a:
        if isinstance(b[k], float):
            assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-6), k
        else:
            assert a[k] == b[k], k



def test_columns_left_on_their_process_give_the_same_experience_batch(tmp_path):
    # gather_trajectories: per-row fields and spans of the whole batch, the token columns of this process's rows
    # only; the experience stage places them per process and arranges them on the devices. On one
    # process its share is the whole batch, so that path must give the gathered path's batch exactly.
    from earl_jax.rl.algorithm.packing import scored_spans

    trainer = Trainer(with_fields(CFG, run_dir=str(tmp_path / "run"), devices=8), log=False)
    seeds, groups, rng = list(range(8)), np.repeat(np.arange(4), 2), jax.random.key(5)
    whole, _ = trainer.play(trainer.env, seeds, groups, rng, trainer.sampling)
    part = process_split.gather_trajectories(whole)
    assert part.local_rows == slice(0, 8)
    np.testing.assert_array_equal(part.spans, scored_spans(whole.loss_mask))
    for k in COLS + ROWS:
        np.testing.assert_array_equal(getattr(part, k), getattr(whole, k), err_msg=k)

    batch = rollout_batch(part, trainer.policy.moves is not None)
    trainer._observe(batch, part.stats.turn_context_len_mean, part.num_games)
    run = trainer.policy.planner.stage_run("experience")
    assert run.process_rows(8) == slice(0, 8) and run.batch_shards > 1
    placed = trainer._experience(run, batch, part.spans, part.local_rows)
    gathered = trainer._experience(run, batch, part.spans, None)
    np.testing.assert_array_equal(placed.arranged, gathered.arranged)  # the same arrangement
    for a, b in zip(jax.tree.leaves(placed.batch), jax.tree.leaves(gathered.batch)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding
