"""The RL loop end to end on CPU (8 fake devices): metrics, bit-exact resume, bad input, learning."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from earl_jax.cli import ConfigError
from earl_jax.parallel.plan import ContextStats
from earl_jax.rl.job import entry as job_cli
from earl_jax.rl.loop.metrics import REQUIRED_METRICS, read_metrics
from earl_jax.rl.loop.trainer import Trainer
from jobs import SMALL, with_fields

CONFIGS = Path(__file__).resolve().parents[3] / "experiments" / "configs"


def _params(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]


def test_short_run_logs_every_metric_and_checkpoints(tmp_path):
    cfg = with_fields(SMALL, devices=8, run_dir=str(tmp_path / "run"))  # every stage on an 8-device mesh
    history = Trainer(cfg).run()
    assert [r["step"] for r in history] == [1, 2, 3]
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] >= 1]
    for r in records:
        missing = [k for k in REQUIRED_METRICS if k not in r]
        assert not missing, missing
        assert 0 <= r["eval/win_rate"] <= 1 and r["rollout/context_len_max"] >= r["rollout/context_len_mean"] > 0
        assert r["parallel/rollout_mesh"].startswith("d")
    # the iteration's own traces and compiles: the first builds the stages' programs
    assert records[0]["compile/lowered"] > 0 and records[0]["time/compile_s"] > 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["rollout"]["groups"] == 4
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == 3
    with pytest.raises(ValueError, match="--resume"):  # the same run dir again, without --resume
        Trainer(cfg, log=False)


def test_few_new_widths_per_iteration_compile_less_and_change_nothing(tmp_path):
    # micro-batches of one row per shard: games of different lengths get different widths
    cfg = with_fields(SMALL, run__steps=1, eval__every=0, sft__steps=0, checkpoint_every=0,
                      micro_batch_tokens=128, max_context=256, eval__games=2)
    runs = {}
    for k in (0, 1):
        runs[k] = Trainer(with_fields(cfg, run_dir=str(tmp_path / str(k)), new_widths_per_iteration=k), log=False)
        runs[k].run()
    most = {k: max(len(widths) for widths in t.policy.planner.shapes.run_at.values()) for k, t in runs.items()}
    assert most[0] > 1 and most[1] == 1  # unlimited: several width programs per stage; limited: one
    # Adam's step is ~lr (1e-3) per weight: a micro-batch cut short would move weights by that much, while padding
    # changes only float rounding (seen: 1.7e-6 on one of 49152 weights)
    for a, b in zip(_params(runs[0]), _params(runs[1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _adam_steps(trainer: Trainer) -> int:
    counts = [int(x) for path, x in jax.tree_util.tree_flatten_with_path(trainer.state.opt_state)[0]
              if "count" in jax.tree_util.keystr(path)]
    assert counts, "no step counter in the optimizer state"
    return max(counts)


def test_ppo_mini_batches_make_that_many_updates_an_iteration(tmp_path):
    """--optim.ppo-mini-batches N: N optimizer steps per pass over the batch (what the flag promises reaches the train
    stage), each on whole groups; a count that leaves a mini-batch without whole groups is refused at start."""
    cfg = with_fields(SMALL, run__steps=1, eval__every=0, sft__steps=0, checkpoint_every=0, eval__games=2)
    steps = {}
    for n in (1, 4):
        trainer = Trainer(with_fields(cfg, run_dir=str(tmp_path / str(n)), ppo_mini_batches=n, ppo_epochs=2),
                          log=False)
        trainer.run()
        steps[n] = _adam_steps(trainer)
    assert steps == {1: 2, 4: 8}
    with pytest.raises(ConfigError, match="^--optim.ppo-mini-batches: must divide --rollout.groups"):
        with_fields(cfg, ppo_mini_batches=3)


@pytest.fixture
def abs_reinforce():
    """A fork's loss with a metric of its own, registered for one test (the registry is process-wide)."""
    import jax.numpy as jnp

    from earl_jax.rl.algorithm.losses import POLICY_LOSSES, register_policy_loss

    @register_policy_loss("abs_reinforce")
    def abs_reinforce(logp, old_logp, advantages, loss_mask, cfg):
        return -advantages * logp, {"adv_abs": jnp.abs(advantages)}

    yield "abs_reinforce"
    POLICY_LOSSES.pop("abs_reinforce")


