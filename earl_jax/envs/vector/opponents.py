"""Batched opponents: one call picks the replies of every game that waits for one.

Each game keeps its own `random.Random`, seeded at reset exactly as `opponents.py` seeds its
opponent, and draws from it exactly when and how the per-game opponent would, so a seeded game
replays move for move. The draws are the only per-game Python left (about 0.1 us a game); the
choice of the candidate moves (legal cells, the alpha-beta best set, the solver's table) is array code.

    RandomOpponents         legal[rng.randrange(len(legal))], every move
    AlphaBetaOpponents(d)   connect_four.best_moves, ties: rng.randrange only when there are several
    SolverOpponents         tic_tac_toe.solver_best_moves, rng.randrange every move (even of 1)
"""
from __future__ import annotations

import random
from typing import Sequence

import numpy as np
from jaxtyping import Bool, Int, UInt64

from earl_jax.envs.opponents import DEFAULT_ALPHABETA_DEPTH
from earl_jax.envs.vector import connect_four, tic_tac_toe


class _SeededOpponents:
    """Per-game RNG streams; subclasses say which moves are candidates and when a draw is made."""

    def __init__(self, num_games: int):
        self.rngs = [random.Random(0) for _ in range(num_games)]
        self._getrandbits = [rng.getrandbits for rng in self.rngs]  # bound once: the hot call

    def reset(self, rows: Sequence[int], seeds: Sequence[int]) -> None:
        for i, seed in zip(rows, seeds):
            self.rngs[i].seed(seed)

    def randbelow(self, rows: Int[np.ndarray, " r"], n: Int[np.ndarray, " r"]) -> Int[np.ndarray, " r"]:
        """`rngs[i].randrange(n)` per row, as CPython 3.11 computes it: getrandbits(n.bit_length())
        until the draw is below n."""
        k = np.frexp(n.astype(np.float64))[1]  # bit_length, exact for small ints
        bits = self._getrandbits
        out = np.array([bits[i](b) for i, b in zip(rows.tolist(), k.tolist())], np.int64).reshape(len(rows))
        redo = np.flatnonzero(out >= n)
        while len(redo):  # rejection: redraw only those rows, in order, from their own streams
            out[redo] = [bits[i](b) for i, b in zip(rows[redo].tolist(), k[redo].tolist())]
            redo = redo[out[redo] >= n[redo]]
        return out

    def act(self, rows: Int[np.ndarray, " r"], me: UInt64[np.ndarray, " r"], opp: UInt64[np.ndarray, " r"],
            legal: Bool[np.ndarray, "r a"]) -> Int[np.ndarray, " r"]:
        """A move per row for the side to move (`me`'s stones; `opp` the agent's)."""
        raise NotImplementedError


def kth_true(mask: Bool[np.ndarray, "r a"], k: Int[np.ndarray, " r"]) -> Int[np.ndarray, " r"]:
    """Column of the k-th True of each row (0-based, left to right)."""
    return (np.cumsum(mask, 1) > k[:, None]).argmax(1)


class RandomOpponents(_SeededOpponents):
    def act(self, rows, me, opp, legal):
        return kth_true(legal, self.randbelow(rows, legal.sum(1)))


class AlphaBetaOpponents(_SeededOpponents):
    def __init__(self, num_games: int, depth: int = DEFAULT_ALPHABETA_DEPTH):
        super().__init__(num_games)
        self.depth = depth

    def act(self, rows, me, opp, legal):
        best, _ = connect_four.best_moves(me, opp, self.depth)
        counts = best.sum(1)
        pick = np.zeros(len(rows), np.int64)
        ties = np.flatnonzero(counts > 1)  # choose_move draws only when it has a choice
        pick[ties] = self.randbelow(rows[ties], counts[ties])
        return kth_true(best, pick)


class SolverOpponents(_SeededOpponents):
    def act(self, rows, me, opp, legal):
        # The table is indexed by (player 0's cells, player 1's cells); me is whoever is to move.
        mover = np.bitwise_count(me | opp) & 1  # 0: player 0 to move
        x = np.where(mover == 0, me, opp)
        o = np.where(mover == 0, opp, me)
        masks = tic_tac_toe.solver_best_moves(np.stack([x, o], 1)).astype(np.int64)
        best = ((masks[:, None] >> np.arange(tic_tac_toe.NUM_ACTIONS)) & 1).astype(bool)
        return kth_true(best, self.randbelow(rows, best.sum(1)))


def make_vector_opponent(spec: str, game: str, num_games: int) -> _SeededOpponents:
    """The batched opponent for a spec `opponents.make_opponent` accepted for `game` (its short name);
    ValueError for a spec that has none (mcts: use make_vector_env's per-game path)."""
    kind, _, arg = spec.strip().lower().partition(":")
    if kind == "random" and not arg:
        return RandomOpponents(num_games)
    if kind == "alphabeta" and game == "connect_four":
        return AlphaBetaOpponents(num_games, int(arg) if arg else DEFAULT_ALPHABETA_DEPTH)
    if kind == "solver" and not arg and game == "tic_tac_toe":
        return SolverOpponents(num_games)
    raise ValueError(f"no batched opponent for {spec!r} in {game}: use make_vector_env (per-game path)")
