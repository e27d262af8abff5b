"""Offline sweep runner over a wandb sweep definition (no wandb needed): grid or random search.

    python experiments/sweep.py launch/sweep_learning.yaml --method random --trials 8
    python experiments/sweep.py launch/sweep_selector.yaml --trials 4 --timeout 150     # 4 GPUs (its header)
    python experiments/sweep.py launch/sweep_learning.yaml --trials 4 \
        --launcher "python launch/local.py -n 2 --cpu-devices 4 --"      # each trial as 2 processes

Each trial runs `python <program> --run-dir <out>/<trial> --NAME=VALUE ...` as a subprocess (one after
another), so every trial has its own run folder (config.json, metrics.jsonl, checkpoints/). The sweep
folder gets trials.jsonl (parameters, status, wall time, final metrics per trial; a failed trial's reason, the last
error line of its log <trial>.log) and summary.csv,
and a table sorted by the YAML's metric is printed. Finished trials are skipped when the sweep is
run again (--rerun repeats them). Besides each metric's last value, the summary holds `time/*_mean` (over
all iterations) and `throughput/*_tgs_mean`, `time/dispatch_share_mean` (over the iterations that compiled
nothing: after the first, and none whose `compile/programs` grew; `steady_iterations` counts them), so a sweep
can optimize throughput: launch/sweep_selector.yaml maximizes throughput/iteration_tgs_mean,
launch/sweep_learning.yaml eval/win_rate.

The YAML is wandb's sweep format: `program`, `method`, `metric: {name, goal}`, and `parameters`, each
with `value` (fixed), `values` (a list; `probabilities` optional), or `distribution` with min/max
(uniform, log_uniform_values, int_uniform, q_uniform, q_log_uniform_values). Grid search needs
`value` / `values` only.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import itertools
import json
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

# Final metrics each trial reports (the last record that has the key), plus the mean of the timings.
SUMMARY_METRICS = ("eval/win_rate", "eval/invalid_rate", "episode/return_mean", "episode/win_rate",
                   "rollout/context_len_mean", "time/rollout_s", "time/experience_s", "time/train_s",
                   "time/dispatch_s", "time/elapsed_s", "parallel/rollout_mesh", "parallel/train_mesh")
MEAN_METRICS = ("time/rollout_s", "time/experience_s", "time/train_s", "time/dispatch_s")
# Throughput over the run, `<name>_mean`: the mean over the iterations that compiled nothing (steady_iterations):
# a few-iteration trial would otherwise rank by compile time, not by the layouts it ran.
STEADY_MEAN_METRICS = ("throughput/iteration_tgs", "throughput/rollout_tgs", "throughput/experience_tgs",
                       "throughput/train_tgs", "time/dispatch_share")


def load_sweep(path: str | Path) -> dict[str, Any]:
    import yaml

    spec = yaml.safe_load(Path(path).read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get("parameters"), dict):
        raise ValueError(f"{path}: a sweep needs a 'parameters' mapping")
    for name, p in spec["parameters"].items():
        if not isinstance(p, dict) or not ({"value", "values", "distribution"} & p.keys()):
            raise ValueError(f"{path}: parameter {name!r} needs value, values or distribution")
    return spec


def _is_fixed(p: dict[str, Any]) -> bool:
    return "value" in p


def grid(parameters: dict[str, dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every combination of the `values` lists (fixed `value`s in each), in YAML order."""
    names, choices = [], []
    for name, p in parameters.items():
        if _is_fixed(p):
            choices.append([p["value"]])
        elif "values" in p:
            choices.append(list(p["values"]))
        else:
            raise ValueError(f"grid search needs a list of values for {name!r} (it has a distribution; "
                             f"use --method random)")
        names.append(name)
    for combo in itertools.product(*choices):
        yield dict(zip(names, combo))


def sample(p: dict[str, Any], rng: np.random.Generator) -> Any:
    """One draw from a parameter spec (wandb's meaning of each distribution)."""
    if _is_fixed(p):
        return p["value"]
    if "values" in p:
        values = list(p["values"])
        probs = p.get("probabilities")
        return values[int(rng.choice(len(values), p=probs))]
    dist, lo, hi = p["distribution"], p.get("min"), p.get("max")
    q = p.get("q", 1)
    if dist == "uniform":
        return float(rng.uniform(lo, hi))
    if dist == "int_uniform":
        return int(rng.integers(int(lo), int(hi) + 1))
    if dist == "log_uniform_values":
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    if dist == "q_uniform":
        return float(round(rng.uniform(lo, hi) / q) * q)
    if dist == "q_log_uniform_values":
        return float(round(math.exp(rng.uniform(math.log(lo), math.log(hi))) / q) * q)
    if dist == "categorical":
        return sample({"values": p["values"]}, rng)
    if dist == "constant":
        return p["value"]
    raise ValueError(f"unsupported distribution {dist!r}")


