"""Batched opponents: one call picks the replies of every game that waits for one.

Each game has its own `random.Random` stream, seeded at reset exactly as `opponents.py` seeds its
opponent, and consumed exactly as the per-game opponent consumes it, so a seeded game replays move
for move. The choice of candidate moves is array code. Here: the base class, the streams and the opponent
every game has; a game's own (Connect Four's alpha-beta, Tic-Tac-Toe's solver) sit in its file in envs/games/
and `make_vector_opponent` finds them through its GameSpec:

    RandomOpponents         legal[rng.randrange(len(legal))], every move

The draws are batched too (`StreamBank`): CPython's `randrange(n)` for small n is one 32-bit
Mersenne Twister word shifted right, redrawn while it is >= n, and `getrandbits(32 * m)` returns
the next m words, first word lowest. So each game's next words are kept in a buffer, and a draw
for a batch is a gather and a shift; a game's words are fetched from its generator 64 at a time.
"""
from __future__ import annotations

import functools
import random
from typing import Sequence

import numpy as np
from jaxtyping import Bool, Int, UInt32, UInt64

from earl_jax.envs.games import OpponentSpec, find_game

BLOCK = 64  # words fetched per generator call: a move draws one or two, so most games never fetch a second
AHEAD = 8  # words a row that was rejected reads at once (randbelow)
_AHEAD = np.arange(AHEAD)


@functools.lru_cache(maxsize=1 << 14)
def _first_block(seed: int) -> UInt32[np.ndarray, " 64"]:
    """random.Random(seed)'s first BLOCK words. Cached: a GRPO group resets its games with one seed."""
    return _words(random.Random(seed), BLOCK)


# n.bit_length() -> the shift randbelow draws with (32 - bit_length), for small n: a lookup instead of frexp
_SHIFTS = np.array([32 - k.bit_length() for k in range(256)], np.uint32)


def _words(rng: random.Random, count: int) -> UInt32[np.ndarray, " count"]:
    return np.frombuffer(rng.getrandbits(32 * count).to_bytes(4 * count, "little"), "<u4")


class StreamBank:
    """`random.Random(seed)` streams of n games, drawn from in batches, word for word as CPython would."""

    def __init__(self, num_games: int):
        self.seeds = np.zeros(num_games, np.int64)
        self.words = np.zeros((num_games, BLOCK), np.uint32)  # each game's next words
        self.used = np.zeros(num_games, np.int64)  # words of the current block already drawn
        self.blocks = np.ones(num_games, np.int64)  # blocks fetched since the seed
        self._rngs: dict[int, random.Random] = {}  # generators past their first block (rare)
        self.reset(range(num_games), [0] * num_games)

    def reset(self, rows: Sequence[int], seeds: Sequence[int]) -> None:
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return
        self.seeds[rows] = seeds
        unique, where = np.unique(np.asarray(seeds, np.int64), return_inverse=True)  # a GRPO group shares its seed
        self.words[rows] = np.stack([_first_block(int(s)) for s in unique.tolist()])[where.reshape(-1)]
        self.used[rows] = 0
        self.blocks[rows] = 1
        if self._rngs:
            for i in rows.tolist():
                self._rngs.pop(i, None)

    def randbelow(self, rows: Int[np.ndarray, " r"], n: Int[np.ndarray, " r"]) -> Int[np.ndarray, " r"]:
        """`random.Random.randrange(n)` per row (CPython 3.11 `_randbelow_with_getrandbits`): the top
        n.bit_length() bits of the next word, until they are below n. 1 <= n < 2**32."""
        rows, n = np.asarray(rows, np.int64), np.asarray(n, np.int64)
        if len(n) and n.max() < len(_SHIFTS):
            shift = _SHIFTS[n]
        else:
            shift = (32 - np.frexp(n.astype(np.float64))[1]).astype(np.uint32)  # frexp's exponent = bit_length
        out = np.zeros(len(rows), np.int64)  # (replaced after the first pass)
        todo = None  # the entries still drawing (None: all of them)
        games, below, sh = rows, n, shift
        while len(games):  # rejection: only the rows whose draw was >= n draw again
            used = self.used[games]
            if todo is not None and used.max() <= BLOCK - AHEAD:
                # The few rows that draw again read their next AHEAD words at once and take the first below n
                # (the words before it consumed as rejections, as CPython does): one pass instead of ~3 more.
                draws = (self.words.reshape(-1)[(games * BLOCK + used)[:, None] + _AHEAD]
                         >> sh[:, None]).astype(np.int64)
                accept = draws < below[:, None]
                got, first = accept.any(1), accept.argmax(1)
                self.used[games] = used + np.where(got, first + 1, AHEAD)
                hit = np.flatnonzero(got)
                out[todo[hit]] = draws[hit, first[hit]]
                todo = todo[~got]
                games, below, sh = rows[todo], n[todo], shift[todo]
                continue
            if used.max() == BLOCK:  # some rows used their block up (used <= BLOCK)
                self._refill(games[used == BLOCK])
                used = self.used[games]
            draw = (self.words.reshape(-1)[games * BLOCK + used] >> sh).astype(np.int64)
            self.used[games] = used + 1
            accept = draw < below
            if todo is None:
                if accept.all():  # no row drew again (no copies)
                    return draw
                out = np.where(accept, draw, 0)
                todo = np.flatnonzero(~accept)
            else:
                out[todo[accept]] = draw[accept]
                todo = todo[~accept]
            games, below, sh = rows[todo], n[todo], shift[todo]
        return out

    def _refill(self, games: np.ndarray) -> None:
        for i in games.tolist():
            rng = self._rngs.get(i)
            if rng is None:  # past the cached first block: the generator, advanced to where the game is
                rng = self._rngs[i] = random.Random(int(self.seeds[i]))
                rng.getrandbits(32 * BLOCK * int(self.blocks[i]))
            self.words[i] = _words(rng, BLOCK)
            self.used[i] = 0
            self.blocks[i] += 1


