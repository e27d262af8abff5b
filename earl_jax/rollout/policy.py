"""The model as an agent-loop `Policy`: one sampler state of slots, one jitted sampler call per turn."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from earl_jax.distributed import global_to_host
from earl_jax.models.paged_cache import PageTable
from earl_jax.rollout.agent_loop import Decoded
from earl_jax.rollout.drafts import DraftIndex
from earl_jax.rollout.moves import MoveTokens, legal_bits
from earl_jax.rollout.sampler import Sampler, SamplingConfig, bucket
from earl_jax.rollout.speculate import Speculation


class SamplerPolicy:
    """Free-text answers (`generate`: a decode loop up to the turn budget), or, with `moves`, constrained moves:
    each turn's answer is one legal move's token drawn from the logits the last extend left (no decode loop)
    and the stop token; both are appended to the cache with the next extend (`_pending`). With `drafts`, free-text
    answers are guessed from earlier rollouts' answers and verified `draft_window` tokens a decode step (default: the
    index's width), exactly (rollout/speculate.py)."""

    def __init__(self, sampler: Sampler, params: nnx.State, sampling: SamplingConfig, stop_tokens: Sequence[int],
                 max_new_tokens: int, moves: MoveTokens | None = None, background: bool = False,
                 drafts: DraftIndex | None = None, draft_window: int | None = None, kv_pages: int = 0):
        """`background`: decode in a worker thread. On GPUs a decode program's `lax.while_loop` is driven by the
        thread that launched it (the host reads the loop condition every step), so the launch returns only when
        the loop is done; from a worker thread the caller goes on stepping other games meanwhile, and groups on
        different devices decode at the same time. One process only (the fetch's collectives must keep one
        order on every process).

        A paged sampler (`Sampler(page_size=P)`) holds `kv_pages` pages (0: as many as the rows fill at the first
        cache size): this policy hands each row pages before a program writes there (`PageTable`), and
        `page_shortfall` tells the agent loop's pool when the rows' next positions would not fit (it then preempts a
        game)."""
        self.kv_pages = kv_pages
        self.pages: PageTable | None = None
        self.sampler, self.params, self.sampling = sampler, params, sampling
        self.stop_tokens, self.max_new_tokens, self.moves = tuple(stop_tokens), max_new_tokens, moves
        self.background = background
        if drafts is not None and moves is not None:
            raise ValueError("SamplerPolicy: drafts need free-text answers (a constrained move is one token a turn)")
        self.speculation = Speculation(drafts, draft_window) if drafts is not None else None

    @property
    def paged(self) -> bool:
        return bool(self.sampler.page_size)

    def reset(self, batch: int, max_len: int) -> None:
        self.state = self.sampler.init_state(batch, max_len, self.kv_pages)
        if self.paged:
            self.pages = PageTable(self.state.cache.num_pages, self.sampler.page_size, batch)
            self._table_key = None
        self.lengths = np.zeros(batch, np.int64)
        self._pending = np.zeros((batch, 2), np.int32)  # constrained answers not yet in the cache
        self._pending_n = np.zeros(batch, np.int64)
        if self.speculation is not None:
            self.speculation.reset(batch)
        if self.moves is None:  # the first decode compiles while the prompt's extend does (when compiling ahead)
            self.sampler.prepare_generate(self.params, self.state, max_new_tokens=self.max_new_tokens,
                                          stop_tokens=self.stop_tokens, sampling=self.sampling)

    @property
    def cache_shape(self) -> tuple[int, int]:
        """(rows, positions a row) of the KV cache: what the agent loop's `kv_used / kv_allocated` divides by."""
        return self.state.batch_size, self.state.max_len

    @property
    def kv_positions(self) -> int:
        """Cache positions this policy holds: rows x positions a row, or a paged cache's pages x page size."""
        if self.pages is not None:
            return self.pages.num_pages * self.pages.page_size
        return self.state.batch_size * self.state.max_len

    def extend(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        tokens, counts = np.asarray(tokens, np.int32), np.asarray(counts, np.int64)
        if self._pending_n.any():  # the last answers go in first, in the same call (only for games that go on)
            tokens, counts = _prepend(self._pending, np.where(counts > 0, self._pending_n, 0), tokens, counts,
                                      self.sampler.length_buckets)  # as wide as the sampler pads: no copy there
            self._pending_n[counts > 0] = 0  # rows not extended now keep theirs
        if not counts.any():
            return
        if self.speculation is not None:
            self.speculation.extended(tokens, counts)
        self.state = self.sampler.ensure_capacity(self.state, int((self.lengths + counts).max()))
        self._assign_pages(self.lengths + counts)
        self.state = self.sampler.extend(self.params, self.state, tokens, counts)  # it pads to its length bucket
        self.lengths += counts

    def generate(self, budgets: np.ndarray, rng: jax.Array, row_ids: np.ndarray,
                 legal: np.ndarray | None = None) -> Callable[[], Decoded]:
        if self.moves is not None:
            return self._pick(np.asarray(budgets), rng, row_ids, legal)
        if legal is not None:
            raise ValueError("SamplerPolicy: legal moves given to a free-text policy (build it with moves=)")
        self.state = self.sampler.ensure_capacity(self.state, int((self.lengths + budgets).max()))
        self._assign_pages(self.lengths + budgets)
        if self.speculation is not None:
            return self._drafted(budgets, rng, row_ids)

        def launch() -> tuple[Any, Any]:
            return self.sampler.generate(self.params, self.state, rng, max_new_tokens=self.max_new_tokens,
                                         budget=budgets, stop_tokens=self.stop_tokens, sampling=self.sampling,
                                         row_ids=row_ids, trim=False)

        def to_host(state, gen) -> tuple[Any, tuple[np.ndarray, ...]]:
            # global_to_host: over several processes the rows live on other hosts too (device_get on one)
            tokens, logprobs, counts, stopped = global_to_host((gen.tokens, gen.logprobs, gen.num_tokens, gen.stopped))
            width = self.max_new_tokens  # the program's bucketed width, trimmed here (no device op)
            return state, (tokens[:, :width], logprobs[:, :width], counts, stopped)

        return self._fetch_later(launch, to_host)

    def page_shortfall(self, extra: np.ndarray, decode: bool = False) -> int:
        """Pages missing for each row to add extra[r] positions next (an extend's tokens, or with `decode` a turn's
        answer budget); 0 with a contiguous cache, and for constrained moves' decode (it writes no cache)."""
        if self.pages is None or (decode and self.moves is not None):
            return 0
        extra = np.asarray(extra, np.int64)
        if not decode:  # the last constrained answers go in with the next extend
            extra = extra + np.where(extra > 0, self._pending_n, 0)
        return self.pages.shortfall(self.lengths + extra)

    def _assign_pages(self, needs: np.ndarray) -> None:
        """Pages for each row's first needs[r] positions, and the state's block table to match."""
        if self.pages is None:
            return
        self.pages.reserve(needs)
        width = self.state.max_len // self.sampler.page_size
        if (self.pages.version, width) != self._table_key:
            self.state = self.sampler.set_block_table(self.state, self.pages.table(width))
            self._table_key = (self.pages.version, width)

    def _drafted(self, budgets: np.ndarray, rng: jax.Array, row_ids: np.ndarray) -> Callable[[], Decoded]:
        """`generate` with drafts: each row's draft verified K tokens a decode step (rollout/speculate.py)."""

        def launch() -> tuple[Any, Callable[[], tuple[np.ndarray, ...]]]:
            return self.speculation.generate(self.sampler, self.params, self.state, rng, budgets, row_ids,
                                             max_new_tokens=self.max_new_tokens, stop_tokens=self.stop_tokens,
                                             sampling=self.sampling)

        return self._fetch_later(launch, lambda state, answers: (state, answers()))

    def _fetch_later(self, launch: Callable[[], tuple], to_host: Callable[..., tuple]) -> Callable[[], Decoded]:
        """`launch()` now (on the decode thread with `background`); the returned fetch takes `to_host(*launched)`'s
        (state, (tokens, logprobs, counts, stopped)), keeps the state and advances the rows' lengths."""
        if self.background:
            result = _pool().submit(lambda: to_host(*launch())).result
        else:
            launched = launch()
            result = lambda: to_host(*launched)  # noqa: E731

        def fetch() -> Decoded:
            self.state, (tokens, logprobs, counts, stopped) = result()
            self.lengths += counts
            return Decoded(tokens, logprobs, counts, stopped)

        return fetch

    def _pick(self, budgets: np.ndarray, rng: jax.Array, row_ids: np.ndarray, legal: np.ndarray | None
              ) -> Callable[[], Decoded]:
        if legal is None:
            raise ValueError("SamplerPolicy: constrained moves need the legal moves of every slot (legal=)")
        going = budgets > 0
        bits = np.where(going, legal_bits(legal), 0)
        if (going & (bits == 0)).any():
            raise ValueError(f"constrained moves: slots {np.flatnonzero(going & (bits == 0)).tolist()} are to move "
                             "but have no legal move")
        action, logp = self.sampler.pick_moves(self.state, bits, rng, row_ids, token_ids=self.moves.token_ids,
                                               sampling=self.sampling)

        def fetch() -> Decoded:
            action_h, logp_h = global_to_host((action, logp))
            b = len(budgets)
            tokens = np.zeros((b, 2), np.int32)
            tokens[:, 0] = np.asarray(self.moves.token_ids, np.int32)[action_h]
            tokens[:, 1] = self.moves.stop_id
            counts = np.where(going, np.minimum(budgets, 2), 0).astype(np.int32)
            logprobs = np.zeros((b, 2), np.float32)
            logprobs[:, 0] = np.where(going, logp_h, 0.0)
            self._pending[:], self._pending_n[:] = tokens, counts
            scored = np.zeros((b, 2), bool)
            scored[:, 0] = going  # the move is the policy's choice; the stop token is not
            choices = np.zeros((b, 2), np.int32)
            choices[:, 0] = bits
            moves = np.where(going, action_h, -1).astype(np.int64)
            return Decoded(tokens, logprobs, counts, counts == 2, scored=scored, choices=choices, moves=moves)

        return fetch

    def reset_rows(self, rows: np.ndarray) -> None:
        self.state = self.sampler.reset_rows(self.state, rows)
        if self.pages is not None:
            self.pages.release(rows)
        self.lengths[rows] = 0
        self._pending_n[rows] = 0  # a finished game's last constrained answer is not the new game's
        if self.speculation is not None:
            self.speculation.reset_rows(rows)

    def take_rows(self, rows: np.ndarray, batch: int) -> None:
        self.state = self.sampler.take_rows(self.state, rows, batch)
        if self.pages is not None:
            self.pages.take(rows, batch)
            self._table_key = (self.pages.version, self.state.max_len // self.sampler.page_size)  # what _take made
        self.lengths = np.concatenate([self.lengths[rows], np.zeros(batch - len(rows), np.int64)])
        self._pending = np.concatenate([self._pending[rows], np.zeros((batch - len(rows), 2), np.int32)])
        self._pending_n = np.concatenate([self._pending_n[rows], np.zeros(batch - len(rows), np.int64)])
        if self.speculation is not None:
            self.speculation.take_rows(rows, batch)


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """Worker threads for background decodes (each policy has at most one decode in flight)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="earl-decode")
    return _POOL


def _prepend(first: np.ndarray, first_n: np.ndarray, tokens: np.ndarray, counts: np.ndarray,
             buckets: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Row r: first[r, :first_n[r]] then tokens[r, :counts[r]] (ragged rows, right-padded with 0, the sampler's
    PAD_TOKEN). `buckets`: widen the rows to the length bucket the sampler's extend would pad them to."""
    b = len(first_n)
    width = max(int((first_n + counts).max(initial=0)), first.shape[1])
    if buckets is not None:
        width = bucket(max(width, 1), buckets)
    out = np.zeros((b, width), np.int32)
    a_cols = np.arange(first.shape[1])[None, :]
    out[:, :first.shape[1]] = np.where(a_cols < first_n[:, None], first, 0)
    if tokens.shape[1]:
        t_cols = np.arange(tokens.shape[1])[None, :]
        valid = t_cols < counts[:, None]
        extended = np.flatnonzero(counts)
        k = first_n[extended]
        if len(k) and (k == k[0]).all():  # one offset (constrained moves: a digit and the stop): a block copy
            start = int(k[0])
            t = min(tokens.shape[1], width - start)  # columns past that are padding
            out[extended, start:start + t] = np.where(valid, tokens, 0)[extended, :t]  # ~0.3x the scatter
        else:
            rows = np.repeat(np.arange(b), counts)
            out[rows, (first_n[:, None] + t_cols)[valid]] = tokens[valid]
    return out, first_n + counts
