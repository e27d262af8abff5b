"""Paged KV cache: one pool of fixed-size pages per layer, shared by the rows through a block table.

A contiguous cache (models/cache.py) holds rows x the cache bucket's positions whatever each row's context is; at
mixed lengths most of it is never written (the pool's long-tailed load used a quarter of it, docs/results.md). Here
row r's positions [j*P, (j+1)*P) live in page block_table[r, j] of a pool of `num_pages` pages, so the memory follows
the positions the rows hold, not the longest row times the batch.

Layout: per layer k and v [num_pages, kv_heads, P, head_dim]; block_table [rows, W] int32, one for every layer. An
entry no page is assigned to holds `num_pages` (out of range): a write there is dropped and a read is zeros, masked by
position as every slot past a row's length is. A row's logical length is W * P (the sampler's cache bucket), so the
programs are shaped as the contiguous cache's, and attention reads the rows' pages gathered into that view, one layer
at a time (XLA; a paged attention kernel would read the pages in place, not built). Pages are handed out on the host
(`PageTable`): the caller that knows each row's next length (rollout/policy.py) assigns them before a program writes.

On a mesh (`paged_cache_shardings`) the pages split over the tensor axis by kv head, as a contiguous cache's, and are
whole on every batch shard: one host page table serves every row, so a shard's rows may hold any page. The pool is
then held once per batch shard, and a write gathers the step's new keys and values over the batch axes (a token a
row a layer); pools split by batch shard, each with its own page range, are not built.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from earl_jax.models.model_config import ModelConfig
from earl_jax.sharding.mesh import Rules, logical_sharding

PAGE_SIZES = (8, 16, 32, 64, 128)  # divisors of the cache buckets' 128: a bucket is whole pages


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLayerCache:
    """One layer's pages and the rows' block table, as the model's attention sees them (made inside a program)."""

    k: Float[Array, "p k z h"]
    v: Float[Array, "p k z h"]
    block_table: Int[Array, "b w"]

    def write(self, k_new: Float[Array, "b t k h"], v_new: Float[Array, "b t k h"],
              positions: Int[Array, "b t"]) -> "PagedLayerCache":
        page, offset = _locate(self.block_table, positions, self.k.shape[2], self.k.shape[0])
        # Advanced indices around a slice: the view is [b, t, k, h], k_new's shape; page == num_pages drops the write.
        k = self.k.at[page, :, offset].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[page, :, offset].set(v_new.astype(self.v.dtype), mode="drop")
        return PagedLayerCache(k, v, self.block_table)

    def keys_values(self) -> tuple[Float[Array, "b k s h"], Float[Array, "b k s h"]]:
        """Each row's pages in position order, as a contiguous cache's [b, kv_heads, W * P, h] (unassigned: zeros)."""
        return _gather(self.k, self.block_table), _gather(self.v, self.block_table)


def _locate(table: Int[Array, "b w"], positions: Int[Array, "b t"], page_size: int, num_pages: int):
    """(page, offset within it) of each position; positions past the table's W * P (padding) get page num_pages."""
    col = positions // page_size
    w = table.shape[1]
    page = jnp.take_along_axis(table, jnp.clip(col, 0, w - 1), axis=1)
    return jnp.where((col >= 0) & (col < w), page, num_pages), positions % page_size


