"""Runs that survive preemption and resume as they were: the saved config restored, a checkpoint on SIGTERM / Ctrl-C,
one-line errors before any setup, and a corrupt checkpoint that costs one warning line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from earl_jax.rl.job import entry as job
from earl_jax.rl.loop.metrics import read_metrics
from earl_jax.rl.loop.run_control import RunControl
from earl_jax.rl.loop.trainer import Trainer
from jobs import job as job_config, with_fields

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "experiments" / "configs" / "connect4"
SMALL = ["--rollout.groups", "4", "--rollout.group-size", "2", "--eval.games", "8", "--rollout.max-turns", "6",
         "--rollout.max-context", "256", "--run.wandb-mode", "disabled", "--run.progress", "false",
         "--model.name", "nano"]  # typed over the preset's base: random weights of the tests' shape


def _main(argv: list[str]) -> int:
    return job.main(argv, name="connect4", configs=CONFIGS)


def _stderr_lines(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if line.strip()]


def test_resume_without_flags_keeps_the_run_and_prints_each_override(tmp_path, capfd):
    run = str(tmp_path / "run")
    first = ["--run-dir", run, "--steps", "1", "--opponent", "curriculum", "--curriculum.ladder", "random,alphabeta:1",
             "--curriculum.promote-at", "0.01", "--learning-rate", "5e-4", *SMALL]
    assert _main(first) == 0
    capfd.readouterr()
    assert _main(["--run-dir", run, "--resume", "--steps", "2"]) == 0
    err = capfd.readouterr().err
    assert "connect4: resume: run.steps: 1 -> 2" in err and "resumed from step 1" in err
    saved = json.loads((Path(run) / "config.json").read_text())
    assert (saved["env"]["opponent"], saved["optim"]["learning_rate"], saved["rollout"]["groups"]) == (
        "curriculum", 5e-4, 4)
    assert saved["curriculum"]["ladder"] == "random,alphabeta:1" and saved["run"]["steps"] == 2
    # the rung reached before the resume (the first evaluation promoted at 0.01) is the rung after it
    records = {r["step"]: r for r in read_metrics(Path(run) / "metrics.jsonl")}
    assert records[1]["curriculum/rung"] == 1 and records[2]["curriculum/rung"] == 1
    # what would make it another experiment is refused, in one line
    assert _main(["--run-dir", run, "--resume", "--seed", "3"]) == 2
    lines = _stderr_lines(capfd)
    assert len(lines) == 1 and lines[0].startswith("connect4: error: --run.seed: the run was started with 0"), lines


def _flags(tmp_path: Path, name: str) -> list[str]:
    """The bad input `name` as a command line (its fixture made in tmp_path)."""
    run = tmp_path / "run"
    hf = tmp_path / "hf"
    if name == "run dir is a file":
        run.write_text("not a folder")
        return ["--run-dir", str(run)]
    if name == "run dir under a file":
        run.write_text("not a folder")
        return ["--run-dir", str(run / "inside")]
    if name == "run dir not writable":  # /sys refuses a new file even to root (who passes os.access and chmod)
        return ["--run-dir", "/sys/earl-jax-test/run"]
    if name == "resume an old run":
        (run / "checkpoints" / "3").mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"steps": 3, "eval_games": 8}))
        return ["--run-dir", str(run), "--resume"]
    if name == "resume an empty folder":
        run.mkdir()
        return ["--run-dir", str(run), "--resume"]
    if name == "malformed HF folder":
        hf.mkdir()
        (hf / "config.json").write_text("{not json")
        (hf / "tokenizer.json").write_text("{}")
        (hf / "model.safetensors").write_bytes(b"")
        return ["--run-dir", str(run), "--model.hf-checkpoint", str(hf)]
    return ["--run-dir", str(run)] + {
        "groups 0": ["--rollout.groups", "0"],
        "learning rate nan": ["--learning-rate", "nan"],
        "unknown preset": ["--preset", "nosuch"],
        "unknown game": ["--game", "nosuch"],
        "unknown opponent": ["--opponent", "nosuch"],
        "unknown eval opponent": ["--eval.opponents", "random,nosuch"],
        "unknown model": ["--model", "nosuch"],
        "thresholds garbage": ["--planner.rollout-thresholds", "garbage"],
        "edges garbage": ["--planner.edges", "garbage"],
        "missing HF folder": ["--hf-checkpoint", "/nonexistent"],
        "old flag name": ["--groups", "4"],
        "missing config file": ["--config", "/nonexistent.toml"],
        "bad ladder rung": ["--opponent", "curriculum", "--curriculum.ladder", "random,alphabeta:0"],
        "moves of two tokens": ["--game", "dots_and_boxes", "--opponent", "random", "--hf-checkpoint", "",
                                "--rollout.constrain-moves", "true"],  # once refused only after the model was made
    }[name]


BAD = ("groups 0", "learning rate nan", "unknown preset", "unknown game", "unknown opponent", "unknown eval opponent",
       "unknown model", "thresholds garbage", "edges garbage", "missing HF folder", "malformed HF folder",
       "run dir is a file", "resume an empty folder", "resume an old run", "old flag name", "missing config file",
       "bad ladder rung", "moves of two tokens", "run dir under a file", "run dir not writable")


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_before_anything_is_made(name, tmp_path, capfd):
    flags = _flags(tmp_path, name)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert _main(flags) == 2
    lines = _stderr_lines(capfd)
    assert len(lines) == 1, lines
    assert lines[0].startswith("connect4: error: ") and len(lines[0]) < 400, lines
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run folder, nothing else either


def test_a_misspelt_game_is_named_unknown_before_the_base_is_blamed(tmp_path, capfd):
    assert _main(["--run-dir", str(tmp_path / "run"), "--env.game", "conect_four"]) == 2
    lines = _stderr_lines(capfd)
    assert lines == ["connect4: error: --env.game: unknown game 'conect_four' (did you mean connect_four? batched "
                     "here: connect_four, tic_tac_toe; or any two-player OpenSpiel game such as breakthrough or hex)"]


def test_a_run_dir_that_cannot_be_written_is_one_line_before_setup(capfd):
    assert _main(["--run-dir", "/sys/earl-jax-test/run"]) == 2
    assert _stderr_lines(capfd) == ["connect4: error: --run.run-dir: /sys/earl-jax-test/run cannot be written (/sys: "
                                    "Permission denied)"]


def test_another_scripts_resume_is_refused_naming_both(tmp_path, capfd):
    run = tmp_path / "run"
    assert _main(["--run-dir", str(run), "--steps", "1", "--eval.every", "0", *SMALL]) == 0
    assert json.loads((run / "config.json").read_text())["job"] == "connect4"
    capfd.readouterr()
    for script in ("tictactoe", "train"):
        configs = ROOT / "experiments" / "configs" / script
        assert job.main(["--run-dir", str(run), "--resume"], name=script, configs=configs) == 2
        assert _stderr_lines(capfd) == [f"{script}: error: --resume: {run} is a run of connect4.py, not of "
                                        f"{script}.py: resume it with experiments/connect4.py (or start a new "
                                        "--run-dir)"]
    assert _main(["--run-dir", str(run), "--resume", "--steps", "2", *SMALL]) == 0  # its own script resumes it


def test_resuming_an_old_run_names_the_converter_and_resumes_once_converted(tmp_path, capfd):
    """A config.json of an earlier version stops --resume with one line naming experiments/upgrade_run.py; after it
    ran, the same command reads the run's config."""
    import importlib.util

    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)  # what --resume looks for first; the config is read after it
    (run / "config.json").write_text(json.dumps({"steps": 3, "eval_games": 8, "compact_finished": True}))
    assert _main(["--run-dir", str(run), "--resume"]) == 2
    assert _stderr_lines(capfd) == [f"connect4: error: --resume: {run / 'config.json'} was written by an earlier "
                                    f"version (flat keys): convert it once with `python experiments/upgrade_run.py "
                                    f"{run}`"]
    spec = importlib.util.spec_from_file_location("upgrade_run", ROOT / "experiments" / "upgrade_run.py")
    upgrade = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upgrade)
    assert upgrade.main([str(run)]) == 0
    cfg, _ = job.resume_config(job.parse_job(["--run-dir", str(run), "--resume"], CONFIGS), "connect4")
    assert (cfg.run.steps, cfg.eval.games, cfg.rollout.compact_finished, cfg.run.resume) == (3, 8, "true", "true")


