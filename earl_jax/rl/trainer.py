"""The RL loop: rollout -> experience -> train, each run through `StagePlanner.run` under its own layout.

One iteration:
    planner.plan()                                      the rollout's layout, from the last batch's context
    weights train layout -> rollout layout             (dispatcher, device to device)
    rollout: B groups x G games in lock-step            (agent loop + sampler)
    planner.observe(this batch); planner.plan()         experience / train layouts for the batch they process
    experience: old/ref log-probs, micro-batched and chunked as planned; advantages
    batch experience layout -> train layout           (dispatcher)
    train: micro-batched PPO-clip update
    metrics (the layouts that ran), evaluation, checkpoint

Everything random derives from (seed, step), so a run killed and resumed from a checkpoint reaches the
same parameters as one that never stopped (bit-exact on CPU).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from earl_jax.compile_cache import CompileCount, count_compiles
from earl_jax.distributed import gather_ints, global_to_host, host_to_global
from earl_jax.envs import EnvConfig
from earl_jax.envs.vector import ObservationCodec, make_vector_env
from earl_jax.models.config import ModelConfig, get_config
from earl_jax.models.init import init_sharded
from earl_jax.models.tokenizer import game_tokenizer, special_ids
from earl_jax.parallel.dispatch import Dispatcher
from earl_jax.parallel.memory import device_memory_stats
from earl_jax.parallel.plan import ContextStats
from earl_jax.parallel.planner import StagePlanner, StageRun
from earl_jax.rl.checkpoint import Checkpointer
from earl_jax.rl.config import RLConfig
from earl_jax.rl.game_seeds import game_seeds
from earl_jax.rl.gc_control import GcClock, StartupPause, collect_and_freeze, manual_gc
from earl_jax.rl.league import host_copy
from earl_jax.rl.losses import LossConfig
from earl_jax.rl.matchmaking import Matchmaker
from earl_jax.rl.metrics import MetricsLogger
from earl_jax.rl.packing import (batch_width, grouped_logprobs, grouped_update, length_order, length_split,
                                 limit_new_widths, mini_batch_rows, rearrange, scored_spans)
from earl_jax.rl.stages import ExperienceBatch, advantage_step, make_optimizer, sft_batch
from earl_jax.rl.warmup import random_legal_games
from earl_jax.rollout.agent_loop import COMPACT_FACTOR, COMPACT_LEVELS, PlayConfig, Trajectories, play_games
from earl_jax.rollout.compile_ahead import CompileAhead
from earl_jax.rollout.device_groups import device_meshes, device_view
from earl_jax.rollout.frozen_opponent import FrozenPolicyOpponent
from earl_jax.rollout.moves import MoveTokens
from earl_jax.rollout.policy import SamplerPolicy
from earl_jax.rollout.process_split import RowView, allgather_rows, gather_trajectories, process_block
from earl_jax.rollout.sampler import (DEFAULT_CACHE_BUCKETS, Sampler, SamplingConfig, cast_weights,
                                      geometric_cache_buckets)
from earl_jax.watchdog import Watchdog

log = logging.getLogger(__name__)


def compile_ahead_now(mode: str, rollouts_done: int, backend: str) -> bool:
    """--compile-ahead: "auto" compiles ahead on accelerators from the second training rollout on. In the first the
    foreground compiles nearly all the time, and ahead compiles only competed with it (2 x H100: the 1.5B pod job's
    first rollout took 94 s with them against 74 s without; experiments/results/NOTES.md call 41)."""
    return mode == "true" or (mode == "auto" and rollouts_done > 0 and backend != "cpu")


def compact_now(mode: str | bool, rollouts_done: int, backend: str) -> bool:
    """--compact-finished: "auto" compacts on the CPU always and on accelerators from the second training rollout
    on. On 4 H100s the pod job's cold first rollout took 65.4 s with compaction and 40.9 s without (the smaller
    batches' decode programs compile for ~8 s each, while a decode step there costs about the same at 64 rows as
    at 16); later rollouts compile them ahead (results/NOTES.md calls 46 and 49)."""
    if isinstance(mode, bool):  # config.json of runs before "auto"
        return mode
    return mode == "true" or (mode == "auto" and (backend == "cpu" or rollouts_done > 0))


def stage_ahead_now(mode: str, backend: str) -> bool:
    """--compile-ahead for the experience / train programs (deferred widths, the optimizer update): "auto" on
    accelerators from the start. These are never guesses, and in the first iteration the update compiles beside
    the gradient program instead of after it."""
    return mode == "true" or (mode == "auto" and backend != "cpu")


def _device_memory() -> dict[str, float]:
    """Largest bytes in use / peak / limit over this process's devices, in GiB (GPU, TPU; {} on CPU)."""
    stats = [device_memory_stats(d) for d in jax.local_devices()]
    out = {}
    for key, name in (("bytes_in_use", "in_use_gib"), ("peak_bytes_in_use", "peak_gib"), ("bytes_limit", "limit_gib")):
        vals = [st[key] for st in stats if key in st]
        if vals:
            out[f"memory/{name}"] = max(vals) / 2**30
    return out


