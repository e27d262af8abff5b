"""Parallelism Selector: the layout (mesh shape, micro-batch, log-prob chunk) of every stage for the
current context length (EARL, arXiv 2510.05943, its Parallelism Selector; EARL adapts rollout only, we do all stages).
The stages are those registered in sharding/stage_registry.py: `plan` plans the ones planned each iteration,
`select` any other when it runs.

Each iteration the trainer calls

    plan = selector.plan(ContextStats(mean_context_len, max_context_len, num_responses))

The selector smooths the mean context length (EMA or a window; `selector_config.py` holds these settings and the
buckets), maps it to a context bucket with hysteresis (leave the current bucket only when the smoothed length
passes the bucket's edge by `margin`), and per stage picks, in this order of authority:

1. `thresholds` given directly: [(context_len_threshold, MeshShape), ...] per stage, ascending; the
   entry with the largest threshold at or below the smoothed length (same hysteresis), no profiling;
2. a `ProfileTable`: the candidate with the highest measured TGS at the bucket (nearest measured
   context and response count), among those the memory model accepts and not marked OOM;
3. neither: the memory model plus a simple cost rule - the smallest tensor degree that fits (tensor
   collectives sit on every layer of every step), then the smallest fsdp degree (more data
   parallelism, fewer parameter all-gathers), then the largest micro-batch.

The trainer never calls the selector directly: `planner.StagePlanner` plans once per iteration with
update=True (it advances the moving average), re-plans within an iteration with update=False, runs
every stage under its layout and owns the OOM fallback (`parallel/fallback.py`), and
checkpoints `state_dict()` (smoothing, bucket, OOM marks survive restarts).

Memory is checked at max(bucket's upper edge, the batch's max context length), so a plan fits the
longest sequence of the batch, not only the average. After an OOM, `mark_oom(stage, mesh, bucket)`
removes the candidate for that bucket, and `cap_micro_batch` lowers a micro-batch there.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Mapping, Sequence

from earl_jax.models.model_config import ModelConfig
from earl_jax.parallel.memory import MemoryConfig, MemoryModel, candidate_meshes, mesh_problem
from earl_jax.parallel.plan import ContextStats, StageLayout, StagePlan
from earl_jax.parallel.profile import HUNG, OK, OOM, ProfileTable
from earl_jax.parallel.selector_config import HysteresisLevel, SelectorConfig, Smoother
from earl_jax.sharding.mesh import MeshShape
from earl_jax.sharding.stage_registry import stage_names, stage_spec

log = logging.getLogger(__name__)


class NoFeasibleLayoutError(RuntimeError):
    """No candidate mesh of a stage fits in memory (or all were marked out of memory)."""


def _nearest(values: Sequence[int], x: float) -> int | None:
    """Nearest value on a log scale; ties go to the larger (more conservative)."""
    if not values:
        return None
    return min(values, key=lambda v: (abs(math.log(v) - math.log(max(x, 1))), -v))


@dataclasses.dataclass(frozen=True)
class Choice:
    """Why a stage got its layout: how it was chosen, at which bucket, and the candidates weighed (best first, each
    with its measured TGS, or None, and its memory estimate per device)."""

    stage: str
    layout: StageLayout
    how: str
    bucket: int
    candidates: tuple[tuple[StageLayout, float | None, int], ...]

    def describe(self, most: int = 4) -> str:
        def one(lay, tgs, est):
            return f"{lay} {est / 2**30:.2f} GiB" + (f" {tgs:.0f} TGS" if tgs is not None else "")

        weighed = "; ".join(one(*c) for c in self.candidates[:most])
        more = f"; +{len(self.candidates) - most} more" if len(self.candidates) > most else ""
        return f"by {self.how}, bucket {self.bucket}" + (f" (weighed: {weighed}{more})" if weighed else "")


class ParallelismSelector:
    def __init__(self, cfg: ModelConfig, num_devices: int, *, memory: MemoryModel | MemoryConfig | None = None,
                 config: SelectorConfig | None = None, table: ProfileTable | None = None,
                 device_kind: str | None = None, batch_rows: int | None = None, decode_rows: int = 0):
        """`batch_rows`: the rows of an iteration's batch; a stage planned each iteration processes it, so only its
        meshes whose batch shards (data x fsdp) divide them are candidates (None: no such limit). `decode_rows`: the
        rows a decode stage holds at once when fewer than its responses (a pool of games, `--rollout.slots`; 0: all):
        its memory and measured throughput are those of that many rows."""
        self.cfg, self.num_devices, self.batch_rows = cfg, int(num_devices), batch_rows
        self.decode_rows = int(decode_rows)
        self.memory = memory if isinstance(memory, MemoryModel) else MemoryModel(cfg, memory)
        self.config = config or SelectorConfig()
        self.table = table
        if table is not None:
            table.check_compatible(device_kind, self.num_devices, cfg.name)
        self.candidates: dict[str, list[MeshShape]] = {}  # per stage; a stage registered later joins on first use
        for s in stage_names():
            self.candidates_of(s)
        edges = self.config.bucket_edges
        self._bucket = HysteresisLevel([0, *edges[:-1]], self.config.margin, inclusive=False)
        for s, entries in (self.config.thresholds or {}).items():
            for _, m in entries:
                if m not in candidate_meshes(cfg, self.num_devices, s):
                    raise ValueError(f"thresholds[{s!r}]: {m} is not a valid {s} mesh of {cfg.name} on "
                                     f"{self.num_devices} devices (it {mesh_problem(cfg, self.num_devices, s, m)}); "
                                     f"valid: {[str(c) for c in candidate_meshes(cfg, self.num_devices, s)]}")
        self._thr = {s: HysteresisLevel([c for c, _ in e], self.config.margin)
                     for s, e in (self.config.thresholds or {}).items()}
        self._smoother = Smoother(self.config.smoothing, self.config.ema_alpha, self.config.window)
        self.oom_marks: set[tuple[str, MeshShape, int]] = set()
        self.micro_batch_caps: dict[tuple[str, MeshShape, int], int] = {}  # after OOMs with shrink_first
        self.last_stats: ContextStats | None = None
        self.last_plan: StagePlan | None = None
        self.choices: dict[str, Choice] = {}  # why each stage's last layout was chosen
        self._stats_of: dict[str, ContextStats] = {}  # the statistics each stage was last selected for

    def rows_that_fit(self, stage: str, context_len: int, most: int) -> int:
        """The most rows (<= `most`) a mesh of decode `stage` holds at `context_len` by the memory model, in whole batch
        shards of that mesh (its data x fsdp); 0 when not one shard's row fits any mesh."""
        best = 0
        for mesh in self.candidates_of(stage):
            unit = mesh.data * mesh.fsdp
            lo, hi = 0, most // unit  # in shards of rows: the largest that fits, by bisection
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.memory.fits(self.memory.estimate(stage, mesh, context_len, mid * unit)):
                    lo = mid
                else:
                    hi = mid - 1
            best = max(best, lo * unit)
        return best

    def candidates_of(self, stage: str) -> list[MeshShape]:
        """The meshes `stage` may run on: valid for the model and the devices (and the batch, see batch_rows)."""
        if stage not in self.candidates:
            meshes = candidate_meshes(self.cfg, self.num_devices, stage)
            if not meshes:
                raise NoFeasibleLayoutError(f"{self.cfg.name}: no valid {stage} mesh over {self.num_devices} devices")
            if self.batch_rows and stage_spec(stage).planned == "each_iteration":
                meshes = [m for m in meshes if self.batch_rows % (m.data * m.fsdp) == 0]
                if not meshes:
                    raise NoFeasibleLayoutError(f"{self.batch_rows} rows do not split over any {stage} mesh of "
                                                f"{self.num_devices} devices")
            self.candidates[stage] = meshes
        return self.candidates[stage]

    @property
    def planned_stages(self) -> tuple[str, ...]:
        """The stages plan() plans: the config's, else every registered stage planned each iteration."""
        return self.config.stages or stage_names("each_iteration")

    def stats_for(self, stage: str) -> ContextStats | None:
        """The statistics `stage` was last selected for (what an out-of-memory fallback re-plans it for)."""
        return self._stats_of.get(stage, self.last_stats)

    # -- buckets -----------------------------------------------------------------------------------
    @property
    def bucket_edges(self) -> tuple[int, ...]:
        return self.config.bucket_edges

    def bucket_of(self, context_len: float) -> int:
        """Upper edge of the bucket `context_len` falls in (no hysteresis)."""
        for e in self.bucket_edges:
            if context_len <= e:
                return e
        return self.bucket_edges[-1]

    @property
    def current_bucket(self) -> int | None:
        return None if self._bucket.index is None else self.bucket_edges[self._bucket.index]

    # -- ranking -------------------------------------------------------------------------------------
    def _check_len(self, bucket: int, stats: ContextStats) -> int:
        return max(int(bucket), int(stats.max_context_len))

    def rows_of(self, stage: str, stats: ContextStats) -> int:
        """The sequences `stage` holds at once: a decode stage's pool rows (`decode_rows`) when fewer."""
        n = stats.num_responses
        if self.decode_rows and stage_spec(stage).memory == "decode":
            return min(n, self.decode_rows)
        return n

    def _heuristic_key(self, mesh: MeshShape, fit) -> tuple:
        return (mesh.tensor, mesh.fsdp, -(fit.micro_batch or 0))

    def ranked_layouts(self, stage: str, bucket: int, stats: ContextStats) -> list[tuple[StageLayout, float | None]]:
        """Feasible, not OOM-marked layouts of `stage`, best first, with the table's TGS where known."""
        return [(lay, tgs) for lay, tgs, _ in self._ranked(stage, bucket, stats)]

    def _ranked(self, stage: str, bucket: int, stats: ContextStats) -> list[tuple[StageLayout, float | None, int]]:
        """`ranked_layouts` with each layout's memory estimate per device (bytes)."""
        ctx = self._check_len(bucket, stats)
        n = self.rows_of(stage, stats)
        scored = []
        tctx = tn = None
        if self.table is not None:
            tctx = _nearest(self.table.context_lens(stage), bucket)
            tn = _nearest(self.table.response_counts(stage), n)
        for mesh in self.candidates_of(stage):
            if (stage, mesh, bucket) in self.oom_marks:
                continue
            tgs = None
            if tctx is not None:
                e = self.table.get(stage, mesh, tctx, tn)
                if e is not None and e.status in (OOM, HUNG):
                    continue  # measured out of memory at this bucket, or never finished there
                tgs = e.tgs if e is not None and e.status == OK else None
            fit = self.memory.choose(stage, mesh, ctx, n, self.micro_batch_caps.get((stage, mesh, bucket)),
                                     extends=stats.extends)
            if fit is None:
                continue
            layout = StageLayout(mesh, fit.micro_batch, fit.logprob_chunk)
            # measured first (highest TGS), then unmeasured by the heuristic
            key = (0, -tgs) if tgs is not None else (1, *self._heuristic_key(mesh, fit))
            scored.append((key, layout, tgs, fit.estimate.total))
        scored.sort(key=lambda s: s[0])
        return [(lay, tgs, est) for _, lay, tgs, est in scored]

    def _threshold_layout(self, stage: str, bucket: int, stats: ContextStats) -> StageLayout | None:
        entries = self.config.thresholds[stage]
        mesh = entries[self._thr[stage].index][1]
        if (stage, mesh, bucket) in self.oom_marks:
            return None
        fit = self.memory.choose(stage, mesh, self._check_len(bucket, stats), self.rows_of(stage, stats),
                                 self.micro_batch_caps.get((stage, mesh, bucket)), extends=stats.extends)
        if fit is None:
            ctx = self._check_len(bucket, stats)
            log.warning("thresholds: %s mesh %s does not fit the memory model at context %d; using it anyway "
                        "(smallest micro-batch and chunk)", stage, mesh, ctx)
            if stage_spec(stage).memory == "decode":
                return StageLayout(mesh)
            return StageLayout(mesh, 1, min(self.memory.mem.min_logprob_chunk, ctx))
        return StageLayout(mesh, fit.micro_batch, fit.logprob_chunk)

    def select(self, stage: str, bucket: int, stats: ContextStats) -> StageLayout:
        self._stats_of[stage] = stats
        if self.config.thresholds and stage in self.config.thresholds:
            lay = self._threshold_layout(stage, bucket, stats)
            if lay is not None:
                self.choices[stage] = Choice(stage, lay, "a --planner.*-thresholds entry", bucket, ())
                return lay
        ranked = self._ranked(stage, bucket, stats)
        if not ranked:
            raise NoFeasibleLayoutError(self._explain(stage, bucket, stats))
        how = ("measured throughput (profile table)" if ranked[0][1] is not None else
               "the memory model (least tensor / fsdp sharding that fits, then the largest micro-batch)")
        self.choices[stage] = Choice(stage, ranked[0][0], how, bucket, tuple(ranked))
        return ranked[0][0]

    def _explain(self, stage: str, bucket: int, stats: ContextStats) -> str:
        ctx, n = self._check_len(bucket, stats), self.rows_of(stage, stats)
        lines = [f"no {stage} layout of {self.cfg.name} on {self.num_devices} devices fits context {ctx} x "
                 f"{n} responses in {self.memory.usable_bytes / 2**30:.2f} GiB per device "
                 f"(budget {self.memory.budget_bytes / 2**30:.2f} GiB x safety {self.memory.mem.safety_fraction}):"]
        for mesh in self.candidates_of(stage):
            if (stage, mesh, bucket) in self.oom_marks:
                lines.append(f"  {mesh}: ran out of memory at bucket {bucket}")
            else:
                lines.append("  " + self.memory.estimate(stage, mesh, ctx, n, extends=stats.extends).describe())
        hint = ("Shorten the context (--rollout.max-context), use fewer responses per iteration (--rollout.groups), "
                "raise --planner.memory-budget-gib where the device holds more, or add devices")
        if stage_spec(stage).memory == "decode":  # a pool of games holds only its slots' rows at once
            fewer = " or fewer" if self.decode_rows else ""
            hint += f" (or decode them in --rollout.slots rows{fewer}: continuous batching)"
        lines.append(hint + ".")
        return "\n".join(lines)

    # -- the per-iteration call ----------------------------------------------------------------------
    def observe(self, stats: ContextStats) -> int:
        """Feed one iteration's statistics; returns the (hysteresis) bucket."""
        if stats.num_responses <= 0:
            raise ValueError(f"num_responses must be positive, got {stats.num_responses}")
        avg = self._smoother.update(stats.mean_context_len)
        self._bucket.update(avg)
        for lvl in self._thr.values():
            lvl.update(avg)
        self.last_stats = stats
        return self.current_bucket

    def plan(self, stats: ContextStats | None = None, *, update: bool = True) -> StagePlan:
        """The layout of every stage for the next iteration. With update=False (or stats=None) the
        smoothed length / bucket stay as they are (re-planning after mark_oom)."""
        if stats is not None and update:
            self.observe(stats)
        stats = stats or self.last_stats
        if stats is None:
            raise ValueError("plan() needs ContextStats on its first call")
        if self.current_bucket is None:
            self.observe(stats)
        self.last_stats = stats
        bucket = self.current_bucket
        layouts = {}
        # stages that update weights (train) first: their state stays resident beside the others (rollout,
        # experience), which are planned around it
        self.memory.resident_bytes = 0
        for s in sorted(self.planned_stages, key=lambda s: not stage_spec(s).updates_weights):
            layouts[s] = self.select(s, bucket, stats)
            if stage_spec(s).updates_weights:
                self.memory.resident_bytes += self.memory.train_resident_bytes(layouts[s].mesh, s)
        plan = StagePlan(layouts, context_bucket=bucket, smoothed_context_len=float(self._smoother.value))
        if self.last_plan is not None and str(self.last_plan) != str(plan):
            for s in plan.layouts:
                if str(plan[s]) != str(self.last_plan[s]):
                    log.info("parallelism: %s %s -> %s at context %.0f: %s", s, self.last_plan[s], plan[s],
                             plan.smoothed_context_len, self.choices[s].describe())
        self.last_plan = plan
        return plan

    # -- OOM -----------------------------------------------------------------------------------------
    def mark_oom(self, stage: str, mesh: MeshShape, bucket: int | None = None) -> None:
        """`mesh` ran out of memory for `stage` at `bucket` (default: the current one): never choose it
        there again (this selector's lifetime, or longer through state_dict). Any registered stage, planned each
        iteration or when it runs."""
        stage_spec(stage)
        bucket = self.current_bucket if bucket is None else int(bucket)
        if bucket is None:
            raise ValueError("mark_oom before the first plan needs an explicit bucket")
        self.oom_marks.add((stage, mesh, bucket))
        log.warning("parallelism: %s on %s ran out of memory at context bucket %d; excluded", stage, mesh, bucket)

    def cap_micro_batch(self, stage: str, mesh: MeshShape, bucket: int, micro_batch: int) -> None:
        """Never use a micro-batch above `micro_batch` for `stage` on `mesh` at `bucket` (after an OOM)."""
        key = (stage, mesh, int(bucket))
        self.micro_batch_caps[key] = max(1, min(int(micro_batch), self.micro_batch_caps.get(key, micro_batch)))

    # -- checkpointing -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        s = self._smoother
        return {"bucket_index": self._bucket.index, "ema": s.ema, "window": list(s.values),
                "thresholds": {k: v.index for k, v in self._thr.items()},
                "oom_marks": [[st, str(m), b] for st, m, b in sorted(self.oom_marks, key=str)],
                "micro_batch_caps": [[st, str(m), b, v] for (st, m, b), v in self.micro_batch_caps.items()]}

    def load_state_dict(self, d: Mapping) -> None:
        self._bucket.index = d.get("bucket_index")
        self._smoother.ema = d.get("ema")
        self._smoother.values.clear()
        self._smoother.values.extend(d.get("window", []))
        for k, v in d.get("thresholds", {}).items():
            if k in self._thr:
                self._thr[k].index = v
        self.oom_marks = {(st, MeshShape.parse(m), int(b)) for st, m, b in d.get("oom_marks", [])}
        self.micro_batch_caps = {(st, MeshShape.parse(m), int(b)): int(v)
                                 for st, m, b, v in d.get("micro_batch_caps", [])}
