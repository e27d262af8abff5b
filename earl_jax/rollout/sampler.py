"""Batched sampler over a live, ragged KV cache: extend (prefill / multi-turn append) and generate.

Every row (one game) has its own length; `extend` appends each row's new tokens at its own positions,
and `generate` decodes all rows in lock-step inside ONE jitted `lax.while_loop` (no host sync per token,
early exit once every row is done), the cache donated so it is updated in place. Shapes are bucketed
(new-token counts, cache sizes, generation lengths) so the number of compiled programs stays bounded;
`compile_count` says how many there are.

`params` is the model's `nnx.State` (floating weights may be float32 masters): each program casts the
matrices once to the model's compute dtype before its loop, so decode steps read bf16 weights and a
new set of weights each RL iteration needs no recompile.

Decode step implementations (`decode_impl`): "xla" is the model's own `hidden` under the stage's sharding
rules (any mesh; the reference, and the CPU path). "pallas" runs `decode_step.decode_hidden` (one device): five
Pallas kernels a layer (earl_jax/kernels), on weights laid out once per weight version (kept while `params`
holds the same arrays). "auto" is that step on one GPU, each matmul in Pallas or XLA as measured faster
(kernels/tuning.py), from AUTO_MIN_CACHE cached positions (the XLA step below), and "xla" elsewhere.
"pallas_interpret" runs the kernels on CPU (tests).
Measurements: docs/results.md (rollout decode).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Bool, Float, Int

from earl_jax.distributed import hosts_to_global
from earl_jax.kernels.decode_attention import block_size
from earl_jax.kernels.tuning import plan as decode_plan
from earl_jax.models.cache import KVCache, LayerCache, cache_shardings, init_cache
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.paged_cache import PagedKVCache, check_page_size, init_paged_cache, paged_cache_shardings
from earl_jax.rollout import decode_step, moves
from earl_jax.rollout.buckets import (  # noqa
    DEFAULT_CACHE_BUCKETS,
    DEFAULT_LENGTH_BUCKETS,
    PREFILL_CHUNK,
    bucket,
    geometric_cache_buckets,
)
from earl_jax.rollout.compile_ahead import SamplerShapes
from earl_jax.rollout.sampling import SamplingConfig, program_key, row_keys, runtime_values, sample_logits
from earl_jax.sharding.context import use_mesh_rules
from earl_jax.sharding.mesh import Rules, batch_axes, logical_sharding

PAD_TOKEN = 0
# "auto" runs the XLA step below this many cached positions (one H200: faster at 384, 0.5B batch 32) and the Pallas
# step from there (1.6x at 24576, 1.5B batch 32), where reading the KV cache dominates; the crossover is not measured.
AUTO_MIN_CACHE = 2048


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerState:
    cache: KVCache | PagedKVCache
    lengths: Int[Array, " b"]  # tokens in the cache per row
    next_logits: Float[Array, "b v"]  # float32 logits predicting each row's next token

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.cache.max_len


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Generation:
    tokens: Int[Array, "b n"]  # row r's tokens are tokens[r, :num_tokens[r]]; the rest is PAD_TOKEN
    logprobs: Float[Array, "b n"]  # log_softmax(logits / temperature) at each token; 0 past num_tokens
    num_tokens: Int[Array, " b"]  # generated tokens, the stop token included
    stopped: Bool[Array, " b"]  # True: ended on a stop token; False: budget (or cache) ran out


@jax.jit
def _zero_rows(lengths, reset):
    return jnp.where(reset, 0, lengths)


def cast_weights(params: nnx.State, dtype) -> nnx.State:
    """Matrices to the compute dtype once (the model casts them at every use anyway, so numerics are
    unchanged); vectors (norm scales, biases) stay as they are, since RMSNorm applies scales in float32."""
    def one(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2 and x.dtype != dtype:
            return x.astype(dtype)
        return x
    return jax.tree.map(one, params)


class Sampler:
    def __init__(self, graphdef: nnx.GraphDef, cfg: ModelConfig, *, mesh: Mesh | None = None,
                 rules: Rules | None = None, cache_dtype: Any = jnp.bfloat16,
                 length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
                 cache_buckets: Sequence[int] = DEFAULT_CACHE_BUCKETS, steps_per_check: int = 1,
                 decode_impl: str = "auto", compiler_options: dict[str, Any] | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, page_size: int = 0):
        if (mesh is None) != (rules is None):
            raise ValueError("Sampler: give both mesh and rules, or neither")
        single = mesh is None or mesh.devices.size == 1
        if page_size:
            check_page_size(page_size)
        self.page_size = page_size  # 0: contiguous caches; else paged (models/paged_cache.py), the XLA decode step
        self.graphdef, self.cfg, self.mesh, self.rules = graphdef, cfg, mesh, rules
        self.cache_dtype = cache_dtype
        self.steps_per_check = steps_per_check  # decode steps per while_loop iteration (early-exit check)
        self.prefill_chunk = prefill_chunk  # an extend wider than this runs in chunks of positions (bounded memory)
        if decode_impl not in ("auto", "xla", "pallas", "pallas_interpret"):
            raise ValueError(f"Sampler: decode_impl must be auto, xla, pallas or pallas_interpret, got {decode_impl!r}")
        if decode_impl == "auto" and not (single and jax.default_backend() == "gpu"):
            decode_impl = "xla"
        if decode_impl != "xla" and not single:
            raise ValueError(f"Sampler: decode_impl={decode_impl!r} runs on one device; a mesh takes 'xla'")
        self.decode_impl = decode_impl
        self._prepare = jax.jit(lambda params: decode_step.prepare(self._model(params)))
        self._decode_weights: tuple[list, Any] | None = None  # (weakrefs to the weights' arrays, their layout)
        self.length_buckets = tuple(sorted(length_buckets))
        self.cache_buckets = tuple(sorted(cache_buckets))
        self._traces = 0
        self._init = jax.jit(self._init_impl, static_argnums=(0, 1, 2))
        self._grow = jax.jit(self._grow_impl, static_argnums=(1,))
        self._take = jax.jit(self._take_impl, static_argnums=(2,))  # a new batch size: nothing to donate into
        # XLA options for the extend / generate programs only (e.g. {"xla_gpu_enable_triton_gemm": False}).
        opts = dict(compiler_options) if compiler_options else None
        self._extend = jax.jit(self._extend_impl, donate_argnums=(1,), compiler_options=opts)
        self._generate = jax.jit(self._generate_impl, static_argnums=(4, 5, 6), donate_argnums=(1,),
                                 compiler_options=opts)
        self._pick = jax.jit(self._pick_impl, static_argnums=(6,))
        self.drafted: Any = None  # the drafted decode program (rollout/speculate.py), made on first use
        # told every shape that runs, waited on before each program: the planner's program service compiles a
        # rollout's next programs ahead there (parallel/shapes.py); nothing by default
        self.shapes: SamplerShapes = SamplerShapes()

    # ---- public API --------------------------------------------------------------------------------
    @property
    def compile_count(self) -> int:
        """Distinct programs traced (each is compiled once); bounded by the buckets."""
        return self._traces

    def init_state(self, batch: int, max_len: int, num_pages: int = 0) -> SamplerState:
        """Empty rows with a cache of the bucketed size >= max_len. A paged sampler's cache holds `num_pages` pages (0:
        as many as the rows fill at that size), none assigned: `set_block_table` assigns them."""
        s = bucket(max_len, self.cache_buckets)
        if self.page_size and not num_pages:
            num_pages = batch * s // self.page_size
        return self._init(batch, s, num_pages if self.page_size else 0)

    def set_block_table(self, state: SamplerState, table) -> SamplerState:
        """A paged state whose rows hold the pages of `table` ([rows, max_len / page_size] ints; unassigned entries =
        the cache's num_pages), from the host's page table (models/paged_cache.PageTable)."""
        table = np.asarray(table, np.int32)
        want = (state.batch_size, state.max_len // self.page_size)
        if table.shape != want:
            raise ValueError(f"set_block_table: a table of shape {table.shape} for a state of {want}")
        (table,) = self._put_rows(table)
        return SamplerState(PagedKVCache(state.cache.pages, table), state.lengths, state.next_logits)

    def ensure_capacity(self, state: SamplerState, needed_len: int) -> SamplerState:
        """Grow the cache (a copy) to the bucket holding `needed_len` tokens per row, if it is smaller."""
        self.shapes.needed(needed_len)
        if needed_len <= state.max_len:
            return state
        new_len = bucket(needed_len, self.cache_buckets)
        self.shapes.wait(("grow", state.batch_size, state.max_len, new_len))
        return self._grow(state, new_len)

    def take_rows(self, state: SamplerState, rows, batch: int) -> SamplerState:
        """A state of `batch` rows holding `state`'s rows `rows` in that order (then empty rows): finished
        games leave the decode batch. `state` is donated."""
        rows = np.asarray(rows, np.int32)
        if len(rows) > batch:
            raise ValueError(f"take_rows: {len(rows)} rows do not fit a batch of {batch}")
        idx = np.zeros(batch, np.int32)
        idx[:len(rows)] = rows
        valid = np.arange(batch) < len(rows)
        idx, valid = self._put_rows(idx, valid)
        self.shapes.wait(("take", state.batch_size, state.max_len, batch))
        return self._take(state, idx, batch, valid)

    def reset_rows(self, state: SamplerState, rows) -> SamplerState:
        """Rows `rows` empty again, in place (their lengths 0; nothing reallocated): the next extend writes a new
        game from position 0. What the old game left in the cache is never read: attention is masked by position
        (slots <= the query's), and the new game overwrites every slot it reaches."""
        reset = np.zeros(state.batch_size, bool)
        reset[np.asarray(rows, np.int64)] = True
        (reset,) = self._put_rows(reset)
        return SamplerState(state.cache, _zero_rows(state.lengths, reset), state.next_logits)

    def extend(self, params: nnx.State, state: SamplerState, tokens, num_new) -> SamplerState:
        """Append row b's first num_new[b] tokens at positions lengths[b]...; rows with num_new == 0 are
        unchanged. Updates next_logits of the extended rows. Prefill == extend on an empty state.
        The caller keeps lengths + num_new <= max_len (`ensure_capacity`); tokens past it are dropped."""
        tokens = np.asarray(tokens, dtype=np.int32)
        num_new = np.asarray(num_new, dtype=np.int32)
        b, t = tokens.shape
        if num_new.shape != (b,):
            raise ValueError(f"extend: num_new has shape {num_new.shape}, expected ({b},)")
        if num_new.max(initial=0) > t or num_new.min(initial=0) < 0:
            raise ValueError(f"extend: num_new must lie in [0, {t}]")
        if t > self.prefill_chunk:  # through the whole stack a chunk of positions at a time; each attends to the last
            for start in range(0, int(num_new.max(initial=0)), self.prefill_chunk):
                part = tokens[:, start:start + self.prefill_chunk]
                state = self.extend(params, state, part, np.clip(num_new - start, 0, part.shape[1]))
            return state
        tb = bucket(max(t, 1), self.length_buckets)
        if tb != t:
            tokens = np.pad(tokens, ((0, 0), (0, tb - t)), constant_values=PAD_TOKEN)
        b, s = state.batch_size, state.max_len
        self.shapes.wait(("extend", b, s, tb))
        state = self._extend(params, state, *self._put_rows(tokens, num_new))
        self.shapes.extended(params, state, tb)
        return state

    def generate(self, params: nnx.State, state: SamplerState, rng: jax.Array, *, max_new_tokens: int,
                 budget, stop_tokens: tuple[int, ...] = (), sampling: SamplingConfig = SamplingConfig(),
                 row_ids=None, trim: bool = True) -> tuple[SamplerState, Generation]:
        """Decode up to min(budget[b], max_new_tokens, free cache slots) tokens per row, lock-step, in
        one jitted while_loop. A row ends at a stop token (fed into the cache and counted) or its budget;
        rows with budget 0 and finished rows do not advance. `state` is donated.

        With `row_ids` ([b] ints, e.g. game ids) row r draws its tokens from fold_in(rng, row_ids[r]) alone,
        so what a row samples does not depend on which rows share its batch, or where it sits in it
        (compaction, pipelined halves); without, the batch draws from `rng` as a whole. [b, 2] row ids are
        (turn, id) pairs: row r draws from fold_in(fold_in(rng, turn_r), id_r) (a pool of games at different
        turns, `sampling.row_keys`). Asynchronous: the
        returned arrays are device arrays still being computed. `trim=False`: tokens and log-probs keep the
        program's bucketed width (columns past max_new_tokens are padding), so the caller slices on the host
        instead of two eager device ops."""
        budget = np.broadcast_to(np.asarray(budget, np.int32), (state.batch_size,))
        n_bucket = bucket(max(int(max_new_tokens), 1), self.length_buckets)
        stop_tokens = tuple(int(s) for s in stop_tokens)
        if row_ids is None:
            (budget,) = self._put_rows(budget)
        else:
            budget, row_ids = self._put_rows(budget, np.asarray(row_ids, np.int32))
        temperature, greedy = runtime_values(sampling)  # runtime values: greedy and sampled share programs
        # 0: no ids; 1 (== True, as prepare_generate says): ids [b]; 2: (turn, id) rows [b, 2]
        statics = (n_bucket, stop_tokens, program_key(sampling), 0 if row_ids is None else row_ids.ndim)
        b, s = state.batch_size, state.max_len
        self.shapes.generating(("generate", b, s) + statics, int(np.count_nonzero(budget)))
        state, gen = self._generate(params, state, rng, budget, n_bucket, stop_tokens, program_key(sampling),
                                    np.int32(max_new_tokens), row_ids, temperature, greedy,
                                    self.decode_weights(params, s))
        self.shapes.generated(params, state, statics, rng, temperature, greedy)
        if trim and n_bucket != max_new_tokens:
            gen = Generation(gen.tokens[:, :max_new_tokens], gen.logprobs[:, :max_new_tokens],
                             gen.num_tokens, gen.stopped)
        return state, gen

    def pick_moves(self, state: SamplerState, bits, rng: jax.Array, row_ids, *, token_ids: tuple[int, ...],
                   sampling: SamplingConfig = SamplingConfig()) -> tuple[jax.Array, jax.Array]:
        """Constrained moves (rollout/moves.py): per row, an action among those set in `bits` (int32 legal-move
        bitmasks) drawn from `state.next_logits` restricted to `token_ids` (one token per action), and its
        log-prob under that masked, tempered softmax. The cache is not touched: the caller appends the move's
        token (with the next extend). Top-k / top-p do not apply. Asynchronous, like `generate`."""
        temperature, greedy = runtime_values(sampling)
        bits, row_ids = self._put_rows(np.asarray(bits, np.int32), np.asarray(row_ids, np.int32))
        return self._pick(state.next_logits, bits, rng, row_ids, temperature, greedy, tuple(token_ids))

    def prepare_generate(self, params: nnx.State, state: SamplerState, *, max_new_tokens: int,
                         stop_tokens: tuple[int, ...] = (), sampling: SamplingConfig = SamplingConfig(),
                         row_ids: bool = True) -> None:
        """A rollout's first decode, of `state`'s shape, is next: `shapes` may start compiling its program now, while
        the prompt's extend compiles and runs."""
        statics = (bucket(max(int(max_new_tokens), 1), self.length_buckets), tuple(int(t) for t in stop_tokens),
                   program_key(sampling), row_ids)
        self.shapes.prepare_generate(params, state, statics, *runtime_values(sampling))

    def kernel_step(self, cache_len: int) -> bool:
        """Whether a generate call over a cache of `cache_len` slots runs the Pallas decode step (contiguous only)."""
        if self.decode_impl == "xla" or self.page_size or block_size(cache_len) is None:
            return False
        return self.decode_impl != "auto" or cache_len >= AUTO_MIN_CACHE

    def decode_weights(self, params: nnx.State, cache_len: int):
        """The weights laid out for the Pallas decode step (None where the XLA step runs), made once per weight
        version: kept while `params` holds the same arrays (weak references: old weights are not kept alive)."""
        if not self.kernel_step(cache_len):
            return None
        leaves = jax.tree.leaves(params)
        held = self._decode_weights
        if held is None or len(held[0]) != len(leaves) or any(r() is not x for r, x in zip(held[0], leaves)):
            self._decode_weights = None  # the old layout's memory goes before the new one is made
            held = self._decode_weights = ([weakref.ref(x) for x in leaves], self._prepare(params))
        return held[1]

    @property
    def batch_shards(self) -> int:
        """Rows split over this many shards of the mesh (its batch axes)."""
        return 1 if self.mesh is None else math.prod(self.mesh.shape[a] for a in batch_axes(self.mesh, self.rules))

    # ---- sharding helpers --------------------------------------------------------------------------
    def _row_sharding(self, shape: tuple[int, ...]) -> NamedSharding:
        """Rows over the mesh's batch axes, the other dimensions whole."""
        return logical_sharding(self.mesh, self.rules, ("batch",) + (None,) * (len(shape) - 1), shape)

    def _state_shardings(self, b: int, s: int, v: int, num_pages: int = 0) -> SamplerState:
        """Where a state of b rows, cache length s (a paged cache's: `num_pages` pages) and vocabulary v lives."""
        cache = (paged_cache_shardings(self.cfg, b, s, num_pages, self.page_size, self.mesh, self.rules)
                 if self.page_size else cache_shardings(self.cfg, b, s, self.mesh, self.rules))
        return SamplerState(cache,
                            logical_sharding(self.mesh, self.rules, ("batch",), (b,)),
                            logical_sharding(self.mesh, self.rules, ("batch", "act_vocab"), (b, v)))

    def _put_rows(self, *xs: np.ndarray) -> list[jax.Array]:
        """Host inputs [rows, ...] -> the rollout mesh, rows over its batch axis, in one transfer call (each
        process puts its own devices' rows). Committed inputs also keep jit from reading unspecified input
        layouts against another input's mesh (JAX converts them with the mesh of the first sharded argument)."""
        if self.mesh is None:
            return [jnp.asarray(x) for x in xs]
        return hosts_to_global(xs, [self._row_sharding(x.shape) for x in xs])

    def _constrain(self, x, axes):
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, logical_sharding(self.mesh, self.rules, axes, x.shape))

    def _constrain_state(self, state: SamplerState) -> SamplerState:
        if self.mesh is None:
            return state
        pages = state.cache.num_pages if self.page_size else 0
        return jax.lax.with_sharding_constraint(state, self._state_shardings(
            state.batch_size, state.max_len, state.next_logits.shape[1], pages))

    def _model(self, params):
        dtype = nnx.merge(self.graphdef, params).dtype
        return nnx.merge(self.graphdef, cast_weights(params, dtype))

    def _ctx(self):
        return contextlib.nullcontext() if self.mesh is None else use_mesh_rules(self.mesh, self.rules)

    # ---- traced programs ---------------------------------------------------------------------------
    def _init_impl(self, batch: int, max_len: int, num_pages: int) -> SamplerState:
        self._traces += 1
        with self._ctx():
            cache = (init_paged_cache(self.cfg, batch, max_len, num_pages, self.page_size, self.cache_dtype)
                     if self.page_size else init_cache(self.cfg, batch, max_len, self.cache_dtype))
            state = SamplerState(cache,
                                 jnp.zeros((batch,), jnp.int32),
                                 jnp.zeros((batch, self.cfg.vocab_size), jnp.float32))
            return self._constrain_state(state)

    def _grow_impl(self, state: SamplerState, new_len: int) -> SamplerState:
        self._traces += 1
        with self._ctx():
            pad = new_len - state.cache.max_len
            if self.page_size:  # more table entries, unassigned; no position moves
                c = state.cache
                table = jnp.pad(c.block_table, ((0, 0), (0, pad // self.page_size)), constant_values=c.num_pages)
                return self._constrain_state(SamplerState(PagedKVCache(c.pages, table), state.lengths,
                                                          state.next_logits))
            grow = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))  # b k s h
            cache = KVCache(tuple(LayerCache(grow(l.k), grow(l.v)) for l in state.cache.layers))
            return self._constrain_state(SamplerState(cache, state.lengths, state.next_logits))

    def _take_impl(self, state: SamplerState, idx, batch: int, valid) -> SamplerState:
        self._traces += 1
        with self._ctx():
            if self.page_size:  # the rows' pages go with them (the host's page table says the same)
                c = state.cache
                cache = PagedKVCache(c.pages, jnp.where(valid[:, None], jnp.take(c.block_table, idx, axis=0),
                                                        c.num_pages))
            else:
                cache = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), state.cache)
            lengths = jnp.where(valid, jnp.take(state.lengths, idx), 0)
            logits = jnp.where(valid[:, None], jnp.take(state.next_logits, idx, axis=0), 0.0)
            return self._constrain_state(SamplerState(cache, lengths, logits))

    def _extend_impl(self, params, state: SamplerState, tokens, num_new) -> SamplerState:
        self._traces += 1
        with self._ctx():
            model = self._model(params)
            b, t = tokens.shape
            s = state.cache.max_len
            idx = jnp.arange(t, dtype=jnp.int32)[None]
            valid = idx < num_new[:, None]
            # Padding goes to slot s: out of range, so its write is dropped and its output ignored.
            positions = jnp.where(valid, state.lengths[:, None] + idx, s)
            tokens = self._constrain(tokens, ("batch", "length"))
            h, cache = model.hidden(tokens, positions, state.cache)
            last = jnp.take_along_axis(h, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)  # b 1 d
            logits = model.logits(last)[:, 0]
            next_logits = jnp.where((num_new > 0)[:, None], logits, state.next_logits)
            return self._constrain_state(SamplerState(cache, state.lengths + num_new, next_logits))

    def _pick_impl(self, next_logits, bits, rng, row_ids, temperature, greedy, token_ids: tuple[int, ...]):
        self._traces += 1
        with self._ctx():
            action, logp = moves.pick_moves(next_logits, bits, rng, row_ids, temperature, greedy, token_ids=token_ids)
            return self._constrain(action, ("batch",)), self._constrain(logp, ("batch",))

    def _generate_impl(self, params, state: SamplerState, rng, budget, n: int, stop_tokens: tuple[int, ...],
                       sampling: SamplingConfig, max_new_tokens, row_ids, temperature, greedy, weights=None):
        self._traces += 1
        with self._ctx():
            model = self._model(params)
            b = state.lengths.shape[0]
            s = state.cache.max_len
            k_steps = self.steps_per_check
            limit = jnp.minimum(jnp.minimum(budget, max_new_tokens), s - state.lengths)
            stops = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)
            plan = None
            if weights is not None:
                impl = "pallas" if self.decode_impl.startswith("pallas") else "auto"
                plan = decode_plan(self.cfg, b, s, impl, interpret=self.decode_impl.endswith("_interpret"))
            if row_ids is not None:  # each row's own stream: draw i of row r is fold_in(fold_in(rng, id_r), i)
                keys = row_keys(rng, row_ids)  # [b, 2] ids (turn, id): fold_in(fold_in(fold_in(rng, turn), id), i)

            def draw(rng, i):
                """(the key(s) for draw i, the carried rng)."""
                if row_ids is None:
                    rng, key = jax.random.split(rng)
                    return key, rng
                return jax.vmap(lambda k: jax.random.fold_in(k, i))(keys), rng

            def hidden(tok, positions, cache):  # [b], [b] -> h [b, 1, d]
                if plan is not None:
                    h, cache = decode_step.decode_hidden(weights, self.cfg, tok, positions, cache, plan)
                    return h[:, None], cache
                return model.hidden(self._constrain(tok[:, None], ("batch", "length")), positions[:, None], cache)

            def logits_of(h):  # [b, 1, d] -> [b, v] float32
                if plan is not None:
                    return decode_step.decode_logits(weights, h[:, 0], plan)
                return model.logits(h)[:, 0]

            # The loop samples each next token right after the logits that predict it, so the [b, v]
            # logits never live in the loop carry; the last hidden state per row does, and next_logits
            # is computed once after the loop.
            def step_fn(c):
                step, cache, lengths, h_last, rng, tok, lp, toks, lps, num, stopped, done = c
                active = ~done & (step < n)
                toks = jax.lax.dynamic_update_slice(toks, jnp.where(active, tok, PAD_TOKEN)[:, None], (0, step))
                lps = jax.lax.dynamic_update_slice(lps, jnp.where(active, lp, 0.0)[:, None], (0, step))
                positions = jnp.where(active, lengths, s)  # finished rows write nowhere
                h, cache = hidden(tok, positions, cache)
                h_last = jnp.where(active[:, None], h[:, 0], h_last)
                add = active.astype(jnp.int32)
                num, lengths = num + add, lengths + add
                hit = active & jnp.any(tok[:, None] == stops[None], axis=-1) & bool(stop_tokens)
                stopped = stopped | hit
                done = done | hit | (num >= limit)
                key, rng = draw(rng, step + 1)
                tok, lp = sample_logits(key, logits_of(h), sampling, temperature, greedy)
                return step + 1, cache, lengths, h_last, rng, tok, lp, toks, lps, num, stopped, done

            def cond(c):
                step, done = c[0], c[-1]
                return (step < n) & ~jnp.all(done)

            def body(c):
                for _ in range(k_steps):  # several decode steps per loop-condition check (host sync)
                    c = step_fn(c)
                return c

            key, rng = draw(rng, 0)
            tok, lp = sample_logits(key, state.next_logits, sampling, temperature, greedy)
            width = n + k_steps - 1  # room for the unrolled steps past n (sliced off below)
            toks = self._constrain(jnp.full((b, width), PAD_TOKEN, jnp.int32), ("batch", None))
            lps = self._constrain(jnp.zeros((b, width), jnp.float32), ("batch", None))
            zeros = jnp.zeros((b,), jnp.int32)
            h_last = jnp.zeros((b, self.cfg.hidden_size), model.dtype)
            init = (jnp.int32(0), state.cache, state.lengths, h_last, rng, tok, lp, toks, lps, zeros,
                    zeros.astype(bool), limit <= 0)
            out = jax.lax.while_loop(cond, body, init)
            _, cache, lengths, h_last, _, _, _, toks, lps, num, stopped, _ = out
            logits = logits_of(h_last[:, None])
            next_logits = jnp.where((num > 0)[:, None], logits, state.next_logits)
            state = self._constrain_state(SamplerState(cache, lengths, next_logits))
            return state, Generation(toks[:, :n], lps[:, :n], num, stopped)
