"""A run's curves.png from its metrics.jsonl: what a user looks for, six panels.

    evaluation win rate per named opponent | training episodes (return, win rate) | context length
    loss, entropy, KL                      | stage seconds per iteration           | the layouts chosen

    python -m earl_jax.rl.job.plots runs/connect4/metrics.jsonl [out.png]
"""

from __future__ import annotations

import re
from pathlib import Path

from earl_jax.rl.loop.metrics import read_metrics
from earl_jax.sharding.stage_registry import stage_names

_MESH_KEY = re.compile(r"parallel/(\w+)_mesh")


def _stages_with_mesh(rows) -> list[str]:
    """The stages whose mesh the records name: registered ones in their order, then any other (a fork's stage whose
    module this process did not import)."""
    found = {m.group(1) for r in rows for k in r if (m := _MESH_KEY.fullmatch(k))}
    return [s for s in stage_names() if s in found] + sorted(found - set(stage_names()))


def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _evaluations(ax, rows) -> None:
    """One line per evaluation opponent (eval/ is the first of --eval.opponents, eval_<name>/ the others)."""
    fresh = [r for r in rows if r.get("eval/fresh")] or rows  # evaluation points only (older runs: every row)
    keys = sorted({k for r in fresh for k in r if k.endswith("/win_rate") and k.startswith(("eval/", "eval_"))},
                  key=lambda k: (k != "eval/win_rate", k))
    for key in keys:
        name = "first opponent" if key == "eval/win_rate" else key[len("eval_"):-len("/win_rate")]
        ax.plot(*_series(fresh, key), label=name, marker="o", markersize=3)
    rung = _series(rows, "curriculum/rung")
    if rung[0]:
        right = ax.twinx()
        right.step(*rung, where="post", color="gray", alpha=0.4)
        right.set_ylabel("curriculum rung (gray)")
    ax.set(title="greedy win rate per opponent", xlabel="iteration", ylim=(-0.02, 1.02))
    if keys:
        ax.legend(fontsize=7)


def _layouts(ax, rows) -> None:
    """Each stage's mesh over the run, as a step plot over the meshes that occurred (the selector's decisions)."""
    stages = _stages_with_mesh(rows)
    meshes = sorted({r[f"parallel/{s}_mesh"] for r in rows for s in stages if r.get(f"parallel/{s}_mesh")})
    index = {m: i for i, m in enumerate(meshes)}
    for k, s in enumerate(stages):
        pts = [(r["step"], index[r[f"parallel/{s}_mesh"]] + (k - 1) * 0.08) for r in rows
               if r.get(f"parallel/{s}_mesh")]
        if pts:
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=s)
    ax.set_yticks(range(len(meshes)), meshes)
    ax.set(title="layouts chosen (mesh per stage)", xlabel="iteration")
    if meshes:
        ax.legend(fontsize=7)


def plot_run(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if r.get("step") is not None]
    iters = [r for r in rows if r["step"] > 0]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    _evaluations(axes[0, 0], rows)
    ax = axes[0, 1]
    ax.plot(*_series(iters, "episode/return_mean"), label="return")
    ax.plot(*_series(iters, "episode/win_rate"), label="win rate", alpha=0.7)
    ax.set(title="training games", xlabel="iteration")
    ax.legend(fontsize=7)
    ax = axes[0, 2]
    ax.plot(*_series(iters, "rollout/context_len_mean"), label="mean")
    ax.plot(*_series(iters, "rollout/context_len_max"), label="max")
    ax.set(title="episode context length (tokens)", xlabel="iteration")
    ax.legend(fontsize=7)
    ax = axes[1, 0]
    for key, label in (("train/loss", "loss"), ("train/entropy", "entropy"), ("train/kl", "KL to reference")):
        ax.plot(*_series(iters, key), label=label)
    ax.set(title="train stage", xlabel="iteration")
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    for s in [s for s in stage_names() if any(f"time/{s}_s" in r for r in iters)]:
        ax.plot(*_series(iters, f"time/{s}_s"), label=s)
    ax.plot(*_series(iters, "time/compile_s"), label="compiling (any stage)", linestyle=":")
    ax.set(title="seconds per iteration", xlabel="iteration", yscale="log" if iters else "linear")
    ax.legend(fontsize=7)
    _layouts(axes[1, 2], iters)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


if __name__ == "__main__":
    import sys

    print(plot_run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else Path(sys.argv[1]).with_name("curves.png")))
