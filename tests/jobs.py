"""Short JobConfigs for tests, by field name: `job(groups=4, steps=3)` sets rollout.groups and run.steps.

A name is a field's own name where it is unique across the components (`groups`, `learning_rate`, `devices`), or its
name before the components existed (`eval_games`, `format_warmup_steps`, `curriculum`, `algorithm`: the map in
earl_jax/rl/config.py that also reads old runs' config.json). `section__field` names any field directly
(`eval__games=8`)."""

from __future__ import annotations

from typing import Any

from earl_jax.cli import replace_paths
from earl_jax.rl.config import JobConfig, legacy_to_nested

# tests' usual settings: quiet, no wandb
QUIET = dict(progress=False, wandb_mode="disabled")


def _paths(fields: dict[str, Any]) -> dict[tuple[str, ...], Any]:
    direct = {tuple(k.split("__")): v for k, v in fields.items() if "__" in k}
    nested = legacy_to_nested({k: v for k, v in fields.items() if "__" not in k})
    return {**{(s, f): v for s, sub in nested.items() for f, v in sub.items()}, **direct}


def with_fields(cfg: JobConfig, **fields: Any) -> JobConfig:
    """`cfg` with the named fields replaced (each component rebuilt once, so its checks see all its new fields)."""
    values = _paths(fields)
    for path, v in values.items():
        if isinstance(v, list):
            values[path] = tuple(v)
        if path == ("run", "resume") and isinstance(v, bool):
            values[path] = "true" if v else "false"
    return replace_paths(cfg, values)


def job(**fields: Any) -> JobConfig:
    """JobConfig() (the library defaults, not a script's preset) with `fields`, quiet unless given."""
    return with_fields(JobConfig(), **{**QUIET, **fields})
