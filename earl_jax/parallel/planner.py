"""The one entry point through which every stage runs under its plan.

`StagePlanner.run(stage, fn)` calls `fn(run)` with a `StageRun`: the stage's `StageLayout` (from the
Parallelism Selector's current `StagePlan`), its `Mesh` and logical-axis rules, the row sharding taken
from the rules table's "batch" entry, the micro-batch split and the compiled programs. An out-of-memory
error reruns `fn` on the next layout (auto mode) or ends the run naming the stage (static mode); on GPUs a stage
program's first call raises one before it runs when XLA's sizes exceed a device's free memory
(`memory_check.py`: a device out of memory inside a multi-device program can hang the others instead). Nothing
else in the trainer builds a mesh, a row sharding or a jit: what the selector decides is what runs.

    planner.plan()                                       # once per iteration: the rollout's layout
    traj = planner.run("rollout", lambda run: play(run.mesh, ...))
    planner.plan_batch(ContextStats(...))                # experience / train for the batch they process
    batch = planner.run("experience", lambda run: run.jit("experience", experience_stage, ...)(...))

Micro-batches have one meaning everywhere: `StageLayout.micro_batch` is rows per batch shard (one slice of
the rules' batch axes: data, or data x fsdp in training), what the memory model sizes. `StageRun.micro_batches`
is the only place that turns it into a count of micro-batches for a batch of global rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from functools import partial
from typing import Any, Callable, Mapping, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from earl_jax import distributed
from earl_jax.compile_cache import count_compiles
from earl_jax.models.model_config import ModelConfig
from earl_jax.parallel import memory_check, pool_memory
from earl_jax.parallel.fallback import OtherProcessFailedError, OtherProcessOOMError, run_with_oom_fallback  # noqa: F401
from earl_jax.parallel.first_call_gate import FirstCallGate
from earl_jax.parallel.memory import MemoryConfig, candidate_meshes, mesh_problem
from earl_jax.parallel.plan import ContextStats, StageLayout, StagePlan
from earl_jax.parallel.planner_config import PlannerConfig
from earl_jax.parallel.profile import ProfileTable, is_oom_error
from earl_jax.parallel.selector import ParallelismSelector
from earl_jax.parallel.selector_config import SelectorConfig, default_bucket_edges
from earl_jax.parallel.shapes import ProgramShapes
from earl_jax.parallel.thresholds import parse_thresholds
from earl_jax.rollout.compile_ahead import spec_of
from earl_jax.sharding.context import use_mesh_rules
from earl_jax.sharding.mesh import MeshShape, Rules, batch_axes, logical_sharding, make_mesh, state_shardings
from earl_jax.sharding.stage_registry import stage_names, stage_spec

log = logging.getLogger(__name__)
T = TypeVar("T")
SHOW_FIRST_CALL_S = 1.0  # a stage program's first call this slow gets an INFO line


def _checked_thresholds(cfg: PlannerConfig, model_cfg: ModelConfig, num_devices: int, stage: str,
                        batch_size: int) -> list[tuple[int, MeshShape]]:
    """`--planner.<stage>-thresholds` parsed and checked against the model and the job before anything compiles; an
    error names the flag, the mesh and what is wrong with it (devices, heads, fsdp, the batch)."""
    flag = f"--planner.{stage}-thresholds"
    try:
        entries = parse_thresholds(cfg.thresholds(stage))
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    for _, mesh in entries:
        why = mesh_problem(model_cfg, num_devices, stage, mesh)
        if why is None and batch_size % (mesh.data * mesh.fsdp):
            why = (f"splits rows over {mesh.data * mesh.fsdp} batch shards (data x fsdp), which the batch of "
                   f"{batch_size} games (--rollout.groups x --rollout.group-size) does not divide")
        if why is not None:
            valid = [str(m) for m in candidate_meshes(model_cfg, num_devices, stage)
                     if batch_size % (m.data * m.fsdp) == 0]
            raise ValueError(f"{flag}: {mesh} {why}; valid {stage} meshes here: {', '.join(valid) or 'none'}")
    return entries


@dataclasses.dataclass(frozen=True)
class MicroBatches:
    """How a batch of global rows splits: `count` micro-batches of `rows` global rows, each taking
    rows / shards rows from every batch shard (so every device computes its own rows, no reshard)."""

    count: int
    rows: int  # global rows in one micro-batch
    shards: int  # batch shards the rows are spread over

    @property
    def rows_per_shard(self) -> int:
        return self.rows // self.shards


@dataclasses.dataclass(frozen=True)
class StageRun:
    """What a stage receives from its plan: the layout, and everything derived from it."""

    stage: str
    layout: StageLayout
    mesh: Mesh
    rules: Rules
    programs: "ProgramCache" = dataclasses.field(repr=False, compare=False)

    @property
    def shapes(self) -> ProgramShapes:
        """The planner's program service: the widths this stage's micro-batches run at, what compiles ahead."""
        return self.programs.shapes

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes rows are split over: the rules table's "batch" entry."""
        return batch_axes(self.mesh, self.rules)

    @property
    def batch_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def row_sharding(self, ndim: int = 2) -> NamedSharding:
        """Rows (the leading dimension) over the batch axes, everything else replicated."""
        return logical_sharding(self.mesh, self.rules, ("batch",) + (None,) * (ndim - 1))

    def put_rows(self, arrays: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host arrays [rows, ...] (the same on every process) onto the mesh, rows over the batch axes."""
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        for k, v in arrays.items():
            if v.shape[0] % self.batch_shards:
                raise ValueError(f"{self.stage}: {v.shape[0]} rows of {k!r} do not split over {self.batch_shards} "
                                 f"batch shards of mesh {self.layout.mesh}")
        placed = distributed.hosts_to_global(list(arrays.values()),
                                             [self.row_sharding(v.ndim) for v in arrays.values()])
        return dict(zip(arrays, placed))

    def process_rows(self, rows: int) -> slice | None:
        """The rows of a `rows`-row batch this process's devices hold under `row_sharding`, when every process
        holds exactly its equal share in process order (rows [p rows/P, (p+1) rows/P), as a rollout split by process
        plays them); else None (e.g. a tensor axis across processes)."""
        n_proc = jax.process_count()
        if rows % n_proc:
            return None
        held: dict[int, set[tuple[int, int]]] = {}
        for device, (index,) in self.row_sharding(1).devices_indices_map((rows,)).items():
            held.setdefault(device.process_index, set()).add(index.indices(rows)[:2])
        share = rows // n_proc
        for proc, spans in held.items():
            lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
            if (lo, hi) != (proc * share, (proc + 1) * share) or sum(b - a for a, b in spans) != share:
                return None
        me = jax.process_index()
        return slice(me * share, (me + 1) * share)

    def put_process_rows(self, arrays: Mapping[str, np.ndarray], rows: int) -> dict[str, jax.Array]:
        """This process's share of a `rows`-row batch (`process_rows`) onto the mesh, rows over the batch axes, as
        one global array per key: no process sends its rows to another."""
        if self.process_rows(rows) is None:
            raise ValueError(f"{self.stage}: mesh {self.layout.mesh} does not hold a batch's rows per process")
        return {k: jax.make_array_from_process_local_data(self.row_sharding(v.ndim), np.asarray(v),
                                                          (rows, *v.shape[1:]))
                for k, v in arrays.items()}

    def shardings(self, state: Any) -> Any:
        """Target shardings of a parameter state (nnx.State) under this stage's rules."""
        return state_shardings(state, self.mesh, self.rules)

    def micro_batches(self, rows: int) -> MicroBatches:
        """The one conversion of the plan's micro-batch (rows per batch shard) into a split of `rows` global
        rows: the fewest micro-batches of at most `micro_batch` rows per shard that divide the shard evenly."""
        if self.layout.micro_batch is None:
            raise ValueError(f"{self.stage}: its layout has no micro-batch ({self.layout.describe()})")
        shards = self.batch_shards
        if rows % shards:
            raise ValueError(f"{self.stage}: {rows} rows do not split over {shards} batch shards")
        per_shard = rows // shards
        count = next(k for k in range(-(-per_shard // self.layout.micro_batch), per_shard + 1) if per_shard % k == 0)
        return MicroBatches(count, rows // count, shards)

    def jit(self, name: str, fn: Callable, *, donate: tuple[int, ...] = (), **static: Any) -> Callable:
        """`fn(*args, **static)` compiled for this stage's mesh, traced under its logical-axis rules; one
        compiled program per (stage, name, mesh, static settings, argument shapes)."""
        return self.programs.get(self, name, fn, donate, static)

    def ahead(self, program: Callable, *args: Any, output_as_arg: int | None = None) -> None:
        """`program` (a `jit` of this run) compiled for `args` in the background, if the program service compiles
        stage programs ahead (`ProgramCache.ahead`)."""
        self.programs.ahead(program, *args, output_as_arg=output_as_arg)


# Experience and train programs on a multi-device GPU mesh compile without XLA's latency-hiding scheduler. With
# it, a data-parallel grad step of Qwen2.5-1.5B (4 layers, 16 rows x 2048 per device, 2 H100s) asked for 11.8 GiB
# of temp against 3.8 on one device: the scheduler moves work early to overlap the gradient all-reduces and
# keeps activations alive for it, sized to the whole device's memory rather than to the stage's share, which
# the memory model cannot see (the 4-H100 pod run's train stage asked for 50 GiB and ran out of memory). Off:
# 3.85 GiB, the one-device plan (experiments/lab/probe_train_collectives.py). The rollout keeps it:
# its memory is the cache, an argument. EARL_XLA_LHS=1 keeps the scheduler everywhere.
NO_LATENCY_HIDING = {"xla_gpu_enable_latency_hiding_scheduler": False}


def stage_compiler_options(stage: str, mesh: Mesh) -> dict[str, Any] | None:
    """XLA options for a stage's programs on `mesh` (None: XLA's defaults)."""
    if stage_spec(stage).memory == "decode" or mesh.devices.size == 1 or os.environ.get("EARL_XLA_LHS") == "1":
        return None
    return dict(NO_LATENCY_HIDING) if mesh.devices.flat[0].platform == "gpu" else None


class ProgramCache:
    """The stages' compiled programs: one jit per (stage, name, mesh, static settings), and a record of every
    (stage, name, mesh, argument shapes) that ran, i.e. every compiled program (`len(cache)`), with a log
    line for each first call. `ahead` compiles a program for arguments it has not run at yet, in the background (when
    the program service compiles stage programs ahead); a first call waits for such a compile."""

    def __init__(self, shapes: ProgramShapes | None = None):
        self.shapes = shapes if shapes is not None else ProgramShapes()
        self._jits: dict[tuple, Callable] = {}
        self.seen: set[tuple] = set()
        self.gate: FirstCallGate | None = None  # set while rollouts run ahead on another thread (rl/loop/overlap.py)

    def __len__(self) -> int:
        return len(self.seen)

    def get(self, run: StageRun, name: str, fn: Callable, donate: tuple[int, ...], static: dict[str, Any]) -> Callable:
        key = (run.stage, name, run.layout.mesh, tuple(sorted(static.items(), key=lambda kv: kv[0])))
        if key not in self._jits:
            body = partial(fn, **static)

            def traced(*args):
                with use_mesh_rules(run.mesh, run.rules):
                    return body(*args)

            traced.__name__ = traced.__qualname__ = f"{run.stage}_{name}"  # what compile logs and metrics name
            jitted = jax.jit(traced, donate_argnums=donate,
                             compiler_options=stage_compiler_options(run.stage, run.mesh))

            def signature(args) -> tuple:
                """Every argument's shape and dtype: what makes jit compile again (a 1-D array's length included)."""
                leaves = [x for x in jax.tree.leaves(args) if hasattr(x, "shape")]
                return (run.stage, name, str(run.layout.mesh), key[3], tuple((x.shape, str(x.dtype)) for x in leaves))

            def call(*args):
                sig = signature(args)
                if sig in self.seen:
                    return jitted(*args)
                if self.shapes.stage_queue is not None:
                    self.shapes.stage_queue.wait(sig)
                # logged: the last 2-D argument (the batch or micro-batch; model programs take the weights first)
                shapes = tuple(tuple(x.shape) for x in jax.tree.leaves(args) if hasattr(x, "shape") and x.ndim >= 2)
                t0 = time.perf_counter()
                gate = self.gate.first_call() if self.gate is not None else contextlib.nullcontext()
                with gate, count_compiles() as c:  # where the time goes: tracing and lowering run every start
                    # compiled here only on devices with a known limit; the call below finds the executable
                    memory_check.check_fits(lambda: jitted.lower(*args).compile(), run.mesh.devices.flat,
                                            f"{run.stage}/{name} on {run.layout.mesh}")
                    out = jitted(*args)
                    if self.gate is not None:  # the first execution sets cuDNN's graphs up: done before a rollout
                        jax.block_until_ready(out)
                self.seen.add(sig)
                width = f", width {static['width']}" if "width" in static else ""
                seconds = time.perf_counter() - t0
                # one line per new program that cost a user time; the instant ones (cached, tiny) at debug level
                log.log(logging.INFO if seconds >= SHOW_FIRST_CALL_S else logging.DEBUG,
                        "%s/%s on %s, batch %s%s: first call (compile or cache load) %.1f s (trace %.1f, lower %.1f, "
                        "compile or load %.1f)", run.stage, name, run.layout.mesh, shapes[-1] if shapes else "-",
                        width, seconds, c.trace_s, c.lower_s, c.backend_s)
                return out

            call.jitted, call.signature = jitted, signature  # for compiling ahead (`ahead`)
            self._jits[key] = call
        return self._jits[key]

    def ahead(self, program: Callable, *args: Any, output_as_arg: int | None = None) -> None:
        """Compile `program` (one of `get`'s) for `args` (arrays: their specs, taken now, before a call donates them)
        in the background, when the program service compiles stage programs ahead; its first call waits for it.
        `output_as_arg=i`: also the variant whose argument i is the program's own output (a gradient accumulator
        after the first micro-batch carries the program's output shardings, which XLA may choose apart from the
        fresh one's; jit compiles one program per sharding: the same one, if they agree)."""
        queue = self.shapes.stage_queue
        if queue is None or (sig := program.signature(args)) in queue or sig in self.seen:
            return
        specs, jitted = jax.tree.map(lambda x: spec_of(x) if isinstance(x, jax.Array) else x, args), program.jitted

        def compile_job():
            lowered = jitted.lower(*specs)
            compiled = lowered.compile()
            if output_as_arg is not None:  # the output's shardings are known once compiled
                out = jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh),
                                   lowered.out_info, compiled.output_shardings)
                jitted.lower(*specs[:output_as_arg], out, *specs[output_as_arg + 1:]).compile()

        queue.submit(sig, compile_job)


class StagePlanner:
    """The selector's plan per iteration, a Mesh per mesh shape, and `run`, the stages' one entry point."""

    def __init__(self, selector: ParallelismSelector, devices: list[jax.Device], num_responses: int,
                 first_context_len: int = 64, static: bool = False, shapes: ProgramShapes | None = None):
        """`static`: keep the first plan for the whole run, no fallback (the baseline the selector is measured
        against). `shapes`: the program service (parallel/shapes.py; default: nothing compiled ahead, the plan's
        micro-batches at their own widths)."""
        self.selector, self.devices, self.static = selector, devices, static
        self.num_responses = num_responses
        self.kv_pages = 0  # a paged rollout cache's pages per pipeline group (from_config; 0: contiguous rows)
        self._meshes: dict[MeshShape, Mesh] = {}
        self._stats = ContextStats(first_context_len, first_context_len, num_responses)
        self._fresh = False  # whether _stats holds an observation the selector has not seen yet
        self.current: StagePlan = selector.plan(self._stats)
        self.ran: dict[str, StageLayout] = {}  # the layout each stage last ran on (after any fallback)
        self._reported: dict[str, str] = {}  # the layouts ran_log_dict last explained
        self._unlogged: set[str] = set()  # stages planned when they run that ran since their layout was logged
        self.programs = ProgramCache(shapes)
        self.shapes = self.programs.shapes

    @classmethod
    def from_config(cls, cfg: PlannerConfig, model_cfg: ModelConfig, batch_size: int, *, remat: bool = True,
                    cache_buckets: tuple[int, ...] | None = None, kv_cache_bytes: int = 2,
                    devices: list[jax.Device] | None = None, stages: tuple[str, ...] | None = None,
                    shapes: ProgramShapes | None = None, decode_rows: int = 0,
                    max_context: int | None = None, draft_tokens: int = 0, kv_pages: int = 0, page_size: int = 16,
                    pipeline_groups: int = 1) -> "StagePlanner":
        """The planner of a job of `batch_size` games a rollout; a layout that does not fit the model or the batch
        is refused here, before anything compiles, naming the flag. `devices` (default: --planner.devices of all)
        and `stages` (the ones it plans each iteration; default: those registered so): a share of the devices
        planned for some stages alone (parallel/split.py). `shapes`: the job's program service (parallel/shapes.py),
        shared by the planners of one job. `decode_rows`: --rollout.slots (the rollout holds that many rows at once:
        its memory is planned for them; 0: every game; -1: as many as the rollout's memory holds at `max_context`, the
        longest context a game reaches, by the memory model: `planner.decode_rows` says how many, 0 when every game).
        `kv_pages`: a paged rollout cache's pages of `page_size` positions in each of `pipeline_groups` (0: contiguous
        rows; -1: as many as the rollout's memory holds at `max_context` beside the rest, `planner.kv_pages` says how
        many; parallel/pool_memory.py)."""
        devices = jax.devices()[: cfg.devices or None] if devices is None else list(devices)
        planned = stages or stage_names("each_iteration")
        thresholds = {s: v for s in (stages or stage_names())
                      if (v := _checked_thresholds(cfg, model_cfg, len(devices), s, batch_size))}
        for stage in planned:  # they process its batch: rows shard over data (x fsdp)
            if not any(batch_size % (m.data * m.fsdp) == 0 for m in candidate_meshes(model_cfg, len(devices), stage)):
                raise ValueError(f"--rollout.groups x --rollout.group-size = {batch_size} games do not split over "
                                 f"any {stage} mesh of {len(devices)} devices: use a multiple of the device count")
        sel_cfg = SelectorConfig(bucket_edges=cfg.edges or default_bucket_edges(model_cfg), margin=cfg.margin,
                                 ema_alpha=cfg.ema, thresholds=thresholds or None, stages=stages)
        budget = int(cfg.memory_budget_gib * 2**30) or None
        memory = MemoryConfig(budget_bytes=budget, remat=remat, max_logprob_chunk=cfg.logprob_chunk,
                              max_micro_batch_tokens=cfg.micro_batch_tokens, cache_buckets=cache_buckets,
                              kv_cache_bytes=kv_cache_bytes, draft_tokens=draft_tokens,
                              kv_positions=max(kv_pages, 0) * page_size * pipeline_groups)
        table = ProfileTable.load(cfg.table) if cfg.table else None
        selector = ParallelismSelector(model_cfg, len(devices), memory=memory, config=sel_cfg, table=table,
                                       device_kind=devices[0].device_kind, batch_rows=batch_size,
                                       decode_rows=max(decode_rows, 0))
        # the pool is sized before the first plan, which reads it
        if decode_rows < 0 and "rollout" in planned:
            selector.decode_rows = pool_memory.rows_that_fit(selector, batch_size, max_context)
        pages = kv_pages
        if kv_pages < 0 and "rollout" in planned:
            pages = pool_memory.pages_that_fit(selector, selector.decode_rows or batch_size, max_context, page_size,
                                               pipeline_groups)
        planner = cls(selector, devices, batch_size, static=cfg.mode == "static", shapes=shapes)
        planner.kv_pages = max(pages, 0)
        return planner

    @property
    def decode_rows(self) -> int:
        """Rows the rollout decodes at once (0: every game; --rollout.slots, or the count sized for -1)."""
        return self.selector.decode_rows

    # ---------------------------------------------------------------- plans
    def mesh_of(self, shape: MeshShape) -> Mesh:
        """One Mesh object per shape, so compiled programs keyed on it are reused."""
        if shape not in self._meshes:
            self._meshes[shape] = make_mesh(shape, self.devices)
        return self._meshes[shape]

    def stage_run(self, stage: str, layout: StageLayout | None = None) -> StageRun:
        """The StageRun of `stage` under `layout` (default: the current plan's)."""
        layout = self.current[stage] if layout is None else layout
        return StageRun(stage, layout, self.mesh_of(layout.mesh), stage_spec(stage).rules, self.programs)

    def plan(self) -> StagePlan:
        """The plan for what runs next; advances the selector's smoothing once per new observation."""
        if self.static:
            return self.current
        self.current = self.selector.plan(self._stats, update=self._fresh)
        self._fresh = False
        return self.current

    def plan_stage(self, stage: str, stats: ContextStats | None = None) -> StageLayout:
        """The layout of a stage planned when it runs rather than with every iteration's plan (sft), for `stats` (its
        batch; default: the batch last observed) at the current context bucket; `run(stage, ...)` then runs on it, and
        an out-of-memory error there re-plans it for the same `stats`."""
        layout = self.selector.select(stage, self.current.context_bucket, stats or self.selector.last_stats)
        self.current = self.current.replace(**{stage: layout})
        return layout

    def observe(self, stats: ContextStats) -> None:
        """The statistics the next plan() reacts to (smoothed inside the selector)."""
        self._stats = stats
        self._fresh = True

    # ---------------------------------------------------------------- running a stage
    def run(self, stage: str, fn: Callable[[StageRun], T], *, rerun_after_success: bool = True) -> T:
        """`fn(run)` under the current plan's layout of `stage`. Auto mode: an out-of-memory error first halves
        the micro-batch, then gives the mesh up for this context bucket, and reruns `fn` with the same inputs
        (`fn` must not donate what a rerun needs; `rerun_after_success=False` for a stage whose success changes
        state, see run_with_oom_fallback). Static mode: an out-of-memory error ends the run, naming the stage."""
        if self.static:
            layout = self.current[stage]
            try:
                result = fn(self.stage_run(stage, layout))
            except Exception as e:
                if is_oom_error(e):
                    raise RuntimeError(f"{stage} stage ran out of memory on the static layout {layout.describe()} "
                                       "(--planner.mode static keeps the first plan; auto adapts it)") from e
                raise
        else:
            result, plan = run_with_oom_fallback(stage, lambda lay: fn(self.stage_run(stage, lay)), self.current,
                                                 self.selector, shrink_first=True,
                                                 rerun_after_success=rerun_after_success)
            self.current, layout = plan, plan[stage]
        self.ran[stage] = layout
        if stage_spec(stage).planned == "when_run":
            self._unlogged.add(stage)
        return result

    def ran_log_dict(self, prefix: str = "parallel/") -> dict[str, Any]:
        """Metrics of the layouts that ran (not of the plan made for the next iteration): every stage planned each
        iteration, and each stage planned when it runs that ran since its layout was last logged. For each stage whose
        layout changed since the last call, `<stage>_why`: the selector's reason and the candidates it weighed."""
        return self._log_dict([s for s in stage_names() if s in self._unlogged or
                               stage_spec(s).planned == "each_iteration"], prefix)

    def stage_log_dict(self, stage: str, prefix: str = "parallel/") -> dict[str, Any]:
        """`ran_log_dict` of one stage alone (sft's, logged with the supervised steps rather than an iteration)."""
        return {k: v for k, v in self._log_dict([stage], prefix).items() if k.startswith(f"{prefix}{stage}_")}

    def _log_dict(self, stages: list[str], prefix: str) -> dict[str, Any]:
        plan = StagePlan({s: self.ran.get(s) for s in stages}, context_bucket=self.current.context_bucket,
                         smoothed_context_len=self.current.smoothed_context_len)
        out = plan.log_dict(prefix)
        for s in stages:
            self._unlogged.discard(s)
            ran = self.ran.get(s)
            if ran is None or self._reported.get(s) == str(ran):
                continue
            choice = self.selector.choices.get(s)
            out[f"{prefix}{s}_why"] = (choice.describe() if choice is not None and str(choice.layout) == str(ran)
                                       else "the first plan, kept (--planner.mode static)" if self.static
                                       else "after an out-of-memory fallback")
            self._reported[s] = str(ran)
        return out

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"selector": self.selector.state_dict(), "stats": dataclasses.asdict(self._stats)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d:
            self.selector.load_state_dict(d["selector"])
            stats = d["stats"]
            self._stats = ContextStats(**stats) if isinstance(stats, dict) else ContextStats(*stats)
            if not self.static:
                self.current = self.selector.plan(self._stats, update=False)
