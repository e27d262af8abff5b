"""Append pod start-up runs (logs + metrics.jsonl from `run_on_device.sh pod-first-iteration`)
to a results JSON: per run the first-iteration line, iteration lines, first calls and per-iteration compile metrics.

    python experiments/benchmarks/summarize_pod_runs.py RESULTS.json --setting "cold, this commit against .baseline" \
        --device "4 x NVIDIA H100 80GB HBM3" \
        /work/.device/1/pod_base.log ...
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

KEEP = ("time/iteration_s", "time/rollout_s", "time/experience_s", "time/train_s", "time/compile_s", "time/trace_s",
        "time/lower_s", "time/gc_pause_s", "time/gc_s",
        "time/compile_ahead_s", "time/compile_ahead_waited_s", "compile/lowered", "compile/ahead", "compile/slowest")


def summarize(log: Path) -> dict:
    text = log.read_text(errors="replace").splitlines()
    first = [ln for ln in text if "first RL iteration finished" in ln]
    seconds = re.search(r"finished ([\d.]+) s after", first[0]) if first else None
    metrics = log.with_suffix(".jsonl")
    iterations = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            r = json.loads(line)
            if "time/rollout_s" in r:
                iterations.append({"step": r["step"], **{k: (round(r[k], 2) if isinstance(r[k], float) else r[k])
                                                         for k in KEEP if k in r}})
    return {"run": log.stem, "first_iteration_line": first[0][9:] if first else None,
            "command_to_first_iteration_s": float(seconds.group(1)) if seconds else None,
            "iteration_lines": [ln[9:] for ln in text if re.search(r"iteration \d+/\d+:", ln)],
            "first_calls": [ln[9:] for ln in text if "first call" in ln or "evaluation: " in ln and ln.endswith(" s")],
            "iterations": iterations}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path)
    p.add_argument("logs", type=Path, nargs="+")
    p.add_argument("--setting", required=True, help="what the runs compared (the call, the commits, the flags)")
    p.add_argument("--device", required=True)
    args = p.parse_args()
    data = json.loads(args.results.read_text()) if args.results.exists() else {"runs": []}
    data.setdefault("calls", []).append({"setting": args.setting, "device": args.device,
                                          "runs": [summarize(log) for log in args.logs]})
    args.results.write_text(json.dumps(data, indent=1) + "\n")
    for run in data["calls"][-1]["runs"]:
        print(run["run"], run["command_to_first_iteration_s"])


if __name__ == "__main__":
    main()
