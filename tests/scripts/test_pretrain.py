"""experiments/pretrain.py at a tiny scale, end to end: expert games, SFT steps whose loss falls, the Hugging Face
folder with earl_base.json, a job that loads it with --model.hf-checkpoint and plays exactly the games the build
reported, and the same command building the same base."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import pretrain  # noqa: E402
from earl_jax.models.export import read_base_info  # noqa: E402
from earl_jax.rl.supervised.expert_games import ExpertGames  # noqa: E402

TINY = ["tictactoe", "--games", "96", "--sft-steps", "8", "--sft-games", "8", "--sft-lr", "1e-2", "--sft-warmup", "1",
        "--accuracy-every", "4", "--accuracy-games", "16", "--devices", "1"]


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    from earl_jax.rl.loop.trainer import Trainer

    def no_trainer(*args, **kwargs):
        raise AssertionError("a base's build constructed an RL Trainer")

    out = tmp_path_factory.mktemp("pretrain")
    with pytest.MonkeyPatch.context() as mp:  # the build runs its SFT and evaluation from a Policy alone
        mp.setattr(Trainer, "__init__", no_trainer)
        result = pretrain.main(TINY + ["--eval-games", "8", "--out", str(out / "base"), "--results", str(out),
                                       "--games-cache", str(out / "games.npz")])
    return out, result


def test_a_tiny_build_trains_measures_and_writes_a_loadable_base(build):
    out, result = build
    loss = result["sft"]["loss"]
    assert len(loss) == 8 and np.mean(loss[-3:]) < np.mean(loss[:3])  # the SFT loss falls
    assert [c["step"] for c in result["accuracy_curve"]] == [0, 4, 8]
    assert 0 <= result["held_out"]["accuracy"] <= 1 and result["held_out"]["moves"] > 0
    assert result["data"]["train"] + result["data"]["held_out"] == result["data"]["unique"] <= 96
    saved = json.loads((out / "pretrain_tictactoe.json").read_text())
    assert saved["eval"] == result["eval"] and (out / "pretrain_tictactoe.png").stat().st_size > 0
    info = read_base_info(out / "base")
    assert (info["game"], info["prompt_style"], info["move_mode"]) == ("tic_tac_toe", "compact", "constrained")
    assert info["command"].startswith("python experiments/pretrain.py tictactoe --games 96")
    assert info["eval"]["random"] == result["eval"]["random"]


def test_the_job_loads_the_base_and_plays_the_games_the_build_reported(build):
    from earl_jax.rl.job.entry import parse_job
    from earl_jax.rl.loop.trainer import Trainer

    out, result = build
    cfg = parse_job(["--model.hf-checkpoint", str(out / "base"), "--eval.games", "8", "--eval.opponents",
                     "random,solver", "--devices", "1", "--run-dir", str(out / "run"), "--run.wandb-mode", "disabled"],
                    ROOT / "experiments" / "configs" / "tictactoe").config
    trainer = Trainer(cfg, log=False)
    assert trainer.policy.model_cfg.num_params() == result["model"]["params"]
    ev = pretrain.evaluation(trainer.evaluate, ("random", "solver"))
    assert ev == result["eval"]  # the same weights play the same greedy games, in the build's evaluator and the job's


def test_the_same_command_builds_the_same_base(build, tmp_path):
    out, _ = build
    pretrain.main(TINY + ["--eval-games", "0", "--out", str(tmp_path / "again"), "--results", str(tmp_path)])
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "base" / "model.safetensors").read_bytes()


def test_a_build_from_saved_games_adds_their_mirror_images_and_learns_best_sets(build, tmp_path):
    out, first = build
    copy = tmp_path / "copy.npz"  # two files are joined (parts searched in parallel): a copy adds no new game
    copy.write_bytes((out / "games.npz").read_bytes())
    result = pretrain.main(TINY + ["--games-from", str(out / "games.npz"), str(copy), "--mirror", "--sft-target",
                                   "best", "--eval-games", "0", "--out", str(tmp_path / "base"), "--results",
                                   str(tmp_path)])
    assert result["expert"]["replayed_from"] == [str(out / "games.npz"), str(copy)]
    assert result["sft"]["target"] == "best"
    data, before = result["data"], first["data"]
    assert (data["unique"], data["held_out"]) == (before["unique"], before["held_out"])  # the same split
    assert before["train"] < data["train"] <= 2 * before["train"]  # the mirror images, less any already there
    # exact: test_expert_replay
    assert len(result["sft"]["loss"]) == 8 and all(0 <= v < 3 for v in result["sft"]["loss"])
    other = ExpertGames.load(out / "games.npz")  # the same games said to be against other opponents
    other.opponents = tuple(f"{o}-other" for o in other.opponents)
    other.save(tmp_path / "other.npz")
    with pytest.raises(SystemExit, match="different opponents or move modes"):  # their indices would mean others
        pretrain.main(TINY + ["--games-from", str(out / "games.npz"), str(tmp_path / "other.npz"), "--out",
                              str(tmp_path / "mixed"), "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match="do not replay as connect_four"):  # Tic-Tac-Toe games for Connect Four
        pretrain.main(["connect4", "--games-from", str(out / "games.npz"), "--devices", "1", "--out",
                       str(tmp_path / "c4"), "--results", str(tmp_path)])


def test_bad_options_fail_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--sft-target best needs constrained moves"):
        pretrain.main(["tictactoe", "--sft-target", "best", "--rollout.constrain-moves", "false", "--devices", "1",
                       "--out", str(tmp_path), "--results", str(tmp_path)])
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(SystemExit, match="--games-from .*bad.npz: not a games file"):
        pretrain.main(["tictactoe", "--games-from", str(tmp_path / "bad.npz"), "--devices", "1", "--out",
                       str(tmp_path), "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match="--games-from .*nothing.npz: no such file"):
        pretrain.main(["tictactoe", "--games-from", str(tmp_path / "nothing.npz"), "--devices", "1", "--out",
                       str(tmp_path), "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match="--sft-games 4 must be a multiple of the 8 devices"):
        pretrain.main(["tictactoe", "--games", "16", "--sft-games", "4", "--devices", "8", "--out", str(tmp_path),
                       "--results", str(tmp_path)])


@pytest.mark.parametrize("flag, value, says", [("--sft-games", "-1", "--sft-games: must be >= 1 (got -1)"),
                                               ("--held-out", "1", "--held-out: must be in [0, 1) (got 1.0)"),
                                               ("--solver", "-2", "--solver: must be >= 0 (got -2)")])
def test_a_count_out_of_range_is_one_line_before_anything_runs(flag, value, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        pretrain.main(["tictactoe", flag, value, "--out", str(tmp_path), "--results", str(tmp_path)])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
