"""The policy's weights and optimizer state moved to whichever layout a stage runs on (the Data Dispatcher).

Stages that only run the model (rollout, experience) get the weights in the compute dtype, cast where they are (on the
train layout) and then dispatched: half the bytes to move, and what the memory model counts. The model casts at every
use anyway, so the values are the same. Stages that update weights (train, sft) get them as they are (float32 masters).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from earl_jax.parallel.dispatch import Dispatcher
from earl_jax.parallel.planner import StageRun
from earl_jax.rl.matchups.league import host_copy
from earl_jax.rollout.sampler import cast_weights
from earl_jax.sharding.stage_registry import stage_spec


class WeightMover:
    def __init__(self, dtype):
        self.dtype = dtype
        self.dispatcher = Dispatcher()
        self._cast = jax.jit(lambda p: cast_weights(p, dtype))  # keeps each leaf's sharding

    def for_stage(self, run: StageRun, params: Any) -> Any:
        """`params` in `run`'s layout (and, for a stage that does not update them, the compute dtype)."""
        if not stage_spec(run.stage).updates_weights and self.dtype != jnp.float32:
            params = self._cast(params)
        return self.dispatcher(params, run.shardings(params))

    def opt_state_for(self, run: StageRun, params: Any, opt_state: Any) -> Any:
        """Optimizer state onto a train layout: moments follow their parameters, scalars are replicated."""
        params_target = run.shardings(params)
        replicated = NamedSharding(run.mesh, P())
        target = jax.tree.map(lambda sub: params_target if isinstance(sub, nnx.State) else replicated, opt_state,
                              is_leaf=lambda x: isinstance(x, nnx.State))
        return self.dispatcher(opt_state, target)

    def host_snapshot(self, params: Any) -> Any:
        """A copy on the host in the compute dtype (a league snapshot: it only decodes)."""
        return host_copy(self._cast(params) if self.dtype != jnp.float32 else params)

    def bytes_moved_since(self, mark: int) -> int:
        return sum(h.bytes for h in self.dispatcher.history[mark:])

    @property
    def mark(self) -> int:
        return len(self.dispatcher.history)
