"""Device groups: a data-parallel rollout decodes one group of games per device, and plays the same games.

Fake CPU devices. The same trainer rolls out the same seeds on a d2f1t1 rollout plan twice: as one SPMD decode
over the mesh and as two single-device groups (each device compiles its own programs: two keep the test short);
every trajectory field must be the same.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from earl_jax.parallel.plan import StageLayout, StagePlan
from earl_jax.rl.config import RLConfig
from earl_jax.rl.trainer import Trainer
from earl_jax.rollout.device_groups import device_meshes, device_view
from earl_jax.sharding.mesh import STAGE_RULES, MeshShape, make_mesh, state_shardings

M = MeshShape.parse
CFG = RLConfig(groups=4, group_size=2, steps=1, eval_every=0, format_warmup_steps=0, devices=2, max_turns=3,
               max_context=128, progress=False, wandb_mode="disabled", selector_mode="static", kl_coef=0.0,
               constrain_moves=False, max_turn_tokens=3)


def _plan(rollout: str) -> StagePlan:
    other = StageLayout(M("d2f1t1"), 2, 64)
    return StagePlan(StageLayout(M(rollout)), other, other, context_bucket=128)


def test_device_groups_play_the_same_games_as_one_spmd_decode(tmp_path):
    trainer = Trainer(dataclasses.replace(CFG, run_dir=str(tmp_path / "run")), log=False)
    trainer.planner.current = _plan("d2f1t1")
    seeds, groups = list(range(8)), np.repeat(np.arange(4), 2)
    out = {}
    for on in (False, True):
        trainer.cfg = dataclasses.replace(trainer.cfg, rollout_device_groups=on)
        out[on], _ = trainer._rollout(trainer.env, seeds, groups, jax.random.key(5), trainer.sampling)
        assert trainer._rollout_groups == (2 if on else 1)
    spmd, grouped = out[False], out[True]
    assert grouped.loss_mask.any() and len(set(map(tuple, grouped.tokens.tolist()))) > 1  # real, varied games
    for field in ("tokens", "loss_mask", "rewards", "lengths", "num_turns", "truncated", "invalid"):
        np.testing.assert_array_equal(getattr(grouped, field), getattr(spmd, field), err_msg=field)
    np.testing.assert_allclose(grouped.logprobs, spmd.logprobs, rtol=1e-5, atol=1e-6)
    assert grouped.winners == spmd.winners and grouped.turn_context_lens == spmd.turn_context_lens
    # each group decoded on its own device of the planned mesh
    planned = set(trainer.planner.stage_run("rollout").mesh.devices.flat)
    used = {s.mesh.devices.flat[0] for k, s in trainer._samplers.items() if isinstance(k, tuple)}
    assert used == planned


def test_device_views_reuse_the_replicas_and_only_replicated_weights_qualify(tmp_path):
    trainer = Trainer(dataclasses.replace(CFG, run_dir=str(tmp_path / "run")), log=False)
    for mesh_name, expect in (("d8f1t1", True), ("d4f1t2", False), ("d1f1t1", False)):
        mesh = make_mesh(M(mesh_name), jax.devices()[:M(mesh_name).size])
        params = jax.device_put(trainer.params, state_shardings(trainer.params, mesh, STAGE_RULES["rollout"]))
        meshes = device_meshes(mesh, params, games=16)
        assert (meshes is not None) == expect, mesh_name
        if meshes:
            assert device_meshes(mesh, params, games=12) is None  # 12 games do not split over 8 devices
            dev = meshes[3].devices.flat[0]
            view = device_view(params, dev)
            for x, v in zip(jax.tree.leaves(params), jax.tree.leaves(view)):
                assert v.devices() == {dev}
                replica = next(s.data for s in x.addressable_shards if s.device == dev)
                assert v.unsafe_buffer_pointer() == replica.unsafe_buffer_pointer()  # no copy


@pytest.mark.parametrize("flag", ["--rollout-device-groups"])
def test_flag_turns_device_groups_off(flag):
    from earl_jax.cli import parse_config
    assert parse_config(RLConfig, [flag, "false"]).rollout_device_groups is False
