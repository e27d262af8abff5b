"""Which programs a run compiles, at which shapes, and when they compile ahead: one service, owned by the planner
(`StagePlanner.shapes`), that the rollout's samplers, the experience and train stages and their micro-batches ask.

Every new shape a program meets is a compile: a KV-cache size or a decode batch the games reach, a micro-batch width
the experience or train stage meets (15-30 s each for a 1.5B model). The service chooses the widths a stage runs at,
records the shapes the samplers run, predicts the next ones and compiles them on background threads
(rollout/compile_ahead.py: XLA compiles outside the GIL; the real call finds the executable in jit's cache, or waits
for the compile under way). It changes no number: a width only pads (causal attention), a compile is a compile.

The policy, here and nowhere else (`--rollout.compile-ahead`, `--rollout.compact-finished`: `true` / `false` force
each on or off; `auto` is decided below):
- stage programs compile ahead (`stage_ahead_now`) on accelerators from the start: the widths an iteration puts off
  and the optimizer update (beside the first gradient); these are never guesses;
- decode programs compile ahead (`decode_ahead_now`) on accelerators from the second training rollout on: in a cold
  first rollout they would only compete with the foreground's compiles;
- finished games leave the decode batch (`compact_now`) on the CPU always, on accelerators from the second training
  rollout on: a cold first rollout compiles the smaller batches' programs for longer than they save (a decode step
  costs about the same at 64 rows as at 16 there); so after the first training rollout, the compacted batches'
  programs compile ahead, during experience and train (`training_rollout_done`).
The CPU compiles nothing ahead under `auto`: the compile threads would take the cores the rollout runs on.

Widths (`widths`): without compiling ahead (the CPU), each micro-batch at its own width bucket, at most
`--planner.new-widths-per-iteration` widths a stage program has not run at yet (the rest run padded to a wider one:
same results, fewer compiles at once), and a finer length split where it cuts padding (rl/packing.length_split).
Compiling ahead (accelerators), the shapes a run meets are bounded and compiled before they are needed: the plan's
micro-batch rows (no finer split: each row count is a family of programs), a batch padded to the widest of the run
so far (`pad_batch`), each micro-batch at the narrowest width already compiled (or compiling) that holds it while the
narrower widths it wanted compile in the background for the next iterations. The foreground compiles a new stage
program only for a batch wider than every compiled width (a new context bucket): once, the widest.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from earl_jax.parallel.decode_shapes import DecodeShapes
from earl_jax.parallel.planner_config import PlannerConfig
from earl_jax.rollout.agent_loop import COMPACT_FACTOR, COMPACT_LEVELS
from earl_jax.rollout.compile_ahead import CompileAhead
from earl_jax.rollout.rollout_config import RolloutConfig
from earl_jax.rollout.sampler import Sampler


def limit_new_widths(widths: list[int], compiled: set[int], budget: int) -> list[int]:
    """`widths` with at most `budget` of them not in `compiled` (0: no limit): the widest new ones stay, every other
    new width rounds up to the narrowest kept or compiled one above it. Columns past a row's length change no
    result (causal attention), so this only bounds how many programs one iteration compiles: a cold start pays
    for one width per stage, not for every width its first batch happens to hold."""
    if budget <= 0:
        return list(widths)
    new = sorted({w for w in widths if w not in compiled}, reverse=True)
    allowed = compiled | set(new[:budget])  # the widest new width is always allowed: nothing wider may exist
    return [min(a for a in allowed if a >= w) for w in widths]


class ProgramShapes:
    """The planner's program service (module docstring): its policy, the stage widths, the samplers it watches."""

    def __init__(self, *, compile_ahead: str = "false", compact_finished: str = "auto",
                 new_widths_per_iteration: int = 0, length_split: bool = False, backend: str | None = None):
        """The defaults: nothing ahead, the plan's split, every width as the rows want it (a planner outside a job:
        the profiler, tests). A job's: `from_config`. `backend`: the one the policy is for (default: JAX's)."""
        self.compile_ahead, self.compact_finished = compile_ahead, compact_finished
        self.new_widths_per_iteration, self.length_split = new_widths_per_iteration, length_split
        self._backend = backend
        self.rollouts_done = 0  # training rollouts finished
        # the experience / train programs' queue (the stage programs call `ProgramCache.wait` on it)
        self.stage_queue = CompileAhead() if self.stage_ahead_now() else None
        # widths each (stage, mesh, rows, shards, chunk) program has run at (or, compiling ahead, was submitted at)
        self.run_at: dict[tuple, set[int]] = {}
        self.widest = 0  # the widest batch so far (compiling ahead, batches are padded to it)
        self.decoders: list[DecodeShapes] = []  # the samplers watched, in the order they were made

    @classmethod
    def from_config(cls, planner: PlannerConfig, rollout: RolloutConfig) -> ProgramShapes:
        return cls(compile_ahead=rollout.compile_ahead, compact_finished=rollout.compact_finished,
                   new_widths_per_iteration=planner.new_widths_per_iteration, length_split=planner.length_split)

    @property
    def backend(self) -> str:
        return self._backend or jax.default_backend()

    # ---- the policy -------------------------------------------------------------------------------
    def stage_ahead_now(self) -> bool:
        """The experience / train programs compile ahead: auto = on accelerators, from the start."""
        mode = self.compile_ahead
        return mode == "true" or (mode == "auto" and self.backend != "cpu")

    def decode_ahead_now(self) -> bool:
        """The next decode programs compile ahead: auto = on accelerators from the second training rollout on."""
        mode = self.compile_ahead
        return mode == "true" or (mode == "auto" and self.rollouts_done > 0 and self.backend != "cpu")

    def compact_now(self) -> bool:
        """Finished games leave the decode batch: auto = on the CPU always, on accelerators from the second training
        rollout on."""
        mode = self.compact_finished
        return mode == "true" or (mode == "auto" and (self.backend == "cpu" or self.rollouts_done > 0))

    # ---- the rollout's samplers -------------------------------------------------------------------
    def watch(self, sampler: Sampler, max_len: int | None = None) -> Sampler:
        """`sampler`, its shapes recorded here from now on (`max_len`: the rollout's max context)."""
        sampler.shapes = DecodeShapes(sampler, max_len)
        self.decoders.append(sampler.shapes)
        return sampler

    def rollout_starts(self, sampler: Sampler, max_len: int | None = None) -> None:
        """A rollout (or an evaluation) decodes on `sampler`: watched from now on if it was not, its next programs
        compile ahead once the policy says so."""
        if not isinstance(sampler.shapes, DecodeShapes):
            self.watch(sampler, max_len)
        if self.decode_ahead_now():
            sampler.shapes.start()

    def training_rollout_done(self, sampler: Sampler, params: Any, compacted: bool) -> None:
        """A training rollout ended (an evaluation's batch is its own: its programs would only compete with the next
        rollout's). When the next one compacts and this one did not, the compacted batches' decode programs compile
        now, in the background during experience and train."""
        self.rollouts_done += 1
        if not compacted and self.compact_now() and self.decode_ahead_now():
            sampler.shapes.start()
            sampler.shapes.compaction_ahead(params, COMPACT_FACTOR, COMPACT_LEVELS)

    # ---- experience and train widths --------------------------------------------------------------
    @property
    def finer_split(self) -> bool:
        """Whether a stage may split a batch into more micro-batches than its plan (rl/packing.length_split)."""
        return self.length_split and self.stage_queue is None

    def pad_batch(self, batch: Any) -> Any:
        """Compiling ahead, a batch (host arrays, [n, t] columns) is padded to the widest batch of the run so far: the
        programs that take the whole batch (cutting micro-batches, writing log-probs back, advantages, the plan itself)
        keep one shape, and a micro-batch can run at any compiled width up to it. Padding columns change no result
        (causal attention)."""
        if self.stage_queue is None:
            return batch
        self.widest = max(self.widest, batch.tokens.shape[1])
        return jax.tree.map(lambda v: np.pad(v, ((0, 0), (0, self.widest - v.shape[1]))) if v.ndim == 2 else v, batch)

    def widths(self, program: tuple, wanted: list[int]) -> tuple[list[int], list[int]]:
        """(the width each micro-batch runs at, the widths put off, now compiling in the background) for micro-batches
        that want the widths `wanted`, of the stage program family `program` (stage, mesh, rows, shards, chunk)."""
        seen = self.run_at.setdefault(program, set())
        if self.stage_queue is None:
            widths = limit_new_widths(wanted, seen, self.new_widths_per_iteration)
            seen.update(widths)
            return widths, []
        if seen and max(seen) >= max(wanted):  # every micro-batch fits a width compiled or compiling: no new program
            widths = [min(a for a in seen if a >= w) for w in wanted]
        else:  # wider than anything compiled: one new program, the widest
            widths = limit_new_widths(wanted, seen, 1)
        deferred = sorted(set(wanted) - set(widths) - seen)
        seen.update(widths, deferred)  # the deferred ones compile now, in the background
        return widths, deferred

    # ---- what the metrics read --------------------------------------------------------------------
    def queues(self) -> list[CompileAhead]:
        """Every compile-ahead queue: the watched samplers' (those compiling ahead), then the stage programs'."""
        queues = [d.ahead for d in self.decoders if d.ahead is not None]
        return queues + ([self.stage_queue] if self.stage_queue is not None else [])
