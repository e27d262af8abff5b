"""The out-of-memory fallback every stage runs under (`StagePlanner.run`): the same batch again on the next layout,
agreed on by every process of a job."""

from __future__ import annotations

import gc
import logging
import zlib
from typing import Any, Callable

from earl_jax import distributed
from earl_jax.parallel.plan import StageLayout, StagePlan
from earl_jax.parallel.profile import is_oom_error
from earl_jax.parallel.selector import NoFeasibleLayoutError, ParallelismSelector

log = logging.getLogger("earl_jax.parallel.planner")


# What one attempt did on one process; after every attempt all processes exchange these (see below).
_ATTEMPT_OK, _ATTEMPT_OOM, _ATTEMPT_FAILED = 0, 1, 2


class OtherProcessOOMError(RuntimeError):
    """Another process of the job ran out of memory on this attempt (this one did not): every process
    treats the attempt as out of memory. The message says "out of memory", so `is_oom_error` is True."""


class OtherProcessFailedError(RuntimeError):
    """Another process of the job failed with an error that is not out of memory; raised on the others
    so that none of them waits for it, or runs on alone."""


def _layout_id(layout: StageLayout) -> int:
    """The same small int on every process for the same layout (crc32, not Python's salted hash)."""
    return zlib.crc32(layout.describe().encode()) & 0x7FFFFFFF  # fits the all-gather's int32


def run_with_oom_fallback(stage: str, fn: Callable[[StageLayout], Any], plan: StagePlan,
                          selector: ParallelismSelector, *, shrink_first: bool = False,
                          max_attempts: int | None = None, rerun_after_success: bool = True,
                          on_switch: Callable[[StageLayout, StageLayout, BaseException], None] | None = None
                          ) -> tuple[Any, StagePlan]:
    """Run `fn(plan[stage])`; on an out-of-memory error mark that mesh for the plan's bucket, re-plan the
    stage (same statistics, no smoothing update) and call `fn` again with the next layout - `fn` must
    be re-runnable with the same inputs (do not donate the batch), so the batch is not lost. Returns
    (result, plan with the layout that worked). With `shrink_first`, an OOM on a micro-batch above 1
    (experience / train) first halves the micro-batch on the same mesh (remembered for that bucket) before
    giving up the mesh. Raises NoFeasibleLayoutError, chained to the last OOM, when no candidate is left;
    other exceptions propagate unchanged.

    Several processes (jax.distributed): every process runs this with the same plan and selector state,
    and after every attempt they agree, in one small all-gather (`distributed.gather_ints`; nothing on
    a single process), on what the attempt did:

    - OOM on ANY process -> an OOM on EVERY process: each marks the same mesh (or caps the same
      micro-batch), picks the same next layout and retries; a process whose attempt succeeded drops its
      result (`OtherProcessOOMError` stands in for the OOM it did not see, for `on_switch` and chaining);
    - a non-OOM error on any process -> that process re-raises its own error after the exchange, and the
      others raise `OtherProcessFailedError` ("another process failed"), instead of waiting for it in
      the next collective; this wins over an OOM elsewhere;
    - the processes ran different layouts (their selectors diverged) -> RuntimeError everywhere;
    - `rerun_after_success=False`, for a stage whose success changes state that a rerun would change
      again (the trainer's train stage updates, and donates, the weights): an attempt that succeeded on
      some processes and ran out of memory on others -> RuntimeError everywhere (nothing to retry from).

    Not solved: the agreement happens only once every process has returned from `fn`. An OOM that
    strikes one process while the others are inside a collective of `fn` (an all-reduce of the step)
    leaves them waiting there until the collective's own timeout (NCCL's, or forever without one) or
    until the launcher stops the job; then no process gets here. The same holds for a process that dies
    or is interrupted (KeyboardInterrupt is not caught here). An OOM that surfaces only after `fn`
    returned (asynchronous dispatch: `fn` should block on its outputs) is not seen by the retry either."""
    layout = plan[stage]
    bucket = plan.context_bucket
    stats = selector.stats_for(stage)  # the batch it was planned for (a stage planned when it runs: its own)
    attempts = 0
    while True:
        attempts += 1
        result = error = None
        try:
            result = fn(layout)
        except Exception as e:  # noqa: BLE001
            error = e
        outcome = _ATTEMPT_OK if error is None else _ATTEMPT_OOM if is_oom_error(error) else _ATTEMPT_FAILED
        try:
            rows = distributed.gather_ints(outcome, _layout_id(layout))  # every process must get here
        except Exception:
            if error is not None:
                raise error  # this process's own failure is the one to report; the exchange's is its context
            raise
        outcomes = [o for o, _ in rows]
        if outcome == _ATTEMPT_FAILED:
            raise error
        if _ATTEMPT_FAILED in outcomes:
            failed = [i for i, o in enumerate(outcomes) if o == _ATTEMPT_FAILED]
            raise OtherProcessFailedError(f"{stage}: another process failed (process {failed}) on "
                                          f"{layout.describe()}; see its log") from error
        if len({lid for _, lid in rows}) > 1:  # every process sees the same rows, so all raise
            raise RuntimeError(f"{stage}: the processes ran different layouts (this one {layout.describe()}); "
                               "their selector states diverged") from error
        if _ATTEMPT_OOM not in outcomes:
            return result, plan.replace(**{stage: layout})
        ooms = [i for i, o in enumerate(outcomes) if o == _ATTEMPT_OOM]
        if not rerun_after_success and _ATTEMPT_OK in outcomes:
            done = [i for i, o in enumerate(outcomes) if o == _ATTEMPT_OK]
            raise RuntimeError(f"{stage}: out of memory on process {ooms} after it had completed on process "
                               f"{done} ({layout.describe()}); it changed state there and cannot be rerun: resume "
                               "from the last checkpoint") from error
        result = None  # another process ran out of memory: this result is dropped, everyone retries
        if error is None:
            error = OtherProcessOOMError(f"{stage}: out of memory on process {ooms} on {layout.describe()} "
                                         "(not on this one)")
        can_shrink = shrink_first and layout.micro_batch is not None and layout.micro_batch > 1
        if can_shrink:
            selector.cap_micro_batch(stage, layout.mesh, bucket, layout.micro_batch // 2)
        else:
            selector.mark_oom(stage, layout.mesh, bucket)
        if max_attempts is not None and attempts >= max_attempts:
            raise NoFeasibleLayoutError(f"{stage}: out of memory after {attempts} attempts "
                                        f"(last {layout.describe()})") from error
        if stats is None:
            raise NoFeasibleLayoutError(f"{stage}: out of memory on {layout.describe()} and the selector "
                                        "has no statistics to re-plan from") from error
        try:
            new = selector.select(stage, bucket, stats)
        except NoFeasibleLayoutError as nf:
            raise NoFeasibleLayoutError(f"{stage}: out of memory on {layout.describe()}, and nothing else "
                                        f"fits:\n{nf}") from error
        if on_switch is not None:
            on_switch(layout, new, error)
        log.warning("%s: out of memory on %s, retrying the same batch on %s", stage, layout.describe(),
                    new.describe())
        layout = new
        del error  # its traceback holds the failed attempt's frames and buffers
        gc.collect()  # drop the failed attempt's buffers (cycles through the traceback) before retrying