def test_a_registered_loss_logs_its_own_metrics_and_is_listed_in_the_help(tmp_path, abs_reinforce, capsys):
    cfg = with_fields(SMALL, run__steps=1, eval__every=0, sft__steps=0, checkpoint_every=0, eval__games=2,
                      run_dir=str(tmp_path / "run"), loss__policy_loss=abs_reinforce)
    Trainer(cfg).run()
    record = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] == 1][0]
    assert record["train/adv_abs"] > 0  # the loss's metric, by its name (advantages are nonzero on some token)
    assert {"train/pg_loss", "train/approx_kl"} <= set(record)  # and policy_loss's own
    assert "train/clip_frac" not in record  # no clip, no clip fraction (it once read 0.0)
    with pytest.raises(SystemExit):
        job_cli.parse_job(["--help"], CONFIGS / "connect4")
    shown = " ".join(capsys.readouterr().out.split())  # the help's lines, unwrapped
    assert ("--loss.policy-loss TEXT policy loss by registered name (rl/algorithm/losses.py): ppo_clip, decoupled_ppo, "
            "reinforce, abs_reinforce (default: ppo_clip)") in shown


def test_killed_and_resumed_run_is_bit_exact(tmp_path):
    cfg = with_fields(SMALL, run__steps=4, eval__every=0, sft__steps=0)
    # the straight run collects garbage on a schedule (--run.gc-every): when Python collects changes nothing computed
    straight = Trainer(with_fields(cfg, run_dir=str(tmp_path / "a"), gc_every=2), log=False)
    straight.run()
    assert gc.isenabled() and not gc.get_freeze_count()  # the collector is back as it was

    first = Trainer(with_fields(cfg, run_dir=str(tmp_path / "b")))
    first.run(stop_after=3)  # "killed" after iteration 3; the last checkpoint is step 2
    first.logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [0, 1, 2, 3]  # 0: before training
    resumed = Trainer(with_fields(cfg, run_dir=str(tmp_path / "b"), resume="true"))
    assert resumed.step == 2
    resumed.run()
    assert resumed.step == straight.step == 4
    for a, b in zip(_params(straight), _params(resumed)):
        np.testing.assert_array_equal(a, b)
    # each step once, in order: the killed run's record of step 3 was dropped and written again
    steps = [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4], steps


def test_resume_without_checkpoint_fails_clearly(tmp_path, capsys):
    """`--resume` on a folder with no checkpoint: one line naming the flag and the folder, before anything is built."""
    empty = tmp_path / "empty"
    code = job_cli.main(["--run-dir", str(empty), "--resume"], name="connect4", configs=CONFIGS / "connect4")
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"connect4: error: --resume: {empty} holds no checkpoint"), err
    assert "\n" not in err and not empty.exists()


def _parse_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        job_cli.parse_job(argv, CONFIGS / "connect4")
    msg = str(e.value)
    assert "\n" not in msg and "usage" not in msg.lower(), msg  # one line, no usage dump
    return msg


@pytest.mark.parametrize("argv, field", [(["--rollout.groups", "0"], "--rollout.groups"),
                                         (["--rollout.temperature", "-1"], "--rollout.temperature"),
                                         (["--loss.estimator", "dqn"], "--loss.estimator"),
                                         (["--no-such-flag", "1"], "--no-such-flag"),
                                         (["--groups", "2"], "--rollout.groups")])  # an old flag: its new name
def test_bad_flags_fail_at_start_naming_the_field(argv, field):
    assert field in _parse_error(argv)


@pytest.mark.parametrize("argv, says", [
    (["--rollout.compile-ahead", "maybe"], "'maybe' is not one of auto, true, false"),
    (["--run.progress", "maybe"], "not a boolean: 'maybe'")])
def test_bad_choice_or_boolean_says_what_is_allowed(argv, says):
    assert says in _parse_error(argv)


def test_a_bad_flag_exits_2_with_one_line(tmp_path, capsys):
    assert job_cli.main(["--rollout.groups", "0"], name="connect4", configs=CONFIGS / "connect4") == 2
    assert capsys.readouterr().err == "connect4: error: --rollout.groups: must be positive (got 0)\n"


