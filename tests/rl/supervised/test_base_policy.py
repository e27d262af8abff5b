"""A base policy folder (made by experiments/pretrain.py) sets what it was trained for in the job: its prompt style and
move mode unless typed; a base for another game, or a typed setting it was not trained with, is one line at start."""

from __future__ import annotations

import tomllib
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from earl_jax.cli import ConfigError
from earl_jax.models.export import save_pretrained
from earl_jax.models.model_config import get_config
from earl_jax.models.qwen2 import Qwen2
from earl_jax.models.tokenizer import game_tokenizer
from earl_jax.rl.job import entry as job
from earl_jax.rl.job.validate import apply_base

CONFIGS = Path(__file__).resolve().parents[3] / "experiments" / "configs"


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Path:
    tok = game_tokenizer()
    cfg = get_config("tiny", vocab_size=tok.get_vocab_size())
    folder = tmp_path_factory.mktemp("base") / "connect4"
    save_pretrained(Qwen2(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32), None, cfg, tok, folder,
                    {"game": "connect_four", "prompt_style": "compact", "move_mode": "free", "command": "test"})
    return folder


def _parsed(flags, game="connect4"):
    return job.parse_job(flags, CONFIGS / game)


def test_a_base_sets_its_prompt_style_and_move_mode(base):
    parsed = _parsed(["--model.hf-checkpoint", str(base)])
    assert parsed.config.rollout.constrain_moves  # the CPU default's
    cfg = apply_base(parsed.config, parsed.typed)
    assert (cfg.env.prompt_style, cfg.rollout.constrain_moves, cfg.sft.steps) == ("compact", False, 0)


def test_a_typed_setting_the_base_was_not_trained_with_is_refused(base):
    parsed = _parsed(["--model.hf-checkpoint", str(base), "--rollout.constrain-moves", "true"])
    with pytest.raises(ConfigError, match="--rollout.constrain-moves: True, but the base .* was trained with False"):
        apply_base(parsed.config, parsed.typed)


def test_a_base_for_another_game_is_refused(base):
    parsed = _parsed(["--model.hf-checkpoint", str(base)], game="tictactoe")
    with pytest.raises(ConfigError, match="a base for connect_four, not for --env.game tic_tac_toe"):
        apply_base(parsed.config, parsed.typed)


def test_a_config_file_names_its_base_relative_to_itself(base, tmp_path):
    preset = base.parent / "preset.toml"
    preset.write_text(f'[model]\nhf_checkpoint = "{base.name}"\n')
    parsed = _parsed(["--config", str(preset)])
    assert parsed.config.model.hf_checkpoint == str(base.resolve())
    # a base a config file names is the user's choice, as a typed one: a setting it was not made for is refused,
    # where a --preset's base is dropped for random weights (the test below)
    parsed = _parsed(["--config", str(preset), "--rollout.constrain-moves", "true"])
    assert not parsed.by_preset
    with pytest.raises(ConfigError, match="--rollout.constrain-moves: True, but the base"):
        apply_base(parsed.config, parsed.typed, parsed.by_preset)


def test_the_default_starts_from_the_shipped_base_and_what_it_was_not_made_for_from_random_weights():
    shipped = CONFIGS.parent / "bases" / "connect4"
    parsed = _parsed([])
    assert Path(apply_base(parsed.config, parsed.typed).model.hf_checkpoint) == shipped.resolve()
    gpu = _parsed(["--preset", "gpu"])  # the GPU preset starts from its own base (the 4.8M one, minimal prompts)
    assert Path(apply_base(gpu.config, gpu.typed, gpu.by_preset).model.hf_checkpoint) == shipped.with_name(
        "connect4_small").resolve()
    for flags in (["--model", "small"], ["--preset", "gpu", "--env.prompt-style", "compact"],
                  ["--model.hf-checkpoint", ""], ["--preset", "gpu", "--model", "tiny"],
                  ["--preset", "gpu", "--rollout.constrain-moves", "false"],
                  ["--rollout.constrain-moves", "false"], ["--preset", "earl"]):  # what the base was not made for
        parsed = _parsed(flags)
        assert not apply_base(parsed.config, parsed.typed, parsed.by_preset).model.hf_checkpoint, flags
    default_kl = tomllib.loads((CONFIGS / "tictactoe" / "tiny-cpu.toml").read_text())["loss"]["kl_coef"]
    assert default_kl > 0
    for flags, kl in (([], default_kl), (["--preset", "gpu"], 0.0), (["--model.hf-checkpoint", ""], 0.0),
                      (["--model.hf-checkpoint", "", "--loss.kl-coef", "0.2"], 0.2)):  # random weights: no reference
        parsed = _parsed(flags, "tictactoe")  # its default holds the policy near the base with a KL term
        assert apply_base(parsed.config, parsed.typed).loss.kl_coef == kl, flags
    parsed = _parsed(["--model", "small", "--model.hf-checkpoint", str(shipped)])  # typed together: the checkpoint
    assert apply_base(parsed.config, parsed.typed).model.hf_checkpoint == str(shipped.resolve())
