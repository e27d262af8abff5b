"""Per-iteration seconds of two side-by-side runs of `run_on_device.sh steady` (A, B) ->
experiments/results/<name>.{json,png}.

    python experiments/lab/summarize_steady.py DIR --name steady_packing_nvidia_h100x2 --a "label of A" \
        --b "label of B"
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("time/iteration_s", "time/rollout_s", "time/experience_s", "time/train_s", "time/compile_s", "compile/lowered",
        "compile/ahead", "compile/ahead_submitted", "compile/ahead_used", "compile/slowest")


def per_iteration_bars(path: Path, series: dict[str, list[tuple[int, float]]], ylabel: str, title: str) -> None:
    """Side-by-side bars per iteration, one colour per series ({label: [(step, seconds), ...]}), log scale."""
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    for k, (label, points) in enumerate(series.items()):
        ax.bar([step + (k - 0.5) * 0.38 for step, _ in points], [v for _, v in points], width=0.38, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--name", required=True)
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--device", default="2 x NVIDIA H100 80GB HBM3 (one GPU per run, side by side)")
    args = ap.parse_args(argv)
    runs = {}
    for side, label in (("a", args.a), ("b", args.b)):
        rows = [json.loads(l) for l in (args.dir / f"steady_{side}.jsonl").read_text().splitlines()]
        runs[label] = [{"step": r["step"], **{k: r.get(k) for k in KEYS}} for r in rows if "time/rollout_s" in r]
    total = {label: {"iteration_1_s": round(rows[0]["time/iteration_s"], 2),
                     "iterations_2_on_s": round(sum(r["time/iteration_s"] for r in rows[1:]), 2),
                     "rollout_2_on_s": round(sum(r["time/rollout_s"] for r in rows[1:]), 2),
                     "experience_train_2_on_s": round(sum(r["time/experience_s"] + r["time/train_s"]
                                                          for r in rows[1:]), 2)}
             for label, rows in runs.items()}
    result = {"device": args.device, "script": "experiments/benchmarks/run_on_device.sh steady",
              "job": "512 compact free-text games, tiny model, empty compile cache", "totals": total,
              "iterations": runs}
    out = ROOT / "experiments" / "results" / args.name
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    per_iteration_bars(out.with_suffix(".png"), {
        f"{label} (iterations 2-{rows[-1]['step']}: {total[label]['iterations_2_on_s']} s)":
            [(r["step"], r["time/iteration_s"]) for r in rows] for label, rows in runs.items()},
        "iteration seconds (log)", f"{result['job']}; {args.device}")
    print(json.dumps(total))
    return result


if __name__ == "__main__":
    main()
