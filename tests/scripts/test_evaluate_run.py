"""experiments/evaluate_run.py: runs' newest checkpoints evaluated against a list of opponents, the mean and spread
over several runs; run folders written before the component configs, converted by experiments/upgrade_run.py."""

from __future__ import annotations

import collections
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from earl_jax.cli import ConfigError
from earl_jax.rl.loop.trainer import Trainer
from jobs import job, with_fields

ROOT = Path(__file__).resolve().parents[2]
SMALL = job(game="tic_tac_toe", groups=2, group_size=2, run__steps=2, eval__every=0, eval__games=4, sft__steps=0,
            devices=2, checkpoint_every=1, max_turns=6, max_context=256, micro_batch_tokens=1024)
GAMES = str(SMALL.eval.games)


def _script(name: str = "evaluate_run"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A finished 2-iteration run (checkpoints 1 and 2) and its final weights' own evaluation against the solver."""
    run = tmp_path_factory.mktemp("trained") / "run"
    trainer = Trainer(with_fields(SMALL, run_dir=str(run)))
    trainer.run()
    return run, trainer.evaluate(("solver",))


def _copy(run: Path, to: Path, keep_step: int | None = None) -> Path:
    """The run folder copied to `to` (its config.json still names the original folder); with `keep_step`, only that
    checkpoint stays, so an evaluation of the copy can be told apart from one of the original."""
    shutil.copytree(run, to)
    if keep_step is not None:
        for d in (to / "checkpoints").iterdir():
            if d.name.isdigit() and int(d.name) != keep_step:
                shutil.rmtree(d)
    return to


def test_evaluates_the_checkpoint_against_each_opponent_and_leaves_the_run_as_it_was(tmp_path, trained):
    run, want = _copy(trained[0], tmp_path / "run"), trained[1]
    config_before = (run / "config.json").read_text()
    metrics_before = (run / "metrics.jsonl").read_text()

    result = _script().main([str(run), "--opponents", "random,solver", "--games", GAMES])
    assert result["step"] == 2 and list(result["opponents"]) == ["random", "solver"]
    for row in result["opponents"].values():
        assert abs(row["win_rate"] + row["draw_rate"] + row["loss_rate"] - 1) < 1e-6
    # the trained weights' own result: the script restored them
    assert result["opponents"]["solver"]["win_rate"] == want["eval_solver/win_rate"]
    assert result["opponents"]["solver"]["loss_rate"] == want["eval_solver/loss_rate"]
    # the blunder rate as the trainer's evaluation has it (none here: random weights answer no valid move)
    assert result["opponents"]["solver"].get("blunder_rate") == want.get("eval_solver/blunder_rate")
    assert json.loads((run / "evaluation.json").read_text()) == result
    # where the numbers come from: the run's own running seconds (its last metrics line) and the evaluating machine
    last = json.loads(metrics_before.splitlines()[-1])
    assert result["run_seconds"] == round(last["time/run_elapsed_s"], 1) > 0
    assert result["device"] and result["host"] and result["jax"]
    assert (run / "config.json").read_text() == config_before  # nothing of the run rewritten
    assert (run / "metrics.jsonl").read_text() == metrics_before


def test_several_runs_give_each_result_and_the_mean_and_spread(tmp_path, trained):
    a = _copy(trained[0], tmp_path / "a")
    b = _copy(trained[0], tmp_path / "b", keep_step=1)  # the folder given is the one evaluated, wherever it was made
    out = tmp_path / "summary.json"
    summary = _script().main([str(a), str(b), "--opponents", "solver", "--games", GAMES, "--out", str(out)])
    per_run = [json.loads((d / "evaluation.json").read_text()) for d in (a, b)]
    assert [r["step"] for r in per_run] == summary["steps"] == [2, 1]
    assert summary["runs"] == [str(a), str(b)] and json.loads(out.read_text()) == summary
    wins = [r["opponents"]["solver"]["win_rate"] for r in per_run]
    got = summary["opponents"]["solver"]["win_rate"]
    assert got["mean"] == pytest.approx(sum(wins) / 2) and got["runs"] == 2
    assert (got["min"], got["max"]) == (min(wins), max(wins))
    assert got["std"] == pytest.approx(abs(wins[0] - wins[1]) / 2 ** 0.5)  # the sample standard deviation of two

    rows = lambda *w: {"opponents": {"x": {"win_rate": v, "draw_rate": 0.0, "loss_rate": 1 - v,  # noqa: E731
                                           "invalid_rate": 0.0} for v in w}}
    spread = _script().summarize([rows(0.5), rows(0.7), rows(0.9)])["x"]["win_rate"]
    assert spread == pytest.approx({"mean": 0.7, "std": 0.2, "min": 0.5, "max": 0.9, "runs": 3})


def _flat(cfg) -> dict:
    """`cfg` as runs wrote config.json before the component configs: one flat dict by the old field names."""
    from earl_jax.cli import fields_of, get_path

    fields = fields_of(cfg)
    old_name = {path: name for name, path in _script("upgrade_run").OLD_NAMES.items()}
    unique = collections.Counter(f.path[-1] for f in fields)
    flat = {}
    for f in fields:  # a field an old name reaches: by the map, or its own name when no other field has it
        name = old_name.get(f.path) or (f.path[-1] if unique[f.path[-1]] == 1 else None)
        if name is not None:
            v = get_path(cfg, f.path)
            flat[name] = list(v) if isinstance(v, tuple) else v
    return {**flat, "resume": False, "rollout_groups": 0, "compact_finished": True}  # the old types, a removed option


def test_an_old_run_folder_is_one_line_naming_the_converter_and_evaluates_once_converted(tmp_path, trained, capsys):
    """An old run's flat config.json (old field names and types, an option since removed) is refused in one line that
    names experiments/upgrade_run.py; converted, it evaluates as the nested one does, the old file kept."""
    run = _copy(trained[0], tmp_path / "old")
    nested = _script().load_run_config(run)
    flat = _flat(nested)
    assert not any(isinstance(v, dict) for v in flat.values()) and flat["format_warmup_steps"] == 0
    (run / "config.json").write_text(json.dumps(flat))
    with pytest.raises(ConfigError) as e:
        _script().main([str(run), "--opponents", "solver", "--games", GAMES])
    assert str(e.value) == (f"{run / 'config.json'} was written by an earlier version (flat keys): convert it once "
                            f"with `python experiments/upgrade_run.py {run}`")

    assert _script("upgrade_run").main([str(run)]) == 0
    assert json.loads((run / "config.json.bak").read_text()) == flat
    assert "flat keys -> sections" in capsys.readouterr().out
    assert _script().load_run_config(run) == with_fields(nested, compact_finished="true")  # the old bool, converted
    result = _script().main([str(run), "--opponents", "solver", "--games", GAMES])
    assert result["step"] == 2
    assert result["opponents"]["solver"]["win_rate"] == trained[1]["eval_solver/win_rate"]


def test_the_converter_reads_a_real_old_config_and_refuses_what_it_cannot_place(tmp_path, capsys):
    """The Tic-Tac-Toe CPU default's run as an earlier version saved it converts; a second pass changes nothing; an
    unknown old field is one line, with the folder left as it was."""
    upgrade = _script("upgrade_run")
    real = tmp_path / "real"
    real.mkdir()
    old = json.loads((ROOT / "experiments" / "results" / "tictactoe_cpu_default.json").read_text())["config"]
    (real / "config.json").write_text(json.dumps(old))
    assert upgrade.main([str(real)]) == 0
    cfg = _script().load_run_config(real)
    assert (cfg.env.game, cfg.rollout.groups, cfg.env.max_retries, cfg.eval.opponents, cfg.loss.estimator) == (
        "tic_tac_toe", 16, 2, ("random", "solver"), "grpo")
    converted = (real / "config.json").read_text()
    assert upgrade.main([str(real)]) == 0 and (real / "config.json").read_text() == converted
    assert capsys.readouterr().out.splitlines()[-1] == f"{real}: config.json is current, nothing to do"

    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**old, "frobnicate": 1}))
    assert upgrade.main([str(odd)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"upgrade_run: error: {odd / 'config.json'}: field 'frobnicate' of an earlier version has no place in this one"]
    assert sorted(p.name for p in odd.iterdir()) == ["config.json"]


def test_a_folder_without_a_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        _script().main([str(tmp_path)])


def test_export_run_keeps_config_records_evaluation_and_curves(tmp_path):
    mod = _script("export_run")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"groups": 4}))
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "eval/win_rate": 0.5}\n')
    (run / "evaluation.json").write_text(json.dumps({"step": 1}))
    (run / "curves.png").write_bytes(b"png")
    out = mod.export(run, "x", "a note", results=tmp_path)
    got = json.loads(out.read_text())
    assert got == {"config": {"groups": 4}, "records": [{"step": 0}, {"step": 1, "eval/win_rate": 0.5}],
                   "evaluation": {"step": 1}, "note": "a note"}
    assert (tmp_path / "x.png").read_bytes() == b"png"