def _gather(pages: Float[Array, "p k z h"], table: Int[Array, "b w"]) -> Float[Array, "b k s h"]:
    b, w = table.shape
    _, k, z, h = pages.shape
    rows = jnp.take(pages, table, axis=0, mode="fill", fill_value=0)  # b w k z h
    return rows.transpose(0, 2, 1, 3, 4).reshape(b, k, w * z, h)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageLayer:
    k: Float[Array, "p k z h"]
    v: Float[Array, "p k z h"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """The pages of every layer and one block table (the same pages per row in every layer)."""

    pages: tuple[PageLayer, ...]
    block_table: Int[Array, "b w"]

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def page_size(self) -> int:
        return self.pages[0].k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.pages[0].k.shape[0]

    @property
    def max_len(self) -> int:
        return self.block_table.shape[1] * self.page_size

    def layer(self, i: int) -> PagedLayerCache:
        return PagedLayerCache(self.pages[i].k, self.pages[i].v, self.block_table)

    def with_layers(self, layers) -> "PagedKVCache":
        return PagedKVCache(tuple(PageLayer(c.k, c.v) for c in layers), self.block_table)


def init_paged_cache(cfg: ModelConfig, batch: int, max_len: int, num_pages: int, page_size: int,
                     dtype=jnp.bfloat16) -> PagedKVCache:
    """`num_pages` empty pages a layer; a block table of `batch` rows x max_len / page_size entries, none assigned."""
    check_page_size(page_size)
    if max_len % page_size:
        raise ValueError(f"a paged cache of {max_len} positions a row is not whole pages of {page_size}")
    shape = (num_pages, cfg.num_key_value_heads, page_size, cfg.dim_per_head)
    table = jnp.full((batch, max_len // page_size), num_pages, jnp.int32)
    return PagedKVCache(tuple(PageLayer(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                              for _ in range(cfg.num_hidden_layers)), table)


PAGE_AXES = (None, "act_kv_heads", None, None)  # pages whole on every batch shard, split by kv head
TABLE_AXES = ("batch", None)


def paged_cache_shardings(cfg: ModelConfig, batch: int, max_len: int, num_pages: int, page_size: int, mesh: Mesh,
                          rules: Rules) -> PagedKVCache:
    """NamedShardings for `init_paged_cache(cfg, batch, max_len, num_pages, page_size)` under a mesh and rules."""
    pages = logical_sharding(mesh, rules, PAGE_AXES, (num_pages, cfg.num_key_value_heads, page_size, cfg.dim_per_head))
    table = logical_sharding(mesh, rules, TABLE_AXES, (batch, max_len // page_size))
    return PagedKVCache(tuple(PageLayer(pages, pages) for _ in range(cfg.num_hidden_layers)), table)


def check_page_size(page_size: int) -> None:
    if page_size not in PAGE_SIZES:
        raise ValueError(f"--rollout.page-size must be one of {', '.join(map(str, PAGE_SIZES))} (a divisor of the "
                         f"cache buckets' 128 positions), got {page_size}")


class PagesExhausted(RuntimeError):
    """The rows' next positions need more pages than the pool has free."""


class PageTable:
    """The host's record of which pages each row holds, and the free pages (a stack: the last freed is reused first).

    `reserve(needs)` gives each row pages for its first needs[r] positions; `release(rows)` returns a row's pages;
    `take(rows, batch)` keeps `rows` in that order (their pages with them) and releases the others. `table(width)` is
    the [rows, width] block table a program reads (unassigned entries = num_pages)."""

    def __init__(self, num_pages: int, page_size: int, rows: int):
        check_page_size(page_size)
        if num_pages < 1:
            raise ValueError(f"--rollout.kv-pages must be positive, got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.rows: list[list[int]] = [[] for _ in range(rows)]
        self.version = 0  # bumped whenever an assignment changes (the device table is then stale)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def used(self) -> int:
        return self.num_pages - len(self.free)

    def pages_for(self, positions: np.ndarray) -> np.ndarray:
        return -(-np.asarray(positions, np.int64) // self.page_size)

    def _more(self, needs: np.ndarray) -> np.ndarray:
        """Pages each row r lacks to hold needs[r] positions."""
        held = np.array([len(p) for p in self.rows], np.int64)
        return np.maximum(self.pages_for(needs) - held, 0)

    def shortfall(self, needs: np.ndarray) -> int:
        """Pages missing for every row r to hold needs[r] positions (0: they fit)."""
        return int(max(0, self._more(needs).sum() - len(self.free)))

    def reserve(self, needs: np.ndarray) -> None:
        """Pages for each row's first needs[r] positions (pages it already holds are kept)."""
        more = self._more(needs)
        missing = int(max(0, more.sum() - len(self.free)))
        if missing:
            raise PagesExhausted(f"the KV cache's rows need {missing} more pages than the {self.num_pages} of "
                                 f"--rollout.kv-pages hold ({self.page_size} positions a page): raise "
                                 "--rollout.kv-pages, or decode fewer rows at once (--rollout.slots)")
        for r in np.flatnonzero(more).tolist():
            self.rows[r].extend(self.free.pop() for _ in range(int(more[r])))
            self.version += 1

    def release(self, rows) -> None:
        for r in np.asarray(rows, np.int64).reshape(-1).tolist():
            if self.rows[r]:
                self.free.extend(reversed(self.rows[r]))
                self.rows[r] = []
                self.version += 1

    def take(self, rows, batch: int) -> None:
        rows = np.asarray(rows, np.int64).reshape(-1).tolist()
        keep = set(rows)
        self.release([r for r in range(self.num_rows) if r not in keep])
        self.rows = [self.rows[r] for r in rows] + [[] for _ in range(batch - len(rows))]
        self.version += 1

    def table(self, width: int) -> np.ndarray:
        out = np.full((self.num_rows, width), self.num_pages, np.int32)
        for r, pages in enumerate(self.rows):
            if len(pages) > width:
                raise ValueError(f"row {r} holds {len(pages)} pages, more than a table of width {width}")
            out[r, :len(pages)] = pages
        return out
