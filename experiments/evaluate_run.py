"""Greedy evaluation of runs' newest checkpoints against a list of opponents, and the mean and spread over runs.

    python experiments/evaluate_run.py runs/connect4-gpu --opponents random,alphabeta:1,alphabeta:2,mcts:100
    python experiments/evaluate_run.py runs/seed0 runs/seed1 runs/seed2 --opponents random,alphabeta:1 --games 128

A base folder made by experiments/pretrain.py (with earl_base.json) is evaluated as its game's default job would
start from it (step 0; nothing is written into the folder). Each run's own config.json rebuilds the model, tokenizer
and game (one written by an earlier version is refused in one line naming experiments/upgrade_run.py, which converts
it); its checkpoint gives the weights (and the curriculum's rung, which is evaluated too). Games use the trainer's
fixed evaluation seeds, so runs are compared on the same openings. Prints a table per run and, for
several runs, the mean and the spread (sample standard deviation, min, max) per opponent, with the blunder rate (the
share of the agent's moves that missed a win in one or a block, Connect Four and Tic-Tac-Toe); writes
<run-dir>/evaluation.json per run (and --out, the summary, for several). Each result also records the run's own
running seconds (`time/run_elapsed_s` of its last metrics line, resumed parts summed; none for a base) and the host
and device the evaluation ran on.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed


def load_run_config(run_dir: Path, paths: dict | None = None):
    """The JobConfig a run was started with (its config.json), with `paths` ({(section, field): value}) set."""
    from earl_jax.cli import ConfigError, replace_paths
    from earl_jax.errors import CheckpointError
    from earl_jax.models.setup import check_spec
    from earl_jax.rl.loop.job_config import JobConfig, OldRunConfig

    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.json (not a run folder)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    try:
        saved = JobConfig.from_dict(raw)
    except OldRunConfig as e:
        raise ConfigError(e.line(path)) from None
    try:
        check_spec(saved.model)  # the base folder the run names, checked as the job checks it
    except CheckpointError as e:  # runs started before typed paths were kept absolute kept them as typed
        relative = not Path(saved.model.hf_checkpoint or "/").is_absolute()
        hint = f" from {Path.cwd()} (evaluate the run from the folder it was started in)" if relative else ""
        raise ConfigError(f"{path}: {e}{hint}") from None
    return replace_paths(saved, paths or {})


def is_base(folder: Path) -> bool:
    return (folder / "earl_base.json").is_file()


def load_base_config(folder: Path, paths: dict):
    """A base made by experiments/pretrain.py, as its game's default job would start from it (nothing is written:
    the run folder is a fresh temporary one)."""
    import tempfile

    from earl_jax.cli import replace_paths
    from earl_jax.models.export import read_base_info
    from earl_jax.rl.job.entry import parse_job
    from earl_jax.rl.job.validate import apply_base

    game = read_base_info(folder)["game"]
    configs = {"connect_four": "connect4", "tic_tac_toe": "tictactoe"}[game]
    parsed = parse_job(["--model.hf-checkpoint", str(folder)], Path(__file__).resolve().parent / "configs" / configs)
    cfg = apply_base(parsed.config, parsed.typed, parsed.by_preset)
    return replace_paths(cfg, {**paths, ("run", "run_dir"): tempfile.mkdtemp(prefix="earl_eval_base_"),
                               ("run", "resume"): "false"})


def run_seconds(run_dir: Path) -> float | None:
    """The run's running seconds as its last metrics line records them (None: no metrics, e.g. a base)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    last = None
    for line in path.read_text().splitlines():
        try:
            last = json.loads(line).get("time/run_elapsed_s", last)
        except json.JSONDecodeError:  # a line cut by a killed run
            continue
    return None if last is None else round(float(last), 1)


