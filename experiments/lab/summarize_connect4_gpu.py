"""Summarize the issue-14 GPU run (`run_on_device.sh connect4 MINUTES` with ONLY_A=1) into a JSON file and a PNG plot.

    python experiments/lab/summarize_connect4_gpu.py runs/connect4-gpu \
        --device "NVIDIA H100 80GB HBM3" --out experiments/results/connect4_gpu_nvidia_h100

Reads <run>/metrics.jsonl (one record per iteration; step 0 is the format warm-up's evaluation) and
<run>/evaluation.json (experiments/evaluate_run.py). A resumed run restarts time/elapsed_s in each process,
so the training wall time is the sum of each segment's last time/elapsed_s. The device name is not in the run
folder (the script prints it from nvidia-smi); pass it with --device.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

CURVE_FIELDS = ("eval/win_rate", "eval/invalid_rate", "eval_alphabeta:1/win_rate", "eval_alphabeta:2/win_rate",
                "curriculum/opponent", "curriculum/rung", "curriculum/promotions", "curriculum/eval_win_rate",
                "train/filtered_frac", "train/entropy", "train/grad_norm", "episode/win_rate", "time/iteration_s",
                "time/elapsed_s")


def load(run: Path) -> tuple[list[dict], dict | None]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["step"])
    ev = run / "evaluation.json"
    return rows, json.loads(ev.read_text()) if ev.exists() else None


def segments(rows: list[dict]) -> list[dict]:
    """Process segments (a resume restarts time/elapsed_s): first/last step and training seconds of each."""
    segs, prev = [], None
    for r in rows:
        t = r.get("time/elapsed_s")
        if t is None:
            continue
        if prev is None or t < prev:
            segs.append({"first_step": r["step"], "last_step": r["step"], "train_s": t,
                         "command_to_first_iteration_s": r.get("time/command_to_first_iteration_s")})
        segs[-1].update(last_step=r["step"], train_s=t)
        prev = t
    return segs


def summarize(rows: list[dict], evaluation: dict | None, device: str) -> dict:
    iters = [r for r in rows if "time/iteration_s" in r]
    its = [r["time/iteration_s"] for r in iters]
    segs = segments(rows)
    first_of_seg = {s["first_step"] for s in segs}
    steady = [r["time/iteration_s"] for r in iters if r["step"] not in first_of_seg]  # first ones compile
    curve = [{"step": r["step"], **{k: r[k] for k in CURVE_FIELDS if k in r}} for r in rows if r.get("eval/fresh")]
    promotions, prev = [], 0
    for r in rows:
        p = r.get("curriculum/promotions")
        if p is not None and p > prev:
            promotions.append({"step": r["step"], "promotions": p, "opponent": r.get("curriculum/opponent"),
                               "rung": r.get("curriculum/rung"), "segment_elapsed_s": r.get("time/elapsed_s")})
            prev = p
    last = iters[-1] if iters else {}
    tail = iters[-50:]
    return {
        "device": device,
        "run_dir": evaluation.get("run_dir") if evaluation else None,
        "iterations": last.get("step"),
        "segments": segs,
        "train_wall_minutes": sum(s["train_s"] for s in segs) / 60,
        "time_per_iteration_s": {
            "median_all": statistics.median(its) if its else None,
            "mean_all": statistics.mean(its) if its else None,
            "median_excluding_first_of_each_segment": statistics.median(steady) if steady else None,
            "first_of_each_segment": [r["time/iteration_s"] for r in iters if r["step"] in first_of_seg],
        },
        # the rollout once compiles have settled (the last 3/4 of the iterations): issue 13's 512-game numbers
        "rollout_steady_state": {k: statistics.median(r[k] for r in iters[len(iters) // 4:] if k in r)
                                 for k in ("time/rollout_s", "rollout/env_frac", "time/iteration_s")}
                                if iters else None,
        "curriculum": {"final_opponent": last.get("curriculum/opponent"), "final_rung": last.get("curriculum/rung"),
                       "promotions": promotions},
        "end_of_training": {
            "train/filtered_frac": last.get("train/filtered_frac"),
            "train/filtered_frac_mean_last50": (statistics.mean(r["train/filtered_frac"] for r in tail)
                                                if tail else None),
            "train/entropy": last.get("train/entropy"),
            "episode/win_rate": last.get("episode/win_rate"),
            "zero_grad_iterations": sum(1 for r in iters if r.get("train/grad_norm") == 0.0),
            "first_zero_grad_step": next((r["step"] for r in iters if r.get("train/grad_norm") == 0.0), None),
        },
        "best_eval": {k: max(((c[k], c["step"]) for c in curve if k in c), default=None)
                      for k in ("eval/win_rate", "eval_alphabeta:1/win_rate", "eval_alphabeta:2/win_rate")},
        "eval_curve": curve,
        "final_evaluation": evaluation,
    }


def plot(rows: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = summary["eval_curve"]
    iters = [r for r in rows if "train/filtered_frac" in r]
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for key, label in (("eval/win_rate", "greedy vs random"), ("eval_alphabeta:1/win_rate", "greedy vs alphabeta:1"),
                       ("eval_alphabeta:2/win_rate", "greedy vs alphabeta:2")):
        pts = [(c["step"], c[key]) for c in curve if key in c]
        if pts:
            a.plot(*zip(*pts), marker=".", ms=3, lw=1, label=label)
    a.axhline(0.97, color="C0", ls=":", lw=0.8, label="target vs random 0.97")
    a.axhline(0.7, color="C2", ls=":", lw=0.8, label="target vs alphabeta:2 0.7")
    a.set_ylabel("win rate (128 greedy games)")
    a.set_ylim(-0.02, 1.02)
    b.plot([r["step"] for r in iters], [r["train/filtered_frac"] for r in iters], lw=0.8, label="train/filtered_frac")
    b.plot([r["step"] for r in iters], [r.get("episode/win_rate") for r in iters], lw=0.8, alpha=0.7,
           label="episode/win_rate (sampled, vs current rung)")
    b.axhline(0.3, color="C0", ls=":", lw=0.8, label="target filtered_frac 0.3")
    b.set_ylabel("fraction")
    b.set_xlabel("iteration")
    b.set_ylim(-0.02, 1.02)
    for ax in (a, b):
        for p in summary["curriculum"]["promotions"]:
            ax.axvline(p["step"], color="k", ls="--", lw=0.8)
        for s in summary["segments"][1:]:
            ax.axvline(s["first_step"], color="gray", ls="-.", lw=0.8)
    for p in summary["curriculum"]["promotions"]:
        a.text(p["step"], 1.0, f" -> {p['opponent']}", fontsize=8, va="top")
    for s in summary["segments"][1:]:
        a.text(s["first_step"], 0.9, " resume", fontsize=8, va="top", color="gray")
    a.legend(fontsize=7, loc="center right")
    b.legend(fontsize=7, loc="center right")
    a.set_title(f"connect4 --preset gpu on {summary['device']}: {summary['iterations']} iterations, "
                f"{summary['train_wall_minutes']:.1f} min of training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, nargs="?", default=Path("runs/connect4-gpu"))
    p.add_argument("--device", default="NVIDIA H100 80GB HBM3", help="nvidia-smi's name line from the run's output")
    p.add_argument("--out", type=Path, default=Path("experiments/results/connect4_gpu_nvidia_h100"),
                   help="path without extension: writes .json and .png")
    args = p.parse_args(argv)
    rows, evaluation = load(args.run_dir)
    summary = summarize(rows, evaluation, args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    plot(rows, summary, args.out.with_suffix(".png"))
    print(json.dumps({k: summary[k] for k in ("device", "iterations", "train_wall_minutes", "time_per_iteration_s",
                                              "curriculum", "end_of_training", "best_eval")}, indent=1))
    return summary


if __name__ == "__main__":
    main()
