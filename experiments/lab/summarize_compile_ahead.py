"""Collect the compile-ahead device calls (run_on_device.sh first-iteration, i.e.
experiments/benchmarks/first_iteration.py --flag rollout.compile-ahead --values false true, then run_on_device.sh
steady) into
experiments/results/compile_ahead_<device>.{json,png}: the cold first iterations, and per iteration of the 512-game
job the rollout seconds and the programs compiled in the foreground, without and with compiling ahead.

    python experiments/lab/summarize_compile_ahead.py --first DIR_OF_CALL_1 --steady DIR_OF_CALL_2 \
        --device nvidia_h100x2
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # summarize_steady.py beside it

from summarize_steady import per_iteration_bars  # noqa: E402

KEYS = ("time/iteration_s", "time/rollout_s", "time/compile_s", "compile/lowered", "compile/ahead",
        "compile/ahead_submitted", "compile/ahead_used", "compile/slowest")


def _pod(log: Path) -> dict:
    """Phase lines of a pod run's log (cut by its timeout before the first iteration finished)."""
    stamp = lambda line: sum(int(x) * m for x, m in zip(line[:8].split(":"), (3600, 60, 1)))  # noqa: E731
    lines = log.read_text().splitlines()
    t0 = stamp(next(l for l in lines if "compile cache:" in l))
    keep = [l for l in lines if re.search(r"evaluation: .*\): |first call|first RL iteration", l)]
    return {"lines": keep, "seconds_after_start": [stamp(l) - t0 for l in keep]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", type=Path, required=True)
    ap.add_argument("--steady", type=Path, required=True)
    ap.add_argument("--device", required=True)
    args = ap.parse_args(argv)
    first = json.loads(next(args.first.glob("first_iteration_compile_ahead_*.json")).read_text())
    steady = {}
    # older results: steady_<mode>.jsonl; run_on_device.sh steady: <side>
    for mode, side in (("false", "a"), ("true", "b")):
        path = args.steady / f"steady_{mode}.jsonl"
        path = path if path.exists() else args.steady / f"steady_{side}.jsonl"
        rows = [json.loads(l) for l in path.read_text().splitlines()]
        steady[mode] = [{"step": r["step"], **{k: r.get(k) for k in KEYS}} for r in rows if "time/rollout_s" in r]
    later = {m: round(sum(r["time/rollout_s"] for r in rows if r["step"] > 1), 2) for m, rows in steady.items()}
    result = {
        "device": f"2 x {first['device']}",
        "scripts": "experiments/benchmarks/run_on_device.sh first-iteration, steady",
        "first_iteration_tiny_512_games": first["runs"],
        "pod_qwen2.5-1.5b_2gpu_cold": {m: _pod(args.first / f"pod_{m}.log") for m in ("false", "true")},
        "steady_512_games_per_iteration": steady,
        "rollout_s_iterations_2_on": later,
    }
    out = ROOT / "experiments" / "results" / f"compile_ahead_{args.device}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    per_iteration_bars(out.with_suffix(".png"), {
        f"--rollout.compile-ahead {mode} (iterations 2-12: {later[mode]} s)":
            [(r["step"], r["time/rollout_s"]) for r in rows]
        for mode, rows in steady.items()}, "rollout seconds (log)",
        f"512 compact free-text games, tiny model, one {first['device']} each, cold compile cache")
    print(json.dumps(later))
    return result


if __name__ == "__main__":
    main()
