"""One rollout sampler's shapes as the planner's program service sees them (parallel/shapes.py): what the sampler
ran, what it is about to need, and its compile-ahead queue (rollout/compile_ahead.py; two worker threads a sampler).

The sampler tells `DecodeShapes` every shape it runs (it is the sampler's `shapes`); from them this predicts its next
decode programs and submits them (rollout/decode_programs.py builds the jobs):
- after each extend and generate, the neighbours of the shape that ran: the next cache size (and the grow to it) once
  rows would reach it within about two turns at their present growth, up to the bucket of the rollout's max context;
  the next compacted batch (agent_loop._compact: a quarter, still a multiple of the batch shards; and the take to it)
  once half the rows have stopped decoding; at each, the generate and the observation extends seen so far;
- before a rollout's first decode, its generate (`prepare_generate`), while the prompt's extend compiles and runs;
- with drafts from history on, the drafted generate (rollout/speculate.py) beside the plain one at each of those
  shapes, once one drafted generate has run (its window and static values are the ones to match);
- after a rollout that kept its finished rows, the compacted batches that rollout would have reached
  (`compaction_ahead`), compiled during the experience and train stages.
It records always; it predicts and compiles only once started (`start`: the service's policy says when).
"""

from __future__ import annotations

from typing import Any

import jax

from earl_jax.rollout.buckets import bucket
from earl_jax.rollout.compile_ahead import CompileAhead, SamplerShapes, spec_of
from earl_jax.rollout.decode_programs import DecodePrograms
from earl_jax.rollout.sampler import Sampler, SamplerState


