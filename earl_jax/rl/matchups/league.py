"""A league of frozen past policies: snapshots of the parameters kept in host memory, played as opponents.

    league = League(size=4, every=10)
    league.maybe_add(step, params)           # a snapshot at step 0, N, 2N, ... (the oldest dropped past K)
    pick = league.sample(seed, step)         # (snapshot step, host params) for this iteration's league games

Decisions:
- Host memory, in the compute dtype: a snapshot only ever decodes (bf16 on GPU halves the bytes; the
  tiny model is 3 MB). Copies are numpy arrays, so the train step's donated buffers can never alias them.
- One snapshot per iteration, drawn uniformly from the league by (seed, step): all league games of an
  iteration decode in one batch against one set of weights (one decode call per opponent turn). Over
  iterations every snapshot is played.
- Not checkpointed (K copies of the weights would multiply a checkpoint's size); the snapshot steps are.
  A resumed run starts its league over with a snapshot of the resumed weights, so resuming with a league
  on is not bit-exact (without one it is).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import numpy as np


class League:
    def __init__(self, size: int, every: int, to_host: Callable[[Any], Any] | None = None):
        if size < 1 or every < 1:
            raise ValueError(f"League: size and every must be >= 1, got {size}, {every}")
        self.size, self.every = size, every
        self.to_host = to_host or host_copy
        self.snapshots: deque[tuple[int, Any]] = deque(maxlen=size)  # (step, host params), oldest first

    def __len__(self) -> int:
        return len(self.snapshots)

    @property
    def steps(self) -> list[int]:
        return [s for s, _ in self.snapshots]

    def maybe_add(self, step: int, params: Any) -> bool:
        """Snapshot `params` at every `every`-th step (and whenever the league is empty, e.g. after a resume)."""
        if self.snapshots and (step % self.every or step in self.steps):
            return False
        self.snapshots.append((step, self.to_host(params)))
        return True

    def sample(self, seed: int, step: int) -> tuple[int, Any]:
        if not self.snapshots:
            raise ValueError("the league is empty: maybe_add a snapshot first")
        k = int(np.random.default_rng((seed, step, 0x1EA9)).integers(len(self.snapshots)))
        return self.snapshots[k]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}


def host_copy(params: Any) -> Any:
    """A pytree of (global) arrays as numpy copies on this host, full values on every process."""
    import jax

    from earl_jax.distributed import global_to_host

    # np.array (not asarray): a copy on the host, never a view of a device buffer the optimizer may donate
    return jax.tree.map(np.array, global_to_host(params))