def _interrupted_at(trainer: Trainer, step: int, sig: int) -> None:
    """Raise `sig` in this process once iteration `step + 1` has started (before its rollout's first host step)."""
    league_games = trainer.matchmaker.league_games

    def hook(s, params):
        if s == step:
            signal.raise_signal(sig)
        return league_games(s, params)

    trainer.matchmaker.league_games = hook


def test_a_stop_signal_mid_iteration_checkpoints_the_last_one_and_the_resumed_run_is_bit_exact(tmp_path):
    cfg = job_config(groups=4, group_size=2, run__steps=3, eval__every=0, eval__games=8, checkpoint_every=100,
                     checkpoint_minutes=0, max_turns=6, max_context=256, constrain_moves=True)
    straight = Trainer(with_fields(cfg, run_dir=str(tmp_path / "a")), log=False)
    straight.run()
    for sig in (signal.SIGTERM, signal.SIGINT):  # one straight run serves both: a stop is a stop
        stopped = Trainer(with_fields(cfg, run_dir=str(tmp_path / sig.name)), log=False)
        _interrupted_at(stopped, 2, sig)
        stopped.run()
        assert stopped.stopped_by == sig.name and stopped.step == 2  # iteration 3 abandoned
        ckpts = tmp_path / sig.name / "checkpoints"
        assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2]
    resumed = Trainer(with_fields(cfg, run_dir=str(tmp_path / "SIGTERM"), resume="true"), log=False)
    assert resumed.step == 2
    resumed.run()
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_wall_time_checkpoints_come_due_on_time(tmp_path):
    run_cfg = job_config(checkpoint_every=1000, checkpoint_minutes=0.001).run  # 60 ms
    with RunControl(run_cfg, total=10, start=0, run_dir=tmp_path, gc_clock=__import__(
            "earl_jax.rl.loop.gc_control", fromlist=["GcClock"]).GcClock(), enabled=False, on_stall=lambda: None) as s:
        assert not s.checkpoint_due(1, last_step=False)
        time.sleep(0.1)
        assert s.checkpoint_due(2, last_step=False)
        s.saved()
        assert not s.checkpoint_due(3, last_step=False)


