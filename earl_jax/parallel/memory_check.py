"""A stage program's memory, checked against its devices' free memory before it first runs.

Why: with one process driving several GPUs, a program that runs out of memory on one device can hang instead of
raising, because the other devices wait in the next collective for the one that failed (Fig. 3's train stage at
3B on 4 H100s waited there until its timeout), so neither the planner's
fallback nor the profile's out-of-memory cells ever see an error. Once compiled, XLA knows the program's own memory
per device (`memory_analysis()`: temporaries and outputs, less the outputs that reuse donated arguments), and the
allocator knows what is free, so a program that cannot fit is refused with an out-of-memory error before any device
starts it. XLA's GPU runtime takes a program's temporaries as one buffer, so they must also fit the largest free
block where the allocator reports it (a fragmented pool can have the total free and no block for them). A program
that fits by these numbers can still fail (NCCL's scratch outside XLA's pool): the check catches the certain cases
only: on 4 x H100 (JAX 0.11) it passed two 3B x 32K train layouts (temporaries 22.0 / 28.0 GiB, 30.6 / 33.5 GiB
free, no largest free block reported by that runtime) whose temporaries then failed to allocate: the totals are not
enough there and the block is unknown. It reads the free memory after compiling (compiling can take memory itself)
and logs what it saw: a warning within 10% of the limit, a debug line otherwise.

Off where devices report no memory limit (CPU) and with EARL_MEMORY_CHECK=0.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable

import jax

from earl_jax.parallel.memory import device_memory_stats

__all__ = ["ProgramMemoryError", "free_bytes", "largest_free_block", "program_bytes", "check_fits"]

GIB = 2**30
CLOSE = 0.9  # a program needing this share of the free memory is logged as a warning
log = logging.getLogger(__name__)


class ProgramMemoryError(RuntimeError):
    """A compiled program needs more memory than a device of its mesh has free (`is_oom_error` is True for it)."""


def free_bytes(devices: Iterable[jax.Device]) -> int | None:
    """The least free memory (limit - in use) of this process's devices among `devices`; None when any of them
    reports no limit (CPU) or none is this process's."""
    free = []
    for d in devices:
        if d.process_index != jax.process_index():
            continue
        stats = device_memory_stats(d)
        if not stats.get("bytes_limit"):
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free) if free else None


def largest_free_block(devices: Iterable[jax.Device]) -> int | None:
    """The smallest of this process's devices' largest free blocks among `devices`; None where not reported."""
    blocks = [device_memory_stats(d).get("largest_free_block_bytes") for d in devices
              if d.process_index == jax.process_index()]
    return None if not blocks or any(b is None for b in blocks) else int(min(blocks))


def program_bytes(compiled: Any) -> tuple[int, str] | None:
    """Bytes per device a compiled program allocates beyond its (already resident) arguments, and their parts;
    None where the backend gives no memory analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    need = m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    parts = (f"temporaries {m.temp_size_in_bytes / GIB:.2f} GiB + outputs {m.output_size_in_bytes / GIB:.2f} GiB"
             f" - reused donated arguments {m.alias_size_in_bytes / GIB:.2f} GiB")
    return need, parts


def check_fits(compile_program: Callable[[], Any], devices: Iterable[jax.Device], what: str) -> None:
    """Raise ProgramMemoryError when the program `compile_program()` compiles needs more than the least free memory
    of `devices`, or its temporaries more than their largest free block; compiles nothing where no limit is known
    (CPU) or the check is off."""
    devices = list(devices)
    if os.environ.get("EARL_MEMORY_CHECK", "1") == "0" or free_bytes(devices) is None:
        return
    compiled = compile_program()
    # read after compiling: compiling (autotuning, the executable's own buffers) can take device memory itself
    free = free_bytes(devices)
    sized = program_bytes(compiled)
    if sized is None:
        return
    need, parts = sized
    why = "refused before running it (a device that runs out of memory inside a multi-device program can hang the " \
          "others; EARL_MEMORY_CHECK=0 skips this check)"
    if need > free:
        raise ProgramMemoryError(f"RESOURCE_EXHAUSTED: out of memory: {what} needs {need / GIB:.2f} GiB per device "
                                 f"({parts}) but a device of its mesh has {free / GIB:.2f} GiB free; {why}")
    temp = compiled.memory_analysis().temp_size_in_bytes
    block = largest_free_block(devices)
    # a warning when it is close (an out-of-memory error after a passed check then shows what the check saw); a
    # debug line otherwise: one per compiled program would bury the run's own lines
    close = need > CLOSE * free or (block is not None and temp > CLOSE * block)
    log.log(logging.WARNING if close else logging.DEBUG,
            "memory check: %s needs %.2f GiB per device (%s); free %.2f GiB, largest free block %s", what,
            need / GIB, parts, free / GIB, "not reported" if block is None else f"{block / GIB:.2f} GiB")
    if block is not None and temp > block:
        raise ProgramMemoryError(f"RESOURCE_EXHAUSTED: out of memory: {what} needs one {temp / GIB:.2f} GiB buffer of "
                                 f"temporaries per device but the largest free block of a device of its mesh is "
                                 f"{block / GIB:.2f} GiB ({free / GIB:.2f} GiB free in all: fragmented); {why}")
