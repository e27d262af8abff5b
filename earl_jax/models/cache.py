"""KV cache: one (k, v) pair per layer, slot index == token position within its row.

Layout [batch, kv_heads, slots, head_dim]: (batch, kv_heads) are the batch dimensions of both attention
matmuls, so keeping them major lets XLA run them on the cache as stored (no per-step transpose copy).

Rows are ragged (each game has its own context length), so writes go to per-row positions; a position
past the end of the cache is dropped, never wrapped (the sampler guards the budget).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from earl_jax.models.model_config import ModelConfig
from earl_jax.sharding.mesh import Rules, logical_sharding

CACHE_AXES = ("batch", "act_kv_heads", "cache_length", None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    k: Float[Array, "b k s h"]
    v: Float[Array, "b k s h"]

    def write(self, k_new: Float[Array, "b t k h"], v_new: Float[Array, "b t k h"],
              positions: Int[Array, "b t"]) -> "LayerCache":
        rows = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
        # Advanced indices around a slice: the indexed view is [b, t, k, h], the shape of k_new.
        k = self.k.at[rows, :, positions].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[rows, :, positions].set(v_new.astype(self.v.dtype), mode="drop")
        return LayerCache(k, v)

    def keys_values(self) -> tuple[Float[Array, "b k s h"], Float[Array, "b k s h"]]:
        return self.k, self.v


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    layers: tuple[LayerCache, ...]

    @property
    def batch_size(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def max_len(self) -> int:
        return self.layers[0].k.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))

    def layer(self, i: int) -> LayerCache:
        return self.layers[i]

    def with_layers(self, layers) -> "KVCache":
        return KVCache(tuple(layers))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    shape = (batch, cfg.num_key_value_heads, max_len, cfg.dim_per_head)
    return KVCache(tuple(LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                         for _ in range(cfg.num_hidden_layers)))


def cache_shardings(cfg: ModelConfig, batch: int, max_len: int, mesh: Mesh, rules: Rules):
    """NamedShardings for `init_cache(cfg, batch, max_len)` under a stage's mesh and rules."""
    shape = (batch, cfg.num_key_value_heads, max_len, cfg.dim_per_head)
    s = logical_sharding(mesh, rules, CACHE_AXES, shape)
    return KVCache(tuple(LayerCache(s, s) for _ in range(cfg.num_hidden_layers)))
