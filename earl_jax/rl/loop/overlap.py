"""Rollouts that overlap training, with bounded staleness (`--rollout.max-staleness K >= 1`).

One background thread plays the training rollouts, in step order, while the loop's thread runs experience and train:

    iteration k   submit every batch j in [k, k + K] not yet sampled, with the weights of version k (copied to the
                  rollout's layout before the train stage donates them); wait for batch k; experience; train
    the thread    batch j: its env, seeds and key by j (rl/matchups/game_seeds.py), decoded on the layout
                  planned when it was submitted

So batch j is sampled by version max(0, j - K), whatever the threads' timing: a run is a function of (seed, K) as
the synchronous one is of its seed, and `check_bound` (rl/stages/staleness.py) refuses any batch older than K. The
weights version of a batch is fixed when it is submitted, so the rollout of batch k + K starts as soon as batch
k + K - 1 is done (one thread), during iteration k's experience and train.

Where the rollout runs: on its own devices when the planner split them (parallel/split.py), else on the shared
devices, interleaved with the train stage's programs. Its layout is planned on the loop's thread at submission (the
planners are not shared between threads); a background rollout has no out-of-memory fallback (an OOM ends the run).

With partial rollouts (`--rollout.token-budget N`, rl/loop/partial.py) the thread's rollouts carry unfinished groups
from each batch into the next, in step order.

Sync points: an evaluation (it decodes on the same sampler) and a checkpoint wait for the rollouts in flight. A
checkpoint of step s holds the finished batches s .. s + K - 1 (their weights are gone; batch s + K is sampled again
from the restored weights), so a resumed run trains the same batches as one that never stopped. A stop signal lets
the rollouts in flight finish: without them that checkpoint could not keep the bound.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp

from earl_jax.parallel.first_call_gate import FirstCallGate
from earl_jax.parallel.plan import ContextStats
from earl_jax.rl.algorithm.losses import BEHAVIOUR_LOSSES
from earl_jax.rl.matchups.game_seeds import rollout_inputs
from earl_jax.rl.stages.staleness import Sampled, check_bound, from_checkpoint, to_checkpoint

log = logging.getLogger("earl_jax.rl.loop.trainer")


class Overlap:
    def __init__(self, trainer):
        """`trainer`: the Trainer whose training rollouts this plays (its config, policy, state, matchmaker, rollout
        stage); built before it restores a checkpoint."""
        cfg = trainer.cfg
        if jax.process_count() > 1:
            raise ValueError("--rollout.max-staleness: rollouts overlapping training run in one process only (the "
                             "background rollout's collectives would interleave with the train stage's)")
        self.t, self.max_staleness = trainer, cfg.rollout.max_staleness
        self.gate = FirstCallGate()  # the train stage's first calls wait for the rollout (parallel/first_call_gate.py)
        for planner in filter(None, (trainer.policy.planner, trainer.policy.rollout_planner)):
            planner.programs.gate = self.gate
        self.pending: dict[int, Sampled] = {}  # finished batches by step
        self.jobs: dict[int, Future] = {}  # submitted, maybe unfinished
        self._pool: ThreadPoolExecutor | None = None
        if cfg.loss.policy_loss not in BEHAVIOUR_LOSSES:
            log.warning("--rollout.max-staleness %d with --loss.policy-loss %s: the ratio is taken against the "
                        "weights at train time, with no correction for the older weights that sampled the batch "
                        "(decoupled_ppo corrects it)", self.max_staleness, cfg.loss.policy_loss)

    @property
    def planner(self):
        """The planner of the training rollout: its own devices' (a split) or the shared one."""
        return self.t.policy.rollout_planner or self.t.policy.planner

    def take(self, step: int) -> Sampled:
        """Batch `step`, once every batch up to step + K is sampled or submitted; refused beyond the bound."""
        self._submit(step)
        t0 = time.perf_counter()
        done = self._finished(step)
        done.wait_s = time.perf_counter() - t0
        batch = done.batch(False)
        check_bound(batch, step, self.max_staleness, newest=done.versions is not None)
        if self.planner is not self.t.policy.planner:  # the rollout's own planner follows the context too
            s = done.traj.stats
            self.planner.observe(ContextStats(s.turn_context_len_mean, batch.tokens.shape[1], done.traj.num_games,
                                              s.prompt_tokens, s.first_cache_len, s.observation_tokens))
        for old in [j for j in self.pending if j < step]:  # iterations that finished: their batches are spent
            del self.pending[old]
        return done

    def _submit(self, step: int) -> None:
        """Submit the batches in [step, step + K] that are neither finished nor in flight, sampled by this version."""
        t = self.t
        wanted = [j for j in range(step, min(step + self.max_staleness + 1, t.cfg.run.steps))
                  if j not in self.pending and j not in self.jobs]
        if not wanted:
            return
        planner = self.planner
        if planner is not t.policy.planner:  # the shared planner planned this iteration's rollout already
            planner.plan()
        run, t0 = planner.stage_run("rollout"), time.perf_counter()
        params = t.policy.weights.for_stage(run, t.state.params)
        if t.policy.weights.dtype == jnp.float32:  # no cast: the train stage would donate these very buffers
            params = jax.tree.map(jnp.copy, params)
        jax.block_until_ready(params)
        weights_s = time.perf_counter() - t0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="earl-rollout")
        for j in wanted:
            self.jobs[j] = self._pool.submit(self._play, j, step, run, params, weights_s)

    def _play(self, step: int, version: int, run, params: Any, weights_s: float) -> Sampled:
        """Batch `step` sampled by `params` (version `version`) on `run`: the background thread's work."""
        with self.gate.rollout():
            return self._play_gated(step, version, run, params, weights_s)

    def _play_gated(self, step: int, version: int, run, params: Any, weights_s: float) -> Sampled:
        t, cfg = self.t, self.t.cfg
        devices = tuple(int(d.id) for d in run.mesh.devices.flat)

        def play(env, seeds, group_ids, rng, **kw):
            return t.rollout(run, params, env, seeds, group_ids, rng, t.sampling, training=True,
                             turn_tokens=cfg.rollout.turn_tokens(step), **kw), weights_s

        if t.partial is not None:  # one thread plays the batches in step order: each carries into the next
            return dataclasses.replace(t.partial.take(step, play, version), layout=run.layout, devices=devices)
        env = t.matchmaker.train_env(step)  # the rung as of the submission: evaluations wait for this rollout
        mix = t.matchmaker.mix_games()
        seeds, group_ids, rng = rollout_inputs(cfg.rollout, cfg.run.seed, step, cfg.env.agent_player is None)
        traj, _ = play(env, seeds, group_ids, rng)
        return Sampled(step, version, traj, weights_s, None, mix, run.layout, devices)

    def _finished(self, step: int) -> Sampled:
        if step not in self.pending:
            self.pending[step] = self.jobs.pop(step).result()  # a failed rollout raises here
        return self.pending[step]

    def drain(self) -> None:
        """Wait for every rollout in flight (before an evaluation or a checkpoint)."""
        for j in sorted(self.jobs):
            self._finished(j)

    def close(self) -> None:
        """Let the rollout in flight finish (its batch kept), drop the queued ones, stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for j, job in list(self.jobs.items()):
            if job.done() and not job.cancelled() and job.exception() is None:
                self.pending[j] = job.result()
        self.jobs.clear()

    def log_dict(self, done: Sampled) -> dict[str, Any]:
        """Where batch `done` was sampled (the rollout's layout and devices) and where experience and train ran."""
        learn = self.t.policy.planner.devices
        return {"parallel/rollout_mesh": str(done.layout.mesh), "parallel/rollout_tensor": done.layout.mesh.tensor,
                "parallel/rollout_fsdp": done.layout.mesh.fsdp, "parallel/rollout_devices": _ids(done.devices),
                "parallel/train_devices": _ids(d.id for d in learn), "time/rollout_wait_s": done.wait_s}

    # ------------------------------------------------------------------------------------------------ checkpoints
    def checkpoint(self, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The batches [step, step + K) a checkpoint of `step` must hold (finished first), as `to_checkpoint`."""
        self.drain()
        keep = [self.pending[j] for j in range(step, step + self.max_staleness) if j in self.pending]
        return to_checkpoint(keep)

    def restore(self, step: int, arrays: dict[str, Any], meta: list[dict[str, Any]]) -> None:
        """The batches a checkpoint of `step` held; one whose staleness at its iteration would pass this run's bound
        (a smaller --rollout.max-staleness than the run's) is dropped and sampled again with the restored weights."""
        for done in sorted(from_checkpoint(arrays, meta), key=lambda d: d.step):
            if done.step - done.version > self.max_staleness:
                log.warning("resume: the saved batch of iteration %d was sampled by version %d, %d behind; "
                            "--rollout.max-staleness %d: sampled again", done.step + 1, done.version,
                            done.step - done.version, self.max_staleness)
                if self.t.partial is not None:  # later batches continued its carried groups
                    break
                continue
            if done.step >= step:
                self.pending[done.step] = done


def _ids(ids) -> str:
    """Device ids as "4-7" when consecutive, else "0,2"."""
    ids = sorted(int(i) for i in ids)
    consecutive = len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1))
    return f"{ids[0]}-{ids[-1]}" if consecutive else ",".join(map(str, ids))

