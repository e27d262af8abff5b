"""models/export.save_pretrained: a policy exported as a Hugging Face folder loads back (loader.from_pretrained, and
the job's --model.hf-checkpoint) with the same logits; earl_base.json says what the base is; bad metadata is refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.models.export import BASE_INFO, read_base_info, save_pretrained
from earl_jax.models.loader import from_pretrained
from earl_jax.models.model_config import get_config
from earl_jax.models.qwen2 import Qwen2
from earl_jax.models.tokenizer import game_tokenizer

META = {"game": "connect_four", "prompt_style": "minimal", "move_mode": "constrained",
        "command": "python experiments/pretrain.py --game connect4", "held_out_accuracy": np.float32(0.5),
        "eval": {"random": {"win_rate": 0.75}}}


def tiny():
    tok = game_tokenizer()
    cfg = get_config("tiny", vocab_size=tok.get_vocab_size())
    model = Qwen2(cfg, rngs=nnx.Rngs(3), dtype=jnp.float32, param_dtype=jnp.float32)
    # a trained model's norms are not all ones: make every parameter matter for the comparison
    graphdef, params = nnx.split(model)
    params = jax.tree.map(lambda p: p + 0.01 * jax.random.normal(jax.random.key(1), p.shape, p.dtype), params)
    return graphdef, params, cfg, tok


def logits(graphdef, params, tokens):
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)[0])(params, tokens))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(4, 90, (2, 24)), jnp.int32)


def test_export_round_trip_gives_identical_logits(tmp_path):
    graphdef, params, cfg, tok = tiny()
    folder = save_pretrained(graphdef, params, cfg, tok, tmp_path / "base", META)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", BASE_INFO, "model.safetensors",
                                                        "tokenizer.json"]
    model, tok2 = from_pretrained(folder, dtype=jnp.float32)
    g2, p2 = nnx.split(model)
    np.testing.assert_array_equal(logits(g2, p2, TOKENS), logits(graphdef, params, TOKENS))
    assert tok2.to_str() == tok.to_str()
    info = read_base_info(folder)
    assert info["game"] == "connect_four" and info["move_mode"] == "constrained"
    assert info["held_out_accuracy"] == pytest.approx(0.5) and info["eval"]["random"]["win_rate"] == 0.75


def test_bf16_export_is_half_the_size_and_loads_the_rounded_weights(tmp_path):
    graphdef, params, cfg, tok = tiny()
    f32 = save_pretrained(graphdef, params, cfg, tok, tmp_path / "f32", META)
    bf16 = save_pretrained(graphdef, params, cfg, tok, tmp_path / "bf16", META, dtype="bfloat16")
    size = lambda f: (f / "model.safetensors").stat().st_size  # noqa: E731
    assert size(bf16) < 0.51 * size(f32) + 4096
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, _ = from_pretrained(bf16, dtype=jnp.float32)
    rounded = jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(jnp.float32), params)
    np.testing.assert_array_equal(logits(*nnx.split(model), TOKENS), logits(graphdef, rounded, TOKENS))


def test_a_model_object_exports_too_and_a_plain_hf_folder_has_no_base_info(tmp_path):
    graphdef, params, cfg, tok = tiny()
    folder = save_pretrained(nnx.merge(graphdef, params), None, cfg, tok, tmp_path / "m", META)
    assert read_base_info(folder)["command"] == META["command"]
    (folder / BASE_INFO).unlink()
    assert read_base_info(folder) is None


@pytest.mark.parametrize("meta, message", [
    ({**META, "move_mode": "chat"}, "move_mode must be one of"),
    ({k: v for k, v in META.items() if k != "game"}, "lacks game"),
])
def test_bad_metadata_is_one_clear_error_before_anything_is_written(tmp_path, meta, message):
    graphdef, params, cfg, tok = tiny()
    with pytest.raises(ValueError, match=message):
        save_pretrained(graphdef, params, cfg, tok, tmp_path / "x", meta)
    assert not (tmp_path / "x").exists()


def test_a_model_config_that_is_not_the_models_is_refused(tmp_path):
    graphdef, params, cfg, tok = tiny()
    with pytest.raises(ValueError, match="not the model_cfg given"):
        save_pretrained(graphdef, params, cfg.replace(num_hidden_layers=2), tok, tmp_path / "x", META)
