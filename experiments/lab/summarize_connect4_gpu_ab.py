"""Summarize an issue-14 GPU comparison (`run_on_device.sh connect4`: runs a, b (c, d) side by side, one GPU
each, one device call) into one JSON (summarize_connect4_gpu.summarize per run) and a PNG of both curves.
`--reference RESULT.json LABEL` draws a run of an earlier result beside them (its evaluation points only).

    python experiments/lab/summarize_connect4_gpu_ab.py OUT_DIR --labels "shared seeds" "per-game seeds" \
        --what "--rollout.group-seeds shared vs per_game" \
        --out experiments/results/connect4_gpu_group_seeds_nvidia_h100x2
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

from summarize_connect4_gpu import load, summarize


def plot(runs: dict[str, tuple[list[dict], dict]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for i, (label, (rows, summary)) in enumerate(runs.items()):
        pts = [(c["step"], c["eval/win_rate"]) for c in summary["eval_curve"] if "eval/win_rate" in c]
        a.plot(*zip(*pts), marker=".", ms=3, lw=1, color=f"C{i}", label=f"{label}: greedy vs random")
        for rung, ls in (("alphabeta:1", ":"), ("alphabeta:2", "--")):  # the ladder's rungs, where evaluated
            pts = [(c["step"], c[f"eval_{rung}/win_rate"]) for c in summary["eval_curve"]
                   if c.get(f"eval_{rung}/win_rate") is not None]
            if pts:
                a.plot(*zip(*pts), ls=ls, lw=1, color=f"C{i}", label=f"{label}: greedy vs {rung}")
        it = [r for r in rows if "train/filtered_frac" in r]
        b.plot([r["step"] for r in it], [r["train/filtered_frac"] for r in it], lw=0.8, color=f"C{i}",
               label=f"{label}: train/filtered_frac")
    a.axhline(0.97, color="gray", ls=":", lw=0.8, label="target vs random 0.97")
    b.axhline(0.3, color="gray", ls=":", lw=0.8, label="target filtered_frac 0.3")
    a.set_ylabel("win rate (greedy)")
    b.set_ylabel("share of games in constant groups")
    b.set_xlabel("iteration")
    for ax in (a, b):
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7, loc="best")
    a.set_title(textwrap.fill(title, 110), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path, help="the call's $OUT (runs.tgz unpacked): a/, b/, ... with metrics.jsonl, "
                                                "evaluation.json")
    p.add_argument("--labels", nargs="+", default=["a", "b"], help="one per run, in order a, b, c, d")
    p.add_argument("--what", required=True, help="what differs between the runs")
    p.add_argument("--device", default=None, help="default: OUT_DIR/device.txt")
    p.add_argument("--out", type=Path, required=True, help="path without suffix")
    p.add_argument("--same-gpu", action="store_true",
                   help="the runs shared GPU 0 (run_on_device.sh connect4 with SAME_GPU=1)")
    p.add_argument("--where", default=None, help="how the runs were placed, for the title when not one call's "
                                                 "(e.g. resumed in separate calls)")
    p.add_argument("--reference", nargs=2, metavar=("RESULT_JSON", "LABEL"), default=None,
                   help="an earlier result of this script: its first run is plotted beside these, as LABEL")
    args = p.parse_args(argv)
    device = args.device or (args.out_dir / "device.txt").read_text().strip().split(",")[0]
    runs = {}
    for label, sub in zip(args.labels, "abcd"):  # one label: run a alone
        rows, ev = load(args.out_dir / sub)
        runs[label] = (rows, summarize(rows, ev, device))
    result = {"what": args.what, "device": device, "script": "experiments/benchmarks/run_on_device.sh connect4",
              "runs_shared_one_gpu": args.same_gpu,
              "runs": {label: s for label, (_, s) in runs.items()}}
    plotted = dict(runs)
    if args.reference:  # plotted only; the JSON names the file (its numbers stay where they were measured)
        ref_path, ref_label = Path(args.reference[0]), args.reference[1]
        ref_name, ref = next(iter(json.loads(ref_path.read_text())["runs"].items()))
        plotted[ref_label] = (ref["eval_curve"], ref)  # its curve rows carry train/filtered_frac at each evaluation
        result["reference"] = {"file": str(ref_path), "run": ref_name, "label": ref_label}
    if args.where:
        where = args.where
    elif len(runs) == 1:
        where = f"alone on one {device} (ONLY_A=1)"
    elif args.same_gpu:
        where = f"at once on one {device} (SAME_GPU=1)"
    else:
        where = f"side by side on {device} (one GPU each)"
    result["placement"] = where
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    title = f"connect4 --preset gpu, {args.what}, {where}, {runs[args.labels[0]][1]['train_wall_minutes']:.0f} min"
    if args.reference:
        title += f"; {args.reference[1]}: {result['reference']['file']}"
    plot(plotted, title, args.out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
