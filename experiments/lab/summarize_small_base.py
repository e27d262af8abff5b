"""Summarize the small-model Connect Four base probe (docs/learning.md, "A stronger teacher") into JSON and a PNG.

    python experiments/lab/summarize_small_base.py --device "NVIDIA H100 80GB HBM3" \
        --base small_ab5_3500=EVALS1/smab5.json ... --run small91=PROBE/small91.eval.json ... \
        --out experiments/results/connect4_small_base_nvidia_h100

`--base NAME=FILE`: `evaluate_run.py BASE_DIR --out FILE` of a base (the same openings for every base of one call);
`--run NAME=FILE`: the same of an RL run folder (held-out accuracies come from each base's `earl_base.json`, quoted
in the doc); `--group LABEL=RUN,RUN,...`: the mean and population spread of those runs per opponent. The plot shows
each run's greedy win rate per opponent under `--title`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _pairs(items: list[str]) -> dict[str, dict]:
    out = {}
    for item in items:
        name, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"summarize_small_base.py: expected NAME=FILE, got {item!r}")
        d = json.loads(Path(path).read_text())
        out[name] = {"games": d["games"], "step": d["step"], "seed": d["seed"],
                     "win_rate": {o: round(v["win_rate"], 4) for o, v in d["opponents"].items()},
                     "blunder_rate": {o: round(v["blunder_rate"], 4) for o, v in d["opponents"].items()}}
    return out


def _groups(items: list[str], runs: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for item in items:
        label, _, listed = item.partition("=")
        names = listed.split(",")
        if not listed or any(n not in runs for n in names):
            raise SystemExit(f"summarize_small_base.py: --group {item!r} names a run not given by --run")
        members = [runs[n] for n in names]
        out[label] = {"runs": names, **{
            o: {"mean": round(statistics.fmean(m["win_rate"][o] for m in members), 4),
                "std": round(statistics.pstdev([m["win_rate"][o] for m in members]), 4)}
            for o in members[0]["win_rate"]}}
    return out


def _plot(runs: dict[str, dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opponents = [o for o in next(iter(runs.values()))["win_rate"]]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(runs)
    for i, (name, r) in enumerate(runs.items()):
        xs = [j + i * width for j in range(len(opponents))]
        ax.bar(xs, [r["win_rate"].get(o, 0.0) for o in opponents], width, label=f"{name} (it. {r['step']})")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(opponents))], opponents)
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("greedy win rate")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", action="append", default=[], help="NAME=evaluate_run.py JSON of a base")
    ap.add_argument("--run", action="append", default=[], help="NAME=evaluate_run.py JSON of an RL run")
    ap.add_argument("--group", action="append", default=[], help="LABEL=RUN,RUN: mean and spread of those runs")
    ap.add_argument("--device", required=True)
    ap.add_argument("--title", default="4.5 min of --preset gpu RL, four runs sharing one GPU")
    ap.add_argument("--out", required=True, help="path prefix of the .json and .png")
    args = ap.parse_args()
    summary = {"device": args.device, "bases": _pairs(args.base), "runs": _pairs(args.run)}
    summary["groups"] = _groups(args.group, summary["runs"])
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    if summary["runs"]:
        _plot(summary["runs"], f"{args.title} ({args.device})", out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
