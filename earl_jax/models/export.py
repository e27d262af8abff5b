"""A trained policy as a Hugging Face folder the loader reads back (`--model.hf-checkpoint DIR`), plus what it is.

    save_pretrained(policy.graphdef, state.params, policy.model_cfg, policy.tokenizer, "bases/connect4",
                    {"game": "connect_four", "prompt_style": "minimal", "move_mode": "constrained",
                     "command": "python experiments/pretrain.py ..."}, dtype="bfloat16")

writes config.json, model.safetensors (float32 or bfloat16), tokenizer.json (loader.save_pretrained: the inverse of
the loader's name table) and earl_base.json. earl_base.json says what the weights are for, so a job does not take a
base for a chat model: the game, the prompt style and the move mode (constrained / free) it was trained in, the
command that made it, and its measured held-out move accuracy and evaluation results. `read_base_info(folder)`
returns it (None for any other Hugging Face folder).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from earl_jax.models.model_config import ModelConfig

BASE_INFO = "earl_base.json"
BASE_FORMAT = "earl-base/1"
REQUIRED = ("game", "prompt_style", "move_mode", "command")
MOVE_MODES = ("constrained", "free")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def save_pretrained(graphdef_or_model: Any, params: nnx.State | None, model_cfg: ModelConfig, tokenizer,
                    folder: str | Path, metadata: Mapping[str, Any], *, dtype: str = "float32") -> Path:
    """Write the policy (a model, or a graphdef and its params, on any mesh) and `metadata` into `folder`; returns the
    folder. `metadata` needs game, prompt_style, move_mode (constrained or free) and command; other JSON keys
    (held_out_accuracy, eval, ...) are kept. Every process must call it with several processes; process 0 writes."""
    from earl_jax.models.loader import save_pretrained as save_hf

    if dtype not in DTYPES:
        raise ValueError(f"save_pretrained: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    info = base_info(metadata)
    model = graphdef_or_model if params is None else nnx.merge(graphdef_or_model, params)
    if model.cfg.replace(name=model_cfg.name) != model_cfg:
        raise ValueError(f"save_pretrained: the model is {model.cfg}, not the model_cfg given ({model_cfg})")
    folder = Path(folder)
    save_hf(model, folder, tokenizer, dtype=None if dtype == "float32" else DTYPES[dtype])
    if jax.process_index() == 0:
        (folder / BASE_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return folder


def base_info(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """earl_base.json's content: `metadata` checked (the required keys, a known move mode, JSON values)."""
    missing = [k for k in REQUIRED if k not in metadata]
    if missing:
        raise ValueError(f"earl_base.json: metadata lacks {', '.join(missing)} (needs {', '.join(REQUIRED)})")
    if metadata["move_mode"] not in MOVE_MODES:
        raise ValueError(f"earl_base.json: move_mode must be one of {MOVE_MODES}, got {metadata['move_mode']!r}")
    info = {"format": BASE_FORMAT, **{k: _plain(v) for k, v in metadata.items()}}
    json.dumps(info)  # a value JSON cannot hold fails here, naming nothing half-written
    return info


def read_base_info(folder: str | Path) -> dict[str, Any] | None:
    """A base's earl_base.json as a dict; None when the folder has none (a plain Hugging Face model)."""
    path = Path(folder) / BASE_INFO
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(info, dict) or info.get("format") != BASE_FORMAT:
        raise ValueError(f"{path}: not an earl base description (format {BASE_FORMAT!r} expected)")
    return info


def _plain(v: Any) -> Any:
    """numpy scalars and arrays as JSON numbers and lists, tuples as lists, recursively."""
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v