def where() -> dict:
    import jax

    return {"host": platform.node(), "processor": platform.processor() or platform.machine(),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def evaluate_run(run_dir: Path, opponents: tuple[str, ...] | None, games: int) -> dict:
    """`opponents` None: a game's default (random); a text task refuses any (its held-out split is played)."""
    from earl_jax.cli import ConfigError
    from earl_jax.rl.loop.trainer import Trainer

    played = opponents or ("random",)
    paths = {("eval", "opponents"): played, ("eval", "games"): games,
             ("run", "wandb_mode"): "disabled", ("run", "progress"): False}
    if is_base(run_dir):
        cfg = load_base_config(run_dir, paths)
    else:  # the folder given, wherever the run was made (its config.json names the folder it was started in)
        cfg = load_run_config(run_dir, {**paths, ("run", "run_dir"): str(run_dir), ("run", "resume"): "true"})
    if cfg.env.task and opponents is not None:
        raise ConfigError(f"--opponents: {run_dir} is a run of the text task {cfg.env.task}, which has no opponents "
                          "(its held-out split is played)")
    if not cfg.env.task:  # a misspelt opponent is one line before anything is built
        from earl_jax.rl.job.validate import check_opponents

        check_opponents("--opponents", played, cfg.env.game)
    trainer = Trainer(cfg, log=False)  # restores the newest readable checkpoint; writes nothing to the run
    if cfg.env.task:  # a text task has no opponents: its held-out split is played (--opponents is for games)
        played = ("held-out",)
    rows = {}
    for name in trainer.matchmaker.eval_opponents():
        t0 = time.perf_counter()
        prefix = "eval/" if name == played[0] else f"eval_{name}/"
        r = trainer.evaluate((name,))
        rows[name] = {k[len(prefix):]: float(v) for k, v in r.items() if k.startswith(prefix)}
        rows[name]["seconds"] = time.perf_counter() - t0
        if cfg.env.task:
            print(f"{run_dir.name:>12} {name:>14}: success {rows[name]['success_rate']:.3f}  score "
                  f"{rows[name]['score']:.3f}  turns {rows[name]['turns']:.2f}  "
                  f"tool calls {rows[name]['tool_calls']:.2f}"
                  f"  failures {rows[name]['tool_failures']:.2f}  ({rows[name]['seconds']:.0f} s)", flush=True)
        else:
            blunders = rows[name].get("blunder_rate")
            print(f"{run_dir.name:>12} {name:>14}: win {rows[name]['win_rate']:.3f}  "
                  f"draw {rows[name]['draw_rate']:.3f}  "
                  f"loss {rows[name]['loss_rate']:.3f}  invalid {rows[name]['invalid_rate']:.3f}  "
                  + (f"blunders {blunders:.3f}  " if blunders is not None else "")
                  + f"({rows[name]['seconds']:.0f} s)", flush=True)
    return {"run_dir": str(run_dir), "step": trainer.step, "game": cfg.env.task or cfg.env.game, "games": games,
            "greedy": True,
            "seed": cfg.run.seed, "run_seconds": None if is_base(run_dir) else run_seconds(run_dir), **where(),
            "opponents": rows}


def summarize(results: list[dict]) -> dict:
    """Per opponent and rate: the mean over runs, the sample standard deviation, min and max."""
    out: dict[str, dict] = {}
    for name in results[0]["opponents"]:
        per = [r["opponents"][name] for r in results if name in r["opponents"]]
        out[name] = {}
        for k in ("win_rate", "draw_rate", "loss_rate", "invalid_rate", "blunder_rate", "success_rate", "score"):
            if k not in per[0]:  # success_rate and score: tasks only; blunder_rate: the batched games
                continue
            vals = [p[k] for p in per]
            out[name][k] = {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                            "min": min(vals), "max": max(vals), "runs": len(vals)}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", type=Path, nargs="+")
    p.add_argument("--opponents", default=None, help="a game's, comma-separated: random (the default), alphabeta:D, "
                                                     "mcts:N, solver; a text task's run plays its held-out split")
    p.add_argument("--games", type=int, default=64, help="greedy games per opponent (256 for a claim near 0.98)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (one run: default <run-dir>/evaluation.json; "
                                                         "several: the summary, default none)")
    args = p.parse_args(argv)
    if args.games <= 0:
        p.error(f"--games: must be positive (got {args.games})")

    from earl_jax.compile_cache import enable_compile_cache

    opponents = None if args.opponents is None else tuple(o.strip() for o in args.opponents.split(",") if o.strip())
    enable_compile_cache(None)
    results = []
    for run_dir in args.run_dirs:
        result = evaluate_run(run_dir, opponents, args.games)
        if args.out and len(args.run_dirs) == 1:
            args.out.write_text(json.dumps(result, indent=1))
        elif not is_base(run_dir):  # a shipped base's folder stays as it was made
            (run_dir / "evaluation.json").write_text(json.dumps(result, indent=1))
        results.append(result)
    if len(results) == 1:
        if args.out or not is_base(args.run_dirs[0]):
            print(f"step {results[0]['step']}: wrote {args.out or args.run_dirs[0] / 'evaluation.json'}")
        return results[0]
    summary = {"runs": [r["run_dir"] for r in results], "seeds": [r["seed"] for r in results],
               "steps": [r["step"] for r in results], "run_seconds": [r["run_seconds"] for r in results],
               "games": args.games, **where(), "opponents": summarize(results)}
    print(f"\nmean over {len(results)} runs (seeds {summary['seeds']}), sample std, [min, max]:")
    for name, rates in summary["opponents"].items():
        w = rates["win_rate"]
        b = rates.get("blunder_rate")
        print(f"{name:>14}: win {w['mean']:.3f} +- {w['std']:.3f} [{w['min']:.3f}, {w['max']:.3f}]  "
              f"draw {rates['draw_rate']['mean']:.3f}"
              + (f"  blunders {b['mean']:.3f} +- {b['std']:.3f}" if b else ""))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    from earl_jax.cli import ConfigError
    from earl_jax.errors import CheckpointError

    try:
        main()
    except (ConfigError, CheckpointError) as e:  # one line, no traceback: the folder or flag and what is wrong
        print(f"evaluate_run: error: {e}", file=sys.stderr)
        sys.exit(2)
