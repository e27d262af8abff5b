"""Which policy model a job trains (`ModelSpec`), its architecture, and the model itself on a mesh.

A preset shape without a checkpoint (`--model.name qwen2.5-0.5b`) is a random-init model of that shape that speaks
the built-in game tokenizer: its vocabulary replaces the preset's 152K, so sampled ids always decode. With
`--model.hf-checkpoint DIR`, the folder's config.json, weights and tokenizer.json (nothing is ever downloaded).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from tokenizers import Tokenizer

from earl_jax.cli import field_help as _f
from earl_jax.errors import CheckpointError
from earl_jax.models.model_config import ModelConfig, get_config
from earl_jax.models.tokenizer import game_tokenizer


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """model: which policy model"""

    name: str = _f("tiny", "model shape: nano (tests), tiny, small, qwen2.5-0.5b ... qwen2.5-72b (random init, the "
                           "built-in game tokenizer) unless hf_checkpoint is given; typed over a preset's checkpoint, "
                           "it drops it")
    hf_checkpoint: str | None = _f(None, "local Hugging Face folder (config.json, *.safetensors, tokenizer.json), "
                                         "or a base made by experiments/pretrain.py (with earl_base.json)", path=True)
    dtype: Literal["auto", "float32", "bfloat16"] = _f("auto", "compute dtype; auto = float32 on CPU, bfloat16 on GPU")

    def compute_dtype(self):
        if self.dtype != "auto":
            return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[self.dtype]
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def check_spec(spec: ModelSpec) -> None:
    """Refuse an unknown shape or an unusable checkpoint folder now, before anything is built (one-line errors)."""
    if spec.hf_checkpoint:
        folder = Path(spec.hf_checkpoint)
        if not folder.is_dir():
            raise CheckpointError(f"--model.hf-checkpoint {folder}: no such folder")
        missing = [f for f in ("config.json", "tokenizer.json") if not (folder / f).is_file()]
        if not any(folder.glob("*.safetensors")):
            missing.append("*.safetensors")
        if missing:
            raise CheckpointError(f"--model.hf-checkpoint {folder}: missing {', '.join(missing)} (a Hugging Face "
                                  "model folder holds config.json, *.safetensors and tokenizer.json)")
        ModelConfig.from_hf_json(folder / "config.json")  # raises naming the file when it does not parse
    else:
        get_config(spec.name, vocab_size=game_tokenizer().get_vocab_size())


def model_config(spec: ModelSpec) -> tuple[ModelConfig, Tokenizer | None]:
    """The architecture, and the built-in tokenizer for a preset shape (None: the checkpoint's, loaded with it)."""
    if spec.hf_checkpoint:
        return ModelConfig.from_hf_json(Path(spec.hf_checkpoint) / "config.json"), None
    tokenizer = game_tokenizer()
    return get_config(spec.name, vocab_size=tokenizer.get_vocab_size()), tokenizer


def load_model(spec: ModelSpec, model_cfg: ModelConfig, mesh: Mesh, rules, seed: int) -> tuple[Any, Tokenizer | None]:
    """(model, the checkpoint's tokenizer or None) with every parameter created in its sharding on `mesh`."""
    dtype = spec.compute_dtype()
    if spec.hf_checkpoint:
        from earl_jax.models.loader import from_pretrained

        model, tokenizer = from_pretrained(spec.hf_checkpoint, mesh=mesh, rules=rules, dtype=dtype,
                                           param_dtype=jnp.float32)
        if tokenizer is None:
            raise CheckpointError(f"--model.hf-checkpoint {spec.hf_checkpoint}: no tokenizer.json in the folder")
        return model, tokenizer
    from earl_jax.models.init import init_sharded

    return init_sharded(model_cfg, mesh, rules, seed=seed, dtype=dtype), None
