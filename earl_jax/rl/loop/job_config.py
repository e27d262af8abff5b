"""The RL job's configuration: one small typed config per component, nested in `JobConfig`.

    JobConfig
      run         RunConfig         iterations, seed, run folder, resume, checkpoints, logging
      model       ModelSpec         which model: a preset shape or a local Hugging Face folder (models/setup.py)
      env         EnvConfig         the game, the opponent, prompts and rewards (envs/openspiel_env.py)
      rollout     RolloutConfig     games per iteration, answers, sampling (rollout/rollout_config.py)
      loss        LossConfig        advantage estimator and policy loss, by registered name (rl/algorithm/losses.py)
      optim       OptimConfig       AdamW, PPO epochs and mini-batches (rl/algorithm/optim.py)
      planner     PlannerConfig     meshes, selector thresholds, memory model bounds (parallel/planner_config.py)
      curriculum  CurriculumConfig  opponent ladder, mixed opponents, self-play league
      eval        EvalConfig        greedy evaluation
      sft         SftConfig         supervised steps before RL: the format warm-up (rl/supervised/sft.py)
      dist        DistConfig        jax.distributed (multi-process jobs)

Each component checks its own fields; `JobConfig` checks what spans components. Every field is a flag named by its
path (`--rollout.temperature`, earl_jax/cli.py); presets are TOML files with the same sections
(experiments/configs/). A run folder's config.json is `to_dict()`; `from_dict` reads it back and refuses, as
`OldRunConfig`, a config.json of an earlier version (experiments/upgrade_run.py converts one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, Mapping

from earl_jax.cli import ConfigError, field_help as _f
from earl_jax.envs.env_config import EnvConfig
from earl_jax.models.setup import ModelSpec
from earl_jax.parallel.planner_config import PlannerConfig
from earl_jax.rl.algorithm.losses import LossConfig, estimator_is_grouped
from earl_jax.rl.algorithm.optim import OptimConfig
from earl_jax.rl.supervised.sft import SftConfig
from earl_jax.rollout.rollout_config import RolloutConfig


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """run: iterations, seed, the run folder, resume and checkpoints, logging"""

    steps: int = _f(150, "RL iterations (rollout -> experience -> train)")
    seed: int = _f(0, "seed for weights, sampling and games")
    run_dir: str = _f("runs/connect4", "folder for config.json, metrics.jsonl, checkpoints/ and curves.png")
    resume: Literal["false", "true", "auto"] = _f(
        "false", "continue the run in run_dir from its newest checkpoint, with its saved config (flags typed now "
                 "override it); auto: resume when run_dir has a checkpoint, else start it")
    max_minutes: float = _f(0.0, "stop after this many minutes of wall time, with a checkpoint (0: no limit)")
    checkpoint_every: int = _f(25, "iterations between checkpoints (and one at the end)")
    checkpoint_minutes: float = _f(10.0, "also a checkpoint when this many minutes passed since the last one, so "
                                         "a kill -9 loses at most that much (0: off); SIGTERM and Ctrl-C always "
                                         "write one")
    keep_checkpoints: int = _f(3, "checkpoints kept (0: none are written)")
    stall_minutes: float = _f(30.0, "end the process (exit 75; resume with --resume) when no iteration or evaluation "
                                    "finishes for this many minutes (earl_jax/watchdog.py); 0: off")
    gc_every: int = _f(0, "Python garbage collection: 0 = automatic; N > 0 = a full collection every N iterations on "
                          "every process at once (rl/loop/gc_control.py)")
    compile_cache: str = _f("", "persistent JAX compilation cache folder (\"\": "
                                "$XDG_CACHE_HOME/earl_jax/jax_compile or $EARL_COMPILE_CACHE; \"off\": none)")
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = _f(
        "auto", "auto = online with WANDB_API_KEY set, else offline; wandb's own output only with online")
    wandb_project: str = _f("earl-jax", "wandb project")
    progress: bool = _f(True, "a live progress bar in a terminal (one line per iteration elsewhere)")

    def __post_init__(self):
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        need(self.steps > 0, "steps", "must be positive")
        for name in ("max_minutes", "checkpoint_every", "checkpoint_minutes", "keep_checkpoints", "stall_minutes",
                     "gc_every"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        need(self.run_dir.strip() != "", "run_dir", "must name a folder")


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
    """curriculum: the opponent ladder (env.opponent = curriculum), mixed opponents, the self-play league"""

    ladder: str = _f("", "rungs, easiest first, e.g. 'random,alphabeta:1,alphabeta:2' (empty: the game's default); a "
                         "rung of several opponents joins them by '+' and is passed when each is beaten")
    promote_at: float = _f(0.8, "the next rung once the greedy evaluation against the current one reaches this")
    promote_on_stall: int = _f(0, "also the next rung after this many evaluations without beating the rung's best by "
                                  "0.02, once that best is >= 0.5 (0: off)")
    rung_max_iterations: int = _f(0, "also the next rung at the first evaluation this many iterations after the rung "
                                     "began, whatever its win rate (0: off)")
    rung_max_share: float = _f(0.0, "also the next rung at the first evaluation after this share of --run.max-minutes "
                                     "was spent on the rung, whatever its win rate, in [0, 1] (0: off)")
    rehearsal_share: float = _f(0.0, "share of the groups that replay the rungs below the current one, one rung an "
                                     "iteration in turn, in [0, 1) (0: off)")
    per_game_share: float = _f(1.0, "share of the groups that play a rung opponent searching one game at a time "
                                    "(mcts:N, Connect Four's solver), in (0, 1]; the rest of the rung's groups play "
                                    "the strongest batched rung below it (1: all of them)")
    mix_opponent: str = _f("", "a second scripted opponent for mix_share of each iteration's groups (empty: none)")
    mix_share: float = _f(0.5, "share of the groups that play mix_opponent, in (0, 1)")
    league_size: int = _f(0, "frozen snapshots of the policy kept as self-play opponents (0: no league)")
    league_every: int = _f(10, "iterations between league snapshots")
    league_share: float = _f(0.25, "share of each iteration's groups played against a league snapshot, in (0, 1]")

    def __post_init__(self):
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        need(0 < self.promote_at <= 1, "promote_at", "must be in (0, 1]")
        need(self.promote_on_stall >= 0, "promote_on_stall", "must be >= 0 (0: off)")
        need(self.rung_max_iterations >= 0, "rung_max_iterations", "must be >= 0 (0: off)")
        need(0 <= self.rung_max_share <= 1, "rung_max_share", "must be in [0, 1] (0: off)")
        need(0 <= self.rehearsal_share < 1, "rehearsal_share", "must be in [0, 1) (0: off)")
        need(0 < self.mix_share < 1, "mix_share", "must be in (0, 1)")
        need(0 < self.per_game_share <= 1, "per_game_share", "must be in (0, 1]")
        need("," not in self.mix_opponent, "mix_opponent", "takes one opponent")
        need(self.league_size >= 0, "league_size", "must be >= 0")
        need(self.league_every > 0, "league_every", "must be positive")
        need(0 < self.league_share <= 1, "league_share", "must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """eval: greedy games against fixed opponents (and the curriculum's rung)"""

    every: int = _f(10, "iterations between evaluations (0: only at the end)")
    games: int = _f(64, "games per evaluation opponent")
    opponents: tuple[str, ...] = _f(("random",), "comma-separated evaluation opponents (empty: no evaluation games, "
                                                  "e.g. throughput sweeps)")

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"every: must be >= 0 (got {self.every!r})")
        if self.games <= 0:
            raise ValueError(f"games: must be positive (got {self.games!r})")


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """dist: jax.distributed (unset: from EARL_* or SLURM_* variables, else one process)"""

    coordinator: str | None = _f(None, "coordinator HOST:PORT (process 0 listens there)")
    num_processes: int | None = _f(None, "processes in the job (one per host)")
    process_id: int | None = _f(None, "this process's index in [0, num_processes)")


