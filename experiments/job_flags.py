"""The job flags a benchmark passes to `experiments/connect4.py`, for the checkout that runs them.

Benchmarks write a job's flags flat (`--eval-games 8`, the names the job took before its component configs), since
they also drive older checkouts as baselines. A checkout with component configs (`earl_jax/rl/job.py`) takes
`--eval.games 8`; `for_tree` rewrites the flags for such a checkout, by the same map that reads old runs'
config.json (`earl_jax.rl.config.LEGACY`, else the one component field of that name).

    for_tree(["--eval-games", "8", "--groups", "4", "--steps", "2"], ROOT)
    # -> ["--eval.games", "8", "--rollout.groups", "4", "--steps", "2"]
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

NOT_FIELDS = {"preset", "config", "debug", "help"}  # the job's own options, the same in both forms


def uses_components(tree: str | Path) -> bool:
    """Whether the checkout at `tree` takes component flags (`--run.steps`) rather than flat ones (`--steps`)."""
    return (Path(tree) / "earl_jax" / "rl" / "job.py").exists()


def component_flags(flags: Sequence[str]) -> list[str]:
    """Flat flags (`--eval-games 8`, `--eval-opponents=`) as this checkout's component flags; the job's short aliases
    (`--steps`, `--run-dir`, ...) and its own options stay as they are."""
    from earl_jax.cli import fields_of
    from earl_jax.rl.config import LEGACY, JobConfig
    from earl_jax.rl.job import ALIASES

    paths: dict[str, list[tuple[str, ...]]] = {}
    for f in fields_of(JobConfig()):
        paths.setdefault(f.path[-1], []).append(f.path)
    out = []
    for arg in flags:
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name and "." not in name and name not in NOT_FIELDS and f"--{name}" not in ALIASES:
            key = name.replace("-", "_")
            path = LEGACY.get(key) or (paths[key][0] if len(paths.get(key, ())) == 1 else None)
            if path is None:
                raise ValueError(f"job flag --{name}: no component field of that name in this checkout")
            arg = "--" + ".".join(p.replace("_", "-") for p in path) + eq + value
        out.append(arg)
    return out


def for_tree(flags: Sequence[str], tree: str | Path) -> list[str]:
    """`flags` as the checkout at `tree` takes them."""
    return component_flags(flags) if uses_components(tree) else list(flags)