class DecodeShapes(SamplerShapes):
    def __init__(self, sampler: Sampler, max_len: int | None = None):
        """`max_len`: the rollout's max context, whose bucket is the largest cache size compiled ahead (default: the
        largest bucket)."""
        self.programs = DecodePrograms(sampler)
        self.cache_buckets, self.shards = sampler.cache_buckets, sampler.batch_shards
        self.top = self.cache_buckets[-1] if max_len is None else bucket(max_len, self.cache_buckets)
        self.ahead: CompileAhead | None = None  # the queue, once compiling ahead
        self.extend_widths: dict[int, int] = {}  # extend width bucket -> real calls (what to predict)
        self._generate_like: tuple | None = None  # the last generate's static arguments and scalar specs
        self._drafted_like: tuple | None = None  # the last drafted generate's decoder, static values and scalar specs
        self._params_specs: tuple[int, Any] | None = None  # (id of the weights, their specs): no reference kept
        self._needed = (0, 0)  # the last two `needed` lengths, while compiling ahead: how fast rows grow
        self._active: int | None = None  # rows the last generate decoded (budget > 0)
        # (batch, cache length) -> fewest rows a generate of that shape decoded: where a rollout that did not compact
        # would have (compaction_ahead)
        self._fewest: dict[tuple[int, int], int] = {}
        self._like: SamplerState | None = None  # specs of a state the sampler ran (any shape: resized per program)

    def start(self) -> None:
        """Compile ahead from now on (after the first rollout, say, whose compiles it would only compete with)."""
        if self.ahead is None:
            self.ahead = CompileAhead()

    # ---- what the sampler tells -------------------------------------------------------------------
    def wait(self, key: tuple) -> None:
        if self.ahead is not None:
            self.ahead.wait(key)

    def needed(self, length: int) -> None:
        if self.ahead is not None:
            self._needed = (self._needed[1], length)

    def extended(self, params: Any, state: SamplerState, width: int) -> None:
        self.extend_widths[width] = self.extend_widths.get(width, 0) + 1
        if self.ahead is not None:
            self._look_ahead(params, state)

    def generating(self, key: tuple, active: int) -> None:
        self._active = active
        self.wait(key)

    def generated(self, params: Any, state: SamplerState, statics: tuple, rng: Any, temperature: Any,
                  greedy: Any) -> None:
        self._generate_like = (statics, spec_of(rng), spec_of(temperature), spec_of(greedy))
        self._decoded(params, state)

    def drafted(self, decoder: Any, params: Any, state: SamplerState, statics: tuple, rng: Any, temperature: Any,
                greedy: Any) -> None:
        self._drafted_like = (decoder, statics, spec_of(rng), spec_of(temperature), spec_of(greedy))
        self._decoded(params, state)

    def _decoded(self, params: Any, state: SamplerState) -> None:
        """What any generate (plain or drafted) leaves: its shape's fewest decoding rows, a state's specs, and the
        neighbours to compile next."""
        b, s = state.batch_size, state.max_len
        self._fewest[b, s] = min(self._active, self._fewest.get((b, s), b))
        if self._like is None:
            self._like = jax.tree.map(spec_of, state)
        if self.ahead is not None:
            self._look_ahead(params, state)

    def prepare_generate(self, params: Any, state: SamplerState, statics: tuple, temperature: Any,
                         greedy: Any) -> None:
        if self.ahead is None:
            return
        last = None if self._generate_like is None else self._generate_like[0]
        if statics[3] and last is not None and last[3] and last[:3] == statics[:3]:
            statics = last  # row ids of the kind the last generate had ([b], or a pool's (turn, id) rows)
        if last != statics:
            self._generate_like = (statics, jax.ShapeDtypeStruct((), jax.random.key(0).dtype), spec_of(temperature),
                                   spec_of(greedy))
        self._generate(self._specs_of(params), jax.tree.map(spec_of, state), state.batch_size, state.max_len)

    # ---- predictions ------------------------------------------------------------------------------
    def compaction_ahead(self, params: Any, factor: int, levels: int) -> int:
        """Submit the compacted batches' programs that the shapes run so far call for, before the first rollout that
        compacts. A batch b that decoded at cache length s with at most b / factor**k rows left would have been
        compacted there to b / factor**k rows (agent_loop._compact: COMPACT_FACTOR, COMPACT_LEVELS): its take,
        generate, observation extends and the grow between such cache lengths. Returns how many programs were
        submitted."""
        if self.ahead is None:
            raise RuntimeError("compaction_ahead: compiling ahead is off (start first)")
        if self._like is None:
            return 0
        p, like, shards = self._specs_of(params), self._like, self.shards
        before = self.ahead.submitted
        for (b, s), fewest in sorted(self._fewest.items()):
            parent = b
            for k in range(1, levels + 1):
                bk = b // factor ** k
                if b % factor ** k or bk % shards or bk < shards or fewest > bk:
                    break
                self._take(like, parent, s, bk)
                self._generate(p, like, bk, s)
                self._extends(p, like, bk, s)
                s_next = min((s2 for (b2, s2), f2 in self._fewest.items() if b2 == b and s2 > s and f2 <= bk),
                             default=None)
                if s_next is not None:  # the compacted rows go on growing
                    self._grow(like, bk, s, s_next)
                parent = bk
        return self.ahead.submitted - before

    def _look_ahead(self, params: Any, state: SamplerState) -> None:
        """Submit the programs of the neighbours of `state`'s shape that the rollout is close to (module docstring)."""
        b, s = state.batch_size, state.max_len
        p = self._specs_of(params)
        like = jax.tree.map(spec_of, state)  # metadata only: the state itself is donated by the next call
        shapes = [(b, s)]
        s_next = bucket(s + 1, self.cache_buckets)
        prev, needed = self._needed
        if s_next <= self.top and needed + 2 * max(needed - prev, 1) > s:  # rows reach s within ~2 turns
            shapes.append((b, s_next))
            self._grow(like, b, s, s_next)
        shards = self.shards
        if b % 4 == 0 and (b // 4) % shards == 0 and self._active is not None and self._active <= b // 2:
            # half the rows have finished: compaction (at a quarter) comes next
            b_next = b // 4
            shapes.append((b_next, s))
            self._take(like, b, s, b_next)
        for bb, ss in shapes:
            self._generate(p, like, bb, ss)
            self._extends(p, like, bb, ss)

    def _specs_of(self, params: Any) -> Any:
        """Argument specs of the weights (kept per weights object: building them walks every leaf). By id, not by
        reference: a reference would keep last iteration's weights alive on the device; a reused id can only be
        weights of the same layout, whose specs are the same."""
        if self._params_specs is None or self._params_specs[0] != id(params):
            self._params_specs = (id(params), jax.tree.map(spec_of, params))
        return self._params_specs[1]

    # ---- submitting -------------------------------------------------------------------------------
    def _grow(self, like: SamplerState, b: int, s: int, s_next: int) -> None:
        self.ahead.submit(("grow", b, s, s_next), self.programs.grow(like, b, s, s_next))

    def _take(self, like: SamplerState, b: int, s: int, b_next: int) -> None:
        self.ahead.submit(("take", b, s, b_next), self.programs.take(like, b, s, b_next))

    def _extends(self, p: Any, like: SamplerState, b: int, s: int) -> None:
        for width, calls in self.extend_widths.items():
            if calls >= 2:  # an observation's width (a prompt's is used once per rollout)
                self.ahead.submit(("extend", b, s, width), self.programs.extend(p, like, b, s, width))

    def _generate(self, p: Any, like: SamplerState, b: int, s: int) -> None:
        if self._generate_like is not None:
            job = self.programs.generate(p, like, b, s, self._generate_like)
            self.ahead.submit(("generate", b, s) + self._generate_like[0], job)
        if self._drafted_like is not None:
            decoder, statics = self._drafted_like[:2]
            self.ahead.submit(decoder.key(b, s, statics), self.programs.drafted(p, like, b, s, self._drafted_like))
