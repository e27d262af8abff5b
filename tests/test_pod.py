"""The pod preset (model, batch and prompts sized for the machine) and the bad input it and the layouts refuse."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from earl_jax.cli import parse_config
from earl_jax.models.config import get_config
from earl_jax.parallel.memory import GiB
from earl_jax.parallel.planner import StagePlanner
from earl_jax.rl.checkpoint import Checkpointer
from earl_jax.rl.config import RLConfig
from earl_jax.rl.pod import POD_MODELS, PodTooSmallError, pod_preset, train_fit
from earl_jax.rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import connect4  # noqa: E402
import tictactoe  # noqa: E402

GAME_VOCAB = 101


def _fits(name: str, n: int, gib: float) -> bool:
    return train_fit(get_config(name, vocab_size=GAME_VOCAB), n, int(gib * GiB), 4096).fits


@pytest.mark.parametrize("n, gib, model", [(1, 80, "qwen2.5-1.5b"), (4, 80, "qwen2.5-7b"), (8, 141, None)])
def test_pod_preset_picks_the_largest_model_whose_train_stage_fits(n, gib, model):
    cfg = pod_preset(n, int(gib * GiB), base=connect4.DEFAULT)
    if model is not None:
        assert cfg.model == model
    i = POD_MODELS.index(cfg.model)
    assert _fits(cfg.model, n, gib) and (i + 1 == len(POD_MODELS) or not _fits(POD_MODELS[i + 1], n, gib))
    assert POD_MODELS.index(cfg.model) >= POD_MODELS.index("qwen2.5-14b") or n < 8  # 8 x 141 GiB: 14B or more
    assert cfg.batch_size % n == 0 and cfg.batch_size == 16 * n and cfg.group_size == 8
    assert (cfg.dtype, cfg.prompt_style, cfg.hf_checkpoint, cfg.game) == ("bfloat16", "compact", None, "connect_four")
    assert cfg.max_turn_tokens < cfg.max_context


def test_pod_preset_refuses_a_machine_too_small_for_any_model():
    with pytest.raises(PodTooSmallError, match=r"1 device x 3\.0 GiB is too small.*qwen2\.5-0\.5b.*needs 1[0-9.]+ GiB"):
        pod_preset(1, 3 * GiB)


def _checkpoint(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(get_config(name).to_hf_dict()))
    return folder


def test_pod_preset_with_a_checkpoint_trains_that_model_with_chat_prompts(tmp_path):
    folder = _checkpoint(tmp_path, "qwen2.5-0.5b")
    cfg = pod_preset(1, 80 * GiB, str(folder), base=tictactoe.DEFAULT)
    assert (cfg.hf_checkpoint, cfg.model, cfg.prompt_style, cfg.game) == (str(folder), "qwen2.5-0.5b", "chat",
                                                                         "tic_tac_toe")
    assert cfg.format_warmup_steps == 0 and cfg.learning_rate <= 1e-5
    with pytest.raises(PodTooSmallError, match=r"too small for --hf-checkpoint .*qwen2\.5-7b"):
        pod_preset(1, 80 * GiB, str(_checkpoint(tmp_path, "qwen2.5-7b")))


def test_pod_preset_from_the_command_line(capsys):
    # this machine's 8 fake CPU devices, the first 2 of them, 80 GiB each; later flags still override
    cfg = parse_config(RLConfig, ["--preset", "pod", "--devices", "2", "--memory-budget-gib", "80", "--steps", "3"],
                       presets=connect4.PRESETS, base=connect4.DEFAULT)
    assert (cfg.model, cfg.batch_size, cfg.steps, cfg.devices) == ("qwen2.5-3b", 32, 3, 2)
    with pytest.raises(SystemExit):  # before any compile: a clear message naming the memory and the need
        parse_config(RLConfig, ["--preset", "pod", "--memory-budget-gib", "0.25"], presets=connect4.PRESETS)
    err = capsys.readouterr().err
    assert "--preset pod: 8 devices x 0.2 GiB is too small for any pod model" in err and "qwen2.5-0.5b" in err


SMALL = RLConfig(groups=2, group_size=2, devices=4, max_context=128, max_turns=2, progress=False,
                 wandb_mode="disabled", format_warmup_steps=0)


@pytest.mark.parametrize("flag, value, message", [
    ("rollout_thresholds", "0:d1f1t3", "--rollout-thresholds: d1f1t3 uses 3 devices; the job has 4"),
    ("rollout_thresholds", "0:d2f2t1", "--rollout-thresholds: d2f2t1 has fsdp=2; only train meshes"),
    ("experience_thresholds", "0:d4f1t1,64:d1f1t3", "--experience-thresholds: d1f1t3 uses 3 devices"),
    ("train_thresholds", "0:d1f1t8", "--train-thresholds: d1f1t8 uses 8 devices"),
    ("rollout_thresholds", "0:d4x1", "--rollout-thresholds: threshold '0:d4x1'"),
])
def test_a_layout_that_does_not_fit_the_job_is_refused_naming_the_flag(tmp_path, flag, value, message):
    cfg = dataclasses.replace(SMALL, run_dir=str(tmp_path / "run"), **{flag: value})
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        Trainer(cfg, log=False)  # refused while planning, before the model is built or anything compiles
    assert "valid" in str(e.value) or "expected" in str(e.value)


def test_a_layout_that_does_not_divide_the_heads_or_the_batch_is_refused():
    tiny = get_config("tiny", vocab_size=GAME_VOCAB)  # 4 query heads, 2 key/value heads
    three = dataclasses.replace(SMALL, devices=3, groups=3, group_size=2, rollout_thresholds="0:d1f1t3")
    with pytest.raises(ValueError, match="d1f1t3 has tensor=3, which does not divide tiny's 4 attention heads"):
        StagePlanner.from_config(three, tiny)
    odd = dataclasses.replace(SMALL, groups=3, group_size=2, train_thresholds="0:d1f4t1")  # 6 games on 4 shards
    with pytest.raises(ValueError, match="--train-thresholds: d1f4t1 splits rows over 4 batch shards.*6 games"):
        StagePlanner.from_config(odd, tiny)
    # a vocabulary the tensor degree does not divide (101 tokens over 2) is replicated, not refused
    ok = StagePlanner.from_config(dataclasses.replace(SMALL, rollout_thresholds="0:d2f1t2"), tiny)
    assert str(ok.current.rollout.mesh) == "d2f1t2"


def test_no_checkpoints_are_written_with_keep_zero(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=0)
    ckpt.save(1, {"x": 1}, {"step": 1})
    ckpt.close()
    assert ckpt.latest_step() is None and not (tmp_path / "checkpoints").exists()
    with pytest.raises(ValueError, match="--keep-checkpoints: --resume needs checkpoints"):
        RLConfig(keep_checkpoints=0, resume=True)
