"""Learning curves (win rate, return, context length) from a run's metrics.jsonl, as one PNG."""

from __future__ import annotations

from pathlib import Path

from earl_jax.rl.metrics import read_metrics


def plot_run(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if r.get("step") is not None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))

    def series(key):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return ([p[0] for p in pts], [p[1] for p in pts])

    fresh = [r for r in rows if r.get("eval/fresh")] or rows  # evaluation points only (older runs: every row)

    def eval_series(key):
        pts = [(r["step"], r[key]) for r in fresh if r.get(key) is not None]
        return ([p[0] for p in pts], [p[1] for p in pts])

    ax = axes[0]
    for key, label in (("eval/win_rate", "win"), ("eval/draw_rate", "draw"), ("eval/loss_rate", "loss"),
                       ("eval/invalid_rate", "invalid")):
        ax.plot(*eval_series(key), label=label, marker="o")
    ax.set(title="greedy evaluation vs first opponent", xlabel="iteration", ylim=(-0.02, 1.02))
    ax.legend()
    axes[1].plot(*series("episode/return_mean"), label="return (training games)")
    axes[1].plot(*series("episode/win_rate"), label="win rate (training games)", alpha=0.7)
    axes[1].set(title="training episodes", xlabel="iteration")
    axes[1].legend()
    axes[2].plot(*series("rollout/context_len_mean"), label="mean")
    axes[2].plot(*series("rollout/context_len_max"), label="max")
    axes[2].set(title="episode context length (tokens)", xlabel="iteration")
    axes[2].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


if __name__ == "__main__":
    import sys

    print(plot_run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else Path(sys.argv[1]).with_name("curves.png")))
