"""Build a model abstractly, or directly into a target sharding (never whole on one device)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from earl_jax.models.config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.sharding.mesh import Rules, state_shardings


def abstract_model(cfg: ModelConfig, **kw: Any) -> Qwen2:
    """Shapes and logical axes only: a 72B model costs no memory."""
    return nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0), **kw))


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules, **kw: Any) -> nnx.State:
    _, state = nnx.split(abstract_model(cfg, **kw))
    return state_shardings(state, mesh, rules)


def init_sharded(cfg: ModelConfig, mesh: Mesh, rules: Rules, seed: int = 0, **kw: Any) -> Qwen2:
    """Random init compiled with out_shardings, so each device only ever holds its own shards."""
    graphdef, abstract_state = nnx.split(abstract_model(cfg, **kw))
    shardings = state_shardings(abstract_state, mesh, rules)

    @jax.jit
    def make():
        return nnx.state(Qwen2(cfg, rngs=nnx.Rngs(seed), **kw))

    state = jax.jit(make, out_shardings=shardings)()
    return nnx.merge(graphdef, state)
