"""The job's planner and policy model, made in the order they need each other: the model's shape, the planner (which
sizes every stage's layout from it), then the model itself, created in the train layout's shardings."""

from __future__ import annotations

from typing import Any

import jax

from earl_jax.models.setup import load_model, model_config
from earl_jax.parallel.planner import StagePlanner
from earl_jax.rollout.sampler import geometric_cache_buckets


def remat_mode(setting: str) -> str:
    """--planner.remat: auto = full per-layer rematerialization on accelerators, none on the CPU."""
    return setting if setting != "auto" else ("none" if jax.default_backend() == "cpu" else "full")


def build_policy(cfg) -> tuple[StagePlanner, Any, Any, Any, tuple[int, ...] | None]:
    """(planner, model config, tokenizer, model, the coarse KV cache sizes or None) for a JobConfig."""
    model_cfg, tokenizer = model_config(cfg.model)
    remat = remat_mode(cfg.planner.remat)
    coarse = geometric_cache_buckets(cfg.rollout.cache_growth) if cfg.rollout.cache_growth else None
    kv_cache_bytes = 4 if cfg.rollout.cache_dtype == "float32" else 2
    planner = StagePlanner.from_config(cfg.planner, model_cfg, cfg.batch_size, remat=remat != "none",
                                       cache_buckets=coarse, kv_cache_bytes=kv_cache_bytes)
    train = planner.stage_run("train")
    model, loaded_tokenizer = load_model(cfg.model, model_cfg, train.mesh, train.rules, cfg.run.seed)
    model.remat = remat == "full"  # a static attribute: part of the graphdef the stages merge
    return planner, model_cfg, loaded_tokenizer or tokenizer, model, coarse