def random_trials(parameters: dict[str, dict[str, Any]], n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{name: sample(p, rng) for name, p in parameters.items()} for _ in range(n)]


def trials(spec: dict[str, Any], method: str | None = None, n: int | None = None, seed: int = 0,
           max_trials: int | None = None) -> list[dict[str, Any]]:
    method = method or spec.get("method", "random")
    if method == "grid":
        out = list(itertools.islice(grid(spec["parameters"]), max_trials))
        return out if n is None else out[:n]
    if method in ("random", "bayes"):  # bayes needs wandb's service: offline it is random search
        return random_trials(spec["parameters"], n or max_trials or 10, seed)
    raise ValueError(f"unknown method {method!r}: grid or random")


def _flag_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def trial_name(index: int, params: dict[str, Any]) -> str:
    digest = hashlib.sha1(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:6]
    return f"t{index:03d}-{digest}"


def trial_command(program: str, params: dict[str, Any], run_dir: str | Path, extra: Sequence[str] = (),
                  launcher: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """The trial's command line: flags as `--NAME=VALUE` (names with underscores become dashes)."""
    flags = [f"--{name.replace('_', '-')}={_flag_value(v)}" for name, v in params.items()]
    return [*launcher, python, program, f"--run-dir={run_dir}", *flags, *extra]


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """Final metrics of a run folder's metrics.jsonl (and the mean of the per-iteration timings)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    out: dict[str, Any] = {"final_step": max((r.get("step") or 0 for r in rows), default=0)}
    for key in SUMMARY_METRICS:
        found = [r[key] for r in rows if r.get(key) is not None]
        if found:
            out[key] = found[-1]
    for key in MEAN_METRICS:
        found = [r[key] for r in rows if r.get(key) is not None and (r.get("step") or 0) > 0]
        if found:
            out[key + "_mean"] = float(np.mean(found))
    iterations = sorted((r for r in rows if (r.get("step") or 0) > 0), key=lambda r: r["step"])
    steady = steady_iterations(iterations)
    out["steady_iterations"] = len(steady)
    for key in STEADY_MEAN_METRICS:
        found = [r[key] for r in steady if r.get(key) is not None]
        if found:
            out[key + "_mean"] = float(np.mean(found))
    return out


def steady_iterations(iterations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The iterations that compiled nothing: after the first, and (where the job logs `compile/programs`, its
    count of compiled programs so far) not one whose count grew, nor (where it logs `compile/lowered`) one that
    traced any new program, an eager op's included. A context schedule that reaches new lengths compiles in
    later iterations too, and a trial of few iterations would otherwise rank by compile time."""
    out = []
    for prev, r in zip(iterations, iterations[1:]):
        if (prev.get("compile/programs") is None or r.get("compile/programs") == prev.get("compile/programs")) \
                and not r.get("compile/lowered"):
            out.append(r)
    return out


# A log line that says why a run ended: the job's one-line error, a traceback's last line, a kill.
ERROR_LINE = re.compile(r"^(\S+: error: |[\w.]*(Error|Exception|Interrupt)\b|Killed\b)")


def failure_reason(log: Path, code: int | str) -> str:
    """Why a trial failed, as its log says: the last line that reads as an error (`connect4: error: --env.game:
    ...`, a traceback's `ValueError: ...`), else the log's last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    found = next((ln for ln in reversed(lines) if ERROR_LINE.match(ln)), None)
    if code == "timeout":
        return "ran past --timeout" + (f" (last error: {found})" if found else "")
    return (found or (lines[-1] if lines else "no output"))[:400]


def find_program(program: str, launcher: str = "") -> str:
    """The YAML's program as found from the working directory or, failing that, from the repository (its paths are
    the repository's: `experiments/connect4.py`), so a sweep started elsewhere does not fail every trial. A custom
    launcher gets the path as written."""
    if launcher or Path(program).is_absolute() or Path(program).exists():
        return program
    root = Path(__file__).resolve().parents[1]
    if (root / program).exists():
        return str(root / program)
    raise ValueError(f"program {program!r}: not found from {Path.cwd()} nor from the repository {root}")


def run_sweep(spec: dict[str, Any], out_dir: str | Path, params_list: list[dict[str, Any]], *,
              extra: Sequence[str] = (), launcher: Sequence[str] = (), rerun: bool = False,
              timeout: float | None = None, dry_run: bool = False, cwd: str | Path | None = None,
              echo=print, only: set[int] | None = None) -> list[dict[str, Any]]:
    out = Path(out_dir)
    if not dry_run:
        out.mkdir(parents=True, exist_ok=True)
    program = spec.get("program", "experiments/connect4.py")
    rows = []
    for i, params in enumerate(params_list):
        name = trial_name(i, params)
        if only is not None and i not in only:
            continue
        run_dir = out / name
        done = run_dir / "trial.json"
        cmd = trial_command(program, params, run_dir, extra, launcher)
        if dry_run:
            echo(shlex.join(cmd))
            rows.append({"trial": name, "status": "planned", **params})
            continue
        if done.exists() and not rerun and json.loads(done.read_text()).get("status") == "ok":
            rows.append(json.loads(done.read_text()))
            echo(f"[{i + 1}/{len(params_list)}] {name}: done before, skipped")
            continue
        if run_dir.exists():  # a failed or repeated trial starts from scratch
            import shutil

            shutil.rmtree(run_dir)
        echo(f"[{i + 1}/{len(params_list)}] {name}: {shlex.join(cmd)}")
        run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(run_dir.with_suffix(".log"), "w") as log:
            try:
                code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=cwd).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        row = {"trial": name, "status": "ok" if code == 0 else f"failed ({code})",
               "wall_s": round(time.perf_counter() - t0, 1), **params, **summarize(run_dir)}
        if code != 0:  # the reason, from the trial's log (run_dir.log): summary.csv, trial.json and here
            row["error"] = failure_reason(run_dir.with_suffix(".log"), code)
            echo(f"[{i + 1}/{len(params_list)}] {name}: {row['status']}: {row['error']}")
        done.write_text(json.dumps(row, indent=1))
        with open(out / "trials.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
    if not dry_run:
        write_csv(rows, out / "summary.csv")
    return rows


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def sort_rows(rows: list[dict[str, Any]], metric: str | None, goal: str = "maximize") -> list[dict[str, Any]]:
    if not metric:
        return rows
    sign = -1 if goal == "maximize" else 1
    return sorted(rows, key=lambda r: (r.get(metric) is None, sign * (r.get(metric) or 0.0)))


def print_table(rows: list[dict[str, Any]], params: Sequence[str], metric: str | None, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = ["trial", "status", *params, *(m for m in (metric, "steady_iterations", "eval/win_rate",
                                                       "episode/return_mean", "time/rollout_s_mean",
                                                       "time/train_s_mean", "wall_s") if m)]
    cols = list(dict.fromkeys(cols))
    for c in cols:
        table.add_column(c, justify="left" if c in ("trial", "status") else "right")

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    for r in rows:
        table.add_row(*(fmt(r.get(c)) for c in cols))
    console = Console()
    if not console.is_terminal:  # a log file: wide enough for every column
        console = Console(width=max(console.width, 240))
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="wandb sweep YAML (e.g. launch/sweep_selector.yaml)")
    parser.add_argument("--method", choices=("grid", "random"), default=None, help="default: the YAML's")
    parser.add_argument("--trials", type=int, default=None, help="random: how many; grid: at most this many")
    parser.add_argument("--max-trials", type=int, default=None, help="grid: stop after this many combinations")
    parser.add_argument("--seed", type=int, default=0, help="random search seed")
    parser.add_argument("--out", default="runs/sweep", help="sweep folder (one run folder per trial)")
    parser.add_argument("--launcher", default="", help="prefix for every trial, e.g. 'python launch/local.py -n 2 --'")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per trial")
    parser.add_argument("--rerun", action="store_true", help="run trials again even if finished")
    parser.add_argument("--only", default=None, help="comma list of trial indices to run (e.g. 2,3), the others "
                                                     "skipped: split one sweep over several calls or machines")
    parser.add_argument("--dry-run", action="store_true", help="print the trial commands only")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, extra = argv[:cut], argv[cut + 1:]  # after --: flags added to every trial
    args = parser.parse_args(argv)
    for flag, n in (("--trials", args.trials), ("--max-trials", args.max_trials)):
        if n is not None and n < 1:
            parser.error(f"{flag}: must be >= 1 (got {n})")
    try:
        only = None if args.only is None else {int(i) for i in args.only.split(",")}
    except ValueError:
        parser.error(f"--only: a comma list of trial indices, e.g. 2,3 (got {args.only!r})")
    try:
        spec = load_sweep(args.sweep)
        spec["program"] = find_program(spec.get("program", "experiments/connect4.py"), args.launcher)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    try:
        params_list = trials(spec, args.method, args.trials, args.seed, args.max_trials)
    except ValueError as e:
        parser.error(str(e))
    rows = run_sweep(spec, args.out, params_list, extra=extra, launcher=shlex.split(args.launcher),
                     rerun=args.rerun, timeout=args.timeout, dry_run=args.dry_run, only=only)
    if args.dry_run:
        return 0
    metric = (spec.get("metric") or {}).get("name")
    goal = (spec.get("metric") or {}).get("goal", "maximize")
    varying = [k for k, p in spec["parameters"].items() if not _is_fixed(p)]
    print_table(sort_rows(rows, metric, goal), varying, metric, f"sweep {args.sweep} -> {args.out}/summary.csv")
    for r in rows:  # after the table, where it is read: each failed trial and why
        if r.get("status") != "ok":
            print(f"{r['trial']}: {r.get('status')}: {r.get('error', 'see its .log')}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
