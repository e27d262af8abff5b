"""The SFT stage: planned like the others (its layout reaches it), its loss falls, and constrained moves are learned
under the legal-move mask."""

from __future__ import annotations

import jax
import numpy as np

from earl_jax.parallel.plan import StageLayout
from earl_jax.rl.algorithm.optim import make_optimizer
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rl.supervised.sft import run_sft
from earl_jax.rl.supervised.warmup import random_legal_games
from earl_jax.sharding.mesh import MeshShape
from jobs import job


def _batches(trainer: Trainer, n: int, steps: int):
    """The same few random legal games every step: a loss that falls on them is the stage learning."""
    rng = np.random.default_rng(0)
    policy = trainer.policy
    tokens, mask, lengths = random_legal_games(trainer.env, policy.tokenizer, list(range(n)), rng,
                                               eos_id=policy.ids.eos_id, bos_id=policy.ids.bos_id, max_context=256,
                                               max_turns=6, codec=policy.codec)
    width = 256
    batch = {"tokens": np.pad(tokens, ((0, 0), (0, width - tokens.shape[1]))),
             "loss_mask": np.pad(mask, ((0, 0), (0, width - mask.shape[1]))), "lengths": lengths}
    return [batch] * steps


def test_sft_runs_on_the_layout_the_planner_chose_and_its_loss_falls(tmp_path):
    # the tiny model: the loss's fall below is what it learns in the warm-up's steps
    trainer = Trainer(job(groups=4, group_size=2, run__steps=1, devices=8, max_turns=6, max_context=256,
                          model__name="tiny", run_dir=str(tmp_path)), log=False)
    seen = []
    run = trainer.policy.planner.run

    def spy(stage, fn, **kw):
        def wrapped(r):
            seen.append((stage, r.layout))
            return fn(r)
        return run(stage, wrapped, **kw)

    trainer.policy.planner.run = spy
    history = run_sft(trainer.policy, trainer.state, _batches(trainer, 8, 6), steps=6,
                      optimizer=make_optimizer(3e-3, 1, 6, 0.0, 1.0))
    assert [s for s, _ in seen] == ["sft"] * 6
    planned = trainer.policy.planner.current.sft
    assert isinstance(planned, StageLayout) and all(lay == planned for _, lay in seen)
    assert trainer.policy.planner.stage_log_dict("sft")["parallel/sft_mesh"] == str(planned.mesh)
    losses = [h["sft_loss"] for h in history]
    assert losses[-1] < 0.8 * losses[0], losses


def test_sft_on_a_forced_mesh_reaches_the_stage(tmp_path):
    trainer = Trainer(job(groups=4, group_size=2, run__steps=1, devices=8, max_turns=6, max_context=256,
                          run_dir=str(tmp_path)), log=False)
    forced = StageLayout(MeshShape(2, 2, 2), 1, 64)
    trainer.policy.planner.plan_stage = lambda stage: setattr(trainer.policy.planner, "current",  # noqa: E731
                                                       trainer.policy.planner.current.replace(sft=forced)) or forced
    meshes = []
    planner = trainer.policy.planner
    run = planner.run
    planner.run = lambda stage, fn, **kw: run(stage, lambda r: (meshes.append(r.mesh.shape), fn(r))[1], **kw)
    run_sft(trainer.policy, trainer.state, _batches(trainer, 8, 1), steps=1,
            optimizer=make_optimizer(3e-3, 1, 2, 0.0, 1.0))
    assert meshes == [{"data": 2, "fsdp": 2, "tensor": 2}]


def test_sft_trains_the_float32_weights_whatever_the_compute_dtype(tmp_path):
    """A stage that updates weights gets them as they are; only the stages that run the model get them cast."""
    trainer = Trainer(job(groups=4, group_size=2, run__steps=1, devices=8, max_turns=6, max_context=256,
                          model__dtype="bfloat16", run_dir=str(tmp_path)), log=False)
    run_sft(trainer.policy, trainer.state, _batches(trainer, 8, 1), steps=1,
            optimizer=make_optimizer(3e-3, 1, 2, 0.0, 1.0))
    assert {str(x.dtype) for x in jax.tree.leaves(trainer.state.params)} == {"float32"}
