"""The RL loop: plan -> rollout -> experience -> train -> evaluate -> log, each stage under its own layout.

One iteration (`Trainer.iteration`):
    planner.plan()                                  the rollout's layout, from the last batch's context
    rollout: B groups x G games in lock-step        weights dispatched train layout -> rollout layout (sampled
                                                    ahead: rl/loop/overlap.py; partial rollouts: rl/loop/partial.py)
    planner.observe(this batch); planner.plan()     experience / train layouts for the batch they process
    experience: old / reference log-probs, then advantages
    train: PPO-clip updates on the train layout     the batch dispatched experience layout -> train layout
    the record: outcomes, contexts, losses, the layouts that ran

Everything random derives from (seed, step), so a run killed and resumed from a checkpoint reaches the same weights
as one that never stopped (bit-exact on CPU). The stages live beside this file; this file only wires them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from earl_jax.compile_cache import count_compiles
from earl_jax.parallel.plan import ContextStats
from earl_jax.parallel.planner import StageRun
from earl_jax.rl.algorithm.optim import with_run_fraction
from earl_jax.rl.algorithm.packing import scored_spans
from earl_jax.rl.loop.checkpoint import Checkpointer, restore_trainer, save_trainer
from earl_jax.rl.loop.gc_control import GcClock
from earl_jax.rl.loop.job_config import JobConfig
from earl_jax.rl.loop.metrics import CompileStats, MetricsLogger, NoSignal, trainer_record
from earl_jax.rl.loop.overlap import Overlap
from earl_jax.rl.loop.partial import PartialRollouts
from earl_jax.rl.loop.run_control import RunControl, StopRun
from earl_jax.rl.matchups.game_seeds import rollout_inputs
from earl_jax.rl.matchups.matchmaking import job_matchmaker
from earl_jax.rl.stages.evaluation import Evaluator
from earl_jax.rl.stages.experience_stage import ExperienceResult, RolloutBatch, experience_stage
from earl_jax.rl.stages.policy_setup import build_policy
from earl_jax.rl.stages.rollout_stage import RolloutStage, timed_weights
from earl_jax.rl.stages.staleness import Sampled
from earl_jax.rl.stages.train_stage import TrainState, train_stage
from earl_jax.rl.supervised.warmup import format_warmup, start_of_run
from earl_jax.rollout.sampler import SamplingConfig


class Trainer:
    def __init__(self, cfg: JobConfig, *, log: bool = True, env_factory: Callable | None = None,
                 job: str | None = None):
        """`env_factory(env_config)` makes one game (default: the built-in batched games, else OpenSpiel; forks pass
        their own envs, with the same reset/step). `log=False` (tests, evaluate_run.py) writes nothing into the run
        folder. `job`: the script's name (connect4), kept in config.json: another script's --resume is refused."""
        self.cfg, self.run_dir, self.is_main, self.step = cfg, Path(cfg.run.run_dir), jax.process_index() == 0, 0
        # the planner sizes every stage's layout from the model's shape; the model is made on the train layout
        policy, params = build_policy(cfg)
        self.optimizer = cfg.optim.make(cfg.run.steps, cfg.run.max_minutes)
        self.elapsed_before_s = 0.0  # the run's time in earlier parts (a resumed run's checkpoint says)
        self.state = TrainState.start(policy, params, self.optimizer, reference=cfg.loss.kl_coef > 0)
        self._gc, self._no_signal, self._compile_stats = GcClock(), NoSignal(), CompileStats()
        self._control: RunControl | None = None  # while run() runs: stop signals, checkpoint timing
        self.stopped_by: str | None = None  # the signal that ended run(), if one did
        self.sampling = cfg.rollout.sampling
        # who the agent plays and on what: a text task's splits, else games against the opponent or curriculum
        self.task, self.env_factory, self.matchmaker = job_matchmaker(cfg, policy, env_factory)
        self.env = self.matchmaker.train_env()
        # constrained moves: each action's token (rollout) and the static token tuple the stages score it over
        self.policy = policy.with_moves(self.env.num_actions) if cfg.rollout.constrain_moves else policy
        self.rollout = RolloutStage(cfg.rollout, self.policy, cfg.rollout.max_context)
        self.evaluate = Evaluator(cfg.eval, cfg.env, self.matchmaker, lambda *a, **k: self.play(*a, **k)[0],
                                  self.task.eval_factory if self.task else self.env_factory,
                                  task_log=self.task.eval_log if self.task else None)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=cfg.run.keep_checkpoints)
        self.overlap = Overlap(self) if cfg.rollout.max_staleness else None  # rollouts ahead, during training
        self.partial = PartialRollouts(self) if cfg.rollout.token_budget else None  # groups carried between rollouts
        if self.checkpointer.resumes(cfg.run.resume, self.run_dir):
            self.restore()
        # config.json, metrics.jsonl and wandb: written by process 0 only, and not at all with log=False
        self.logger = MetricsLogger(self.run_dir, {**({"job": job} if job else {}), **cfg.to_dict()},
                                    wandb_mode=cfg.run.wandb_mode, project=cfg.run.wandb_project,
                                    resume_step=self.step if self.step else None, enabled=log and self.is_main,
                                    write_config=True)

    @property
    def params(self) -> Any:
        return self.state.params

    # ---------------------------------------------------------------- checkpoints
    def save(self) -> None:
        save_trainer(self)

    def restore(self) -> None:
        restore_trainer(self)

    # ---------------------------------------------------------------- stages
    def play(self, env, seeds, group_ids, rng, sampling: SamplingConfig, *, league=None, training: bool = True, **kw):
        """(trajectories, dispatch seconds): `env`'s games on the planned rollout layout (`kw`:
        rl/loop/partial.py's)."""
        turn_tokens, weights = self.cfg.rollout.turn_tokens(self.step), self.policy.weights
        if self.overlap is not None:  # an evaluation decodes on the training rollout's sampler: not at once
            self.overlap.drain()

        def rollout(run: StageRun):
            params, dispatch_s = timed_weights(lambda: weights.for_stage(run, self.state.params))
            traj = self.rollout(run, params, env, seeds, group_ids, rng, sampling, turn_tokens=turn_tokens,
                                league=league, training=training, league_params=self.rollout.league_params,
                                interrupt=self._stop_point if training and jax.process_count() == 1 else None, **kw)
            return traj, dispatch_s

        return (self.policy.rollout_planner or self.policy.planner).run("rollout", rollout)

    def _clock(self, control: RunControl) -> None:
        """The share of --run.max-minutes spent, for the learning rate (rl/algorithm/optim.py) and the rung budget."""
        fraction = self.matchmaker.run_fraction = control.run_fraction()
        if self.cfg.run.max_minutes:
            self.state.opt_state = with_run_fraction(self.state.opt_state, fraction)

    @property
    def run_elapsed_s(self) -> float:
        """The run's time in the training loop, all parts (what a checkpoint keeps)."""
        return self._control.run_elapsed_s if self._control is not None else self.elapsed_before_s

    def _stop_point(self) -> None:  # where an iteration may be abandoned for a running RunControl's stop signal
        if self._control is not None:
            self._control.stop_point()

    def _experience(self, run: StageRun, batch: RolloutBatch, spans, rows) -> ExperienceResult:
        p, s = self.policy, self.state
        ref = None if s.ref_params is None else p.weights.for_stage(run, s.ref_params)
        return experience_stage(run, p.weights.for_stage(run, s.params), ref, batch, spans, graphdef=p.graphdef,
                                loss=self.cfg.loss, num_groups=self.cfg.rollout.groups, choice_tokens=p.choice_tokens,
                                rows=rows)

    def _train(self, run: StageRun, experience: ExperienceResult) -> dict[str, Any]:
        # the selector may have moved training to another mesh: weights and optimizer state follow
        p, s, t0 = self.policy, self.state, time.perf_counter()
        s.params = p.weights.for_stage(run, s.params)
        s.opt_state = p.weights.opt_state_for(run, s.params, s.opt_state)
        moved_s = time.perf_counter() - t0
        s.params, s.opt_state, metrics = train_stage(
            run, s.params, s.opt_state, experience, p.weights.dispatcher, graphdef=p.graphdef,
            loss=self.cfg.loss, optimizer=self.optimizer, epochs=self.cfg.optim.ppo_epochs,
            mini_batches=self.cfg.optim.ppo_mini_batches, choice_tokens=p.choice_tokens)
        metrics["dispatch_s"] += moved_s
        return metrics

    def _observe(self, batch: RolloutBatch, mean_context_len: float, rows: int | None = None, **extends):
        """Experience / train layouts for the batch about to be processed (its padded width is known)."""
        n, width = batch.tokens.shape
        self.policy.planner.observe(ContextStats(mean_context_len, width, rows or n, **extends))
        self.policy.planner.plan()

    def format_warmup(self) -> dict[str, float]:
        """The format warm-up (rl/supervised/warmup.py) of this job's policy, on its games against its current
        opponent."""
        return format_warmup(self.policy, self.state, self.cfg, self.env, self.matchmaker.opponent,
                             env_factory=self.env_factory, task_log=self.task.train_log if self.task else None)

    # ---------------------------------------------------------------- one iteration
    def rollout_inputs(self) -> tuple[list[int], np.ndarray, jax.Array]:
        return rollout_inputs(self.cfg.rollout, self.cfg.run.seed, self.step, self.cfg.env.agent_player is None)

    def sample(self) -> Sampled:
        """This iteration's batch, sampled now by the current weights (--rollout.max-staleness 0)."""
        seeds, group_ids, rng = self.rollout_inputs()
        self.env = self.matchmaker.train_env(self.step)  # a new env when the rung changed; the rung replayed
        league = self.matchmaker.league_games(self.step, self.state.params)
        traj, weights_s = self.play(self.env, seeds, group_ids, rng, self.sampling, league=league)
        return Sampled(self.step, self.step, traj, weights_s, league, self.matchmaker.mix_games())

    def iteration(self) -> dict[str, Any]:
        planner, weights = self.policy.planner, self.policy.weights
        planner.plan()  # the rollout's layout, from the last batch's statistics
        self._gc.take()  # time/gc_pause_s counts this iteration's pauses only
        with count_compiles() as compiles:  # every program traced or compiled in the iteration
            mark, t_start = weights.mark, time.perf_counter()
            done = (self.overlap or self.partial).take(self.step) if self.overlap or self.partial else self.sample()
            batch = planner.shapes.pad_batch(done.batch(self.policy.moves is not None))
            traj, s = done.traj, done.traj.stats
            self._observe(batch, s.turn_context_len_mean, traj.num_games, prompt_tokens=s.prompt_tokens,
                          first_cache_len=s.first_cache_len, observation_tokens=s.observation_tokens)
            spans = scored_spans(traj.loss_mask) if traj.spans is None else traj.spans  # up to the last scored token
            self._stop_point()
            t0 = time.perf_counter()
            experience = planner.run("experience", lambda run: self._experience(run, batch, spans, traj.local_rows))
            t1 = time.perf_counter()
            self._stop_point()  # the last point before the train stage changes the weights
            # train updates (and donates) the weights: never rerun on a process where it already succeeded
            train_metrics = planner.run("train", lambda run: self._train(run, experience), rerun_after_success=False)
            t2 = time.perf_counter()
        self.step += 1
        no_signal = self._no_signal(self.step, train_metrics["grad_norm"], experience.metrics.get("filtered_frac", 0.0))
        times = {"rollout": s.rollout_s, "experience": t1 - t0, "train": t2 - t1, "iteration": t2 - t_start,
                 "dispatch": done.weights_s + train_metrics.pop("dispatch_s")}
        return trainer_record(self, done, batch, times, experience.metrics, train_metrics, compiles,
                              no_signal=no_signal, dispatch_bytes=weights.bytes_moved_since(mark))

    def run(self, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Train to --run.steps (or --run.max-minutes, or a stop signal: then `stopped_by` names it and the last
        finished iteration is checkpointed). `stop_after` ends the work after that many iterations without the
        end-of-run evaluation or checkpoint, as a kill would (resume tests)."""
        cfg, history, last_eval = self.cfg, [], {}
        with RunControl(cfg.run, total=cfg.run.steps, start=self.step, run_dir=self.run_dir, gc_clock=self._gc,
                        enabled=self.is_main, on_stall=self.logger.close,
                        elapsed_before_s=self.elapsed_before_s) as control:
            self._control, saved = control, self.step
            try:
                control.beat("the start: format warm-up or the first evaluation")
                if self.step == 0:  # the curves start from the untrained (or format-warmed) policy
                    last_eval = start_of_run(self, control)
                self._clock(control)
                spent = control.spent_at_start()
                while self.step < cfg.run.steps and not spent and not control.out_of_time():
                    if stop_after is not None and len(history) >= stop_after:
                        return history
                    control.beat(f"iteration {self.step + 1}")
                    control.stop_point()
                    record = self.iteration()
                    control.iteration_done(self.step, record)
                    self._clock(control)
                    last_step, out_of_time = self.step == cfg.run.steps, control.out_of_time()
                    evaluated = bool((cfg.eval.every and self.step % cfg.eval.every == 0) or last_step or out_of_time)
                    if evaluated:
                        control.dog.beat(f"the evaluation after iteration {self.step}")
                        last_eval = self.evaluate.logged(self.step, control.bar.status)
                    # the last evaluation, carried between evaluations; eval/fresh marks a new one
                    record.update({**last_eval, "eval/fresh": evaluated, **control.times(),
                                   "time/run_share": self.matchmaker.run_fraction})
                    self.logger.log(record)
                    history.append(record)
                    control.show(self.step, record)
                    if control.checkpoint_due(self.step, last_step):
                        control.dog.beat(f"the checkpoint after iteration {self.step}")
                        self.save()
                        control.saved()
                        saved = self.step
                    if out_of_time:
                        break
            except StopRun as stop:
                self.stopped_by = stop.signal_name
                control.stopped(stop, self.step, saved, self.save, self.run_dir)
            finally:
                self._control = None
                if self.overlap is not None:
                    self.overlap.close()
        self.logger.close()
        self.checkpointer.close()
        return history
