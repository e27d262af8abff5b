"""The selector sweep's result file from its trial folders (issue 12 item 5): JSON + PNG.

    python experiments/lab/sweep_table.py /tmp/sw1 /tmp/sw2 --device nvidia_h100x4

Each folder is a `sweep.py --out` folder (or the trials.tgz of `run_on_device.sh sweep` unpacked): trial.json per
trial (parameters, status) and the trial's metrics.jsonl. A trial found in several folders keeps its last run.
Every trial is summarized again with `sweep.summarize` (steady iterations: those that compiled nothing), and
each steady iteration is listed with its context and meshes, so layouts compare at the same context.
Writes experiments/results/sweep_selector_<device>.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
from sweep import load_sweep, steady_iterations, summarize  # noqa: E402

KEYS = ("throughput/iteration_tgs", "throughput/rollout_tgs", "throughput/experience_tgs", "throughput/train_tgs",
        "time/iteration_s", "time/dispatch_share", "rollout/context_len_mean", "rollout/turn_context_len_mean",
        "parallel/smoothed_context_len", "parallel/rollout_mesh", "parallel/experience_mesh", "parallel/train_mesh",
        "parallel/train_micro_batch", "compile/programs")


def collect(folders: list[Path], varying: list[str]) -> list[dict]:
    trials = {}
    for folder in folders:
        for done in sorted(folder.glob("t*/trial.json")):
            row = json.loads(done.read_text())
            metrics = done.parent / "metrics.jsonl"
            recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
            its = sorted((r for r in recs if (r.get("step") or 0) > 0 and "time/iteration_s" in r),
                         key=lambda r: r["step"])
            steady = {r["step"] for r in steady_iterations(its)}
            trials[row["trial"]] = {
                "trial": row["trial"], "status": row["status"], "wall_s": row.get("wall_s"),
                "params": {k: row.get(k) for k in varying}, **summarize(done.parent),
                "iterations": [{"step": r["step"], "steady": r["step"] in steady, **{k: r.get(k) for k in KEYS}}
                               for r in its]}
    return sorted(trials.values(), key=lambda t: -(t.get("throughput/iteration_tgs_mean") or 0))


def plot(trials: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for t in trials:
        pts = [(i["rollout/context_len_mean"], i["throughput/iteration_tgs"]) for i in t["iterations"] if i["steady"]]
        if pts:
            p = t["params"]
            label = (f"{t['trial']}: R {p.get('rollout-thresholds') or 'auto'} / "
                     f"E {p.get('experience-thresholds') or 'auto'} / T {p.get('train-thresholds') or 'auto'}, "
                     f"ema {p.get('selector-ema')}")
            ax.plot(*zip(*pts), "o-", label=label)
    ax.set_xlabel("mean game context (tokens)")
    ax.set_ylabel("tokens / GPU / s, whole iteration")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--sweep", type=Path, default=ROOT / "launch" / "sweep_selector.yaml")
    p.add_argument("--device", required=True, help="file name slug, e.g. nvidia_h100x4")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results")
    args = p.parse_args(argv)
    spec = load_sweep(args.sweep)
    varying = [k for k, v in spec["parameters"].items() if "value" not in v]
    trials = collect(args.folders, varying)
    result = {"what": f"{args.sweep.name}: random trials, seed 0; steady = iterations that compiled nothing",
              "device": args.device, "fixed": {k: v["value"] for k, v in spec["parameters"].items() if "value" in v},
              "trials": trials}
    path = args.out / f"sweep_selector_{args.device}.json"
    path.write_text(json.dumps(result, indent=1))
    plot(trials, path.with_suffix(".png"), f"selector sweep, {args.device}: steady iterations")
    for t in trials:
        steady = [(i["step"], round(i["rollout/context_len_mean"]), round(i["throughput/iteration_tgs"]))
                  for i in t["iterations"] if i["steady"]]
        print(t["trial"], t["status"], t["params"], "steady (step, context, tgs):", steady)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
