"""Profile mode of the Parallelism Selector: measure tokens per device per second (the paper's TGS) of
every stage x candidate mesh x context bucket x response count, and keep the results in a table that
later runs reuse.

The measurement itself is a user callable

    measure(stage: str, mesh: MeshShape, context_len: int, num_responses: int) -> float

that runs one representative step of `stage` on a mesh of that shape for `num_responses` sequences of
`context_len` tokens and returns tokens per device per second (tokens processed / wall seconds /
devices). Returning total tokens per second instead ranks candidates identically (every candidate
spans the same devices) and gives the same Speedup%, but the table's absolute numbers then are not TGS.
If the callable also accepts a keyword `layout`, it receives the `StageLayout` (mesh, micro-batch,
log-prob chunk) the memory model chose. An out-of-memory error raised by it (XlaRuntimeError /
RuntimeError whose message has RESOURCE_EXHAUSTED or "out of memory", or MemoryError) is recorded as
"oom"; any other exception propagates.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import inspect
import json
import logging
import math
import re
from pathlib import Path
from typing import Callable, Iterable, Sequence

import jax

from earl_jax.models.model_config import ModelConfig
from earl_jax.parallel.memory import MemoryModel, candidate_meshes
from earl_jax.parallel.plan import StageLayout
from earl_jax.sharding.mesh import MeshShape
from earl_jax.sharding.stage_registry import stage_names, stage_spec
from earl_jax.watchdog import EXIT_CODE, Watchdog

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
OK, OOM, INFEASIBLE = "ok", "oom", "infeasible"
# A cell whose process was ended while measuring it (run_profile's cell_timeout_s, or killed from outside): with one
# process driving several GPUs, an out-of-memory on one device can leave the others waiting in a collective forever
# (Fig. 3's 3B train stage on 4 H100s), so such a cell never raises. Never chosen.
HUNG = "hung"
HUNG_EXIT = EXIT_CODE  # the exit code of a process its cell watchdog ended: run it again to go on

Measure = Callable[[str, MeshShape, int, int], float]


# XLA GPU reports scratch it cannot get outside its pool (e.g. NCCL's for an all-reduce) as INTERNAL, not as
# RESOURCE_EXHAUSTED: "Failed to allocate Scratch 1 for all-reduce" (seen on 4 x H100 at a 32K context,
# mem fraction 0.92)
SCRATCH_OOM = re.compile(r"Failed to allocate (Scratch|collective memory)")


def is_oom_error(e: BaseException) -> bool:
    """True for an accelerator (or host) out-of-memory error."""
    if isinstance(e, MemoryError):
        return True
    if not isinstance(e, RuntimeError):  # XlaRuntimeError / JaxRuntimeError subclass RuntimeError
        return False
    msg = str(e)
    return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower() or SCRATCH_OOM.search(msg) is not None


class ProfileTableMismatch(ValueError):
    """A saved table was measured on another device kind / device count / model."""


@dataclasses.dataclass(frozen=True)
class ProfileEntry:
    stage: str
    mesh: MeshShape
    context_len: int
    num_responses: int
    tgs: float | None  # tokens per device per second; None unless status == "ok"
    status: str = OK  # ok | oom | infeasible | hung
    micro_batch: int | None = None
    logprob_chunk: int | None = None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["mesh"] = str(self.mesh)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ProfileEntry":
        d = dict(d)
        d["mesh"] = MeshShape.parse(d["mesh"])
        return cls(**d)


@dataclasses.dataclass
class ProfileTable:
    device_kind: str
    device_count: int
    model_name: str
    entries: dict[tuple[str, MeshShape, int, int], ProfileEntry] = dataclasses.field(default_factory=dict)
    created: str = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    meta: dict = dataclasses.field(default_factory=dict)

    # -- content -----------------------------------------------------------------------------------
    def add(self, entry: ProfileEntry) -> None:
        self.entries[(entry.stage, entry.mesh, entry.context_len, entry.num_responses)] = entry

    def get(self, stage: str, mesh: MeshShape, context_len: int, num_responses: int) -> ProfileEntry | None:
        return self.entries.get((stage, mesh, int(context_len), int(num_responses)))

    def tgs(self, stage: str, mesh: MeshShape, context_len: int, num_responses: int) -> float | None:
        e = self.get(stage, mesh, context_len, num_responses)
        return e.tgs if e is not None and e.status == OK else None

    def context_lens(self, stage: str | None = None) -> list[int]:
        return sorted({k[2] for k in self.entries if stage is None or k[0] == stage})

    def response_counts(self, stage: str | None = None) -> list[int]:
        return sorted({k[3] for k in self.entries if stage is None or k[0] == stage})

    def meshes(self, stage: str) -> list[MeshShape]:
        return sorted({k[1] for k in self.entries if k[0] == stage}, key=lambda m: (m.tensor, m.fsdp))

    def __len__(self) -> int:
        return len(self.entries)

    def forget(self, status: str) -> int:
        """Drop the entries of one status (e.g. HUNG, to measure those cells again after a fix or under other
        settings); returns how many. A measured throughput is never dropped this way."""
        if status == OK:
            raise ValueError("forget() drops failed or skipped cells, not measured ones")
        gone = [k for k, e in self.entries.items() if e.status == status]
        for k in gone:
            del self.entries[k]
        if status == HUNG:
            self.meta.pop("hung", None)
        return len(gone)

    # -- compatibility / persistence ---------------------------------------------------------------
    def check_compatible(self, device_kind: str | None = None, device_count: int | None = None,
                         model_name: str | None = None, source: str = "profile table") -> None:
        wrong = []
        if device_kind is not None and device_kind != self.device_kind:
            wrong.append(f"device kind {self.device_kind!r} (running on {device_kind!r})")
        if device_count is not None and int(device_count) != self.device_count:
            wrong.append(f"device count {self.device_count} (running on {device_count})")
        if model_name is not None and model_name != self.model_name:
            wrong.append(f"model {self.model_name!r} (running {model_name!r})")
        if wrong:
            raise ProfileTableMismatch(
                f"{source} was measured for " + "; ".join(wrong) +
                ". Its throughputs do not apply here: re-profile, or point the selector at a matching table.")

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "device_kind": self.device_kind,
                "device_count": self.device_count, "model_name": self.model_name, "created": self.created,
                "meta": self.meta, "entries": [e.to_json() for e in self.entries.values()]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def from_json(cls, d: dict) -> "ProfileTable":
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ProfileTableMismatch(
                f"profile table schema_version {d.get('schema_version')!r}, this code reads {SCHEMA_VERSION}")
        t = cls(d["device_kind"], int(d["device_count"]), d["model_name"], created=d.get("created", ""),
                meta=d.get("meta", {}))
        for e in d["entries"]:
            t.add(ProfileEntry.from_json(e))
        return t

    @classmethod
    def load(cls, path: str | Path, *, device_kind: str | None = None, device_count: int | None = None,
             model_name: str | None = None) -> "ProfileTable":
        """Read a table; with any of device_kind / device_count / model_name given, refuse (raise
        ProfileTableMismatch) a table measured for something else."""
        t = cls.from_json(json.loads(Path(path).read_text()))
        t.check_compatible(device_kind, device_count, model_name, source=f"profile table {path}")
        return t


def current_device_kind() -> str:
    return jax.devices()[0].device_kind


def device_slug(kind: str | None = None, count: int = 1) -> str:
    """The one spelling of a device in result file names: "NVIDIA H100 80GB HBM3" -> "nvidia_h100", with
    "x<count>" for several accelerators ("nvidia_h200x2"); the host CPU (fake devices or not) is "cpu"."""
    kind = current_device_kind() if kind is None else kind
    words = re.findall(r"[a-z0-9]+", kind.lower())
    slug = "cpu" if words[:1] == ["cpu"] else "_".join(words[:2]) or "device"
    return f"{slug}x{count}" if count > 1 and slug != "cpu" else slug


def _accepts_layout(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "layout" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def run_profile(memory: MemoryModel, measure: Measure, *, num_devices: int | None = None,
                context_lens: Sequence[int], response_counts: Sequence[int],
                stages: Iterable[str] | None = None, meshes: dict[str, Sequence[MeshShape]] | None = None,
                device_kind: str | None = None, table: ProfileTable | None = None,
                progress: bool = True, console=None, save: Path | None = None,
                cell_timeout_s: float | None = None) -> ProfileTable:
    """Measure every stage (default: those planned each iteration) x candidate x context x response count; skip
    (record "infeasible") what the memory model rejects, record "oom" when `measure` runs out of memory. Entries
    already present in `table` (a resumed profile) are not measured again. Returns the (new or extended) table.

    With `save`, the table is written before and after every cell, the cell being measured named in
    meta["pending"]. `cell_timeout_s` ends this process (exit code HUNG_EXIT) when one cell takes longer, after
    saving the cell in meta["timed_out"]: a hung multi-GPU program cannot be interrupted from Python, only left. The
    next run_profile on that table records such a cell "hung" and goes on. A cell left pending otherwise (the
    process killed from outside, e.g. by a command's time limit) is measured once more, and
    recorded "hung" if that process ends in it too (meta["cut"])."""
    num_devices = num_devices or jax.device_count()
    cfg: ModelConfig = memory.cfg
    if table is None:
        table = ProfileTable(device_kind or current_device_kind(), num_devices, cfg.name)
    else:
        table.check_compatible(device_kind, num_devices, cfg.name)
    stages = list(stage_names("each_iteration") if stages is None else stages)
    timed_out = table.meta.pop("timed_out", None)
    if (pending := table.meta.pop("pending", None)) is not None:  # the last process ended while measuring this cell
        stage, mesh, ctx, n = pending
        cut = table.meta.setdefault("cut", [])
        if pending == timed_out or pending in cut:
            table.add(ProfileEntry(stage, MeshShape.parse(mesh), int(ctx), int(n), None, HUNG))
            table.meta.setdefault("hung", []).append(pending)
            why = "ran past its cell timeout" if pending == timed_out else "was cut twice"
            log.warning("profile: %s %s ctx %s n %s %s in the last run: recorded %r", stage, mesh, ctx, n, why, HUNG)
        else:  # not its own watchdog: ended from outside, so nothing says the cell hangs; one more try
            cut.append(pending)
            log.warning("profile: %s %s ctx %s n %s was cut in the last run (not by its cell timeout): measuring it "
                        "again", stage, mesh, ctx, n)
    jobs = []
    for stage in stages:
        cands = list(meshes[stage]) if meshes and stage in meshes else candidate_meshes(cfg, num_devices, stage)
        for ctx in context_lens:
            for n in response_counts:
                for m in cands:
                    if table.get(stage, m, ctx, n) is None:
                        jobs.append((stage, m, int(ctx), int(n)))
    pass_layout = _accepts_layout(measure)

    def one(stage, mesh, ctx, n):
        if save is None:
            return measure_one(stage, mesh, ctx, n)
        cell = table.meta["pending"] = [stage, str(mesh), ctx, n]
        table.save(save)

        def mark_timed_out():  # the watchdog's last act: the next run must know this cell hung, not was cut
            table.meta["timed_out"] = cell
            table.save(save)

        try:
            with Watchdog(cell_timeout_s, f"profile cell {stage} {mesh} ctx {ctx} n {n}", on_fire=mark_timed_out,
                          hint="run again with the saved table to record the cell 'hung' and go on"):
                return measure_one(stage, mesh, ctx, n)
        finally:
            table.meta.pop("pending", None)
            table.save(save)

    def measure_one(stage, mesh, ctx, n):
        fit = memory.choose(stage, mesh, ctx, n)
        if fit is None:
            table.add(ProfileEntry(stage, mesh, ctx, n, None, INFEASIBLE))
            return INFEASIBLE
        layout = StageLayout(mesh, fit.micro_batch, fit.logprob_chunk)
        try:
            tgs = measure(stage, mesh, ctx, n, layout=layout) if pass_layout else measure(stage, mesh, ctx, n)
        except Exception as e:  # noqa: BLE001 - only OOM is swallowed
            if not is_oom_error(e):
                raise
            table.add(ProfileEntry(stage, mesh, ctx, n, None, OOM, fit.micro_batch, fit.logprob_chunk))
            del e
            gc.collect()
            return OOM
        tgs = float(tgs)
        if not math.isfinite(tgs) or tgs <= 0:
            raise ValueError(f"measure({stage}, {mesh}, {ctx}, {n}) returned {tgs!r}; expected tokens/s > 0")
        table.add(ProfileEntry(stage, mesh, ctx, n, tgs, OK, fit.micro_batch, fit.logprob_chunk))
        return f"{tgs:,.0f} tok/s/dev"

    if not progress:
        for job in jobs:
            one(*job)
        return table
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]profile[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=False) as bar:
        task = bar.add_task("", total=len(jobs))
        for stage, mesh, ctx, n in jobs:
            bar.update(task, description=f"{stage} {mesh} ctx {ctx} n {n}")
            res = one(stage, mesh, ctx, n)
            bar.update(task, advance=1, description=f"{stage} {mesh} ctx {ctx} n {n}: {res}")
    return table


# ---- an analytic stand-in for `measure` (tests, --synthetic figures) ----------------------------

@dataclasses.dataclass
class SyntheticThroughput:
    """A roofline-style throughput model, qualitative only: decode / forward time per step = bytes read
    (weights / tensor + the shard's KV cache) / HBM bandwidth + per-layer all-reduce latency growing with
    the tensor degree. Rollout responses that do not fit in memory are decoded in waves (what paged
    samplers do), which is why a larger tensor degree wins at long contexts and many responses while
    the smaller one wins at short contexts (fewer, cheaper collectives). Raises an out-of-memory
    RuntimeError when not even one wave fits. `oom_if(stage, mesh, ctx, n)` can force OOMs in tests."""

    memory: MemoryModel
    hbm_bytes_per_s: float = 3.0e12
    flops_per_s: float = 4.0e14
    allreduce_latency_s: float = 12e-6  # per all-reduce per extra rank
    link_bytes_per_s: float = 1.5e11
    step_overhead_s: float = 2e-4
    oom_if: Callable[[str, MeshShape, int, int], bool] | None = None

    def __call__(self, stage: str, mesh: MeshShape, context_len: int, num_responses: int) -> float:
        if self.oom_if is not None and self.oom_if(stage, mesh, context_len, num_responses):
            raise RuntimeError("RESOURCE_EXHAUSTED: synthetic out of memory")
        mm, cfg = self.memory, self.memory.cfg
        shards = mesh.data * mesh.fsdp
        per_shard = -(-num_responses // shards)
        # concurrency: as many of the shard's sequences as memory allows (decoded in waves)
        conc = self._concurrency(stage, mesh, context_len, num_responses, per_shard)
        if conc == 0:
            raise RuntimeError(f"RESOURCE_EXHAUSTED: synthetic {stage} {mesh} ctx {context_len} n {num_responses}")
        t = mesh.tensor
        kind = stage_spec(stage).memory
        weight_bytes = cfg.num_params() * 2 / t / (mesh.fsdp if kind == "update" else 1)
        kv_bytes = conc * context_len * mm.kv_bytes_per_token_per_device(t)
        tokens_per_step = conc if kind == "decode" else conc * context_len
        flops = 2 * cfg.num_params() / t * tokens_per_step * (3 if kind == "update" else 1)
        comm = 0.0
        if t > 1:
            msg = tokens_per_step * cfg.hidden_size * 2
            comm = 2 * cfg.num_hidden_layers * (self.allreduce_latency_s * (t - 1) +
                                                2 * msg * (t - 1) / t / self.link_bytes_per_s)
        if kind == "update" and mesh.fsdp > 1:
            comm += 3 * cfg.num_params() * 2 / t / self.link_bytes_per_s * (mesh.fsdp - 1) / mesh.fsdp
        step = max((weight_bytes + kv_bytes) / self.hbm_bytes_per_s, flops / self.flops_per_s) + comm
        step += self.step_overhead_s
        # tokens per device per second: the shard's tokens over its `tensor` devices
        return tokens_per_step / step / t

    def _concurrency(self, stage, mesh, ctx, n, per_shard) -> int:
        """Largest number of the shard's sequences (rollout) / micro-batch (others) that fits."""
        mm = self.memory
        lo, hi = 0, per_shard
        while lo < hi:
            mid = (lo + hi + 1) // 2
            decode = stage_spec(stage).memory == "decode"
            est = mm.estimate(stage, mesh, ctx, n, mid, None if decode else mm.mem.min_logprob_chunk)
            if mm.fits(est):
                lo = mid
            else:
                hi = mid - 1
        return lo
