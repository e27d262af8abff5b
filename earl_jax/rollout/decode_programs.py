"""A sampler's decode programs as compile jobs for shapes it has not run yet: each program lowered from argument specs
(a state of any batch and cache size, sharded as the sampler lays one out), for a `CompileAhead` queue. Which shapes,
and when, is the planner's program service's choice (parallel/decode_shapes.py)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from earl_jax.models.paged_cache import PagedKVCache
from earl_jax.rollout.sampler import Sampler, SamplerState

CompileJob = Callable[[], Any]


class DecodePrograms:
    """The jobs that compile `sampler`'s grow, take, extend, generate and drafted generate programs; `like` is the specs
    of a state the sampler ran (any shape), `params` the specs of its weights. A job builds its specs when it runs
    (on a worker)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._weights_spec: tuple[Any, Any] | None = None  # (weight specs, specs of their Pallas decode layout)

    def grow(self, like: SamplerState, b: int, s: int, s_next: int) -> CompileJob:
        return lambda: self.sampler._grow.lower(self.state_spec(like, b, s), s_next).compile()

    def take(self, like: SamplerState, b: int, s: int, b_next: int) -> CompileJob:
        return lambda: self.sampler._take.lower(self.state_spec(like, b, s), self.rows_spec((b_next,), np.int32),
                                                b_next, self.rows_spec((b_next,), np.bool_)).compile()

    def extend(self, params: Any, like: SamplerState, b: int, s: int, width: int) -> CompileJob:
        return lambda: self.sampler._extend.lower(params, self.state_spec(like, b, s),
                                                  self.rows_spec((b, width), np.int32),
                                                  self.rows_spec((b,), np.int32)).compile()

    def generate(self, params: Any, like: SamplerState, b: int, s: int, generate_like: tuple) -> CompileJob:
        """`generate_like`: (static arguments, specs of the key, temperature and greedy) of the generate to match."""
        statics, rng, temperature, greedy = generate_like
        n_bucket, stop_tokens, pkey, with_ids = statics
        rows = self.rows_spec((b,), np.int32)
        ids = None if not with_ids else rows if with_ids == 1 else self.rows_spec((b, 2), np.int32)  # (turn, id) rows
        weights = None
        if self.sampler.kernel_step(s):
            if self._weights_spec is None or self._weights_spec[0] is not params:  # traced once per weight specs
                self._weights_spec = (params, jax.eval_shape(self.sampler._prepare, params))
            weights = self._weights_spec[1]
        return lambda: self.sampler._generate.lower(
            params, self.state_spec(like, b, s), rng, rows, n_bucket, stop_tokens, pkey,
            jax.ShapeDtypeStruct((), np.int32), ids, temperature, greedy, weights).compile()

    def drafted(self, params: Any, like: SamplerState, b: int, s: int, drafted_like: tuple) -> CompileJob:
        """The drafted generate (rollout/speculate.DraftDecoder); `drafted_like`: (its decoder, static values, specs of
        the key, temperature and greedy) of the call to match."""
        decoder, (n_bucket, stop_tokens, pkey, width, id_dims), rng, temperature, greedy = drafted_like
        rows = self.rows_spec((b,), np.int32)
        # a list, as `Sampler._put_rows` returns the call's (the pytree's structure is part of the program's key)
        args = [rows, self.rows_spec((b, width), np.int32), rows, self.rows_spec((b, 2)[:id_dims], np.int32)]
        return lambda: decoder._decode.lower(params, self.state_spec(like, b, s), rng, args, n_bucket, stop_tokens,
                                             pkey, jax.ShapeDtypeStruct((), np.int32), temperature, greedy).compile()

    def rows_spec(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """What `Sampler._put_rows` makes of a host array of this shape (uncommitted without a mesh: jnp.asarray)."""
        mesh = self.sampler.mesh
        return jax.ShapeDtypeStruct(shape, dtype, sharding=None if mesh is None else self.sampler._row_sharding(shape))

    def state_spec(self, like: SamplerState, b: int, s: int) -> SamplerState:
        """Specs of a state of b rows and cache length s, sharded as `Sampler._constrain_state` leaves one (without a
        mesh: on `like`'s device)."""
        is_spec = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
        if isinstance(like.cache, PagedKVCache):  # the pages stay as they are; the block table is b x s / page size
            cache = PagedKVCache(jax.tree.map(lambda x: x.shape, like.cache.pages, is_leaf=is_spec),
                                 (b, s // self.sampler.page_size))
        else:
            cache = jax.tree.map(lambda x: (b, x.shape[1], s) + x.shape[3:], like.cache, is_leaf=is_spec)
        shapes = SamplerState(cache, (b,), (b, like.next_logits.shape[1]))
        pages = like.cache.num_pages if isinstance(like.cache, PagedKVCache) else 0
        shardings = (jax.tree.map(lambda x: x.sharding, like) if self.sampler.mesh is None
                     else self.sampler._state_shardings(b, s, like.next_logits.shape[1], pages))
        return jax.tree.map(lambda x, shape, sh: jax.ShapeDtypeStruct(shape, x.dtype, sharding=sh), like, shapes,
                            shardings, is_leaf=is_spec)
