"""experiments/evaluate_run.py: a run's newest checkpoint evaluated against a list of opponents."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from earl_jax.rl.config import RLConfig
from earl_jax.rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SMALL = RLConfig(game="tic_tac_toe", groups=2, group_size=2, steps=1, eval_every=0, eval_games=4, format_warmup_steps=0,
                 devices=2, checkpoint_every=1, max_turns=6, max_context=256, progress=False, wandb_mode="disabled",
                 micro_batch_tokens=1024)


def _script():
    spec = importlib.util.spec_from_file_location("evaluate_run", ROOT / "experiments" / "evaluate_run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_evaluates_the_checkpoint_against_each_opponent_and_leaves_the_run_as_it_was(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(dataclasses.replace(SMALL, run_dir=str(run)))
    trainer.run()
    config_before = (run / "config.json").read_text()
    metrics_before = (run / "metrics.jsonl").read_text()
    want = trainer.evaluate(("solver",))  # the trained weights' own result: the script must restore them

    result = _script().main([str(run), "--opponents", "random,solver", "--games", str(SMALL.eval_games)])
    assert result["step"] == 1 and list(result["opponents"]) == ["random", "solver"]
    for row in result["opponents"].values():
        assert abs(row["win_rate"] + row["draw_rate"] + row["loss_rate"] - 1) < 1e-6
    assert result["opponents"]["solver"]["win_rate"] == want["eval_solver/win_rate"]
    assert result["opponents"]["solver"]["loss_rate"] == want["eval_solver/loss_rate"]
    assert json.loads((run / "evaluation.json").read_text()) == result
    assert (run / "config.json").read_text() == config_before  # nothing of the run rewritten
    assert (run / "metrics.jsonl").read_text() == metrics_before


def test_a_folder_without_a_run_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no config.json"):
        _script().main([str(tmp_path)])


def test_export_run_keeps_config_records_evaluation_and_curves(tmp_path):
    spec = importlib.util.spec_from_file_location("export_run", ROOT / "experiments" / "export_run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
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
