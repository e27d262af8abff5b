"""The offline sweep runner: YAML parsing, trial generation, command lines, summaries (no long runs)."""

from __future__ import annotations

import csv
import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import sweep  # noqa: E402
from earl_jax.parallel.thresholds import parse_thresholds  # noqa: E402
from earl_jax.rl.job.entry import parse_job  # noqa: E402

SELECTOR_YAML = ROOT / "launch" / "sweep_selector.yaml"
LEARNING_YAML = ROOT / "launch" / "sweep_learning.yaml"
SELECTOR_KNOBS = {"planner.edges", "planner.margin", "planner.ema", "planner.rollout-thresholds",
                  "planner.experience-thresholds", "planner.train-thresholds"}


def _connect4(argv: list[str]):
    """The config experiments/connect4.py runs with these flags."""
    return parse_job(argv, ROOT / "experiments" / "configs" / "connect4").config


def _varying(spec) -> set[str]:
    return {k for k, p in spec["parameters"].items() if "value" not in p}


def test_selector_sweep_maximizes_throughput_over_the_selector_knobs_with_learning_fixed():
    from earl_jax.models.model_config import get_config
    from earl_jax.parallel.memory import mesh_problem

    spec = sweep.load_sweep(SELECTOR_YAML)
    assert spec["program"] == "experiments/connect4.py"
    assert spec["metric"] == {"name": "throughput/iteration_tgs_mean", "goal": "maximize"}
    assert _varying(spec) == SELECTOR_KNOBS
    assert {"optim.learning-rate", "loss.kl-coef"} <= set(spec["parameters"]) - _varying(spec)  # fixed, not swept
    # every value is a valid connect4 flag value, and every mesh a valid layout of the model and the batch
    first = {k: p["value"] if "value" in p else p["values"][0] for k, p in spec["parameters"].items()}
    for params in ({**first, k: v} for k in _varying(spec) for v in spec["parameters"][k]["values"]):
        cfg = _connect4(sweep.trial_command("x", params, "r")[3:])
        model = get_config(cfg.model.name, vocab_size=101)
        for stage in ("rollout", "experience", "train"):
            for _, mesh in parse_thresholds(getattr(cfg.planner, f"{stage}_thresholds")):
                assert mesh_problem(model, cfg.planner.devices, stage, mesh) is None, (stage, mesh)
                assert cfg.batch_size % (mesh.data * mesh.fsdp) == 0, (stage, mesh)
    assert (cfg.model.name, cfg.planner.devices, cfg.run.keep_checkpoints, cfg.eval.opponents, cfg.run.steps) == (
        "qwen2.5-1.5b", 4, 0, (), 4)
    assert cfg.rollout.turn_tokens(0) < cfg.rollout.turn_tokens(cfg.run.steps - 1)  # the context grows: edges matter


def test_learning_sweep_maximizes_the_win_rate_over_learning_rate_and_kl():
    spec = sweep.load_sweep(LEARNING_YAML)
    assert spec["metric"] == {"name": "eval/win_rate", "goal": "maximize"}
    assert _varying(spec) == {"optim.learning-rate", "loss.kl-coef"}
    cfg = _connect4(sweep.trial_command("x", sweep.trials(spec, "random", 1)[0], "runs/t")[2:])
    assert cfg.run.run_dir == "runs/t" and cfg.run.steps == 20 and cfg.run.progress is False


def test_grid_is_the_product_of_values_with_fixed_values_in_each():
    params = {"a": {"values": [1, 2, 3]}, "b": {"values": ["x", "y"]}, "c": {"value": 7}}
    got = list(sweep.grid(params))
    assert len(got) == 6 and got[0] == {"a": 1, "b": "x", "c": 7} and got[-1] == {"a": 3, "b": "y", "c": 7}
    assert len(sweep.trials({"parameters": params}, "grid", max_trials=4)) == 4
    with pytest.raises(ValueError, match="list of values"):
        list(sweep.grid({"lr": {"distribution": "uniform", "min": 0, "max": 1}}))


