"""Compiling ahead, a run's experience / train programs are a bounded set known from the plan: the plan's micro-batch
rows, the width buckets; after the first batch of a context bucket the foreground compiles nothing new."""

from __future__ import annotations

import numpy as np

from earl_jax.parallel.planner import StagePlanner
from earl_jax.parallel.shapes import ProgramShapes
from earl_jax.rl.algorithm.packing import length_order, micro_batch_plan
from earl_jax.rl.stages.experience_stage import RolloutBatch
from jobs import job


def _split(run, lengths: np.ndarray, width: int):
    arranged = lengths[length_order(lengths, run.batch_shards)]
    return micro_batch_plan(run, arranged, width)


def _shapes(ahead: bool) -> ProgramShapes:
    """A job's program service (one new width an iteration, finer length splits allowed), compiling ahead or not."""
    return ProgramShapes(compile_ahead="true" if ahead else "false", new_widths_per_iteration=1, length_split=True)


def _planner(ahead: bool):
    from earl_jax.models.model_config import get_config

    cfg = job(groups=16, group_size=4, devices=4, micro_batch_tokens=1024)
    return StagePlanner.from_config(cfg.planner, get_config("tiny", vocab_size=101), cfg.batch_size,
                                    shapes=_shapes(ahead))


def test_compiling_ahead_the_foreground_meets_a_new_program_only_for_a_wider_batch():
    run = _planner(ahead=True).stage_run("train")
    rng = np.random.default_rng(0)
    plan_rows = run.micro_batches(64).rows
    foreground = []  # per batch: the widths that ran but had neither run nor been submitted before
    seen_before: set[int] = set()
    for top in (100, 100, 300, 120, 290, 60):  # a longer bucket arrives at the third batch
        lengths = rng.integers(10, top, 64)
        lengths[0] = top
        micro, widths, deferred = _split(run, lengths, 384)
        assert micro.rows == plan_rows  # the plan's rows: no finer split, so no other row count's programs
        foreground.append(set(widths) - seen_before)
        seen_before |= set(widths) | set(deferred)
        assert max(widths) >= top  # every micro-batch still holds its rows
    assert [len(f) for f in foreground] == [1, 0, 1, 0, 0, 0], foreground
    assert len(seen_before) <= 6  # bounded by the width buckets up to the longest batch


def test_without_compiling_ahead_a_finer_split_and_a_new_width_each_batch_are_allowed():
    run = _planner(ahead=False).stage_run("train")
    lengths = np.array([300] * 8 + [20] * 56)
    micro, widths, deferred = _split(run, lengths, 384)
    assert deferred == [] and micro.rows <= run.micro_batches(64).rows


def test_compiling_ahead_a_narrower_batch_is_padded_to_the_widest_so_far():
    """The whole-batch programs keep one shape and a micro-batch can run at a compiled width wider than its batch."""
    shapes = _shapes(ahead=True)

    def batch(width: int) -> RolloutBatch:
        ones = np.ones((4, width), np.int32)
        return RolloutBatch(ones, ones == 1, ones.astype(np.float32), np.arange(4), choices=ones)

    assert shapes.pad_batch(batch(1536)).tokens.shape == (4, 1536)
    padded = shapes.pad_batch(batch(512)).check()
    assert padded.tokens.shape == padded.loss_mask.shape == padded.choices.shape == (4, 1536)
    assert padded.group_ids.shape == (4,) and padded.sampler_logp is None
    assert not (padded.loss_mask[:, 512:].any() or padded.tokens[:, 512:].any() or padded.choices[:, 512:].any())
    assert _shapes(ahead=False).pad_batch(batch(512)).tokens.shape == (4, 512)  # CPU: as before
