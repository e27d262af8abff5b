"""Rollouts that overlap training (--rollout.max-staleness K): the versions that sampled each trained batch, the bound,
the device split the planner decides, and a stopped run that resumes with the same batches (CPU, 8 fake devices)."""

from __future__ import annotations

import contextlib
import signal
import threading
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from earl_jax.models.setup import model_config
from earl_jax.parallel.first_call_gate import FirstCallGate
from earl_jax.parallel.split import rank_splits, split_candidates, split_planners
from earl_jax.rl.loop import trainer as trainer_mod
from earl_jax.rl.loop.overlap import Overlap
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rl.stages.experience_stage import RolloutBatch
from earl_jax.rl.stages.rollout_stage import RolloutStage
from earl_jax.rl.stages.staleness import (
    Sampled,
    StalenessError,
    check_bound,
    from_checkpoint,
    staleness_metrics,
    to_checkpoint,
)
from earl_jax.rollout.episodes import RolloutStats, Trajectories
from jobs import job, with_fields

K1 = job(groups=4, group_size=2, run__steps=4, eval__every=0, eval__games=8, checkpoint_every=100,
         checkpoint_minutes=0, max_turns=6, max_context=256, constrain_moves=True, devices=8, max_staleness=1,
         policy_loss="decoupled_ppo", group_seeds="per_game")


