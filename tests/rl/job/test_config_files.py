"""TOML presets and --config files: each value is checked against its field's type, naming the key and the type."""

from __future__ import annotations

from pathlib import Path

import pytest

from earl_jax.cli import ConfigError, read_toml
from earl_jax.rl.job import entry as job
from earl_jax.rl.loop.job_config import JobConfig

CONFIGS = Path(__file__).resolve().parents[3] / "experiments" / "configs" / "connect4"


def _read(tmp_path: Path, text: str) -> dict:
    path = tmp_path / "my.toml"
    path.write_text(text)
    return read_toml(path, JobConfig())


@pytest.mark.parametrize("text, says", [
    ("[run]\nsteps = 2.5", "run.steps: expected an integer, got 2.5"),  # once ran, logging "iteration 3/2"
    ("[rollout]\ngroups = true", "rollout.groups: expected an integer, got true"),  # once ran
    ("[optim]\nlearning_rate = [1e-3]", "optim.learning_rate: expected a number, got [0.001]"),  # named no key
    ("[rollout]\nstop_at_eos = 1", "rollout.stop_at_eos: expected true or false, got 1"),
    ("[model]\nname = 7", "model.name: expected a string, got 7"),
    ("[eval]\nopponents = \"random\"\ngames = \"many\"", "eval.games: 'many' is not an integer"),
    ("[eval]\nopponents = [\"random\", 3]", "eval.opponents: expected a string, got 3"),
    ("[planner]\nedges = 1024", "planner.edges: expected a list (or a comma-separated string), got 1024"),
    ("[env]\nprompt_style = \"fancy\"", "env.prompt_style: \"fancy\" is not one of compact, minimal, chat, labeled"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key_and_the_type(tmp_path, text, says):
    with pytest.raises(ConfigError) as e:
        _read(tmp_path, text)
    assert str(e.value) == f"config file {tmp_path / 'my.toml'}: {says}"


def test_values_of_the_field_types_read_as_the_flags_would(tmp_path):
    got = _read(tmp_path, "[run]\nsteps = 3\nresume = true\n[optim]\nlearning_rate = 1\n[env]\n"
                          "agent_player = \"none\"\n"
                          "[eval]\nopponents = [\"random\", \"alphabeta:1\"]\n[planner]\nedges = \"512,2048\"")
    assert got == {("run", "steps"): 3, ("run", "resume"): "true", ("optim", "learning_rate"): 1.0,
                   ("env", "agent_player"): None, ("eval", "opponents"): ("random", "alphabeta:1"),
                   ("planner", "edges"): (512, 2048)}
    assert isinstance(got[("optim", "learning_rate")], float)


def test_a_bad_config_file_is_one_line_before_setup(tmp_path, capsys):
    (tmp_path / "my.toml").write_text("[run]\nsteps = 2.5\n")
    assert job.main(["--config", str(tmp_path / "my.toml"), "--run-dir", str(tmp_path / "run")], name="connect4",
                    configs=CONFIGS) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"connect4: error: config file {tmp_path / 'my.toml'}: run.steps: expected an integer, got 2.5"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("path", sorted((CONFIGS.parent).glob("*/*.toml")), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_preset_reads_as_its_script_would(path):
    """Each TOML preset under experiments/configs/<script>/ parses over that script's default into a valid config."""
    cfg = job.parse_job(["--preset", path.stem], path.parent).config
    assert isinstance(cfg, JobConfig)


def test_a_path_is_kept_absolute_whether_a_file_or_a_flag_names_it(tmp_path, monkeypatch):
    """A file gives a path relative to itself, a flag relative to the working directory; config.json records both
    absolute, so a resume or an evaluation from another directory finds the same folder."""
    (tmp_path / "bases" / "mine").mkdir(parents=True)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "my.toml").write_text('[model]\nhf_checkpoint = "../bases/mine"\n')
    monkeypatch.chdir(tmp_path)
    want = str(tmp_path.resolve() / "bases" / "mine")
    from_file = job.parse_job(["--config", "conf/my.toml"], CONFIGS)
    from_flag = job.parse_job(["--model.hf-checkpoint", "bases/mine"], CONFIGS)
    assert from_file.config.model.hf_checkpoint == from_flag.config.model.hf_checkpoint == want
    assert from_flag.typed[("model", "hf_checkpoint")] == want
    assert job.parse_job(["--model.hf-checkpoint", ""], CONFIGS).config.model.hf_checkpoint == ""  # none stays none


def test_a_run_saved_with_a_relative_base_resumes_when_the_same_folder_is_typed_again(tmp_path, monkeypatch):
    import json

    from earl_jax.cli import ConfigError

    (tmp_path / "bases" / "mine").mkdir(parents=True)
    (tmp_path / "bases" / "other").mkdir()
    run = tmp_path / "run"
    (run / "checkpoints" / "1").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    saved = job.parse_job(["--model.hf-checkpoint", "bases/mine", "--run-dir", str(run)], CONFIGS).config.to_dict()
    saved["model"]["hf_checkpoint"] = "bases/mine"  # as runs started before typed paths were kept absolute have it
    (run / "config.json").write_text(json.dumps(saved))
    monkeypatch.setattr("earl_jax.rl.loop.checkpoint.has_checkpoint", lambda d: True)
    again = ["--run-dir", str(run), "--resume", "--model.hf-checkpoint"]
    cfg, _ = job.resume_config(job.parse_job(again + ["bases/mine"], CONFIGS), "connect4")
    assert cfg.model.hf_checkpoint == "bases/mine"
    with pytest.raises(ConfigError, match="--model.hf-checkpoint: the run was started with 'bases/mine'"):
        job.resume_config(job.parse_job(again + ["bases/other"], CONFIGS), "connect4")
