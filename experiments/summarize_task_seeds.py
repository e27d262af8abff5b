"""The table of experiments/task_seeds.sh: per run folder OUT/<preset>-<seed>, the SFT base (step 0's held-out
evaluation), RL's last held-out evaluation, the last training success, and per preset the gain's mean and spread.

    python experiments/summarize_task_seeds.py OUT [--out experiments/results/X.json] [--plot X.png]

--plot draws each preset's held-out success over the run's minutes, one line per seed (the base at 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def run_summary(run: Path) -> dict | None:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("eval/fresh") and "eval/success_rate" in r]
    if len(evals) < 2 or evals[0]["step"] != 0:
        return None
    train = [r["task/success_rate"] for r in rows if "task/success_rate" in r]
    return {"base_success": evals[0]["eval/success_rate"], "rl_success": evals[-1]["eval/success_rate"],
            "rl_eval_turns": evals[-1].get("eval/turns"), "rl_eval_tool_calls": evals[-1].get("eval/tool_calls"),
            "train_success_last10": float(np.mean(train[-10:])) if train else None,
            "iterations": evals[-1]["step"], "elapsed_s": rows[-1].get("time/elapsed_s")}


def plot(out_dir: Path, presets: list[str], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 3.6), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for run in sorted(out_dir.glob(f"{preset}-*")):
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            evals = [r for r in rows if r.get("eval/fresh") and "eval/success_rate" in r]
            minutes = [r.get("time/run_elapsed_s", r.get("time/elapsed_s", 0)) / 60 for r in evals]
            ax.plot(minutes, [r["eval/success_rate"] for r in evals], label=f"seed {run.name.rpartition('-')[2]}")
        ax.set(title=f"--preset {preset}", xlabel="minutes", ylabel="held-out success", ylim=(0, 1))
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path, help="PNG: held-out success over the minutes, per preset and seed")
    a = p.parse_args()
    presets: dict[str, dict] = {}
    for run in sorted(d for d in a.out_dir.iterdir() if d.is_dir()):
        s = run_summary(run)
        if s is not None:
            preset, _, seed = run.name.rpartition("-")
            presets.setdefault(preset, {"seeds": {}})["seeds"][seed] = s
    for v in presets.values():
        gains = [s["rl_success"] - s["base_success"] for s in v["seeds"].values()]
        v.update(gain_mean=float(np.mean(gains)), gain_std=float(np.std(gains)))
        for seed, s in sorted(v["seeds"].items()):
            print(f"seed {seed}: base {s['base_success']:.3f} -> RL {s['rl_success']:.3f} "
                  f"(training success {s['train_success_last10']}, {s['iterations']} iterations)")
    for name, v in presets.items():
        print(f"{name}: RL - base {v['gain_mean']:+.3f} +- {v['gain_std']:.3f} over {len(v['seeds'])} seeds")
    if a.plot:
        plot(a.out_dir, sorted(presets), a.plot)
    if a.out:
        a.out.write_text(json.dumps({"script": "experiments/task_seeds.sh + experiments/summarize_task_seeds.py",
                                     "runs": presets}, indent=1))


if __name__ == "__main__":
    main()