def test_random_trials_are_seeded_and_within_their_ranges():
    params = {"lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
              "n": {"distribution": "int_uniform", "min": 2, "max": 4},
              "u": {"distribution": "uniform", "min": -1.0, "max": 1.0},
              "c": {"values": ["p", "q"], "probabilities": [0.0, 1.0]}, "fixed": {"value": True}}
    a = sweep.random_trials(params, 50, seed=3)
    assert a == sweep.random_trials(params, 50, seed=3) and a != sweep.random_trials(params, 50, seed=4)
    assert all(1e-4 <= t["lr"] <= 1e-2 and t["n"] in (2, 3, 4) and -1 <= t["u"] <= 1 for t in a)
    assert {t["c"] for t in a} == {"q"} and all(t["fixed"] is True for t in a)
    assert {t["n"] for t in a} == {2, 3, 4}
    lrs = sorted(t["lr"] for t in a)
    assert lrs[len(lrs) // 2] < 3e-3  # log-uniform: the median sits near the geometric mean (1e-3)


def test_trial_command_flags_and_names():
    cmd = sweep.trial_command("experiments/connect4.py", {"loss.kl_coef": 0.01, "planner.edges": [64, 256],
                                                          "run.progress": False, "planner.rollout-thresholds": ""},
                              "runs/sweep/t000", extra=["--steps", "2"], launcher=["launcher", "--"],
                              python="py")
    assert cmd == ["launcher", "--", "py", "experiments/connect4.py", "--run-dir=runs/sweep/t000",
                   "--loss.kl-coef=0.01", "--planner.edges=64,256", "--run.progress=false",
                   "--planner.rollout-thresholds=", "--steps", "2"]
    assert sweep.trial_name(3, {"a": 1}) == sweep.trial_name(3, {"a": 1}) != sweep.trial_name(3, {"a": 2})


def test_run_sweep_writes_one_folder_per_trial_and_a_summary(tmp_path, capsys):
    # a stand-in program: writes metrics.jsonl like the trainer (final eval win rate = the 'x' flag)
    program = tmp_path / "fake_job.py"
    program.write_text(textwrap.dedent('''
        import json, sys
        from pathlib import Path
        args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
        if args["x"] == "bad":  # a traceback, the job's one-line error, then more output
            print("Traceback (most recent call last):\\nValueError: not this one", file=sys.stderr)
            print("fake_job: error: --x: 'bad' is not a number", file=sys.stderr)
            print("fake_job: bye")
            sys.exit(3)
        run = Path(args["run-dir"]); run.mkdir(parents=True, exist_ok=True)
        rows = [{"step": 0, "eval/win_rate": 0.0},
                {"step": 1, "episode/return_mean": -0.5, "time/rollout_s": 2.0, "time/train_s": 1.0},
                {"step": 2, "episode/return_mean": 0.25, "time/rollout_s": 4.0, "time/train_s": 3.0,
                 "eval/win_rate": float(args["x"])}]
        (run / "metrics.jsonl").write_text("\\n".join(json.dumps(r) for r in rows))
    '''))
    yaml_path = tmp_path / "s.yaml"
    yaml_path.write_text(f"program: {program}\nmethod: grid\nmetric: {{name: eval/win_rate, goal: maximize}}\n"
                         "parameters:\n  x: {values: ['0.25', 'bad', '0.75']}\n  y: {value: 1}\n")
    out = tmp_path / "sweep"
    code = sweep.main([str(yaml_path), "--out", str(out), "--", "--extra=1"])
    assert code == 1  # one trial failed: the sweep says so
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [r["status"] for r in rows] == ["ok", "failed (3)", "ok"]
    why = "fake_job: error: --x: 'bad' is not a number"  # the last error line of the trial's log
    assert [r["error"] for r in rows] == ["", why, ""]
    ok = rows[0]
    assert float(ok["eval/win_rate"]) == 0.25 and float(ok["episode/return_mean"]) == 0.25
    assert float(ok["time/rollout_s_mean"]) == 3.0 and float(ok["time/train_s"]) == 3.0 and ok["final_step"] == "2"
    assert (out / rows[2]["trial"] / "metrics.jsonl").exists()
    assert len((out / "trials.jsonl").read_text().splitlines()) == 3
    printed = capsys.readouterr().out
    assert f"{rows[1]['trial']}: failed (3): {why}" in printed.splitlines()[1:]  # as it ran, and after the table
    printed = printed[printed.index("summary.csv"):]  # the table (the trial commands come before it)
    assert printed.index("0.75") < printed.index("0.25")  # sorted by the metric, best first
    assert printed.strip().splitlines()[-1] == f"{rows[1]['trial']}: failed (3): {why}"
    # run again: finished trials are skipped, the failed one runs again
    sweep.main([str(yaml_path), "--out", str(out)])
    assert "done before, skipped" in capsys.readouterr().out
    assert len((out / "trials.jsonl").read_text().splitlines()) == 4
    assert json.loads((out / rows[0]["trial"] / "trial.json").read_text())["status"] == "ok"


def test_sweep_summarizes_throughput_after_the_compile_iteration_and_sorts_by_it(tmp_path, capsys):
    # a stand-in program: iteration 1 is slow (compiling), the steady throughput is the 'x' flag
    program = tmp_path / "fake_job.py"
    program.write_text(textwrap.dedent('''
        import json, sys
        from pathlib import Path
        args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
        run = Path(args["run-dir"]); run.mkdir(parents=True, exist_ok=True)
        x = float(args["x"])
        rows = [{"step": 1, "throughput/iteration_tgs": 1.0 / x, "compile/programs": 5},
                {"step": 2, "throughput/iteration_tgs": x, "compile/programs": 5},
                {"step": 3, "throughput/iteration_tgs": x + 2, "compile/programs": 5},
                {"step": 4, "throughput/iteration_tgs": 1.0, "compile/programs": 7}]  # compiled: new lengths
        (run / "metrics.jsonl").write_text("\\n".join(json.dumps(r) for r in rows))
    '''))
    yaml_path = tmp_path / "s.yaml"
    yaml_path.write_text(f"program: {program}\nmethod: grid\n"
                         "metric: {name: throughput/iteration_tgs_mean, goal: maximize}\n"
                         "parameters:\n  x: {values: ['10', '30', '20']}\n")
    assert sweep.main([str(yaml_path), "--out", str(tmp_path / "sweep")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "summary.csv")))
    assert [float(r["throughput/iteration_tgs_mean"]) for r in rows] == [11.0, 31.0, 21.0]  # steps 2-3 only
    assert [r["steady_iterations"] for r in rows] == ["2", "2", "2"]
    table = capsys.readouterr().out
    table = table[table.index("summary.csv"):]
    by_x = {r["x"]: r["trial"] for r in rows}
    assert table.index(by_x["30"]) < table.index(by_x["20"]) < table.index(by_x["10"])  # best first


def test_the_yamls_program_is_found_from_another_folder_and_bad_counts_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the shipped YAMLs name experiments/connect4.py, a path from the repository
    assert sweep.main([str(LEARNING_YAML), "--dry-run", "--trials", "1"]) == 0
    assert f"{ROOT / 'experiments' / 'connect4.py'} --run-dir=" in capsys.readouterr().out
    (tmp_path / "s.yaml").write_text("program: nowhere.py\nparameters:\n  x: {value: 1}\n")
    for argv, says in (([str(tmp_path / "s.yaml")], "program 'nowhere.py': not found from"),
                       ([str(LEARNING_YAML), "--trials", "0"], "--trials: must be >= 1 (got 0)"),
                       ([str(LEARNING_YAML), "--only", "a,b"], "--only: a comma list of trial indices")):
        with pytest.raises(SystemExit) as exit_:
            sweep.main(argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing ran