def test_out_of_memory_in_a_stage_reruns_it_on_the_next_mesh(tmp_path, monkeypatch):
    cfg = with_fields(SMALL, devices=8, run__steps=1, eval__every=0, sft__steps=0,
                      run_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, log=False)
    first = trainer.policy.planner.current.experience.mesh
    real, seen = Trainer._experience, []

    def flaky(self, run, *args):
        seen.append(run.layout.mesh)
        if run.layout.mesh == first:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes")
        return real(self, run, *args)

    monkeypatch.setattr(Trainer, "_experience", flaky)
    record = trainer.iteration()
    assert seen[0] == first and seen[1] != first  # the same batch, rerun on the next candidate
    assert record["parallel/experience_mesh"] == str(seen[1])
    assert any(stage == "experience" and mesh == first for stage, mesh, _ in trainer.policy.planner.selector.oom_marks)
    assert np.isfinite(record["train/loss"])


def test_turn_token_schedule_and_fixed_length_answers(tmp_path):
    cfg = with_fields(SMALL, turn_tokens_schedule="0:3,2:8", stop_at_eos=False, sft__steps=0,
                      max_context=512, run_dir=str(tmp_path / "run"))
    assert [cfg.rollout.turn_tokens(i) for i in range(4)] == [3, 3, 8, 8]
    trainer = Trainer(cfg, log=False)
    trainer.step = 2  # the schedule's second entry
    traj, _ = trainer.play(trainer.env, list(range(trainer.env.num_games)), None, jax.random.key(0), trainer.sampling)
    runs = []  # lengths of the generated spans (one per agent answer)
    for row in traj.loss_mask:
        edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(int), [0]])))
        runs += list(edges[1::2] - edges[::2])
    assert runs and set(runs) == {8}, runs  # no answer ended early at the end token


@pytest.mark.parametrize("schedule", ["4:8", "0:8,0:16", "0:0", "0-8", "0:8,2:600"])
def test_bad_turn_token_schedule_names_the_flag(schedule):
    with pytest.raises(ConfigError, match="^--rollout.(turn-tokens-schedule|max-context): "):
        with_fields(SMALL, turn_tokens_schedule=schedule)


def test_static_mode_keeps_the_first_plan_and_names_the_stage_that_ran_out_of_memory(tmp_path, monkeypatch):
    cfg = with_fields(SMALL, devices=8, run__steps=1, eval__every=0, sft__steps=0, planner__mode="static",
                      run_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, log=False)
    first = trainer.policy.planner.current
    trainer.policy.planner.observe(ContextStats(200_000, 250_000, 8))  # a context the first plan was never made for
    assert trainer.policy.planner.plan() is first

    def out_of_memory(self, run, *args):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes")

    monkeypatch.setattr(Trainer, "_experience", out_of_memory)
    with pytest.raises(RuntimeError, match="experience stage ran out of memory on the static layout d8f1t1"):
        trainer.iteration()
    assert not trainer.policy.planner.selector.oom_marks  # static: no fallback, nothing marked


@pytest.mark.parametrize("script", ["connect4.py", "tictactoe.py"])
def test_main_jobs_start_from_a_clone_without_install(tmp_path, script):
    """The README's command: `python experiments/connect4.py` from a fresh clone, no package install."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(root / "experiments" / script), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--planner.mode" in out.stdout, out.stderr[-2000:]


def test_the_kl_reference_is_the_warmed_up_policy_and_a_resume_keeps_it(tmp_path):
    """With a warm-up (SFT) before RL, the KL term holds the policy near where RL starts, not near the random init:
    at the first iteration the policy is its reference (KL 0), and the reference comes back with a checkpoint."""
    cfg = with_fields(SMALL, run__steps=2, eval__every=0, sft__steps=4, checkpoint_every=1, kl_coef=0.1,
                      run_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, log=False)
    init = [np.asarray(x).copy() for x in jax.tree.leaves(trainer.state.ref_params)]
    history = trainer.run()
    assert history[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)  # the warmed-up weights sampled the first batch
    assert history[1]["train/kl"] > 0  # one update later they differ
    ref = [np.asarray(x) for x in jax.tree.leaves(trainer.state.ref_params)]
    assert any(not np.array_equal(a, b) for a, b in zip(ref, init))  # not the random init

    resumed = Trainer(with_fields(cfg, run__steps=3, resume="true"), log=False)
    for a, b in zip(ref, jax.tree.leaves(resumed.state.ref_params)):
        np.testing.assert_array_equal(a, np.asarray(b))