def _devices(tree) -> set[int]:
    return {d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


class Spy:
    """What the loop trained on (step, the version that sampled it, its tokens), the batches the background thread
    sampled, and the devices each stage computed on."""

    def __init__(self, monkeypatch):
        self.trained: list[tuple[int, int, np.ndarray]] = []
        self.sampled: list[int] = []
        self.devices: dict[str, set[int]] = {}
        take, play = Overlap.take, Overlap._play
        spy = self

        def spy_take(ov, step):
            done = take(ov, step)
            spy.trained.append((step, done.version, done.traj.tokens.copy()))
            return done

        def spy_play(ov, step, *a):
            spy.sampled.append(step)
            return play(ov, step, *a)

        def on(stage, real):
            def call(self_or_run, *a, **kw):
                run, params = (a[0], a[1]) if stage == "rollout" else (self_or_run, a[0])
                spy.devices.setdefault(stage, set()).update({d.id for d in run.mesh.devices.flat} | _devices(params))
                return real(self_or_run, *a, **kw)
            return call

        monkeypatch.setattr(Overlap, "take", spy_take)
        monkeypatch.setattr(Overlap, "_play", spy_play)
        monkeypatch.setattr(RolloutStage, "__call__", on("rollout", RolloutStage.__call__))
        monkeypatch.setattr(trainer_mod, "experience_stage", on("experience", trainer_mod.experience_stage))
        monkeypatch.setattr(trainer_mod, "train_stage", on("train", trainer_mod.train_stage))


def test_rollouts_ahead_keep_the_bound_on_their_own_devices_and_a_stopped_run_resumes_with_the_same_batches(
        tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    straight = Trainer(with_fields(K1, run_dir=str(tmp_path / "a")), log=False)
    history = straight.run()
    # batch j is sampled by version max(0, j - 1) and trains at version j
    assert [(step, version) for step, version, _ in spy.trained] == [(0, 0), (1, 0), (2, 1), (3, 2)]
    assert [r["rollout/staleness_max"] for r in history] == [0, 1, 1, 1]
    assert [r["rollout/staleness_mean"] for r in history] == [0, 1, 1, 1]
    # the planner split the 8 devices: the rollout on the first 4, experience and train on the others
    rollout, learn = straight.policy.rollout_planner.devices, straight.policy.planner.devices
    assert [d.id for d in rollout] == [0, 1, 2, 3] and [d.id for d in learn] == [4, 5, 6, 7]
    assert spy.devices == {"rollout": {0, 1, 2, 3}, "experience": {4, 5, 6, 7}, "train": {4, 5, 6, 7}}
    assert {(r["parallel/rollout_devices"], r["parallel/train_devices"]) for r in history} == {("0-3", "4-7")}
    assert {r["parallel/rollout_mesh"] for r in history} == {str(straight.policy.rollout_planner.current.rollout)}
    straight_batches = {step: tokens for step, _, tokens in spy.trained}

    stopped = Trainer(with_fields(K1, run_dir=str(tmp_path / "b")), log=False)
    take = stopped.overlap.take

    def stop_in_iteration_3(step):  # SIGTERM once iteration 3 has its batch: it is abandoned before experience
        done = take(step)
        if step == 2:
            signal.raise_signal(signal.SIGTERM)
        return done

    stopped.overlap.take = stop_in_iteration_3
    stopped.run()
    assert stopped.stopped_by == "SIGTERM" and stopped.step == 2
    spy.trained.clear(), spy.sampled.clear()
    resumed = Trainer(with_fields(K1, run_dir=str(tmp_path / "b"), resume=True), log=False)
    assert resumed.step == 2 and sorted(resumed.overlap.pending) == [2]  # batch 2's weights (version 1) are gone
    resumed.run()
    assert spy.sampled == [3]  # batch 2 came from the checkpoint; batch 3 from the restored weights
    assert [(step, version) for step, version, _ in spy.trained] == [(2, 1), (3, 2)]
    for step, _, tokens in spy.trained:
        np.testing.assert_array_equal(tokens, straight_batches[step])
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_on_shared_devices_the_rollout_ahead_interleaves_with_training(monkeypatch, tmp_path):
    spy = Spy(monkeypatch)
    first_calls = []  # (thread, background rollouts running) as each stage program's first call runs
    gated = FirstCallGate.first_call

    @contextlib.contextmanager
    def spy_first_call(gate):
        with gated(gate):
            first_calls.append((threading.current_thread().name, gate.rollouts))
            yield

    monkeypatch.setattr(FirstCallGate, "first_call", spy_first_call)
    cfg = with_fields(K1, run__steps=3, max_staleness=2, rollout_devices=8, run_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, log=False)
    history = trainer.run()
    assert trainer.policy.rollout_planner is None
    # the train and experience programs' first calls (cuDNN's graphs on GPU) never ran beside a background rollout
    loop_calls = [n for thread, n in first_calls if not thread.startswith("earl-rollout")]
    assert loop_calls and set(loop_calls) == {0}
    assert [(step, version) for step, version, _ in spy.trained] == [(0, 0), (1, 0), (2, 0)]
    assert [r["rollout/staleness_max"] for r in history] == [0, 1, 2]
    assert spy.devices == {stage: set(range(8)) for stage in ("rollout", "experience", "train")}


def test_the_planner_takes_the_split_with_the_shortest_overlapped_iteration():
    model_cfg, _ = model_config(K1.model)
    # 4 heads, 8 rows: no mesh over 3, 5, 6 or 7 devices takes a batch of 8 rows (data) with a tensor degree of 1, 2
    # or 4, so 2 + 6 and 6 + 2 fail on one side
    assert split_candidates(model_cfg, 8, 8) == [4]
    assert split_candidates(model_cfg, 8, 16) == [4]
    assert split_candidates(model_cfg, 4, 8) == [2]
    assert rank_splits([2, 4, 6], 8)[0] == 4  # equal costs: the most even split
    assert rank_splits([2, 4, 6], 8, rollout_cost=3.0)[0] == 6  # max(3/6, 1/2) < max(3/4, 1/4)
    assert rank_splits([2, 6], 8)[0] == 6  # a tie gives the rollout the larger share
    with pytest.raises(ValueError, match="--planner.rollout-devices: 3 of 8 devices .* valid: .*4"):
        split_planners(with_fields(K1, rollout_devices=3).planner, model_cfg, 8)
    shared, none = split_planners(with_fields(K1, rollout_devices=8).planner, model_cfg, 8)
    assert none is None and len(shared.devices) == 8


def _batch(versions: list[list[int]]) -> RolloutBatch:
    v = np.asarray(versions, np.int32)
    mask = v >= 0
    return RolloutBatch(np.ones_like(v), mask, np.zeros(v.shape, np.float32), np.arange(len(v)), versions=v)


def test_a_batch_older_than_the_bound_is_refused():
    batch = _batch([[-1, 3, 3], [4, -1, 5]])  # -1: not a scored token
    check_bound(batch, 5, 2)  # its scored tokens 2, 2, 1 and 0 versions behind
    assert staleness_metrics(batch, 5) == {"rollout/staleness_max": 2.0, "rollout/staleness_mean": 1.25}
    with pytest.raises(StalenessError, match="2 policy version.*--rollout.max-staleness 1"):
        check_bound(batch, 5, 1)
    with pytest.raises(StalenessError, match="not trained yet"):
        check_bound(batch, 4, 2)  # version 5 cannot sample a batch that trains at version 4


def _traj(seed: int) -> Trajectories:
    rng = np.random.default_rng(seed)
    mask = np.array([[False, True, True], [False, True, False]])
    stats = RolloutStats(0.5, 0.0, 0.5, 0.0, 2.5, 3, 1.0, 1.0, 0.0, 3, 5, 0.1, 0.2, 0.3, 4, 2, 8, 1,
                         process_rollout_s=(0.3,))
    return Trajectories(rng.integers(0, 9, (2, 3)).astype(np.int32), mask, rng.normal(size=(2, 3)).astype(np.float32),
                        np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32), np.array([3, 2]),
                        np.array([1.0, -1.0], np.float32), np.array([1, 1], np.int32), np.array([False, False]),
                        np.array([0, 0]), ["agent", None], np.array([False, False]), [[1], [1]], stats)


def test_waiting_batches_survive_a_checkpoint_and_a_stale_one_is_refused_or_sampled_again():
    fake = SimpleNamespace(cfg=with_fields(K1, run__steps=10), partial=None,
                           policy=SimpleNamespace(planner=None, rollout_planner=None))
    overlap = Overlap(fake)
    saved = [Sampled(3, 2, _traj(0), 0.1, mix_games=np.array([False, True])), Sampled(4, 2, _traj(1), 0.1)]
    arrays, meta = to_checkpoint(saved)
    back = from_checkpoint(arrays, meta)
    for a, b in zip(saved, back):
        assert (a.step, a.version, a.traj.winners, a.traj.stats) == (b.step, b.version, b.traj.winners, b.traj.stats)
        np.testing.assert_array_equal(a.batch(False).tokens, b.batch(False).tokens)
    np.testing.assert_array_equal(back[0].mix_games, [False, True])
    overlap.restore(3, arrays, meta)  # K = 1: batch 4 (version 2) would train 2 versions behind
    assert sorted(overlap.pending) == [3]
    # batch 4 deliberately stale; with batches 3 to 5 at hand the loop submits no rollout
    overlap.pending.update({4: Sampled(4, 2, _traj(1)), 5: Sampled(5, 4, _traj(2))})
    overlap.take(3)
    with pytest.raises(StalenessError):
        overlap.take(4)
