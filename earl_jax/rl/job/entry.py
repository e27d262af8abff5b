"""The command-line job behind experiments/connect4.py and tictactoe.py: parse, check, train, plot.

    job.main(argv, name="connect4", configs=Path("experiments/configs/connect4"), description=__doc__)

`configs` holds the script's presets as TOML files; `tiny-cpu.toml` is its default (what runs with no flags).
Every bad input fails before anything is built, as one line on stderr naming the flag (exit 2); `--debug` (or
EARL_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Sequence

from earl_jax.cli import ConfigError, Parsed, load_file, parse
from earl_jax.errors import CheckpointError
from earl_jax.rl.loop.job_config import JobConfig, OldRunConfig
from earl_jax.rl.loop.run_control import EXIT_CODES

DEFAULT_PRESET = "tiny-cpu"
# Short flags for the fields people type most.
ALIASES = {
    "--steps": ("run", "steps"), "--seed": ("run", "seed"), "--run-dir": ("run", "run_dir"),
    "--resume": ("run", "resume"), "--game": ("env", "game"), "--opponent": ("env", "opponent"),
    "--learning-rate": ("optim", "learning_rate"), "--model": ("model", "name"),
    "--hf-checkpoint": ("model", "hf_checkpoint"), "--devices": ("planner", "devices"),
}


def presets_of(configs: Path) -> dict[str, object]:
    """The script's presets: each TOML file in `configs` by its name, and the pod preset (sized from the machine)."""
    from earl_jax.rl.job.pod import pod_preset_for_this_machine

    return {**{p.stem: p for p in sorted(configs.glob("*.toml"))}, "pod": pod_preset_for_this_machine}


def parse_job(argv: Sequence[str] | None, configs: Path, *, prog: str | None = None, description: str = ""
              ) -> Parsed[JobConfig]:
    import dataclasses

    presets = presets_of(configs)
    base = load_file(presets[DEFAULT_PRESET], JobConfig())
    parsed = parse(argv, base, presets=presets, aliases=ALIASES, prog=prog, description=description,
                   extra=lambda group: group.add_argument("--debug", action="store_true",
                                                          help="show the traceback of an error (also EARL_DEBUG=1)"))
    return dataclasses.replace(parsed, config=drop_default_curriculum(parsed.config, parsed.typed, parsed.flags))


# Fields a resumed run cannot change: they would make it another experiment (the device count may change: the
# checkpoint restores into the new layout).
FIXED_ON_RESUME = {("model", "name"): "the model's shape", ("model", "hf_checkpoint"): "the model's weights",
                   ("env", "game"): "the game", ("env", "task"): "the task", ("run", "seed"): "the seed"}