def _pad_cols(x: np.ndarray, width: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, width - x.shape[1])))


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where a rollout decodes (Trainer._placement): the mesh, the games this process plays, (sampler, weights)
    per decode group, the smallest decode batch, and whether the games are split by process / per device."""

    mesh: Mesh
    games: slice
    samplers: list[tuple[Sampler, Any]]
    min_batch: int
    split: bool
    device_groups: bool = False


class Trainer:
    def __init__(self, cfg: RLConfig, *, log: bool = True, env_factory: Callable[[EnvConfig], Any] | None = None):
        """`env_factory(env_config)` makes one game (default: an OpenSpiel text environment); tests and
        research forks pass their own environments with the same reset/step interface."""
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.is_main = jax.process_index() == 0
        self.dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(
            cfg.dtype, jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)

        # Model and tokenizer: a local Hugging Face folder, or a preset with the built-in game tokenizer.
        if cfg.hf_checkpoint:
            self.model_cfg = ModelConfig.from_hf_json(Path(cfg.hf_checkpoint) / "config.json")
        else:
            # A preset without a checkpoint is a random-init model of that shape that speaks the built-in
            # game tokenizer (its vocabulary replaces the preset's 152K: sampled ids must decode).
            self.tokenizer = game_tokenizer()
            self.model_cfg = get_config(cfg.model, vocab_size=self.tokenizer.get_vocab_size())
        self.remat = cfg.remat if cfg.remat != "auto" else ("none" if jax.default_backend() == "cpu" else "full")
        # --rollout-cache-growth: coarser KV cache sizes, so fewer decode programs; the memory model prices them
        coarse = geometric_cache_buckets(cfg.rollout_cache_growth) if cfg.rollout_cache_growth else None
        self.cache_buckets = coarse or DEFAULT_CACHE_BUCKETS
        self.planner = StagePlanner.from_config(cfg, self.model_cfg, remat=self.remat != "none", cache_buckets=coarse)
        train = self.planner.stage_run("train")
        if cfg.hf_checkpoint:
            from earl_jax.models.loader import from_pretrained

            model, self.tokenizer = from_pretrained(cfg.hf_checkpoint, mesh=train.mesh, rules=train.rules,
                                                    dtype=self.dtype, param_dtype=jnp.float32)
            if self.tokenizer is None:
                raise ValueError(f"--hf-checkpoint {cfg.hf_checkpoint}: no tokenizer.json in the folder")
        else:
            model = init_sharded(self.model_cfg, train.mesh, train.rules, seed=cfg.seed, dtype=self.dtype)
        self.ids = special_ids(self.tokenizer)
        model.remat = self.remat == "full"  # a static attribute: part of the graphdef the stages merge
        self.graphdef, self.params = nnx.split(model)
        self.dispatcher = Dispatcher()
        self._cast = jax.jit(lambda p: cast_weights(p, self.dtype))  # keeps each leaf's sharding
        # A frozen copy: the train stage donates (overwrites) the policy's buffers.
        self.ref_params = jax.tree.map(jnp.copy, self.params) if cfg.kl_coef > 0 else None

        self.loss_cfg = LossConfig(
            estimator=cfg.algorithm, clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
            dual_clip=cfg.dual_clip, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
            entropy_coef=cfg.entropy_coef, aggregation=cfg.aggregation, gamma=cfg.gamma,
            between_group_weight=cfg.between_group_weight, entropy_floor=cfg.entropy_floor,
            turn_discount=cfg.turn_discount, filter_constant_groups=cfg.filter_constant_groups)
        updates = cfg.ppo_epochs * cfg.ppo_mini_batches  # optimizer steps an iteration: the schedule counts those
        self.optimizer = make_optimizer(cfg.learning_rate, cfg.warmup_steps * updates, cfg.steps * updates,
                                        cfg.weight_decay, cfg.grad_clip)
        self.opt_state = self._place_opt_state(train, jax.jit(self.optimizer.init)(self.params))
        self.sft_optimizer = make_optimizer(3e-3, 5, max(cfg.format_warmup_steps, 6), 0.0, cfg.grad_clip)
        self.step = 0
        self._no_signal = 0  # consecutive iterations without a gradient (see iteration())
        self._widths_run: dict[tuple, set[int]] = {}  # micro-batch widths each stage program has run at
        self._samplers: dict[Any, Sampler] = {}  # per rollout mesh (or device of one): each keeps its programs
        self._ahead_failed_seen = 0  # compile-ahead failures already warned about
        self._rollouts_done = 0  # training rollouts finished (accelerators compile ahead and compact after the first)
        # experience / train programs compiled in the background: deferred widths, the optimizer update
        self._stage_ahead = CompileAhead() if stage_ahead_now(cfg.compile_ahead, jax.default_backend()) else None
        self._rollout_groups = 1  # the last rollout's decode groups (device groups x pipeline groups)
        self._gc = GcClock()  # the collector's pauses in an iteration (time/gc_pause_s), timed inside run()
        self.sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        self.rollout_cfg = PlayConfig(cfg.max_turn_tokens, cfg.max_turns, cfg.max_context,
                                         constrain_moves=cfg.constrain_moves)
        env_cfg = EnvConfig(game=cfg.game, opponent=cfg.opponent, agent_player=cfg.agent_player,
                            prompt_style=cfg.prompt_style, max_retries=cfg.invalid_retries,
                            win_reward=cfg.win_reward, loss_reward=cfg.loss_reward, draw_reward=cfg.draw_reward,
                            invalid_reward=cfg.invalid_reward, retry_reward=cfg.retry_reward,
                            blunder_penalty=cfg.blunder_penalty, blunder_depth=cfg.blunder_depth)
        self.env_cfg, self._env_factory = env_cfg, env_factory
        # the training opponent (fixed, or the curriculum's rung) and the league of frozen snapshots
        self.matchmaker = Matchmaker(cfg, env_cfg, env_factory, to_host=self._league_snapshot)
        self._league_device: tuple[Any, Any] | None = None  # (snapshot step, rollout mesh), weights there
        # every game of a batch stepped in one call (batched rules for Connect Four / Tic-Tac-Toe)
        self.env = self.matchmaker.train_env()
        self.eval_envs: dict[str, Any] = {}  # one per evaluation opponent, made on first use
        self.codec = ObservationCodec(self.tokenizer)
        # --constrain-moves: each action's token (rollout) and the static token tuple the stages score it over
        self.moves = MoveTokens.build(self.tokenizer, self.env.num_actions, self.ids.eos_id) if cfg.constrain_moves else None
        self.choice_tokens = self.moves.token_ids if self.moves else ()

        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=cfg.keep_checkpoints)
        if cfg.resume:
            self._restore()
        elif self.checkpointer.latest_step() is not None:
            raise ValueError(f"--run-dir {self.run_dir} already holds checkpoints: pass --resume to continue it, "
                             f"or choose a new --run-dir (refusing to overwrite a run)")
        self.logger = MetricsLogger(self.run_dir, dataclasses.asdict(cfg), wandb_mode=cfg.wandb_mode,
                                    project=cfg.wandb_project, resume_step=self.step if cfg.resume else None,
                                    enabled=log and self.is_main)
        if self.is_main and log:  # log=False (tests, evaluate_run.py) leaves the run folder as it is
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))

    # ---------------------------------------------------------------- checkpoints
    def _state(self) -> dict[str, Any]:
        mesh = self.planner.stage_run("train").mesh
        return {"params": self.params, "opt_state": self.opt_state,
                # a global (replicated) array: orbax cannot save a single-device array over several processes
                "rng": host_to_global(jax.random.key_data(jax.random.key(self.cfg.seed)), NamedSharding(mesh, P()))}

    def save(self) -> None:
        self.checkpointer.save(self.step, self._state(), {"step": self.step, "planner": self.planner.state_dict(),
                                                          "matchmaker": self.matchmaker.state_dict()})

    def _restore(self) -> None:
        step, state, meta = self.checkpointer.restore_latest(self._state())
        self.params, self.opt_state, self.step = state["params"], state["opt_state"], step
        self.planner.load_state_dict(meta.get("planner", {}))
        self.matchmaker.load_state_dict(meta.get("matchmaker") or {})  # the curriculum's rung
        self.env = self.matchmaker.train_env()

    # ---------------------------------------------------------------- layouts of the weights
    def _place_opt_state(self, run: StageRun, opt_state: Any) -> Any:
        """Optimizer state onto a train layout: moments follow their parameters, scalars are replicated."""
        params_target = run.shardings(self.params)
        replicated = NamedSharding(run.mesh, P())
        target = jax.tree.map(lambda sub: params_target if isinstance(sub, nnx.State) else replicated, opt_state,
                              is_leaf=lambda x: isinstance(x, nnx.State))
        return self.dispatcher(opt_state, target)

    def _params_for(self, run: StageRun, params: Any = None) -> Any:
        """Weights in `run`'s layout. The inference stages get them in the compute dtype, cast where they are
        (half the bytes to move, and what the memory model counts); the model casts at every use anyway."""
        params = self.params if params is None else params
        if run.stage != "train" and self.dtype != jnp.float32:
            params = self._cast(params)
        return self.dispatcher(params, run.shardings(params))

    # ---------------------------------------------------------------- stages
    def _rollout(self, env, seeds, group_ids, rng, sampling: SamplingConfig, league=None, training: bool = True
                 ) -> tuple[Trajectories, float]:
        """Play one game per row of `env` on the planned rollout layout; returns the episodes and the weights'
        dispatch time. `training` (False: an evaluation) decides what the next training rollout's programs are
        predicted from. `league` (Matchmaker.league_games): the games a frozen snapshot plays, decoded on the
        same sampler (its compiled programs) with its own cache."""
        turn_tokens = self.cfg.turn_tokens(self.step)
        stops = (self.ids.eos_id,) if self.cfg.stop_at_eos else ()

        def rollout(run: StageRun) -> tuple[Trajectories, float]:
            t0 = time.perf_counter()
            params = self._params_for(run)
            jax.block_until_ready(params)
            dispatch_s = time.perf_counter() - t0
            at = self._placement(run, params, len(seeds), split=self.cfg.rollout_split_processes and league is None)
            games, samplers, min_batch = at.games, at.samplers, at.min_batch
            per = self._pipeline_groups((games.stop - games.start) // len(samplers), min_batch)
            # several groups decode from worker threads, so one group's decode loop does not hold the host
            background = len(samplers) * per > 1 and not at.mesh.is_multi_process
            policies = [SamplerPolicy(sampler, p, sampling, stops, turn_tokens, moves=self.moves, background=background)
                        for sampler, p in samplers for _ in range(per)]
            compact = compact_now(self.cfg.compact_finished, self._rollouts_done, jax.default_backend())
            rollout_cfg = dataclasses.replace(self.rollout_cfg, max_turn_tokens=turn_tokens, compact=compact,
                                              pipeline_groups=len(policies), min_batch=min_batch)
            self._rollout_groups = len(policies) * (jax.process_count() if at.split else 1)
            if league is not None:
                league_games, snap_step, snap = league
                frozen_params = self._league_params(run, snap_step, snap)
                if at.device_groups:  # the league's games decode on the first device
                    frozen_params = device_view(frozen_params, samplers[0][0].mesh.devices.flat[0])
                frozen = SamplerPolicy(samplers[0][0], frozen_params, sampling, stops, turn_tokens, moves=self.moves)
                env.assign(FrozenPolicyOpponent(frozen, self.codec, jax.random.fold_in(rng, 0x0990),
                                                max_turn_tokens=turn_tokens, bos_id=self.ids.bos_id,
                                                min_batch=min_batch), league_games)
            ids = np.asarray(np.arange(len(seeds)) if group_ids is None else group_ids)[games]
            try:
                traj = play_games(policies, RowView(env, games) if at.split else env, self.tokenizer,
                                  rollout_cfg, rng, list(seeds)[games], ids, bos_id=self.ids.bos_id, codec=self.codec,
                                  game_offset=games.start)
            finally:
                if league is not None:
                    env.assign(None)
            if training:  # an evaluation's batch is its own: its programs would only compete with the next rollout's
                self._compaction_ahead(compact, samplers)
            if at.split:  # the token columns stay on their process: the experience stage places them from there
                traj = gather_trajectories(traj)
            return traj, dispatch_s

        return self.planner.run("rollout", rollout)

    def _compaction_ahead(self, compacted: bool, samplers: list[tuple[Sampler, Any]]) -> None:
        """After a rollout that did not compact, when the next one will (accelerators' first training rollout):
        compile the compacted batches' decode programs now, in the background during experience and train, rather
        than in the next rollout, which would wait for them (4 x H100, pod job: ~25 s of iteration 2's rollout,
        results/NOTES.md call 49)."""
        backend, after = jax.default_backend(), self._rollouts_done + 1
        if compacted or not compact_now(self.cfg.compact_finished, after, backend):
            return
        if not compile_ahead_now(self.cfg.compile_ahead, after, backend):
            return
        for sampler, params in samplers:
            sampler.start_compiling_ahead()
            sampler.compile_compaction_ahead(params, COMPACT_FACTOR, COMPACT_LEVELS)

    def _placement(self, run: StageRun, params: Any, n_games: int, split: bool) -> "_Placement":
        """Where a rollout decodes: with `split`, this process's block of the mesh and share of the games when the
        rollout can be split by process (rollout/process_split.py); then one SPMD decode over that mesh, or one
        group per device (`--rollout-device-groups`, rollout/device_groups.py)."""
        mesh, games, key, shards = run.mesh, slice(0, n_games), run.layout.mesh, run.batch_shards
        block = process_block(run.mesh, params, n_games) if split else None
        if block is not None:
            mesh, params, games = block.mesh, block.params, block.games
            key = ("process", run.layout.mesh, tuple(d.id for d in mesh.devices.flat))
            shards = math.prod(mesh.shape[a] for a in run.batch_axes)
        meshes = device_meshes(mesh, params, games.stop - games.start) if self.cfg.rollout_device_groups else None
        if meshes is None:
            return _Placement(mesh, games, [(self._sampler(key, mesh, run.rules), params)], shards, block is not None)
        devices = [m.devices.flat[0] for m in meshes]
        samplers = [(self._sampler(("device", d.id), m, run.rules), device_view(params, d)) for m, d in zip(meshes, devices)]
        return _Placement(mesh, games, samplers, 1, block is not None, device_groups=True)

    def _sampler(self, key: Any, mesh: Mesh, rules) -> Sampler:
        """The sampler of a rollout mesh (or of one device of it), kept with its compiled programs."""
        if key not in self._samplers:
            self._samplers[key] = Sampler(self.graphdef, self.model_cfg, mesh=mesh, cache_buckets=self.cache_buckets,
                                          rules=rules, max_len=self.cfg.max_context)
        sampler = self._samplers[key]
        if compile_ahead_now(self.cfg.compile_ahead, self._rollouts_done, jax.default_backend()):
            sampler.start_compiling_ahead()
        return sampler

    def _league_snapshot(self, params: Any) -> Any:
        """A league snapshot on the host, in the compute dtype (it only decodes)."""
        return host_copy(self._cast(params) if self.dtype != jnp.float32 else params)

    def _league_params(self, run: StageRun, step: int, snapshot: Any) -> Any:
        """The snapshot's weights on the rollout layout, kept there while the same snapshot plays."""
        key = (step, run.layout.mesh)
        if self._league_device is None or self._league_device[0] != key:
            leaves, treedef = jax.tree.flatten(snapshot)
            targets = treedef.flatten_up_to(run.shardings(snapshot))
            self._league_device = (key, treedef.unflatten([host_to_global(x, s) for x, s in zip(leaves, targets)]))
        return self._league_device[1]

    def _pipeline_groups(self, games: int, shards: int) -> int:
        """Groups of games that take turns on the device (each a multiple of the data shards), so the host
        steps one group while the device decodes another. auto (0) is 1: two groups decoding from worker
        threads were slower on one H100 (tiny model, 512 games: rollout 0.234 s against 0.167 s; call 27 in
        experiments/results/NOTES.md): the device's step time hardly shrinks with half the rows."""
        want = self.cfg.rollout_groups or 1
        while want > 1 and games % (want * shards):
            want -= 1
        return want

    def _batch_arrays(self, traj: Trajectories) -> dict[str, np.ndarray]:
        """The rows the experience stage computes on: the batch's, or this process's share (`traj.local_rows`)."""
        width = batch_width(traj.tokens.shape[1])
        groups = traj.group_ids if traj.local_rows is None else traj.group_ids[traj.local_rows]
        arrays = {"tokens": _pad_cols(traj.tokens, width), "loss_mask": _pad_cols(traj.loss_mask, width),
                  "rewards": _pad_cols(traj.rewards, width), "group_ids": groups}
        if self.moves is not None:  # free-text runs neither move nor keep the (all-zero) bitmasks
            arrays["choices"] = _pad_cols(traj.choices, width)
        return arrays

    def _experience(self, run: StageRun, arrays: dict[str, np.ndarray], lengths: np.ndarray,
                    rows: slice | None = None) -> tuple[ExperienceBatch, dict, np.ndarray]:
        """Old (and reference) log-probs by length-grouped micro-batches, then advantages. Returns the batch
        with its rows arranged by `packing.length_order` (the arrangement is returned too). `rows`: `arrays` hold
        only these rows of the batch (a split rollout's share on this process, `lengths` the whole batch's)."""
        params = self._params_for(run)
        ref = None if self.ref_params is None else self._params_for(run, self.ref_params)
        perm = length_order(lengths, run.batch_shards)
        if rows is not None and run.process_rows(len(lengths)) == rows:
            # each process places its own rows; the arrangement then moves rows device to device
            x = rearrange(run, run.put_process_rows(arrays, len(lengths)), perm)
        else:
            if rows is not None:  # this layout splits rows otherwise (a tensor axis across processes): gather them
                arrays = allgather_rows(arrays)
            x = run.put_rows({k: v[perm] for k, v in arrays.items()})
        micro, widths, ahead = self._split(run, lengths[perm], x["tokens"].shape)
        kw = dict(graphdef=self.graphdef, choices=x.get("choices"), choice_tokens=self.choice_tokens)
        old = grouped_logprobs(run, params, x["tokens"], widths, micro, ahead=ahead, **kw)
        ref_logp = old if ref is None else grouped_logprobs(run, ref, x["tokens"], widths, micro, **kw)
        fn = run.jit("advantages", advantage_step, num_groups=self.cfg.groups, loss_cfg=self.loss_cfg)
        out = fn(old, ref_logp, x["tokens"], x["loss_mask"], x["rewards"], x["group_ids"], x.get("choices"))
        return (*jax.block_until_ready(out), perm)  # an OOM must surface inside the planner's fallback

    def _train(self, run: StageRun, batch: ExperienceBatch, lengths: np.ndarray, arranged: np.ndarray
               ) -> dict[str, Any]:
        """PPO epochs of length-grouped updates, `cfg.ppo_mini_batches` an epoch. `batch` rows are `lengths`' rows
        in the order `arranged`. Metrics: the mean over the last epoch's updates."""
        t0 = time.perf_counter()
        # The selector may have moved training to another mesh: weights and optimizer state follow.
        self.params = self._params_for(run)
        self.opt_state = self._place_opt_state(run, self.opt_state)
        batch = self.dispatcher(batch, jax.tree.map(lambda x: run.row_sharding(x.ndim), batch))
        parts = []  # (mini-batch, its length split): each in this layout's arrangement (as many shards)
        for rows in mini_batch_rows(len(lengths), self.cfg.ppo_mini_batches, run.batch_shards):
            perm = rows[length_order(lengths[rows], run.batch_shards)]
            part = rearrange(run, batch, np.argsort(arranged)[perm])
            parts.append((part, self._split(run, lengths[perm], part.tokens.shape)))
        jax.block_until_ready([part for part, _ in parts])
        dispatch_s = time.perf_counter() - t0
        for _ in range(self.cfg.ppo_epochs):
            updates = []
            for part, (micro, widths, ahead) in parts:
                try:
                    self.params, self.opt_state, metrics = grouped_update(
                        run, self.params, self.opt_state, part, widths, micro, graphdef=self.graphdef, loss="policy",
                        loss_cfg=self.loss_cfg, optimizer=self.optimizer,
                        token_weighted=self.loss_cfg.aggregation == "token_mean", choice_tokens=self.choice_tokens,
                        ahead=ahead)
                    jax.block_until_ready(metrics)
                except Exception as e:
                    if any(x.is_deleted() for x in jax.tree.leaves(self.params)):  # donated buffers are gone
                        raise RuntimeError("the train stage failed after donating the weights; resume from the "
                                           "last checkpoint (--resume)") from e
                    raise
                updates.append(global_to_host(metrics))
        metrics = {k: float(np.mean([u[k] for u in updates])) for k in updates[0]}
        metrics["dispatch_s"] = dispatch_s
        return metrics

    def _split(self, run: StageRun, arranged_lengths: np.ndarray, shape: tuple[int, ...]):
        """`packing.length_split`, then at most cfg.new_widths_per_iteration widths this stage's programs have not
        run at yet (the model's program is per stage, mesh, chunk, micro-batch rows and width: packing.py); and,
        when compiling ahead, the queue and the new widths this iteration ran wider, for the next iteration."""
        micro, wanted = length_split(run, arranged_lengths, shape[1], self.cfg.length_split)
        key = (run.stage, str(run.layout.mesh), micro.rows, micro.shards, run.layout.logprob_chunk)
        seen = self._widths_run.setdefault(key, set())
        widths = limit_new_widths(wanted, seen, self.cfg.new_widths_per_iteration)
        seen.update(widths)
        deferred = sorted(set(wanted) - set(widths))
        return micro, widths, None if self._stage_ahead is None else (self._stage_ahead, deferred)

    def _plan_batch(self, arrays: dict[str, np.ndarray], mean_context_len: float, rows: int | None = None,
                    **extends: int) -> None:
        """Experience / train layouts for the batch they are about to process (its padded width is known); `rows`:
        the batch's rows where `arrays` hold one process's share."""
        n, width = arrays["tokens"].shape
        self.planner.observe(ContextStats(mean_context_len, width, rows or n, **extends))
        self.planner.plan()

    # ---------------------------------------------------------------- warm-up, evaluation
    def format_warmup(self) -> dict[str, float]:
        """Supervised steps on games of uniformly random LEGAL moves (from the rules, no sampling): teaches the
        answer format, not the game. Runs on the train layout planned for the warm-up's own batch.

        Every step has the same shape, so its three programs compile once: `--format-warmup-games` games (a
        multiple of the devices), cut to the length bucket of the first batch's 95th-percentile game (Connect
        Four, minimal style: 256 tokens; a cut game loses only late answers, the format is in every turn)."""
        cfg = self.cfg
        rng = np.random.default_rng(cfg.seed + 12345)
        n_dev = len(self.planner.devices)
        games = -(-(cfg.format_warmup_games or cfg.batch_size) // n_dev) * n_dev
        env = self.env if games == self.env.num_games else make_vector_env(
            dataclasses.replace(self.env_cfg, opponent=self.matchmaker.opponent), games, self._env_factory)
        opt_state = None
        metrics = {}
        width = None
        for i in range(cfg.format_warmup_steps):
            seeds = [10_000_000 + i * games + j for j in range(games)]
            tokens, mask, lengths = random_legal_games(env, self.tokenizer, seeds, rng, eos_id=self.ids.eos_id,
                                                       bos_id=self.ids.bos_id, max_context=cfg.max_context,
                                                       max_turns=cfg.max_turns, codec=self.codec)
            if width is None:  # one shape for every step: one compile of each warm-up program
                width = batch_width(int(np.percentile(lengths, 95)))
            lengths = np.minimum(lengths, width)
            arrays = {"tokens": _pad_cols(tokens[:, :width], width), "loss_mask": _pad_cols(mask[:, :width], width)}
            if i == 0:  # one plan for the warm-up (its games are all alike), not fed to the selector's smoothing
                self._plan_batch(arrays, float(lengths.mean()))

            def sft(run: StageRun):
                nonlocal opt_state
                self.params = self._params_for(run)
                opt_state = self._place_opt_state(run, jax.jit(self.sft_optimizer.init)(self.params)
                                                  if opt_state is None else opt_state)
                perm = length_order(lengths, run.batch_shards)
                x = run.put_rows({k: v[perm] for k, v in arrays.items()})
                micro = run.micro_batches(len(perm))
                batch = run.jit("sft_batch", sft_batch)(x["tokens"], x["loss_mask"])
                self.params, opt_state, out = grouped_update(
                    run, self.params, opt_state, batch, [width] * micro.count, micro, graphdef=self.graphdef,
                    loss="sft", loss_cfg=None, optimizer=self.sft_optimizer, token_weighted=True)
                return jax.block_until_ready(out)

            metrics = self.planner.run("train", sft, rerun_after_success=False)
        return {k: float(v) for k, v in global_to_host(metrics).items()}

    def _evaluate_logged(self, bar) -> dict[str, float]:
        """`evaluate`, a phase line, and the curriculum's promotion when the current rung is beaten."""
        from earl_jax.progress import phase

        opponents = ", ".join(self.matchmaker.eval_opponents())
        bar.status(f"evaluation vs {opponents}")
        with phase(f"evaluation: {self.cfg.eval_games} greedy games vs {opponents}") as p:
            out = self.evaluate()
            p.note(", ".join(f"{k} {v:.2f}" for k, v in out.items() if k.endswith("win_rate")))
        if "curriculum/eval_win_rate" in out:  # promotes (and logs a line) when the current rung is beaten
            self.matchmaker.after_evaluation(out["curriculum/eval_win_rate"], self.step)
        return out

    def evaluate(self, opponents: tuple[str, ...] | None = None) -> dict[str, float]:
        """Greedy games against each evaluation opponent and the curriculum's current rung, or against
        `opponents` (fixed seeds, so evaluations are comparable)."""
        out: dict[str, float] = {}
        greedy = SamplingConfig(greedy=True)
        for name in opponents or self.matchmaker.eval_opponents():
            env = self.eval_envs.get(name)
            if env is None:
                # evaluation reads outcomes only: no move judging (it would need the batched env for every opponent)
                eval_cfg = dataclasses.replace(self.env_cfg, opponent=name, blunder_penalty=0.0)
                env = self.eval_envs[name] = make_vector_env(eval_cfg, self.cfg.eval_games, self._env_factory)
            seeds = [20_000_000 + i for i in range(env.num_games)]
            traj, _ = self._rollout(env, seeds, None, jax.random.key(0), greedy, training=False)
            prefix = "eval" if name == self.cfg.eval_opponents[0] else f"eval_{name}"
            for k in ("win_rate", "draw_rate", "loss_rate", "invalid_rate"):
                out[f"{prefix}/{k}"] = getattr(traj.stats, k)
            if self.matchmaker.curriculum and name == self.matchmaker.curriculum.opponent:
                out["curriculum/eval_win_rate"] = traj.stats.win_rate
        return out

    # ---------------------------------------------------------------- the loop
    def rollout_inputs(self) -> tuple[list[int], np.ndarray, jax.Array]:
        """This iteration's game seeds (by --group-seeds: a GRPO group's games share one, or each has its own with
        the group's seat), group ids and sampling key."""
        cfg = self.cfg
        seeds = game_seeds([(cfg.seed * 1_000_003 + self.step * cfg.groups + g) % (2**31) for g in range(cfg.groups)],
                           cfg.group_size, cfg.group_seeds, seat_from_seed=cfg.agent_player is None)
        return seeds, np.repeat(np.arange(cfg.groups), cfg.group_size), jax.random.fold_in(jax.random.key(cfg.seed),
                                                                                           self.step)

    def iteration(self) -> dict[str, Any]:
        cfg = self.cfg
        self.planner.plan()  # the rollout's layout, from the last batch's statistics
        seeds, group_ids, rng = self.rollout_inputs()
        self._gc.take()  # time/gc_pause_s counts this iteration's pauses only (not evaluation's, nor --gc-every's)

        # every program traced or compiled in the iteration, eager ops' included: a slow iteration that compiled
        # nothing the stages count shows it here
        with count_compiles() as compiles:
            n_dispatch = len(self.dispatcher.history)
            t_start = time.perf_counter()
            self.env = self.matchmaker.train_env(self.step)  # a new env when the rung changed; the rung replayed
            league = self.matchmaker.league_games(self.step, self.params)
            traj, rollout_dispatch_s = self._rollout(self.env, seeds, group_ids, rng, self.sampling, league=league)
            self._rollouts_done += 1
            s = traj.stats
            arrays = self._batch_arrays(traj)
            # Experience and train are planned for the batch they process; the OOM fallback may still change them.
            self._plan_batch(arrays, s.turn_context_len_mean, traj.num_games, prompt_tokens=s.prompt_tokens,
                             first_cache_len=s.first_cache_len, observation_tokens=s.observation_tokens)
            # what experience and train compute: up to each row's last scored token
            spans = scored_spans(traj.loss_mask) if traj.spans is None else traj.spans
            t0 = time.perf_counter()
            batch, exp_metrics, arranged = self.planner.run(
                "experience", lambda run: self._experience(run, arrays, spans, traj.local_rows))
            t1 = time.perf_counter()
            # train updates (and donates) the weights: never rerun on a process where it already succeeded
            train_metrics = self.planner.run("train", lambda run: self._train(run, batch, spans, arranged),
                                             rerun_after_success=False)
            t2 = time.perf_counter()
        self.step += 1
        dispatch_s = rollout_dispatch_s + train_metrics.pop("dispatch_s")
        iteration_s, n_dev = t2 - t_start, len(self.planner.devices)
        # A zero gradient means every advantage was 0 (every group constant or filtered): the weights do not move
        # until some group's rewards vary again, so a collapsed policy stays collapsed. Say so (first, every 10th).
        self._no_signal = self._no_signal + 1 if train_metrics["grad_norm"] == 0.0 else 0
        if self._no_signal % 10 == 1:
            warnings.warn(f"iteration {self.step}: no learning signal for {self._no_signal} iteration(s) in a row (zero "
                          f"gradient; {float(exp_metrics.get('filtered_frac', 0.0)):.0%} of games in constant groups); "
                          "see --entropy-floor and --between-group-weight", RuntimeWarning, stacklevel=2)

        return {
            "step": self.step,
            "episode/return_mean": float(traj.returns.mean()),
            "episode/win_rate": s.win_rate, "episode/invalid_rate": s.invalid_rate,
            "episode/turns_mean": s.turns_mean, "episode/truncated_rate": s.truncated_rate,
            **({} if s.blunder_rate is None else {"rollout/blunder_rate": s.blunder_rate}),
            "rollout/context_len_mean": s.context_len_mean, "rollout/context_len_max": s.context_len_max,
            "rollout/turn_tokens": cfg.turn_tokens(self.step - 1),
            "rollout/turn_context_len_mean": s.turn_context_len_mean,
            "rollout/tokens": s.tokens, "rollout/generated_tokens": s.generated_tokens,
            "rollout/env_frac": s.env_s / max(s.rollout_s, 1e-9),
            "rollout/wait_frac": s.wait_s / max(s.rollout_s, 1e-9),
            "rollout/decode_rows": s.decode_rows, "rollout/groups": self._rollout_groups,
            "rollout/gather_frac": s.gather_s / max(s.rollout_s, 1e-9),
            "rollout/gather_wait_frac": s.gather_wait_s / max(s.rollout_s, 1e-9),
            # each process's own games (a rollout split by process; one process: the rollout itself)
            "rollout/process_min_s": min(s.process_rollout_s or (s.rollout_s,)),
            "rollout/process_max_s": max(s.process_rollout_s or (s.rollout_s,)),
            "time/rollout_s": s.rollout_s, "time/experience_s": t1 - t0, "time/train_s": t2 - t1,
            "time/dispatch_s": dispatch_s, "time/iteration_s": iteration_s,
            # tokens per device per second (EARL's TGS): generated tokens in the rollout, the batch's real
            # (unpadded) tokens in experience, train and the whole iteration
            "throughput/rollout_tgs": s.generated_tokens / max(s.rollout_s, 1e-9) / n_dev,
            "throughput/experience_tgs": s.tokens / max(t1 - t0, 1e-9) / n_dev,
            "throughput/train_tgs": s.tokens * cfg.ppo_epochs / max(t2 - t1, 1e-9) / n_dev,
            "throughput/iteration_tgs": s.tokens / max(iteration_s, 1e-9) / n_dev,
            "time/dispatch_share": dispatch_s / max(iteration_s, 1e-9),
            "train/loss": train_metrics["loss"], "train/kl": train_metrics.get("kl", 0.0),
            "train/entropy": train_metrics.get("entropy", 0.0), "train/grad_norm": train_metrics["grad_norm"],
            "train/clip_frac": train_metrics.get("clip_frac", 0.0), "train/skipped": train_metrics["skipped"],
            "train/filtered_frac": float(exp_metrics.get("filtered_frac", 0.0)),
            "train/no_signal_iters": self._no_signal,
            "dispatch/bytes": sum(h.bytes for h in self.dispatcher.history[n_dispatch:]),
            **self._peer_maxima(compiles),
            **self.planner.ran_log_dict(), **_device_memory(), **self.matchmaker.metrics(),
            **self._league_metrics(traj, league), **self._mix_metrics(traj),
        }

    def _peer_maxima(self, compiles: CompileCount) -> dict[str, Any]:
        """Compiled programs, this iteration's compiles and collector pauses, the most of any process: each process of
        a split rollout compiles for its own games' shapes, and pauses on its own (one slow process holds up the
        others)."""
        decode = sum(sp.compile_count for sp in self._samplers.values())
        mine = (decode, round(self._gc.take() * 1e6), compiles.lowered, round(compiles.backend_s * 1e6))
        rows = gather_ints(*mine) if jax.process_count() > 1 else [mine]
        decode, paused_us, lowered, compile_us = (max(col) for col in zip(*rows))
        ahead = [sp.ahead for sp in self._samplers.values() if sp.ahead is not None]
        ahead += [self._stage_ahead] if self._stage_ahead is not None else []
        failed = [f for a in ahead for f in a.failed]
        if len(failed) > self._ahead_failed_seen:  # a miss only (the real call compiles), but say why once per new one
            log.warning("compiling ahead failed for %d program(s), e.g. %s: %s", len(failed) - self._ahead_failed_seen,
                        *failed[self._ahead_failed_seen])
            self._ahead_failed_seen = len(failed)
        return {"compile/programs": len(self.planner.programs) + decode, "time/gc_pause_s": paused_us / 1e6,
                "compile/lowered": lowered, "time/compile_s": compile_us / 1e6,
                # this process's tracing and lowering (foreground): the part of a start no compile cache saves
                "time/trace_s": compiles.trace_s, "time/lower_s": compiles.lower_s,
                "compile/slowest": compiles.slowest(),  # this process's: names to look for when an iteration is slow
                # this process's compiles on compile-ahead threads (rollout/compile_ahead.py)
                "compile/ahead": compiles.ahead, "time/compile_ahead_s": compiles.ahead_s,
                "compile/ahead_failed": len(failed),
                # of the programs submitted so far, those a real call then asked for (the rest was a wrong guess)
                "compile/ahead_submitted": sum(a.submitted for a in ahead), "compile/ahead_used": sum(len(a.used) for a in ahead),
                "time/compile_ahead_waited_s": sum(a.waited_s for a in ahead)}

    def _mix_metrics(self, traj: Trajectories) -> dict[str, Any]:
        """Outcomes against --mix-opponent and against the other opponent, apart."""
        games = self.matchmaker.mix_games()
        if games is None:
            return {}
        won, drew = (np.array([w == o for w in traj.winners]) for o in ("agent", "draw"))
        return {"mix/games_frac": float(games.mean()), "mix/win_rate": float(won[games].mean()),
                "mix/draw_rate": float(drew[games].mean()), "mix/other_win_rate": float(won[~games].mean()),
                "mix/other_draw_rate": float(drew[~games].mean())}

    def _league_metrics(self, traj: Trajectories, league) -> dict[str, Any]:
        """Outcomes of the games against the frozen snapshot and against the scripted opponent, apart."""
        if league is None:
            return {}
        games, snap_step, _ = league
        won = np.array([w == "agent" for w in traj.winners])
        return {"league/games_frac": float(games.mean()), "league/snapshot_step": snap_step,
                "league/win_rate": float(won[games].mean()),
                "league/scripted_win_rate": float(won[~games].mean()) if (~games).any() else float("nan"),
                "league/opponent_fallback_rate": self.env.policy_fallbacks / max(self.env.policy_moves, 1)}

    def run(self, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Train to cfg.steps (or cfg.max_minutes). `stop_after` ends the process's work after that many
        iterations without the end-of-run evaluation or checkpoint, as a kill would (resume tests)."""
        from earl_jax.progress import phase, process_age_s
        from earl_jax.rl.progress import Progress

        cfg = self.cfg
        start = time.perf_counter()
        history = []
        last_eval: dict[str, float] = {}
        # a live bar in a terminal; elsewhere (logs, CI) one plain line per phase and iteration instead
        dog = Watchdog(cfg.stall_minutes * 60, f"training in {self.run_dir}", on_fire=self.logger.close,
                       hint=f"the newest checkpoint is in {self.run_dir / 'checkpoints'}: run again with --resume")
        with Progress(cfg.steps, enabled=cfg.progress and self.is_main and sys.stderr.isatty()) as bar, \
                self._gc, manual_gc(cfg.gc_every), StartupPause(cfg.gc_every == 0) as startup, dog:
            warmup = self.step == 0 and cfg.format_warmup_steps > 0
            if warmup and cfg.constrain_moves:
                log.info("format warm-up skipped: constrained moves (--constrain-moves) have no answer format to learn")
                warmup = False
            dog.beat("the start: format warm-up or the first evaluation")
            if warmup:
                bar.status("format warm-up (random legal moves)")
                with phase(f"format warm-up: {cfg.format_warmup_steps} supervised steps on random legal games"):
                    warm = self.format_warmup()
                last_eval = self._evaluate_logged(bar)
                self.logger.log({"step": 0, **{f"warmup/{k}": v for k, v in warm.items()}, **last_eval,
                                 "eval/fresh": True})
            elif self.step == 0:  # the curves start from the untrained policy
                last_eval = self._evaluate_logged(bar)
                self.logger.log({"step": 0, **last_eval, "eval/fresh": True})
            bar.advance_to(self.step)
            while self.step < cfg.steps:
                if stop_after is not None and len(history) >= stop_after:
                    return history
                bar.status(f"iteration {self.step + 1}")
                dog.beat(f"iteration {self.step + 1}")
                record = self.iteration()
                t_gc = time.perf_counter()
                startup.end()  # the collector back on after the first iteration (time/gc_s counts its collection)
                if cfg.gc_every and self.step % cfg.gc_every == 0:  # every process at the same iteration
                    collect_and_freeze()
                record["time/gc_s"] = time.perf_counter() - t_gc  # the scheduled collection (--gc-every)
                if not history:  # what a user waits for: the command to the first finished iteration
                    age = process_age_s()
                    record["time/command_to_first_iteration_s"] = age
                    log.info("first RL iteration finished %.1f s after the command (rollout %.1f s, experience "
                             "%.1f s, train %.1f s, compiles included)", age or float("nan"), record["time/rollout_s"],
                             record["time/experience_s"], record["time/train_s"])
                last_step = self.step == cfg.steps
                out_of_time = cfg.max_minutes and (time.perf_counter() - start) / 60 > cfg.max_minutes
                evaluated = bool((cfg.eval_every and self.step % cfg.eval_every == 0) or last_step or out_of_time)
                if evaluated:
                    dog.beat(f"the evaluation after iteration {self.step}")
                    last_eval = self._evaluate_logged(bar)
                record.update(last_eval)  # carried between evaluations; eval/fresh marks a new one
                record["eval/fresh"] = evaluated
                record["time/elapsed_s"] = time.perf_counter() - start
                self.logger.log(record)
                history.append(record)
                bar.update(self.step, record)
                if not bar.enabled:  # no live display (not a terminal, or --progress false): one line per iteration
                    log.info("iteration %d/%d: return %+.2f, win %.2f, context %.0f, %.2f s (rollout %.2f, "
                             "experience %.2f, train %.2f), meshes %s / %s / %s", self.step, cfg.steps,
                             record["episode/return_mean"], record["episode/win_rate"],
                             record["rollout/context_len_mean"], record["time/iteration_s"], record["time/rollout_s"],
                             record["time/experience_s"], record["time/train_s"], record["parallel/rollout_mesh"],
                             record["parallel/experience_mesh"], record["parallel/train_mesh"])
                if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or last_step or out_of_time:
                    dog.beat(f"the checkpoint after iteration {self.step}")
                    self.save()
                if out_of_time:
                    break
        self.logger.close()
        self.checkpointer.close()
        return history