def test_a_run_whose_base_folder_is_not_found_is_one_line(tmp_path, trained, monkeypatch):
    run = _copy(trained[0], tmp_path / "run")
    saved = json.loads((run / "config.json").read_text())
    saved["model"]["hf_checkpoint"] = "bases/mine"  # relative, as runs started before paths were kept absolute
    (run / "config.json").write_text(json.dumps(saved))
    monkeypatch.chdir(tmp_path)
    says = r"--model.hf-checkpoint bases/mine: no such folder from .* \(evaluate the run from the folder it was started"
    with pytest.raises(ConfigError, match=says):
        _script().main([str(run), "--games", GAMES])


def test_a_misspelt_opponent_is_one_line_naming_the_flag(tmp_path, trained):
    run = _copy(trained[0], tmp_path / "run")
    with pytest.raises(ConfigError, match=r"--opponents: unknown opponent spec 'rnadom': expected \"random\""):
        _script().main([str(run), "--opponents", "random,rnadom", "--games", GAMES])
    assert not (run / "evaluation.json").exists()  # nothing played, nothing written


def test_a_games_count_below_one_is_refused_naming_this_scripts_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        _script().main([str(tmp_path), "--games", "0"])
    assert exit_.value.code == 2 and "--games: must be positive (got 0)" in capsys.readouterr().err
