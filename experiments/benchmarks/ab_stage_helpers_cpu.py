"""Which programs an iteration still traces in the foreground with compiling ahead on, this checkout against an older
one (CPU): the same `connect4.py` job (128 compact games, 8 iterations, `--compile-ahead true`) in each tree, one after
the other, then per iteration the programs lowered in the foreground (`compile/lowered`, `compile/slowest`) and
those submitted ahead (`compile/ahead`). Compile seconds are not comparable (the second run finds the first's
persistent cache); the counts are.

    git archive OLD | tar -x -C .baseline && python experiments/benchmarks/ab_stage_helpers_cpu.py --trees .baseline .
    python experiments/benchmarks/ab_stage_helpers_cpu.py --summarize /tmp/h_base /tmp/h_new  # run folders already made
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a clone: no install needed

from experiments.job_flags import for_tree  # noqa: E402

JOB = ["--steps", "8", "--eval-every", "0", "--format-warmup-steps", "5", "--compile-ahead", "true", "--prompt-style",
       "compact", "--groups", "16", "--group-size", "8", "--wandb-mode", "disabled", "--progress", "false"]


def summarize(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "compile/lowered" in r:
            rows.append({"step": r["step"], "lowered": r["compile/lowered"], "ahead": r.get("compile/ahead"),
                         "foreground": r.get("compile/slowest", "")})
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", type=Path, nargs="+", default=None)
    p.add_argument("--summarize", type=Path, nargs="+", default=None, help="run folders made earlier (old, new)")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "stage_helpers_ahead_cpu.json")
    args = p.parse_args(argv)
    runs = args.summarize or []
    for tree in args.trees or []:
        run_dir = Path("/tmp") / f"helpers_{tree.resolve().name}"
        subprocess.run([sys.executable, "experiments/connect4.py", *for_tree([*JOB, "--run-dir", str(run_dir)], tree)],
                       cwd=tree,
                       env={**os.environ, "PYTHONPATH": str(tree.resolve())}, check=True, capture_output=True)
        runs.append(run_dir)
    result = {"job": "connect4.py " + " ".join(JOB), "machine": f"{os.cpu_count()} CPU cores",
              "runs": {str(r): summarize(r) for r in runs}}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r, rows in result["runs"].items():
        print(r, [row["lowered"] for row in rows])
    return result


if __name__ == "__main__":
    main()
