"""Keep a run as a result: experiments/results/<name>.json (its config, every metrics record, and its
evaluation.json when there is one) and <name>.png (the run's curves.png).

    python experiments/export_run.py runs/connect4 connect4_cpu_default
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export(run_dir: Path, name: str, note: str = "", results: Path = ROOT / "experiments" / "results") -> Path:
    out = results / f"{name}.json"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = {"config": json.loads((run_dir / "config.json").read_text()), "records": records}
    if (run_dir / "evaluation.json").exists():
        result["evaluation"] = json.loads((run_dir / "evaluation.json").read_text())
    if note:
        result["note"] = note
    out.write_text(json.dumps(result, indent=1))
    if (run_dir / "curves.png").exists():
        shutil.copy(run_dir / "curves.png", out.with_suffix(".png"))
    return out


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    print("wrote", export(Path(sys.argv[1]), sys.argv[2], " ".join(sys.argv[3:])))
