"""Sizing the rollout's pool from the memory model: `--rollout.slots -1` (how many rows decode at once) and
`--rollout.kv-pages -1` (how many KV pages a paged cache holds), both at `--rollout.max-context`.

Both are sized once, when the planner is built, for the rollout's worst case (every row at the longest context) and
beside the train state that stays resident on the same devices: the largest state any train layout the planner may
choose keeps (`resident_beside`), so that no later plan finds the pool too large for its devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

from earl_jax.parallel.selector import NoFeasibleLayoutError, ParallelismSelector
from earl_jax.sharding.stage_registry import stage_spec

log = logging.getLogger(__name__)


def resident_beside(selector: ParallelismSelector) -> int:
    """Bytes per device the stages that update weights keep resident while the rollout runs, when this selector plans
    them on the rollout's devices: for each, the largest over its candidate meshes (0 for a rollout of its own)."""
    memory = selector.memory
    return sum(max(memory.train_resident_bytes(m, s) for m in selector.candidates_of(s))
               for s in selector.planned_stages if stage_spec(s).updates_weights)


@contextlib.contextmanager
def _beside_training(selector: ParallelismSelector) -> Iterator[None]:
    before, selector.memory.resident_bytes = selector.memory.resident_bytes, resident_beside(selector)
    try:
        yield
    finally:
        selector.memory.resident_bytes = before


def rows_that_fit(selector: ParallelismSelector, batch_size: int, max_context: int | None) -> int:
    """--rollout.slots -1: the decode rows the rollout's memory holds at the longest context (0: every game fits)."""
    if max_context is None:
        raise ValueError("--rollout.slots -1 sizes the pool at the longest context: give the planner max_context")
    with _beside_training(selector):
        rows = selector.rows_that_fit("rollout", max_context, batch_size)
    if rows == 0:
        raise NoFeasibleLayoutError(f"--rollout.slots -1: not one row of {selector.cfg.name} decodes at context "
                                    f"{max_context} in {selector.memory.usable_bytes / 2**30:.2f} GiB per device: "
                                    "lower --rollout.max-context or add devices")
    log.info("--rollout.slots -1: %s rows of %d decode at once at context %d (the memory model)",
             "all" if rows >= batch_size else rows, batch_size, max_context)
    return 0 if rows >= batch_size else rows


def pages_that_fit(selector: ParallelismSelector, rows: int, max_context: int | None, page_size: int,
                   groups: int) -> int:
    """--rollout.kv-pages -1: the pages each of the rollout's `groups` pipeline groups holds, as many as its memory
    takes beside everything else the rollout keeps for `rows` rows at `max_context` (their gathered layer view, the
    weights, the train state resident beside it), and never more than those rows fill at that context. Sets the
    memory model's pages to them, so that every plan after prices what the sampler holds."""
    if max_context is None:
        raise ValueError("--rollout.kv-pages -1 sizes the pages at the longest context: give the planner max_context")
    memory = selector.memory
    per_row = -(-max_context // page_size)  # the pages one game takes at the longest context
    most = -(-rows // groups) * per_row

    def fits(pages: int) -> bool:
        memory.mem = dataclasses.replace(memory.mem, kv_positions=max(pages, 1) * page_size * groups)
        return any(memory.fits(memory.estimate("rollout", m, max_context, rows))
                   for m in selector.candidates_of("rollout"))

    with _beside_training(selector):
        lo, hi = 0, most  # the most pages that fit, by bisection (the estimate grows with them)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    if lo < per_row:
        raise NoFeasibleLayoutError(
            f"--rollout.kv-pages -1: {lo} pages of {page_size} positions fit beside the rollout's {rows} rows in "
            f"{memory.usable_bytes / 2**30:.2f} GiB per device, fewer than one game at --rollout.max-context "
            f"{max_context} takes ({per_row}): lower --rollout.slots or --rollout.max-context, or give "
            "--planner.memory-budget-gib more")
    memory.mem = dataclasses.replace(memory.mem, kv_positions=lo * page_size * groups)
    gib = lo * page_size * groups * memory.kv_bytes_per_token_per_device(1) / 2**30
    log.info("--rollout.kv-pages -1: %d pages of %d positions%s (%.2f GiB), %.0f%% of what %d rows take at context %d "
             "(the memory model)", lo, page_size, f" in each of {groups} pipeline groups" if groups > 1 else "", gib,
             100 * lo / most, rows, max_context)
    return lo