def _job_env() -> EnvConfig:
    # The job's game defaults differ from a bare environment's: short prompts, and retries after an invalid answer.
    return EnvConfig(prompt_style="minimal", max_retries=2, retry_reward=-0.1)


def _component(cls, factory=None):
    return dataclasses.field(default_factory=factory or cls)


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """The whole RL job."""

    run: RunConfig = _component(RunConfig)
    model: ModelSpec = _component(ModelSpec)
    env: EnvConfig = _component(EnvConfig, _job_env)
    rollout: RolloutConfig = _component(RolloutConfig)
    loss: LossConfig = _component(LossConfig)
    optim: OptimConfig = _component(OptimConfig)
    planner: PlannerConfig = _component(PlannerConfig)
    curriculum: CurriculumConfig = _component(CurriculumConfig)
    eval: EvalConfig = _component(EvalConfig)
    sft: SftConfig = _component(SftConfig)
    dist: DistConfig = _component(DistConfig)

    def __post_init__(self):
        def need(ok: bool, flag: str, why: str):
            if not ok:
                raise ConfigError(f"{flag}: {why}")

        r, c = self.rollout, self.curriculum
        need(r.groups % self.optim.ppo_mini_batches == 0, "--optim.ppo-mini-batches",
             f"must divide --rollout.groups ({r.groups}): a mini-batch holds whole GRPO groups "
             f"(got {self.optim.ppo_mini_batches})")
        need(r.group_size > 1 or not estimator_is_grouped(self.loss.estimator), "--rollout.group-size",
             f"{self.loss.estimator} compares games within a group: use at least 2 (got {r.group_size})")
        # only a curriculum reads it (rl/job/entry.py drops a preset's without one, and refuses a flag's)
        need(not c.rung_max_share or self.run.max_minutes > 0 or self.env.opponent != "curriculum",
             "--curriculum.rung-max-share",
             "is a share of the run's time: needs --run.max-minutes")
        need(not c.mix_opponent or r.groups >= 2, "--curriculum.mix-opponent", "needs --rollout.groups >= 2")
        need(not (c.mix_opponent and c.league_size), "--curriculum.mix-opponent",
             "and --curriculum.league-size both take whole groups from the scripted opponent: use one of them")
        if c.rehearsal_share:
            need(r.groups >= 2, "--curriculum.rehearsal-share", "needs --rollout.groups >= 2")
            need(not c.mix_opponent, "--curriculum.rehearsal-share",
                 "takes the second opponent's groups as --curriculum.mix-opponent does: use one of them")
            replay = min(r.groups - 1, max(1, round(c.rehearsal_share * r.groups)))
            league = max(1, round(c.league_share * r.groups)) if c.league_size else 0
            need(replay + league < r.groups, "--curriculum.rehearsal-share",
                 f"{replay} group(s) of rehearsal and {league} of --curriculum.league-share leave none of the "
                 f"{r.groups} for the current rung: lower one of them")
        need(not (self.run.resume == "true" and self.run.keep_checkpoints == 0), "--run.keep-checkpoints",
             "--resume needs checkpoints: 0 writes none")
        need(not (r.max_staleness and c.league_size), "--rollout.max-staleness",
             "a league's snapshots are taken from the weights of their step: train with --curriculum.league-size 0")
        if r.token_budget:  # a carried game keeps its env row, its opponent and the batch it will train in
            need(not c.league_size, "--rollout.token-budget", "a league's frozen opponent plays one iteration's "
                 "games: train with --curriculum.league-size 0")
            need(not (c.mix_opponent or c.rehearsal_share), "--rollout.token-budget", "a carried game keeps its "
                 "opponent, and the second opponent's games are counted by iteration: use neither "
                 "--curriculum.mix-opponent nor --curriculum.rehearsal-share")
        need(not self.planner.rollout_devices or r.max_staleness, "--planner.rollout-devices",
             "applies while rollout and training run at once: it needs --rollout.max-staleness >= 1")

    @property
    def batch_size(self) -> int:
        return self.rollout.batch_size

    # ------------------------------------------------------------------------------------------ run folders
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobConfig":
        """A run's saved config (`to_dict()`); OldRunConfig for one written by an earlier version."""
        import typing

        from earl_jax.cli import fields_of, replace_paths

        if not any(isinstance(v, dict) for v in d.values()):
            raise OldRunConfig("flat keys")
        known = {f.path: f for f in fields_of(cls())}
        values = {}
        for section, sub in d.items():
            for name, v in (sub.items() if isinstance(sub, dict) else ()):
                path = (section, name)
                if path not in known:
                    raise ConfigError(f"config.json: unknown field {section}.{name}")
                tp = known[path].type
                if isinstance(v, bool) and typing.get_origin(tp) is typing.Literal:  # a switch before it had "auto"
                    raise OldRunConfig(f"{section}.{name} = {str(v).lower()}")
                values[path] = tuple(v) if isinstance(v, list) else v
                if tp is float and isinstance(v, int) and not isinstance(v, bool):
                    values[path] = float(v)
        return replace_paths(cls(), values)


class OldRunConfig(ConfigError):
    """A run's config.json written by an earlier version: `experiments/upgrade_run.py RUN_DIR` converts it."""

    def line(self, config_json: Path) -> str:
        """The one line a user reads: what is old and the command that converts it."""
        return (f"{config_json} was written by an earlier version ({self}): convert it once with "
                f"`python experiments/upgrade_run.py {config_json.parent}`")
