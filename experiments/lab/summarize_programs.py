"""The bounded-programs check of `run_on_device.sh programs` as one JSON and PNG: per iteration of the pod preset, the
seconds, the foreground compile seconds and the seconds spent waiting for programs compiling in the background.

    python experiments/lab/summarize_programs.py --run LABEL DIR [--run LABEL DIR ...] --device nvidia_h200

Each DIR holds pod_cold.jsonl and pod_warm.jsonl (the run folders' metrics.jsonl) and programs.txt (the call's output).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

KEYS = ("time/iteration_s", "time/rollout_s", "time/experience_s", "time/train_s", "time/compile_s",
        "compile/lowered", "time/compile_ahead_waited_s", "compile/slowest")


def load(run_dir: Path) -> dict:
    out = {}
    for phase in ("cold", "warm"):
        rows = [json.loads(line) for line in (run_dir / f"pod_{phase}.jsonl").read_text().splitlines() if line.strip()]
        iters = [r for r in rows if r.get("step", 0) > 0 and "time/rollout_s" in r]
        out[phase] = {"iterations": [{"step": r["step"], **{k: r.get(k) for k in KEYS}} for r in iters],
                      "model_mesh": iters[0].get("parallel/train_mesh") if iters else None,
                      "first_iteration_s": next((r.get("time/command_to_first_iteration_s") for r in iters), None)}
    text = (run_dir / "programs.txt").read_text()
    for phase in ("cold", "warm"):
        m = re.search(rf"=== pod {phase}: rc=\d+ command to iteration (\d+): (\d+) s\n"
                      rf"program lines in the log: (\d+)", text)
        if m:
            out[phase].update(command_to_last_iteration_s=int(m.group(2)), last_iteration=int(m.group(1)),
                              program_log_lines=int(m.group(3)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", nargs=2, action="append", metavar=("LABEL", "DIR"), required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = p.parse_args()
    result = {"device": args.device, "script": "run_on_device.sh programs",
              "runs": {l: load(Path(d)) for l, d in args.run}}
    stem = args.out / f"pod_programs_{args.device}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, phase in zip(axes, ("cold", "warm")):
        for label, run in result["runs"].items():
            its = run[phase]["iterations"][1:]  # after the first: what the check is about
            steps = [r["step"] for r in its]
            ax.plot(steps, [r["time/compile_s"] or 0 for r in its], marker="o", label=f"{label}: foreground compile")
            ax.plot(steps, [r["time/iteration_s"] for r in its], linestyle=":", label=f"{label}: iteration")
        ax.set(title=f"pod preset, {phase} compile cache (iterations 2-10)", xlabel="iteration", ylabel="seconds")
        ax.legend(fontsize=7)
    fig.suptitle(f"programs compiled after the first iteration ({args.device})")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=100)
    print(stem.with_suffix(".json"), stem.with_suffix(".png"))


if __name__ == "__main__":
    main()
