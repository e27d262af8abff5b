"""The rollout stage as the RL loop runs it: where games decode, with which programs, and what comes back.

    stage = RolloutStage(cfg.rollout, policy, cfg.rollout.max_context)
    traj, dispatch_s = planner.run("rollout", lambda run: stage(run, weights_on_run, env, seeds, ...))

Placement: one sampler per rollout mesh (it keeps its compiled decode programs); in a multi-process job whose
rollout mesh holds a whole model per process, each process plays only its block of the games
(rollout/process_split.py) and the token columns stay on their process. Whether finished games leave the decode batch
and which decode programs compile ahead, when: the planner's program service decides (parallel/shapes.py), which
watches every sampler made here. With `--rollout.drafts K` the stage keeps a `DraftIndex` (rollout/drafts.py) across
iterations, fed by every training rollout and read by the next ones' model policies; it is not checkpointed (a resumed
run starts with an empty one).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from earl_jax.distributed import host_to_global
from earl_jax.parallel.planner import StageRun
from earl_jax.rl.stages.policy_setup import Policy
from earl_jax.rollout.agent_loop import Carried, PlayConfig, Trajectories, play_games
from earl_jax.rollout.drafts import DraftIndex
from earl_jax.rollout.frozen_opponent import FrozenPolicyOpponent
from earl_jax.rollout.policy import SamplerPolicy
from earl_jax.rollout.process_split import RowView, gather_trajectories, process_block
from earl_jax.rollout.rollout_config import RolloutConfig, parse_schedule
from earl_jax.rollout.sampler import DEFAULT_CACHE_BUCKETS, Sampler, SamplingConfig


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a rollout decodes: the mesh, the games this process plays, their sampler and weights, the smallest decode
    batch, and whether the games are split by process."""

    mesh: Mesh
    games: slice
    sampler: Sampler
    params: Any
    min_batch: int
    split: bool