def kth_true(mask: Bool[np.ndarray, "r a"], k: Int[np.ndarray, " r"]) -> Int[np.ndarray, " r"]:
    """Column of the k-th True of each row (0-based, left to right)."""
    return (np.cumsum(mask, 1) > k[:, None]).argmax(1)


@functools.cache
def _set_tables(width: int) -> tuple[Int[np.ndarray, " w"], Int[np.ndarray, " s"], Int[np.ndarray, " s*w"]]:
    """For sets of `width` items as bitmasks: (bit weights, each set's size, its k-th member at [set * width + k])."""
    codes = np.arange(1 << width)
    members = ((codes[:, None] >> np.arange(width)) & 1).astype(bool)
    kth = np.zeros((1 << width, width), np.int64)
    for c in codes.tolist():
        kth[c, :members[c].sum()] = np.flatnonzero(members[c])
    return 1 << np.arange(width), members.sum(1), kth.reshape(-1)


class BatchedOpponent:
    """Per-game RNG streams; subclasses say which moves are candidates and when a draw is made."""

    def __init__(self, num_games: int):
        self.streams = StreamBank(num_games)

    def reset(self, rows: Sequence[int], seeds: Sequence[int]) -> None:
        self.streams.reset(rows, seeds)

    def act(self, rows: Int[np.ndarray, " r"], me: UInt64[np.ndarray, " r"], opp: UInt64[np.ndarray, " r"],
            legal: Bool[np.ndarray, "r a"]) -> Int[np.ndarray, " r"]:
        """A move per row for the side to move (`me`: its stones; `opp`: the agent's)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the opponent holds beyond its arrays (search worker processes); nothing by default."""


class RandomOpponents(BatchedOpponent):
    def act(self, rows, me, opp, legal):
        width = legal.shape[1]
        if width > 12:
            return kth_true(legal, self.streams.randbelow(rows, legal.sum(1)))
        weights, sizes, kth = _set_tables(width)  # the legal set as one code: two lookups instead of row sums
        code = legal @ weights
        return kth[code * width + self.streams.randbelow(rows, sizes[code])]


def make_vector_opponent(spec: str, game: str, num_games: int) -> BatchedOpponent:
    """The batched opponent for a spec `opponents.make_opponent` accepted for `game` (its short name): random, or
    one of the game's GameSpec.batched_opponents; ValueError for a spec that has none (mcts: make_vector_env's
    per-game path, or `per_game_opponents.any_opponent` inside the batched env)."""
    parsed = OpponentSpec.parse(spec, "an opponent spec")
    if parsed.kind == "random" and not parsed.arg:
        return RandomOpponents(num_games)
    registered = find_game(game)
    make = registered.batched_opponents.get(parsed.kind) if registered is not None else None
    if make is None:
        raise ValueError(f"no batched opponent for {spec!r} in {game}: use make_vector_env (per-game path)")
    return make(parsed, num_games)
