"""Convert the config.json of runs written by an earlier version into this version's nested config, once.

    python experiments/upgrade_run.py runs/connect4-old [RUN_DIR ...]

`--resume` and experiments/evaluate_run.py read only the nested config (`JobConfig.to_dict()`); on an older file they
stop with one line naming this script. What it converts:

- the flat config (one dict of field names, before the component configs) into sections, by OLD_NAMES for the fields
  that were renamed and by the field's own name where one component has a field of that name;
- a switch saved as true/false that has more settings now (`resume`, `rollout.compact_finished`).

The old file is kept beside the new one as config.json.bak; a folder whose config.json is current is left as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any, Mapping

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed

# Flat field names of earlier runs whose place is not (the one section with a field of that name, the same name).
OLD_NAMES = {
    "steps": ("run", "steps"), "learning_rate": ("optim", "learning_rate"), "game": ("env", "game"),
    "opponent": ("env", "opponent"), "agent_player": ("env", "agent_player"),
    "prompt_style": ("env", "prompt_style"), "invalid_retries": ("env", "max_retries"),
    "retry_reward": ("env", "retry_reward"), "win_reward": ("env", "win_reward"), "draw_reward": ("env", "draw_reward"),
    "loss_reward": ("env", "loss_reward"), "invalid_reward": ("env", "invalid_reward"),
    "blunder_penalty": ("env", "blunder_penalty"), "blunder_depth": ("env", "blunder_depth"),
    "model": ("model", "name"), "hf_checkpoint": ("model", "hf_checkpoint"), "dtype": ("model", "dtype"),
    "curriculum": ("curriculum", "ladder"), "algorithm": ("loss", "estimator"),
    "rollout_cache_growth": ("rollout", "cache_growth"), "rollout_split_processes": ("rollout", "split_processes"),
    "selector_mode": ("planner", "mode"), "selector_edges": ("planner", "edges"),
    "selector_margin": ("planner", "margin"), "selector_ema": ("planner", "ema"),
    "selector_table": ("planner", "table"),
    "eval_every": ("eval", "every"), "eval_games": ("eval", "games"), "eval_opponents": ("eval", "opponents"),
    "format_warmup_steps": ("sft", "steps"), "format_warmup_games": ("sft", "games"),
}
DROPPED = {"rollout_groups", "rollout_device_groups"}  # options that no longer exist: their value is left out


class UpgradeError(ValueError):
    """A config.json this script cannot convert: one line naming the field."""


def _fields() -> dict[tuple[str, ...], Any]:
    from earl_jax.cli import fields_of
    from earl_jax.rl.loop.job_config import JobConfig

    return {f.path: f.type for f in fields_of(JobConfig())}


def nested(flat: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A flat config as sections, and the names of the options left out."""
    types = _fields()
    by_name: dict[str, list[tuple[str, ...]]] = {}
    for path in types:
        by_name.setdefault(path[-1], []).append(path)
    out: dict[str, Any] = {}
    dropped = []
    for k, v in flat.items():
        path = OLD_NAMES.get(k) or (by_name[k][0] if len(by_name.get(k, ())) == 1 else None)
        if path is None:
            if k not in DROPPED:
                raise UpgradeError(f"field {k!r} of an earlier version has no place in this one")
            dropped.append(k)
            continue
        if k == "algorithm" and v == "ppo":
            raise UpgradeError("algorithm 'ppo' (GAE without a critic) no longer exists: start a new run")
        out.setdefault(path[0], {})[path[1]] = v
    return out, dropped


def upgrade(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`config` (a config.json's content, of any earlier version) as this version writes it, and what was changed."""
    notes = []
    if any(isinstance(v, dict) for v in config.values()):
        out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    else:
        out, dropped = nested(config)
        notes.append("flat keys -> sections")
        notes += [f"{k} left out (no longer an option)" for k in dropped]
    types = _fields()
    for section, sub in out.items():
        for name, v in (sub.items() if isinstance(sub, dict) else ()):
            tp = types.get((section, name))
            if isinstance(v, bool) and typing.get_origin(tp) is typing.Literal:
                sub[name] = "true" if v else "false"
                notes.append(f"{section}.{name}: {str(v).lower()} -> \"{sub[name]}\"")
    return out, notes


def upgrade_run(run_dir: Path) -> str:
    """Convert `run_dir`/config.json in place (the old one kept as config.json.bak); the line to print."""
    from earl_jax.cli import ConfigError
    from earl_jax.rl.loop.job_config import JobConfig, OldRunConfig

    path, backup = run_dir / "config.json", run_dir / "config.json.bak"
    if not path.is_file():
        raise UpgradeError(f"{run_dir}: no config.json (not a run folder)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UpgradeError(f"{path}: not valid JSON ({e})") from None
    try:
        JobConfig.from_dict(config)
        return f"{run_dir}: config.json is current, nothing to do"
    except OldRunConfig:
        pass
    except ConfigError as e:
        raise UpgradeError(f"{path}: {str(e).removeprefix('config.json: ')}") from None
    try:
        new, notes = upgrade(config)
        JobConfig.from_dict(new)
    except UpgradeError as e:
        raise UpgradeError(f"{path}: {e}") from None
    except ConfigError as e:
        raise UpgradeError(f"{path}: converted, it still does not load: {str(e).removeprefix('config.json: ')}"
                           ) from None
    if backup.exists():
        raise UpgradeError(f"{backup} exists already: move it away first (this script keeps the old config there)")
    path.replace(backup)
    path.write_text(json.dumps(new, indent=1))
    return f"{run_dir}: config.json converted ({'; '.join(notes)}); the old one is {backup.name}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run folders (each with a config.json)")
    args = p.parse_args(argv)
    status = 0
    for run_dir in args.run_dirs:
        try:
            print(upgrade_run(run_dir))
        except UpgradeError as e:
            print(f"upgrade_run: error: {e}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