class RolloutStage:
    """Plays one batch of games on the planned rollout layout (`__call__`); keeps the samplers and their programs."""

    def __init__(self, cfg: RolloutConfig, policy: Policy, max_context: int):
        self.cfg, self.graphdef, self.model_cfg = cfg, policy.graphdef, policy.model_cfg
        self.tokenizer, self.ids, self.codec, self.moves = policy.tokenizer, policy.ids, policy.codec, policy.moves
        self.cache_buckets, self.max_context = policy.cache_buckets or DEFAULT_CACHE_BUCKETS, max_context
        self.samplers: dict[Any, Sampler] = {}  # per rollout mesh (or process block of one)
        # decode rows of a pool of games: --rollout.slots, or the planner's count for -1 (0: every game)
        self.slots = (policy.rollout_planner or policy.planner).decode_rows
        self.shapes = policy.planner.shapes  # compaction and compiling ahead: when, and which programs
        self.pipeline_groups = 1  # the last rollout's pipeline groups (--rollout.pipeline-groups where it applied)
        self.decode_groups = 1  # the last rollout's decode groups (processes, when the games were split)
        self._league_device: tuple[Any, Any] | None = None  # (snapshot step, rollout mesh), weights there
        planner = policy.rollout_planner or policy.planner
        # --rollout.kv-pages, or the planner's count for -1 (0: contiguous rows)
        self.kv_pages = cfg.kv_pages if cfg.kv_pages >= 0 else planner.kv_pages
        if cfg.drafts and jax.process_count() > 1:
            raise ValueError("--rollout.drafts: drafts run in one process only (each process would need the same "
                             "index and rows); use --rollout.drafts 0")
        # training rollouts' answers, whole up to the longest turn budget, for the next ones (drafted K a step)
        longest = max([cfg.max_turn_tokens] + [t for _, t in parse_schedule(cfg.turn_tokens_schedule)])
        self.drafts = DraftIndex(max(longest, cfg.drafts)) if cfg.drafts else None

    @property
    def compile_count(self) -> int:
        return sum(sp.compile_count for sp in self.samplers.values())

    def __call__(self, run: StageRun, params: Any, env, seeds, group_ids, rng, sampling: SamplingConfig, *,
                 turn_tokens: int, league: tuple | None = None, training: bool = True,
                 league_params: Callable[[StageRun, int, Any], Any] | None = None,
                 interrupt: Callable[[], None] | None = None, token_budget: int = 0,
                 carried: Carried | None = None) -> Trajectories:
        """One game per row of `env`, decoded with `params` (already on `run`'s layout). `training` (False: an
        evaluation) decides what the next training rollout's programs are predicted from. `league`: the games a
        frozen snapshot plays (Matchmaker.league_games), decoded on the same sampler with its own cache.
        `token_budget`, `carried`: partial rollouts (rl/loop/partial.py, `PlayConfig.token_budget`)."""
        stops = (self.ids.eos_id,) if self.cfg.stop_at_eos else ()
        split = self.cfg.split_processes and league is None
        at = self._placement(run, params, len(seeds), split)
        games, sampler, min_batch, params = at.games, at.sampler, at.min_batch, at.params
        backend = jax.default_backend()
        k = self._pipeline_groups(len(range(len(seeds))[games]), min_batch, at.split or league is not None)
        drafts = self.drafts if training else None  # evaluations decode as they always have
        # an accelerator's decode loop holds the thread that launched it: a group must decode from a worker thread
        policies = [SamplerPolicy(sampler, params, sampling, stops, turn_tokens, moves=self.moves,
                                  background=k > 1 and backend != "cpu", drafts=drafts,
                                  draft_window=self.cfg.drafts, kv_pages=self.kv_pages) for _ in range(k)]
        compact = self.shapes.compact_now()
        unit = k * min_batch  # a pool's rows: whole decode batches in every pipeline group
        slots = 0 if league is not None else -(-self.slots // unit) * unit  # a frozen opponent draws by its calls
        play_cfg = PlayConfig(turn_tokens, self.cfg.max_turns, self.max_context,
                              constrain_moves=self.cfg.constrain_moves, compact=compact, pipeline_groups=k,
                              min_batch=min_batch, slots=slots, token_budget=token_budget,
                              budget_min_ended=self.cfg.budget_min_ended)
        self.pipeline_groups = k
        self.decode_groups = jax.process_count() if at.split else 1
        if league is not None:
            league_games, snap_step, snap = league
            frozen = SamplerPolicy(sampler, league_params(run, snap_step, snap), sampling, stops, turn_tokens,
                                   moves=self.moves, kv_pages=self.kv_pages)
            env.assign(FrozenPolicyOpponent(frozen, self.codec, jax.random.fold_in(rng, 0x0990),
                                            max_turn_tokens=turn_tokens, bos_id=self.ids.bos_id, min_batch=min_batch),
                       league_games)
        ids = np.asarray(np.arange(len(seeds)) if group_ids is None else group_ids)[games]
        try:
            traj = play_games(policies, RowView(env, games) if at.split else env, self.tokenizer, play_cfg, rng,
                              list(seeds)[games], ids, bos_id=self.ids.bos_id, codec=self.codec,
                              game_offset=games.start, interrupt=interrupt, carried=carried)
        finally:
            if league is not None:
                env.assign(None)
        if training:  # an evaluation's batch is its own: its programs would only compete with the next rollout's
            self.shapes.training_rollout_done(sampler, params, compact)
        if at.split:  # the token columns stay on their process: the experience stage places them from there
            traj = gather_trajectories(traj)
        if drafts is not None:
            traj.stats = dataclasses.replace(traj.stats, draft_proposed=sum(p.speculation.proposed for p in policies),
                                             draft_accepted=sum(p.speculation.accepted for p in policies))
            drafts.add_trajectories(traj)
        return traj

    def _pipeline_groups(self, n_games: int, min_batch: int, shared: bool) -> int:
        """--rollout.pipeline-groups for a batch it splits into whole decode batches; 1 for a batch it does not
        (an evaluation's, say), a process-split rollout (one fetch order on every process) or a league's games
        (the frozen opponent decodes on the same sampler). `rollout/pipeline_groups` records what ran."""
        k = self.cfg.pipeline_groups
        if k == 1 or shared or jax.process_count() > 1 or n_games % k or (n_games // k) % min_batch:
            return 1
        return k

    def _placement(self, run: StageRun, params: Any, n_games: int, split: bool) -> Placement:
        """With `split`, this process's block of the mesh and share of the games when the rollout can be split by
        process; else the whole mesh and batch."""
        block = process_block(run.mesh, params, n_games) if split else None
        if block is None:
            sampler = self._sampler(run.layout.mesh, run.mesh, run.rules)
            return Placement(run.mesh, slice(0, n_games), sampler, params, run.batch_shards, False)
        key = ("process", run.layout.mesh, tuple(d.id for d in block.mesh.devices.flat))
        shards = math.prod(block.mesh.shape[a] for a in run.batch_axes)
        return Placement(block.mesh, block.games, self._sampler(key, block.mesh, run.rules), block.params, shards, True)

    def _sampler(self, key: Any, mesh: Mesh, rules) -> Sampler:
        """The sampler of a rollout mesh, kept with its compiled programs."""
        if key not in self.samplers:
            impl = self.cfg.decode_impl if mesh.devices.size == 1 else "xla"
            self.samplers[key] = Sampler(self.graphdef, self.model_cfg, mesh=mesh, cache_buckets=self.cache_buckets,
                                         rules=rules, cache_dtype=self.cfg.cache_dtype, decode_impl=impl,
                                         page_size=self.cfg.page_size if self.kv_pages else 0)
        sampler = self.samplers[key]
        self.shapes.rollout_starts(sampler, self.max_context)  # the service records its shapes, may compile ahead
        return sampler

    def league_params(self, run: StageRun, step: int, snapshot: Any) -> Any:
        """A league snapshot's weights (host, compute dtype) on the rollout layout, kept there while it plays."""
        key = (step, run.layout.mesh)
        if self._league_device is None or self._league_device[0] != key:
            leaves, treedef = jax.tree.flatten(snapshot)
            targets = treedef.flatten_up_to(run.shardings(snapshot))
            self._league_device = (key, treedef.unflatten([host_to_global(x, s) for x, s in zip(leaves, targets)]))
        return self._league_device[1]


def timed_weights(fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn()'s weights, ready, and the seconds it took (the dispatch's share of a rollout)."""
    t0 = time.perf_counter()
    params = jax.block_until_ready(fn())
    return params, time.perf_counter() - t0
