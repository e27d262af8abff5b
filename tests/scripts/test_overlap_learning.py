"""experiments/overlap_learning.py: held-out success per trained episode, the runs compared at the same count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(folder: Path, name: str, trained_groups: list[int] | None, evals: dict[int, float]) -> None:
    rows = []
    for step in range(1, 5):
        row = {"step": step, "rollout/tokens": 10}
        if trained_groups is not None:
            row["rollout/trained_groups"] = trained_groups[step - 1]
        rows.append(row)
    rows += [{"step": s, "eval/fresh": True, "eval/success_rate": v} for s, v in evals.items()]
    (folder / f"{name}.metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (folder / f"{name}.config.json").write_text(json.dumps({"rollout": {"groups": 4, "group_size": 2}}))


def test_runs_are_compared_at_the_smallest_final_count_of_trained_episodes(tmp_path):
    # sync trains 4 groups of 2 an iteration: 8, 16, 24, 32 episodes; the partial run 4, 1, 4, 1 groups: 8, 10, 18, 20
    _run(tmp_path, "sync-1", None, {0: 0.2, 2: 0.4, 4: 0.6})
    _run(tmp_path, "both-1", [4, 1, 4, 1], {0: 0.3, 2: 0.5, 4: 0.7})
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(ROOT / "experiments/overlap_learning.py"), str(tmp_path), "--out", str(out)],
                   check=True, capture_output=True)
    r = json.loads(out.read_text())
    assert r["common_episodes"] == 20
    # sync at 20 episodes: between step 2 (16, 0.4) and step 4 (32, 0.6); the partial run at its end
    assert abs(r["runs"]["sync-1"]["success_at_common"] - 0.45) < 1e-9
    assert abs(r["modes"]["sync"]["gain_mean"] - 0.25) < 1e-9 and abs(r["modes"]["both"]["gain_mean"] - 0.4) < 1e-9
    assert r["runs"]["both-1"]["single_group_iterations"] == 2 and out.with_suffix(".png").is_file()
