"""A run with a wall-time limit schedules over its time: the learning rate decays over the share of --run.max-minutes
spent, rung budgets are shares of it, and a run resumed in parts continues the clock it had."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.cli import ConfigError
from earl_jax.rl.algorithm.optim import OptimConfig, run_fraction, timed_learning_rate, with_run_fraction
from earl_jax.rl.job import entry as job_cli
from earl_jax.rl.job.validate import check_job
from earl_jax.rl.loop.job_config import JobConfig
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rl.matchups.curriculum import Curriculum
from jobs import job, with_fields

SMALL = job(groups=4, group_size=2, run__steps=2, eval__every=0, eval__games=4, sft__steps=0, devices=2,
            checkpoint_every=1, max_turns=6, max_context=256, micro_batch_tokens=1024, max_minutes=10.0)
CONFIGS = Path(__file__).resolve().parents[3] / "experiments" / "configs"


def test_the_learning_rate_decays_over_the_share_of_time_spent_not_over_updates():
    lr = 1e-3
    assert float(timed_learning_rate(lr, 5, 0, 0.0)) == pytest.approx(lr / 5)  # warm-up by updates, as before
    assert float(timed_learning_rate(lr, 5, 10, 0.0)) == pytest.approx(lr)
    assert float(timed_learning_rate(lr, 5, 10, 0.5)) == pytest.approx(0.55 * lr)
    assert float(timed_learning_rate(lr, 5, 10, 1.0)) == pytest.approx(0.1 * lr)
    assert float(timed_learning_rate(lr, 5, 10_000, 0.0)) == pytest.approx(lr)  # many updates, no time: still peak

    opt = OptimConfig(learning_rate=lr, warmup_steps=0).make(iterations=100, minutes=15)
    params = {"w": jnp.ones(4)}
    grads = {"w": jnp.full(4, 0.5)}
    state = opt.init(params)
    assert run_fraction(state) == 0.0
    early, _ = opt.update(grads, with_run_fraction(state, 0.0), params)
    late, _ = opt.update(grads, with_run_fraction(state, 1.0), params)
    # the same gradients and moments: only the time read differs, so the update is 10x smaller at the end
    np.testing.assert_allclose(np.asarray(late["w"]) * 10, np.asarray(early["w"]), rtol=1e-5)
    assert run_fraction(OptimConfig().make(100).init(params)) is None  # no limit: the schedule over iterations


@pytest.mark.parametrize("minutes", [0, 15])
def test_a_constant_schedule_keeps_the_peak_rate_after_the_warm_up(minutes):
    params, grads = {"w": jnp.ones(4)}, {"w": jnp.full(4, 0.5)}
    for schedule, end in (("cosine", 0.1), ("constant", 1.0)):
        opt = OptimConfig(learning_rate=1e-3, warmup_steps=0, schedule=schedule).make(iterations=4, minutes=minutes)
        state = opt.init(params)
        first, state = opt.update(grads, with_run_fraction(state, 0.0), params)
        for _ in range(4):  # past the run's 4 iterations, or at the end of its minutes
            last, state = opt.update(grads, with_run_fraction(state, 1.0), params)
        # Adam's update of a constant gradient is the same each step: only the rate differs
        np.testing.assert_allclose(np.asarray(last["w"]), end * np.asarray(first["w"]), rtol=1e-4)
    with pytest.raises(ValueError, match="schedule"):
        OptimConfig(schedule="linear")


def test_a_rung_is_left_when_its_share_of_the_time_is_spent_and_that_survives_resume():
    ladder = ("random", "alphabeta:1", "alphabeta:2")
    c = Curriculum(ladder, promote_at=0.8, rung_max_share=0.3)
    assert [c.observe(0.1, s, f) for s, f in ((5, 0.1), (500, 0.29))] == [None, None]  # iterations do not count
    line = c.observe(0.1, 6, 0.31)
    assert "from random to alphabeta:1" in line and "the rung's time: 0.31" in line
    assert c.rung_start_share == 0.31 and c.observe(0.1, 7, 0.6) is None  # the new rung counts from 0.31
    resumed = Curriculum(ladder, promote_at=0.8, rung_max_share=0.3)
    resumed.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert resumed.rung_start_share == 0.31 and resumed.observe(0.1, 8, 0.6) is None
    assert "the rung's time: 0.30" in resumed.observe(0.1, 9, 0.61) and resumed.at_top
    with pytest.raises(ValueError, match="rung_max_share"):
        Curriculum(ladder, promote_at=0.8, rung_max_share=1.5)
    with pytest.raises(ConfigError, match="^--curriculum.rung-max-share: .*--run.max-minutes"):
        with_fields(SMALL, opponent="curriculum", rung_max_share=0.3, max_minutes=0.0)


def test_a_run_reads_its_clock_and_a_resumed_part_continues_it(tmp_path):
    cfg = with_fields(SMALL, run_dir=str(tmp_path / "run"))
    first = Trainer(cfg, log=False)
    first.elapsed_before_s = 300.0  # as a resumed part would have: half of the 10 minutes spent
    history = first.run()
    shares = [r["time/run_share"] for r in history]
    assert len(history) == 2 and 0.5 <= shares[0] <= shares[1] < 0.6
    assert all(r["time/run_elapsed_s"] >= 300 for r in history)
    saved_share = run_fraction(first.state.opt_state)
    assert saved_share == pytest.approx(shares[-1], abs=1e-6)  # the next updates' learning rate reads it

    resumed = Trainer(with_fields(cfg, run__steps=3, resume="true"), log=False)
    assert resumed.step == 2 and resumed.elapsed_before_s >= 300  # the checkpoint kept the run's time
    assert run_fraction(resumed.state.opt_state) == pytest.approx(saved_share, abs=1e-6)
    record = resumed.run()[-1]
    assert record["step"] == 3 and record["time/run_share"] >= saved_share  # the clock goes on, not from 0

    spent = Trainer(with_fields(cfg, run__steps=5, resume="true"), log=False)
    spent.elapsed_before_s = 601.0  # the run's 10 minutes are spent: a resume runs no iteration
    assert spent.run() == [] and spent.step == 3


def test_gpu_preset_ends_by_time_and_resume_refuses_another_kind_of_schedule(tmp_path):
    cfg = job_cli.parse_job(["--preset", "gpu"], CONFIGS / "connect4").config
    assert cfg.run.max_minutes > 0 and cfg.run.steps >= 100_000  # the step count is only a cap
    assert cfg.curriculum.rung_max_share > 0 and cfg.curriculum.rung_max_iterations == 0
    # against one opponent the preset's curriculum means nothing and is dropped; a flag's is refused (validate.py)
    one = job_cli.parse_job(["--preset", "gpu", "--opponent", "random", "--run.max-minutes", "0"], CONFIGS / "connect4")
    c = one.config.curriculum
    assert (c.ladder, c.rung_max_share, c.rehearsal_share, c.promote_on_stall) == ("", 0, 0, 0)
    check_job(one.config)  # the job starts (it named --curriculum.ladder, never typed, before)
    typed = job_cli.parse_job(["--preset", "gpu", "--opponent", "random", "--curriculum.ladder", "random"],
                              CONFIGS / "connect4")
    assert typed.config.curriculum.ladder == "random" and typed.config.curriculum.rung_max_share == 0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(JobConfig().to_dict()))  # a run over iterations
    parsed = job_cli.parse_job(["--resume", "--run-dir", str(run_dir), "--run.max-minutes", "5"], CONFIGS / "connect4")
    with pytest.raises(ConfigError, match="^--run.max-minutes: the run's learning-rate schedule is over its iter"):
        job_cli.resume_config(parsed)
    same_kind = job_cli.parse_job(["--resume", "--run-dir", str(run_dir), "--run.max-minutes", "0"],
                                  CONFIGS / "connect4")
    assert job_cli.resume_config(same_kind)[0].run.max_minutes == 0


def test_two_processes_read_the_same_clock(monkeypatch):
    """Every process reads the largest of their clocks: a learning rate or a time limit that differed per process
    would make replicated weights differ, or leave one process waiting in a collective alone."""
    import time

    import earl_jax.distributed as dist
    from earl_jax.rl.loop.run_control import RunControl

    control = RunControl.__new__(RunControl)  # the clock only: no signals, watchdog or progress bar
    control.cfg, control.elapsed_before_s, control.started = SMALL.run, 60.0, time.perf_counter()
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(dist, "gather_ints", lambda ms: [(120_000,), (ms,), (450_000,)])  # three processes' clocks
    assert control.agreed_run_elapsed_s() == 450.0 and control.run_fraction() == 0.75
    assert not control.out_of_time()
    monkeypatch.setattr(dist, "gather_ints", lambda ms: [(ms,), (601_000,)])  # one process is past the 10 minutes
    assert control.out_of_time() and control.run_fraction() == 1.0
