"""Text tasks through the job: --env.task module:factory from the stock command line, its metrics, resume, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from earl_jax.cli import ConfigError
from earl_jax.rl.job.entry import main
from earl_jax.tasks import TaskEnv, TaskLog, load_task

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "docs" / "examples"
# small and quiet; 16 games make one mini-batch over the 8 test devices (the preset's 4 need 64)
QUIET = ["--run.progress", "false", "--run.wandb-mode", "disabled", "--rollout.groups", "4", "--eval.games", "8",
         "--sft.steps", "2", "--optim.ppo-mini-batches", "1"]


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.slow
def test_the_fork_doc_task_trains_from_the_stock_command_line_and_resumes(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), "--env.task", "my_task:make", "--env.task-args",
           '{"length": 3}', "--steps", "2", "--run-dir", str(run), "--run.checkpoint-every", "1", *QUIET]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "held-out success" in out.stdout
    saved = json.loads((run / "config.json").read_text())
    assert saved["env"]["task"] == "my_task:make" and json.loads(saved["env"]["task_args"]) == {"length": 3}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    for key in ("task/success_rate", "task/score", "task/turns", "task/tool_calls", "eval/success_rate",
                "eval/score"):
        assert key in last, key
    assert last["task/turns"] == 1.0  # one answer per episode
    # a resume re-imports module:factory from the saved config: no --env.task typed
    assert main(["--resume", "true", "--run-dir", str(run), "--steps", "3", *QUIET], name="train",
                configs=ROOT / "experiments" / "configs" / "train") == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3 and "task/success_rate" in records[-1]


@pytest.mark.parametrize("flags, says", [
    (["--env.task", "no_such_module:make"], "--env.task no_such_module:make: cannot import"),
    (["--env.task", "my_task:nothing"], "has no callable 'nothing'"),
    (["--env.task", "earl_jax/NoSuch-v0"], "neither module:factory nor a registered Gymnasium id"),
    (["--env.task", "my_task:make", "--env.task-args", "[1]"], "--env.task-args"),
    (["--env.task", "my_task:make", "--env.task-args", '{"colour": 1}'], "colour"),
    (["--env.task", "my_task:make", "--curriculum.league-size", "2"], "--curriculum.league-size: a game feature"),
    (["--env.task", "my_task:make", "--rollout.constrain-moves", "true"], "--rollout.constrain-moves: a game feature"),
    (["--env.task", "my_task:make", "--opponent", "curriculum"], "--env.opponent curriculum: a game feature"),
    (["--env.task", "my_task:make", "--opponent", "alphabeta:2"], "--env.opponent alphabeta:2: a game feature"),
    (["--env.task", "my_task:make", "--eval.opponents", "random,mcts:10"],
     "--eval.opponents random,mcts:10: a game feature"),
])
def test_a_bad_task_input_is_one_line_before_setup(flags, says, tmp_path, capsys):
    _refused_in_one_line("train", flags, says, tmp_path, capsys)


def _refused_in_one_line(script: str, flags: list[str], says: str, tmp_path, capsys) -> None:
    """The job `script` (its configs folder's name) exits 2 with one error line holding `says`, making no run folder."""
    run = tmp_path / "run"
    code = main([*flags, "--run-dir", str(run), *QUIET], name=script, configs=ROOT / "experiments" / "configs" / script)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert not run.exists()


@pytest.mark.parametrize("flags, says", [
    (["--env.task", "my_task:make"], "--curriculum.rehearsal-share: a game feature (set by the script's preset: text "
                                     "tasks run with experiments/train.py)"),
    (["--env.task-args", '{"high": 8}'], "--env.task-args: a text task's keyword arguments, and --env.task is not set"),
])
def test_the_game_script_refuses_a_task_and_a_tasks_arguments_in_one_line(flags, says, tmp_path, capsys):
    _refused_in_one_line("connect4", flags, says, tmp_path, capsys)


def test_a_layout_nothing_fits_is_one_error_line_naming_what_to_change(tmp_path, capsys):
    """The memory model refusing every layout (here: not one pool row of --rollout.slots -1 at 1 MiB) ends the job
    with one line, what did not fit and the flag to change, not a traceback."""
    code = main(["--rollout.slots", "-1", "--planner.memory-budget-gib", "0.001", "--run-dir", str(tmp_path / "run"),
                 *QUIET], name="train", configs=ROOT / "experiments" / "configs" / "train")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("train: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "not one row of tiny decodes" in errors[0] and "lower --rollout.max-context" in errors[0], errors


class _Script:
    """A task that returns what it is told to: for the adapter's checks."""

    def __init__(self, steps):
        self.steps = list(steps)

    def reset(self, seed=None, options=None):
        return "go\n> ", {"winner": "agent"}  # a winner key from the task is not an end at reset

    def step(self, answer):
        return self.steps.pop(0)


def test_the_adapter_maps_outcomes_and_logs_each_finished_episode():
    log = TaskLog()
    env = TaskEnv(_Script([("a\n> ", 0.5, False, False, {}), ("", 0.5, True, False, {"tool_calls": 2})]), "s", log)
    obs, info = env.reset(seed=0)
    assert obs == "go\n> " and "winner" not in info
    assert "winner" not in env.step("x")[4]
    assert env.step("y")[4]["winner"] == "agent"  # no "success" key: a positive return is a success
    env = TaskEnv(_Script([("", -1.0, True, False, {"invalid": True, "success": False})]), "s", log)
    env.reset()
    assert env.step("?")[4]["winner"] == "opponent"
    env = TaskEnv(_Script([("", 0.0, False, True, {})]), "s", log)
    env.reset()
    assert env.step("?")[4]["winner"] is None  # truncated: no outcome
    # scores: the returns (1.0, -1.0, 0.0), no task said one
    assert log.drain("task") == pytest.approx({"task/success_rate": 1 / 3, "task/score": 0.0, "task/turns": 4 / 3,
                                               "task/tool_calls": 2 / 3, "task/tool_failures": 0.0})
    assert log.drain("task") == {}


def test_a_task_that_breaks_the_protocol_is_named():
    env = TaskEnv(_Script([("obs", 1.0, True)]), "broken:make")
    env.reset()
    with pytest.raises(TypeError, match="task broken:make: step must return"):
        env.step("x")


def test_tasks_load_by_gymnasium_id_and_by_module_path():
    pytest.importorskip("earl_jax.tasks.guess_number")
    by_id = load_task("earl_jax/GuessNumber-v0")(high=16)
    by_path = load_task("earl_jax.tasks.guess_number:make_guess_number")(high=16)
    assert by_id.reset(seed=3)[0] == by_path.reset(seed=3)[0]


def test_evaluate_run_plays_a_task_runs_held_out_split(tmp_path):
    import importlib.util

    run = tmp_path / "run"
    assert main(["--env.task", "my_task:make", "--steps", "1", "--run-dir", str(run), *QUIET], name="train",
                configs=ROOT / "experiments" / "configs" / "train") == 0
    spec = importlib.util.spec_from_file_location("evaluate_run", ROOT / "experiments" / "evaluate_run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main([str(run), "--games", "8"])
    row = result["opponents"]["held-out"]
    assert result["game"] == "my_task:make" and list(result["opponents"]) == ["held-out"]
    assert 0.0 <= row["success_rate"] <= 1.0 and row["turns"] == 1.0
    with pytest.raises(ConfigError, match="--opponents: .* text task my_task:make, which has no opponents"):
        mod.main([str(run), "--games", "8", "--opponents", "random"])  # a game's flag: refused, not ignored


def test_task_metrics_count_only_the_policys_episodes(tmp_path):
    """The SFT stage's demonstrations go through the task's envs too (all expert successes): the first iteration's
    task/success_rate is the rollout's own, as episode/win_rate says."""
    from earl_jax.rl.loop.trainer import Trainer
    from jobs import job

    cfg = job(env__task="earl_jax/GuessNumber-v0", sft__steps=2, sft__games=16, groups=4, group_size=4,
              max_turn_tokens=6, max_turns=6, max_context=256, devices=1, eval__games=4, eval__every=0,
              checkpoint_every=0, run__steps=1, run_dir=str(tmp_path))
    trainer = Trainer(cfg, log=False)
    trainer.format_warmup()
    record = trainer.iteration()
    assert record["task/success_rate"] == pytest.approx(record["episode/win_rate"])
