"""Iterations and seconds an iteration per curriculum rung of Connect Four runs, from their metrics.jsonl.

    python experiments/lab/summarize_rung_speed.py --device "NVIDIA H200" --run w8=DIR/w8.metrics.jsonl \
        --run w0=DIR/w0.metrics.jsonl --out experiments/results/connect4_search_workers_probe_nvidia_h200.json

Used for the search-workers probe of docs/learning.md (`run_on_device.sh presets`, the runs side by side on one GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summarize(path: Path) -> dict:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    its = [r for r in recs if "time/iteration_s" in r and r.get("curriculum/rung") is not None]
    rungs = {}
    for r in its:
        rungs.setdefault(r["curriculum/rung"], []).append(r)
    return {"iterations": max(r["step"] for r in its),
            "rungs": {str(k): {"opponent": v[0]["curriculum/opponent"], "iterations": len(v),
                               "median_iteration_s": round(statistics.median(r["time/iteration_s"] for r in v), 3)}
                      for k, v in sorted(rungs.items())}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="append", required=True, help="NAME=metrics.jsonl (repeat)")
    p.add_argument("--device", required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    runs = {}
    for item in a.run:
        name, _, path = item.partition("=")
        if not path:
            p.error(f"--run: expected NAME=metrics.jsonl, got {item!r}")
        runs[name] = summarize(Path(path))
    res = {"script": "experiments/lab/summarize_rung_speed.py", "device": a.device, "runs": runs}
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
