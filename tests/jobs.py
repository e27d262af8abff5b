"""Short JobConfigs for tests, by field name: `job(groups=4, run__steps=3)` sets rollout.groups and run.steps.

A name is `section__field` (`eval__games=8`), or a field's own name where no other component has a field of that name
(`groups`, `max_context`, `devices`); `steps` (run and sft) and the like must say their section."""

from __future__ import annotations

import collections
import functools
from typing import Any

from earl_jax.cli import fields_of, replace_paths
from earl_jax.rl.loop.job_config import JobConfig

# tests' usual settings: quiet, no wandb
QUIET = dict(run__progress=False, run__wandb_mode="disabled")
# tests' jobs run the nano shape (~21K parameters: steps ~1/6 of the tiny model's); a test of a shape names its own
MODEL = dict(model__name="nano")


@functools.cache
def _fields() -> tuple[dict[tuple[str, ...], Any], dict[str, list[tuple[str, ...]]]]:
    by_name: dict[str, list[tuple[str, ...]]] = collections.defaultdict(list)
    fields = {f.path: f for f in fields_of(JobConfig())}
    for path in fields:
        by_name[path[-1]].append(path)
    return fields, dict(by_name)


def _path(name: str) -> tuple[str, ...]:
    fields, by_name = _fields()
    if "__" in name:
        path = tuple(name.split("__"))
        if path not in fields:
            raise TypeError(f"jobs: no field {'.'.join(path)}")
        return path
    paths = by_name.get(name, [])
    if len(paths) != 1:
        where = " or ".join("__".join(p) for p in paths) or "no field of that name"
        raise TypeError(f"jobs: {name!r} is not one field's name ({where})")
    return paths[0]


def with_fields(cfg: JobConfig, **fields: Any) -> JobConfig:
    """`cfg` with the named fields replaced (each component rebuilt once, so its checks see all its new fields)."""
    values = {}
    for name, v in fields.items():
        path = _path(name)
        if isinstance(v, list):
            v = tuple(v)
        if path == ("run", "resume") and isinstance(v, bool):
            v = "true" if v else "false"
        values[path] = v
    return replace_paths(cfg, values)


def job(**fields: Any) -> JobConfig:
    """JobConfig() (the library defaults, not a script's preset) with `fields`, quiet unless given."""
    return with_fields(JobConfig(), **{**QUIET, **MODEL, **fields})


# a three-iteration game job on two devices, evaluating and checkpointing every two iterations
SMALL = job(groups=4, group_size=2, run__steps=3, eval__every=2, eval__games=8, sft__steps=1, devices=2,
            checkpoint_every=2, max_turns=6, max_context=256, micro_batch_tokens=1024)