def resume_config(parsed: Parsed[JobConfig], name: str | None = None) -> tuple[JobConfig, list[str]]:
    """The config to run and one line per change. `--resume` (or `--resume auto` on a folder with a checkpoint) takes
    the run's saved config.json and applies only what this command line set (flags, a preset, a config file); fields
    in FIXED_ON_RESUME are refused, and so is a run that config.json says another script (`job`) started than
    `name`. `--resume auto` on a folder without a checkpoint starts the run."""
    from earl_jax.cli import absolute, fields_of, flag_of, get_path, replace_paths
    from earl_jax.rl.loop.checkpoint import has_checkpoint

    cfg = parsed.config
    run_dir = Path(cfg.run.run_dir)
    if cfg.run.resume == "false" or (cfg.run.resume == "auto" and not has_checkpoint(run_dir)):
        return cfg, []
    saved_path = run_dir / "config.json"
    if not saved_path.is_file():
        raise ConfigError(f"--resume: {saved_path} is missing: the run's config cannot be restored (start a new run, "
                          "or restore the file)")
    try:
        data = json.loads(saved_path.read_text())
        saved = JobConfig.from_dict(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--resume: {saved_path} is not readable JSON ({e}); restore it or start a new run") from None
    except OldRunConfig as e:
        raise ConfigError(f"--resume: {e.line(saved_path)}") from None
    except ConfigError as e:
        raise ConfigError(f"--resume: {saved_path}: {str(e).removeprefix('config.json: ')}") from None
    started_by = data.get("job")  # runs written before it was kept have none
    if name and started_by and started_by != name:
        raise ConfigError(f"--resume: {run_dir} is a run of {started_by}.py, not of {name}.py: resume it with "
                          f"experiments/{started_by}.py (or start a new --run-dir)")
    changes, lines = {("run", "resume"): cfg.run.resume}, []
    path_fields = {f.path for f in fields_of(JobConfig()) if f.is_path}
    for path, value in parsed.typed.items():
        if path == ("run", "resume"):
            continue
        old = get_path(saved, path)
        if value == old or (path in path_fields and isinstance(old, str) and old and absolute(old) == value):
            continue  # a run saved before paths were kept absolute names its folder relative to where it started
        if path == ("run", "max_minutes") and (old == 0) != (value == 0):
            raise ConfigError(f"--run.max-minutes: the run's learning-rate schedule is over its "
                              f"{'iterations' if old == 0 else 'wall time'} (started with {old!r}); a schedule over "
                              f"{'time' if old == 0 else 'iterations'} is another experiment (use a new --run-dir)")
        if path in FIXED_ON_RESUME:
            raise ConfigError(f"{flag_of(path)}: the run was started with {old!r}; changing {FIXED_ON_RESUME[path]} "
                              f"would make it another experiment (use a new --run-dir)")
        changes[path] = value
        lines.append(f"{'.'.join(path)}: {old!r} -> {value!r}")
    return replace_paths(saved, changes), lines


def drop_preset_task_args(parsed: Parsed[JobConfig]) -> Parsed[JobConfig]:
    """A task typed without --env.task-args takes none: the preset's arguments belong to the preset's task."""
    import dataclasses

    from earl_jax.cli import replace_paths

    if ("env", "task") in parsed.typed and ("env", "task_args") not in parsed.typed:
        return dataclasses.replace(parsed, config=replace_paths(parsed.config, {("env", "task_args"): "{}"}))
    return parsed


def drop_default_curriculum(cfg: JobConfig, typed, flags) -> JobConfig:
    """An --env.opponent typed (or set by a preset) other than the curriculum leaves the curriculum: the fields that
    only the curriculum reads and that no flag set (the default preset's ladder or rehearsal share, or `--preset
    gpu`'s rung budget) are dropped, as the default preset's base is dropped for a shape it was not made for
    (rl/job/validate.py apply_base). Ones set by flag are still refused, naming the flag."""
    from earl_jax.cli import replace_paths
    from earl_jax.rl.job.validate import CURRICULUM_ONLY
    from earl_jax.rl.loop.job_config import CurriculumConfig

    if ("env", "opponent") not in typed or cfg.env.opponent == "curriculum":
        return cfg
    default = CurriculumConfig()
    changes = {("curriculum", name): getattr(default, name) for name in CURRICULUM_ONLY
               if ("curriculum", name) not in flags and getattr(cfg.curriculum, name) != getattr(default, name)}
    return replace_paths(cfg, changes) if changes else cfg


class SetupError(ValueError):
    """The job could not be set up from its inputs (before training started): one line for the user."""


def main(argv: Sequence[str] | None = None, *, name: str, configs: Path, description: str = "") -> int:
    """Run the job; bad input is one line on stderr and exit status 2 (the traceback with --debug or EARL_DEBUG=1)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("EARL_DEBUG") == "1"
    try:
        trainer = setup(argv, name, configs, description)
    except (ConfigError, CheckpointError, SetupError) as e:
        if debug:
            raise
        print(f"{name}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    from earl_jax.models.paged_cache import PagesExhausted

    try:
        return train(trainer, name)
    except PagesExhausted as e:  # the pages the flag gave are too few for one game: a setting, not a crash
        if debug:
            raise
        print(f"{name}: error: {e}; the run's checkpoints are kept (--resume auto continues from the last)",
              file=sys.stderr)
        return 2


def setup(argv: list[str], name: str, configs: Path, description: str):
    """Parse and check the inputs, then build the trainer; every input error surfaces here, as a one-line error."""
    from earl_jax import distributed
    from earl_jax.compile_cache import enable_compile_cache
    from earl_jax.progress import show_progress_logs
    from earl_jax.rl.job.validate import apply_base, check_game_name, check_job, check_run_dir
    from earl_jax.rl.loop.trainer import Trainer

    parsed = parse_job(argv, configs, prog=f"{name}.py", description=description)
    parsed = drop_preset_task_args(parsed)
    check_run_dir(parsed.config)
    cfg, changes = resume_config(parsed, name)
    check_game_name(cfg)  # a misspelt game is that, not a base made for another game
    cfg = apply_base(cfg, parsed.typed, parsed.by_preset)
    cfg = drop_default_curriculum(cfg, parsed.typed, parsed.flags)
    check_job(cfg, frozenset(parsed.flags))
    for line in changes:  # what this resume changes in the saved experiment
        print(f"{name}: resume: {line}", file=sys.stderr)
    # before anything touches a device: join the multi-process job, if this process is part of one
    distributed.maybe_initialize(cfg.dist.coordinator, cfg.dist.num_processes, cfg.dist.process_id)
    show_progress_logs(distributed.is_main())  # model creation / loading / cache lines, process 0 only
    enable_compile_cache(cfg.run.compile_cache or None)  # before the first compile: restarts reuse the programs
    from earl_jax.parallel.selector import NoFeasibleLayoutError

    try:
        return Trainer(cfg, job=name)
    except ValueError as e:  # the planner refusing a layout for the model and batch, a game the rollout cannot play
        raise SetupError(str(e)) from e
    except NoFeasibleLayoutError as e:  # nothing fits the memory model: what did not fit, then what to change
        lines = str(e).splitlines()
        raise SetupError(" ".join(dict.fromkeys([lines[0], lines[-1]]))) from e


def train(trainer, name: str) -> int:
    from earl_jax import distributed
    from earl_jax.rl.job.plots import plot_run

    cfg = trainer.cfg
    history = trainer.run()
    if trainer.stopped_by is not None:  # a stop signal: the checkpoint is written, the line logged
        return EXIT_CODES[trainer.stopped_by]
    if distributed.is_main():  # only process 0 writes metrics.jsonl, plots and prints
        run_dir = Path(cfg.run.run_dir)
        png = plot_run(run_dir / "metrics.jsonl", run_dir / "curves.png", title=name)
        last = history[-1] if history else {}
        if cfg.env.task:
            print(f"{name}: {trainer.step} iterations; held-out success {last.get('eval/success_rate')}, score "
                  f"{last.get('eval/score')}, invalid {last.get('eval/invalid_rate')}; curves: {png}")
        else:
            print(f"{name}: {trainer.step} iterations; eval win {last.get('eval/win_rate')}, draw "
                  f"{last.get('eval/draw_rate')}, invalid {last.get('eval/invalid_rate')}; curves: {png}")
    return 0
