"""The pod preset (model, batch and prompts sized for the machine) and the bad input it and the layouts refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from earl_jax.cli import ConfigError
from earl_jax.models.model_config import get_config
from earl_jax.parallel.memory import GiB
from earl_jax.parallel.planner import StagePlanner
from earl_jax.rl.job.entry import parse_job
from earl_jax.rl.job.pod import POD_MODELS, PodTooSmallError, pod_preset, train_fit
from earl_jax.rl.loop.checkpoint import Checkpointer
from earl_jax.rl.loop.trainer import Trainer
from jobs import job, with_fields

CONFIGS = Path(__file__).resolve().parents[3] / "experiments" / "configs"
CONNECT4 = parse_job([], CONFIGS / "connect4").config  # the scripts' defaults (what runs with no flags)
TICTACTOE = parse_job([], CONFIGS / "tictactoe").config
GAME_VOCAB = 101


def _fits(name: str, n: int, gib: float) -> bool:
    return train_fit(get_config(name, vocab_size=GAME_VOCAB), n, int(gib * GiB), 4096).fits


@pytest.mark.parametrize("n, gib, model", [(1, 80, "qwen2.5-1.5b"), (4, 80, "qwen2.5-7b"), (8, 141, None)])
def test_pod_preset_picks_the_largest_model_whose_train_stage_fits(n, gib, model):
    cfg = pod_preset(n, int(gib * GiB), base=CONNECT4)
    name = cfg.model.name
    if model is not None:
        assert name == model
    i = POD_MODELS.index(name)
    assert _fits(name, n, gib) and (i + 1 == len(POD_MODELS) or not _fits(POD_MODELS[i + 1], n, gib))
    assert POD_MODELS.index(name) >= POD_MODELS.index("qwen2.5-14b") or n < 8  # 8 x 141 GiB: 14B or more
    assert cfg.batch_size % n == 0 and cfg.batch_size == 16 * n and cfg.rollout.group_size == 8
    assert (cfg.model.dtype, cfg.env.prompt_style, cfg.model.hf_checkpoint, cfg.env.game) == (
        "bfloat16", "compact", None, "connect_four")
    assert cfg.rollout.max_turn_tokens < cfg.rollout.max_context


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
    cfg = pod_preset(1, 80 * GiB, str(folder), base=TICTACTOE)
    assert (cfg.model.hf_checkpoint, cfg.model.name, cfg.env.prompt_style, cfg.env.game) == (
        str(folder), "qwen2.5-0.5b", "chat", "tic_tac_toe")
    assert cfg.sft.steps == 0 and cfg.optim.learning_rate <= 1e-5
    with pytest.raises(PodTooSmallError, match=r"too small for --model.hf-checkpoint .*qwen2\.5-7b"):
        pod_preset(1, 80 * GiB, str(_checkpoint(tmp_path, "qwen2.5-7b")))


def test_pod_preset_from_the_command_line():
    # this machine's 8 fake CPU devices, the first 2 of them, 80 GiB each; later flags still override
    parsed = parse_job(["--preset", "pod", "--devices", "2", "--planner.memory-budget-gib", "80", "--steps", "3"],
                       CONFIGS / "connect4")
    cfg = parsed.config
    assert (cfg.model.name, cfg.batch_size, cfg.run.steps, cfg.planner.devices) == ("qwen2.5-3b", 32, 3, 2)
    assert parsed.typed[("model", "name")] == "qwen2.5-3b"  # what the preset chose is typed: --resume keeps it
    with pytest.raises(ConfigError) as e:  # before any compile: one line naming the memory and the need
        parse_job(["--preset", "pod", "--planner.memory-budget-gib", "0.25"], CONFIGS / "connect4")
    msg = str(e.value)
    assert msg.startswith("--preset pod: 8 devices x 0.2 GiB is too small for any pod model") and "qwen2.5-0.5b" in msg
    assert "\n" not in msg


SMALL = job(groups=2, group_size=2, devices=4, max_context=128, max_turns=2, sft__steps=0)


@pytest.mark.parametrize("flag, value, message", [
    ("rollout_thresholds", "0:d1f1t3", "--planner.rollout-thresholds: d1f1t3 uses 3 devices; the job has 4"),
    ("rollout_thresholds", "0:d2f2t1", "--planner.rollout-thresholds: d2f2t1 has fsdp=2; only train and sft meshes"),
    ("experience_thresholds", "0:d4f1t1,64:d1f1t3", "--planner.experience-thresholds: d1f1t3 uses 3 devices"),
    ("train_thresholds", "0:d1f1t8", "--planner.train-thresholds: d1f1t8 uses 8 devices"),
    ("rollout_thresholds", "0:d4x1", "--planner.rollout-thresholds: '0:d4x1' is not CONTEXT:MESH"),
])
def test_a_layout_that_does_not_fit_the_job_is_refused_naming_the_flag(tmp_path, flag, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        # refused when the config is made (a malformed threshold) or while planning, before anything compiles
        Trainer(with_fields(SMALL, run_dir=str(tmp_path / "run"), **{flag: value}), log=False)
    assert any(says in str(e.value) for says in ("valid", "such as"))  # and what would be accepted


def test_a_layout_that_does_not_divide_the_heads_or_the_batch_is_refused():
    tiny = get_config("tiny", vocab_size=GAME_VOCAB)  # 4 query heads, 2 key/value heads
    planner = lambda cfg: StagePlanner.from_config(cfg.planner, tiny, cfg.batch_size)  # noqa: E731
    three = with_fields(SMALL, devices=3, groups=3, group_size=2, rollout_thresholds="0:d1f1t3")
    with pytest.raises(ValueError, match="d1f1t3 has tensor=3, which does not divide tiny's 4 attention heads"):
        planner(three)
    odd = with_fields(SMALL, groups=3, group_size=2, train_thresholds="0:d1f4t1")  # 6 games on 4 shards
    with pytest.raises(ValueError, match="--planner.train-thresholds: d1f4t1 splits rows over 4 batch shards.*6 games"):
        planner(odd)
    # a vocabulary the tensor degree does not divide (101 tokens over 2) is replicated, not refused
    ok = planner(with_fields(SMALL, rollout_thresholds="0:d2f1t2"))
    assert str(ok.current.rollout.mesh) == "d2f1t2"


def test_no_checkpoints_are_written_with_keep_zero(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=0)
    ckpt.save(1, {"x": 1}, {"step": 1})
    ckpt.close()
    assert ckpt.latest_step() is None and not (tmp_path / "checkpoints").exists()
    with pytest.raises(ConfigError, match="^--run.keep-checkpoints: --resume needs checkpoints"):
        job(keep_checkpoints=0, resume="true")