def test_a_corrupt_newest_checkpoint_costs_one_warning_line(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "experiments" / "connect4.py"), "--run-dir", str(run), *SMALL,
           "--run.checkpoint-every", "1", "--eval.every", "0"]
    subprocess.run(cmd + ["--steps", "2"], check=True, capture_output=True, cwd=ROOT)
    for f in (run / "checkpoints" / "2" / "state").rglob("manifest.ocdbt"):  # an unreadable newest checkpoint
        f.write_text("garbage")
    out = subprocess.run(cmd + ["--steps", "3", "--resume"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    about = [line for line in text.splitlines() if "unreadable" in line]
    assert len(about) == 1 and "moved to" in about[0], about
    assert "Traceback" not in text and "Event loop is closed" not in text
    assert (run / "corrupt_checkpoints" / "2").is_dir() and "resumed from step 1" in text
    for f in (run / "checkpoints").rglob("manifest.ocdbt"):  # no checkpoint reads back: a clear error, exit 1
        f.write_text("garbage")
    out = subprocess.run(cmd + ["--steps", "4", "--resume"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("connect4: error:")]
    assert len(errors) == 1 and "reads back" in errors[0], out.stderr[-3000:]


@pytest.mark.slow
def test_two_processes_under_sigterm_save_the_same_step(tmp_path):
    """SIGTERM to the launcher reaches both processes; they agree at a stop point, save one step together, exit 143."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("launch_local", ROOT / "launch" / "local.py")
    local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(local)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EARL_", "SLURM_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=local.cpu_xla_flags(env.get("XLA_FLAGS", ""), 4), WANDB_MODE="disabled",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), EARL_COMPILE_CACHE="off")
    run, logs = tmp_path / "run", tmp_path / "logs"
    cmd = [sys.executable, str(ROOT / "experiments" / "connect4.py"), "--run-dir", str(run), "--steps", "50", *SMALL,
           "--eval.every", "0", "--run.checkpoint-every", "100", "--run.checkpoint-minutes", "0"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "local.py"), "-n", "2", "--cpu-devices", "4",
                             "--log-dir", str(logs), "--quiet-main", "--timeout", "400", "--", *cmd],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log0 = logs / "process_0.log"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (log0.exists() and "iteration 1/50" in log0.read_text()):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=200)
    texts = [p.read_text() for p in sorted(logs.glob("process_*.log"))]
    assert proc.returncode == 143, out[-2000:] + "\n".join(t[-2000:] for t in texts)
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert len(steps) == 1 and steps[0] >= 1, steps
    for text in texts:  # both processes stopped after the same iteration, the one saved
        assert f"SIGTERM: stopped after iteration {steps[0]}" in text, text[-2000:]
