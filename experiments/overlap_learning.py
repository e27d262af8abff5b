"""Learning per sample with rollouts ahead and partial rollouts against the synchronous loop (issue 47's second
target): held-out success over the episodes each run trained, from runs of the same job and seeds in two modes.

Each run folder's metrics.jsonl (or a file MODE-SEED.metrics.jsonl, as run_on_device.sh presets returns them) gives
the held-out evaluations (`eval/success_rate`, every --eval.every iterations) and the groups trained an iteration
(`rollout/trained_groups`; a partial rollout trains fewer some iterations and carries the rest). The comparison is at
the same trained episodes: each run's held-out success interpolated at the smallest final count of all runs.

    python experiments/overlap_learning.py DIR --modes sync,both --device 'NVIDIA H100' --out experiments/results/X.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone

from earl_jax.rl.loop.metrics import read_metrics  # noqa: E402


def load(path: Path, config: Path) -> dict:
    """One run: `path` its metrics.jsonl, `config` its config.json (the groups an iteration, the group size)."""
    rollout = json.loads(config.read_text())["rollout"]
    group_size = rollout["group_size"]
    rows = read_metrics(path)
    # without a token budget every iteration trains all its groups (the key is logged with partial rollouts only)
    trained = {r["step"]: r.get("rollout/trained_groups", rollout["groups"]) * group_size
               for r in rows if "rollout/tokens" in r}
    steps = sorted(trained)
    cumulative = dict(zip(steps, np.cumsum([trained[s] for s in steps]).tolist()))
    evals = [(r["step"], r["eval/success_rate"]) for r in rows if r.get("eval/fresh") and "eval/success_rate" in r]
    if not evals or evals[0][0] != 0:
        raise SystemExit(f"{path}: no held-out evaluation at step 0 (the base): run with the preset's --eval.every")
    episodes = [0 if s == 0 else cumulative[s] for s, _ in evals]
    return {"episodes": episodes, "success": [v for _, v in evals], "iterations": steps[-1] if steps else 0,
            "carried_over": int(sum(r.get("rollout/carried_over", 0) for r in rows)),
            "single_group_iterations": int(sum(1 for s in steps if trained[s] == group_size))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--modes", default="sync,both")
    p.add_argument("--out", type=Path)
    p.add_argument("--device", default="")
    a = p.parse_args()
    runs = {}
    for mode in a.modes.split(","):
        for f in sorted(a.dir.glob(f"{mode}-*.metrics.jsonl")) + sorted(a.dir.glob(f"{mode}-*/metrics.jsonl")):
            name = f.name.split(".")[0] if f.name != "metrics.jsonl" else f.parent.name
            config = f.parent / "config.json" if f.name == "metrics.jsonl" else f.with_name(f"{name}.config.json")
            runs[name] = {"mode": mode} | load(f, config)
    if not runs:
        raise SystemExit(f"{a.dir}: no MODE-SEED runs for --modes {a.modes}")
    common = min(r["episodes"][-1] for r in runs.values())
    for r in runs.values():
        r["success_at_common"] = float(np.interp(common, r["episodes"], r["success"]))
        r["gain_at_common"] = r["success_at_common"] - r["success"][0]
    modes = {}
    for mode in a.modes.split(","):
        gains = [r["gain_at_common"] for r in runs.values() if r["mode"] == mode]
        modes[mode] = {"gain_mean": float(np.mean(gains)), "gain_std": float(np.std(gains)), "gains": gains}
        print(f"{mode}: held-out success gain over the base at {common} trained episodes "
              f"{modes[mode]['gain_mean']:+.3f} +- {modes[mode]['gain_std']:.3f} ({len(gains)} runs)")
    result = {"script": "experiments/overlap_learning.py", "device": a.device, "common_episodes": common,
              "modes": modes, "runs": runs}
    out = a.out or a.dir / "overlap_learning.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and its .png")


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {}
    for name, r in sorted(result["runs"].items()):
        line, = ax.plot(np.array(r["episodes"]) / 1e3, r["success"], color=colors.get(r["mode"]), lw=1,
                        label=None if r["mode"] in colors else r["mode"])
        colors[r["mode"]] = line.get_color()
    ax.axvline(result["common_episodes"] / 1e3, color="gray", ls=":", lw=1)
    ax.set(xlabel="trained episodes (thousands)", ylabel="held-out success",
           title=f"learning per sample, {result['device']}".strip(", "))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
