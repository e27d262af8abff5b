"""What the Sampler compiles ahead: the programs of the shapes a rollout is about to reach (the next cache size, the
next compacted batch), lowered from argument specs on background threads (rollout/compile_ahead.py). A mixin of
`Sampler`: it reads the sampler's jitted programs, its shardings and the shapes run so far."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from earl_jax.rollout.buckets import bucket
from earl_jax.rollout.compile_ahead import CompileAhead, spec_of as _spec

if TYPE_CHECKING:
    from earl_jax.rollout.sampler import SamplerState


class CompilingAhead:
    def compile_compaction_ahead(self, params: nnx.State, factor: int, levels: int) -> int:
        """Submit the compacted batches' programs that the shapes run so far call for, before the first rollout
        that compacts (on accelerators the first training rollout does not: trainer.compact_now). A batch b that
        decoded at cache length s with at most b / factor**k rows left would have been compacted there to
        b / factor**k rows (agent_loop._compact: COMPACT_FACTOR, COMPACT_LEVELS): its take, generate, observation
        extends and the grow between such cache lengths. Compiled in the background (during the experience and
        train stages), so the next rollout finds them instead of waiting for them. Returns how many programs were
        submitted."""
        if self.ahead is None:
            raise RuntimeError("compile_compaction_ahead: compiling ahead is off (start_compiling_ahead first)")
        if self._like is None:
            return 0
        p, like, shards = self._specs_of(params), self._like, self._batch_shards()
        before = self.ahead.submitted
        for (b, s), fewest in sorted(self._fewest.items()):
            parent = b
            for k in range(1, levels + 1):
                bk = b // factor ** k
                if b % factor ** k or bk % shards or bk < shards or fewest > bk:
                    break
                self._ahead_take(like, parent, s, bk)
                self._ahead_generate(p, like, bk, s)
                self._ahead_extends(p, like, bk, s)
                s_next = min((s2 for (b2, s2), f2 in self._fewest.items() if b2 == b and s2 > s and f2 <= bk),
                             default=None)
                if s_next is not None:  # the compacted rows go on growing
                    self._ahead_grow(like, bk, s, s_next)
                parent = bk
        return self.ahead.submitted - before

    def start_compiling_ahead(self) -> None:
        """Turn compiling ahead on from now (e.g. after the first rollout, whose compiles it would only compete
        with)."""
        if self.ahead is None:
            self.ahead = CompileAhead()

    def _wait(self, key: tuple) -> None:
        if self.ahead is not None:
            self.ahead.wait(key)

    def _specs_of(self, params: nnx.State) -> Any:
        """Argument specs of the weights (kept per weights object: building them walks every leaf). By id, not by
        reference: a reference would keep last iteration's weights alive on the device; a reused id can only be
        weights of the same layout, whose specs are the same."""
        if self._params_specs is None or self._params_specs[0] != id(params):
            self._params_specs = (id(params), jax.tree.map(_spec, params))
        return self._params_specs[1]

    def _look_ahead(self, params: nnx.State, like: SamplerState, b: int, s: int) -> None:
        """Submit the programs of this shape's neighbours that the rollout is close to: the next cache size (and the
        grow to it) once rows would reach it within about two turns at their present growth, the next compacted
        batch (agent_loop._compact: a quarter, still a multiple of the batch shards; and the take to it) once half
        the rows have stopped decoding."""
        p = self._specs_of(params)
        like = jax.tree.map(_spec, like)  # metadata only: the state itself is donated by the next call
        shapes = [(b, s)]
        s_next = bucket(s + 1, self.cache_buckets)
        prev, needed = self._needed
        if s_next <= self._ahead_top and needed + 2 * max(needed - prev, 1) > s:  # rows reach s within ~2 turns
            shapes.append((b, s_next))
            self._ahead_grow(like, b, s, s_next)
        shards = self._batch_shards()
        if b % 4 == 0 and (b // 4) % shards == 0 and self._active is not None and self._active <= b // 2:
            # half the rows have finished: compaction (at a quarter) comes next
            b_next = b // 4
            shapes.append((b_next, s))
            self._ahead_take(like, b, s, b_next)
        for bb, ss in shapes:
            self._ahead_generate(p, like, bb, ss)
            self._ahead_extends(p, like, bb, ss)

    def _ahead_grow(self, like: SamplerState, b: int, s: int, s_next: int) -> None:
        self.ahead.submit(("grow", b, s, s_next),
                          lambda: self._grow.lower(self._state_spec(like, b, s), s_next).compile())

    def _ahead_take(self, like: SamplerState, b: int, s: int, b_next: int) -> None:
        self.ahead.submit(("take", b, s, b_next), lambda: self._take.lower(
            self._state_spec(like, b, s), self._rows_spec((b_next,), np.int32), b_next,
            self._rows_spec((b_next,), np.bool_)).compile())

    def _ahead_extends(self, p: Any, like: SamplerState, b: int, s: int) -> None:
        for tb, calls in self._extend_widths.items():
            if calls >= 2:  # an observation's width (a prompt's is used once per rollout)
                self.ahead.submit(("extend", b, s, tb), lambda tb=tb: self._extend.lower(
                    p, self._state_spec(like, b, s), self._rows_spec((b, tb), np.int32),
                    self._rows_spec((b,), np.int32)).compile())

    def _ahead_generate(self, p: Any, like: SamplerState, b: int, s: int) -> None:
        if self._generate_like is None:
            return
        statics, rng, temperature, greedy = self._generate_like
        n_bucket, stop_tokens, pkey, with_ids = statics
        rows = self._rows_spec((b,), np.int32)
        ids = None if not with_ids else rows if with_ids == 1 else self._rows_spec((b, 2), np.int32)  # (turn, id) rows
        weights = None
        if self.kernel_step(s):
            if self._weights_spec is None or self._weights_spec[0] is not p:  # traced once per weight specs
                self._weights_spec = (p, jax.eval_shape(self._prepare, p))
            weights = self._weights_spec[1]
        self.ahead.submit(("generate", b, s) + statics, lambda: self._generate.lower(
            p, self._state_spec(like, b, s), rng, rows, n_bucket, stop_tokens, pkey,
            jax.ShapeDtypeStruct((), np.int32), ids, temperature, greedy, weights).compile())

    def _rows_spec(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """What `_put_rows` makes of a host array of this shape (uncommitted without a mesh: jnp.asarray)."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=None if self.mesh is None else self._row_sharding(shape))

    def _state_spec(self, like: SamplerState, b: int, s: int) -> SamplerState:
        """Specs of a state of b rows and cache length s, sharded as `_constrain_state` leaves one (without a
        mesh: on `like`'s device)."""
        shapes = type(like)(jax.tree.map(lambda x: (b, x.shape[1], s) + x.shape[3:], like.cache,
                                           is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)),
                              (b,), (b, like.next_logits.shape[1]))
        shardings = (jax.tree.map(lambda x: x.sharding, like) if self.mesh is None
                     else self._state_shardings(b, s, like.next_logits.shape[1]))
        return jax.tree.map(lambda x, shape, sh: jax.ShapeDtypeStruct(shape, x.dtype, sharding=sh), like, shapes,
                            shardings, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
