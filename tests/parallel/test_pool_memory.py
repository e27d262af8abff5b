"""Sizing the rollout's pool from the memory model (parallel/pool_memory.py): `--rollout.kv-pages -1` gives the paged
cache as many pages as fit beside the rest of the rollout and the train state, and the rollout stage's sampler holds
exactly the pages the planner sized."""

from __future__ import annotations

import dataclasses

import pytest

from earl_jax.models.model_config import get_config
from earl_jax.parallel.memory import GiB, MemoryConfig
from earl_jax.parallel.pool_memory import pages_that_fit, resident_beside
from earl_jax.parallel.selector import NoFeasibleLayoutError, ParallelismSelector
from earl_jax.sharding.mesh import MeshShape

CTX, P = 4096, 16


def _selector(budget_gib: float, stages: tuple[str, ...] | None = None) -> ParallelismSelector:
    from earl_jax.parallel.selector_config import SelectorConfig, default_bucket_edges

    cfg = get_config("qwen2.5-1.5b")
    sel_cfg = SelectorConfig(bucket_edges=default_bucket_edges(cfg), stages=stages)
    return ParallelismSelector(cfg, 1, memory=MemoryConfig(budget_bytes=int(budget_gib * GiB)), config=sel_cfg)


def _fits(sel: ParallelismSelector, pages: int, rows: int) -> bool:
    mem = sel.memory
    mem.mem = dataclasses.replace(mem.mem, kv_positions=pages * P)
    return mem.fits(mem.estimate("rollout", MeshShape(), CTX, rows))


def test_the_pages_are_the_most_that_fit_beside_the_rollout_and_the_train_state():
    alone = _selector(40, stages=("rollout",))  # a rollout on devices of its own (a split): nothing resident
    pages = pages_that_fit(alone, 256, CTX, P, 1)
    assert alone.memory.mem.kv_positions == pages * P  # every later plan prices these pages
    assert 0 < pages < 256 * CTX // P
    assert _fits(alone, pages, 256) and not _fits(alone, pages + 1, 256)
    shared = _selector(40)  # train planned on the same device: its state stays resident while the rollout runs
    assert resident_beside(shared) == shared.memory.train_resident_bytes(MeshShape()) > 0
    beside = pages_that_fit(shared, 256, CTX, P, 1)
    kv_token = shared.memory.kv_bytes_per_token_per_device(1)
    assert beside < pages and (pages - beside) * P * kv_token == pytest.approx(resident_beside(shared), rel=0.01)
    # ample memory: no more pages than the rows fill at the longest context; two pipeline groups: each its half
    assert pages_that_fit(_selector(80, stages=("rollout",)), 8, CTX, P, 1) == 8 * CTX // P
    assert pages_that_fit(_selector(80, stages=("rollout",)), 8, CTX, P, 2) == 4 * CTX // P


def test_too_little_memory_for_one_games_pages_is_one_error_naming_the_flags():
    with pytest.raises(NoFeasibleLayoutError, match="--rollout.kv-pages -1.*--rollout.slots or --rollout.max-context"):
        pages_that_fit(_selector(24), 256, CTX, P, 1)


def test_the_rollout_stage_holds_the_pages_the_planner_sized(tmp_path, monkeypatch, caplog):
    """`--rollout.kv-pages -1` in a job: the pages the memory model sized (under a budget that binds: fewer than the
    games fill at --rollout.max-context) are what every sampler policy of the rollout holds, and the games play."""
    import earl_jax.rl.stages.rollout_stage as rollout_stage
    from earl_jax.rl.loop.trainer import Trainer
    from exact_cases import BASE as JOB, KINDS
    from jobs import job

    def trainer(budget_gib: float, name: str) -> Trainer:
        return Trainer(job(**JOB, **KINDS["game"], rollout__max_turns=4, rollout__kv_pages=-1, rollout__page_size=8,
                           planner__memory_budget_gib=budget_gib, run__run_dir=str(tmp_path / name)), log=False)

    ample = trainer(8.0, "ample")
    games, ctx = ample.cfg.rollout.batch_size, ample.cfg.rollout.max_context
    assert ample.policy.planner.kv_pages == games * ctx // 8  # capped at what the games fill
    # a budget halfway between one game's pages and every game's: the pages bind
    mem = ample.policy.planner.selector.memory
    every = mem.estimate("rollout", MeshShape(), ctx, games).total  # beside the train state, as sized
    one = every - mem.kv_bytes_per_token_per_device(1) * (games - 1) * ctx
    budget = (one + every) / 2 / mem.mem.safety_fraction
    held = []
    real = rollout_stage.SamplerPolicy
    monkeypatch.setattr(rollout_stage, "SamplerPolicy", lambda *a, **k: held.append(k["kv_pages"]) or real(*a, **k))
    with caplog.at_level("INFO", logger="earl_jax"):
        tight = trainer(budget / GiB, "tight")
    pages = tight.policy.planner.kv_pages
    assert ctx // 8 <= pages < games * ctx // 8 and "--rollout.kv-pages -1: %d pages" % pages in caplog.text
    assert tight.policy.planner.selector.memory.mem.kv_positions == pages * 8  # the plans price the same pages
    seeds, group_ids, rng = tight.rollout_inputs()
    traj, _ = tight.play(tight.matchmaker.train_env(0), seeds, group_ids, rng, tight.sampling)
    assert traj.num_games == games and held and set(held) == {pages}


def test_slots_minus_one_size_the_rows_beside_the_train_state_too():
    from earl_jax.parallel.pool_memory import rows_that_fit

    alone, shared = _selector(40, stages=("rollout",)), _selector(40)
    assert 0 < rows_that_fit(shared, 4096, CTX) < rows_that_fit(alone, 4096, CTX) < 4096
    assert shared.memory.resident_bytes == 0  # sizing leaves the plans' own resident bytes as they were
