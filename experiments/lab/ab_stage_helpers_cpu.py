"""Which programs an iteration still traces in the foreground with compiling ahead on (CPU): the `connect4.py` job
(128 compact games, 8 iterations, `--rollout.compile-ahead true`) in this checkout, then per iteration the programs
lowered in the foreground (`compile/lowered`, `compile/slowest`) and those submitted ahead (`compile/ahead`), beside
the runs recorded in the result file (`--against`). Compile seconds are not comparable (a run finds the persistent
cache an earlier one left); the counts are.

    python experiments/lab/ab_stage_helpers_cpu.py                    # run this checkout, add it to the file
    python experiments/lab/ab_stage_helpers_cpu.py --summarize /tmp/helpers_run  # a run folder made earlier
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "experiments" / "results" / "stage_helpers_ahead_cpu.json"

JOB = ["--steps", "8", "--eval.every", "0", "--sft.steps", "5", "--rollout.compile-ahead", "true",
       "--env.prompt-style", "compact", "--rollout.groups", "16", "--rollout.group-size", "8",
       "--run.wandb-mode", "disabled", "--run.progress", "false"]


def summarize(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "compile/lowered" in r:
            rows.append({"step": r["step"], "lowered": r["compile/lowered"], "ahead": r.get("compile/ahead"),
                         "foreground": r.get("compile/slowest", "")})
    return rows


def _revision() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summarize", type=Path, nargs="+", default=None, help="run folders made earlier (run nothing)")
    p.add_argument("--against", type=Path, default=RESULT, help="the result file whose runs this one is shown beside")
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args(argv)
    result = json.loads(args.against.read_text()) if args.against.is_file() else {"runs": {}}
    result.update({"job": "connect4.py " + " ".join(JOB), "machine": f"{os.cpu_count()} CPU cores"})
    new = {str(r): summarize(r) for r in args.summarize or []}
    if not args.summarize:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, str(ROOT / "experiments" / "connect4.py"), *JOB, "--run-dir", tmp],
                           cwd=ROOT, check=True, capture_output=True)
            new[f"this checkout: {_revision()}"] = summarize(Path(tmp))
    result["runs"].update(new)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r, rows in result["runs"].items():
        print(r, [row["lowered"] for row in rows])
    return result


if __name__ == "__main__":
    main()
