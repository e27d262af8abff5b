"""Connect Four, the batched game: rules and search on uint64 bitboards, its text, opponents and blunder classes.

Bit layout as in `connect_four_search`: column c owns bits c*7 .. c*7+5, bottom row first, and
bit c*7+6 is an always-empty sentinel, so shifted four-in-a-row tests never wrap into the next
column. A batch is `stones: uint64[n, 2]` (player 0's stones, player 1's stones); player 0 is
OpenSpiel's 'x' and moves first. Actions are columns 0..6, OpenSpiel's ids and legal order.

Every function takes and returns arrays over the batch; none loops over games. `SPEC` (at the end) is what the
rest of the package reads: the rules, the text, the alpha-beta opponent (per game and batched), the blunder
classes and the default ladder.
"""
from __future__ import annotations

import random

import numpy as np
from jaxtyping import Bool, Int, UInt64

from earl_jax.envs import connect_four_search as _ref, connect_four_solver as _solver
from earl_jax.envs.games import GameSpec, Rules, register_game
from earl_jax.envs.games.game_text import GameText
from earl_jax.envs.vector.batched_opponents import BatchedOpponent, kth_true

ROWS, COLS = 6, 7
NUM_ACTIONS = COLS
BOARD_SHAPE = (ROWS, COLS)
H1 = ROWS + 1
_U = np.uint64
BOTTOM: UInt64[np.ndarray, " 7"] = np.array(_ref.BOTTOM, _U)
TOP: UInt64[np.ndarray, " 7"] = np.array(_ref.TOP, _U)
COLUMN: UInt64[np.ndarray, " 7"] = np.array(_ref.COLUMN, _U)
BOARD = _U(_ref.BOARD)
BOTTOM_ROW = _U(sum(_ref.BOTTOM))
CENTER = _U(_ref.CENTER)
ORDER = np.array(_ref.ORDER)  # the reference's search order: its first immediate win is the one it plays
WIN = _ref.WIN
MAX_LEAVES = 1 << 22  # positions searched at once, at most (x 8 bytes, a few arrays): ~100 MB at depth 5
DIRECTIONS = tuple(_U(d) for d in (1, H1, H1 - 1, H1 + 1))  # vertical, horizontal, two diagonals
_SHIFTS = np.array(DIRECTIONS, _U)[:, None]  # is_win: the four directions in one pass, [direction, game]
_SHIFTS2 = _SHIFTS + _SHIFTS
# The printed board's cell (top row first, left to right) of bit i (0..64; 64 is what a 0 bitboard counts)
_PRINT_OF_BIT = np.array([(ROWS - 1 - i % H1) * COLS + i // H1 for i in range(65)], np.int64)


# ---- rules ----------------------------------------------------------------------------------------
def legal_mask(stones: UInt64[np.ndarray, "n 2"]) -> Bool[np.ndarray, "n 7"]:
    """Columns with room left."""
    mask = stones[:, 0] | stones[:, 1]
    return (mask[:, None] & TOP) == 0


def drop(stones: UInt64[np.ndarray, "n 2"], actions: Int[np.ndarray, " n"]) -> UInt64[np.ndarray, " n"]:
    """The bit a stone dropped into each row's column lands on (0 if the column is full)."""
    mask = stones[:, 0] | stones[:, 1]
    return (mask + BOTTOM[actions]) & COLUMN[actions]


def is_win(p: UInt64[np.ndarray, " n"]) -> Bool[np.ndarray, " n"]:
    """Four in a row in any direction: `connect_four_search.is_win`, batched (the four directions in one pass
    over a [4, n] array: ~16 against ~24 us a loop over them took at 480 games on the 2-core CPU)."""
    q = p.reshape(1, -1)
    m = q & (q >> _SHIFTS)
    m &= m >> _SHIFTS2
    return (np.bitwise_or.reduce(m, 0) != 0).reshape(p.shape)


def is_full(stones: UInt64[np.ndarray, "n 2"]) -> Bool[np.ndarray, " n"]:
    return (stones[:, 0] | stones[:, 1]) == BOARD


def print_index(bits: UInt64[np.ndarray, " n"]) -> Int[np.ndarray, " n"]:
    """Where single-stone bitboards sit on the printed board (top row first, left to right)."""
    return _PRINT_OF_BIT[np.bitwise_count(bits - _U(1))]  # by the bit's index


# ---- search -------------------------------------------------------------------------------------
def _winning_cells(p: UInt64[np.ndarray, " n"], mask: UInt64[np.ndarray, " n"]) -> UInt64[np.ndarray, " n"]:
    """Empty cells where a stone of p completes four (Pascal Pons' formula): one pass per direction
    instead of one `is_win` per candidate move."""
    r = (p << _U(1)) & (p << _U(2)) & (p << _U(3))  # vertical: only three below can complete it
    for d in DIRECTIONS[1:]:
        d2, d3 = d + d, d + d + d
        left = (p << d) & (p << d2)
        r |= left & (p << d3)
        r |= left & (p >> d)
        right = (p >> d) & (p >> d2)
        r |= right & (p << d)
        r |= right & (p >> d3)
    return r & (BOARD ^ mask)


def evaluate(me: UInt64[np.ndarray, " n"], opp: UInt64[np.ndarray, " n"]) -> Int[np.ndarray, " n"]:
    """`connect_four_search.evaluate`, batched: open threes and centre stones, mine minus theirs.

    A window of four holds three stones and one empty cell in at most one way, so the reference's
    four counts per direction are one count of the OR of its four patterns (a third of the work).
    """
    empty = BOARD & ~(me | opp)
    threes = np.zeros(me.shape, np.int64)
    for d in DIRECTIONS:
        e1, e2, e3 = empty >> d, empty >> (d + d), empty >> (d + d + d)
        for p, sign in ((me, 1), (opp, -1)):
            p1, p2, p3 = p >> d, p >> (d + d), p >> (d + d + d)
            p23, p01 = p2 & p3, p & p1
            windows = (empty & p1 & p23) | (p & e1 & p23) | (p01 & e2 & p3) | (p01 & p2 & e3)
            if sign > 0:
                threes += np.bitwise_count(windows)
            else:
                threes -= np.bitwise_count(windows)
    centre = np.bitwise_count(me & CENTER).astype(np.int64) - np.bitwise_count(opp & CENTER)
    return 8 * threes + 3 * centre


def _values(me: UInt64[np.ndarray, " m"], opp: UInt64[np.ndarray, " m"], depth: int, ply: int) -> Int[np.ndarray, " m"]:
    """What `connect_four_search._negamax` returns with a full window, for every position at once.

    Full width, no pruning: alpha-beta with a full window returns the exact minimax value, so this
    is the same number. Node order as in the reference: full board 0, then an immediate win
    (WIN - ply - 1) before the depth test, then the best child. `depth` >= 1 (leaves: `_child_scores`).
    """
    mask = me | opp
    moves = (mask + BOTTOM_ROW) & BOARD
    win = (_winning_cells(me, mask) & moves) != 0
    value = np.where(win, WIN - ply - 1, 0).astype(np.int64)
    open_ = np.flatnonzero((moves != 0) & ~win)  # only these need their children
    value[open_] = _child_scores(me[open_], opp[open_], depth - 1, ply + 1).max(1)
    return value


def _child_scores(me: UInt64[np.ndarray, " k"], opp: UInt64[np.ndarray, " k"], depth: int, ply: int
                  ) -> Int[np.ndarray, "k 7"]:
    """Minus the value of each child (me plays column c; the child is at `ply`, `depth` plies left to
    search), -2 WIN for a full column. Leaves (depth 0) are scored from the parent: the child's side to
    move is `opp`, whose winning cells do not change when me fills a cell, so one `_winning_cells` per
    parent serves its seven children."""
    mask = me | opp
    bits = (mask[:, None] + BOTTOM) & COLUMN  # (k, 7): the landing bit per column, 0 if full
    legal = bits != 0
    child_me = np.broadcast_to(opp[:, None], bits.shape)
    child_opp = me[:, None] | bits
    scores = np.full(bits.shape, -2 * WIN, np.int64)
    if depth > 0:
        scores[legal] = -_values(child_me[legal], child_opp[legal], depth, ply)
        return scores
    moves = (mask + BOTTOM_ROW) & BOARD
    child_moves = (moves[:, None] & ~bits) | ((bits << _U(1)) & BOARD)  # the cell above replaces bit
    child_win = (_winning_cells(opp, mask)[:, None] & child_moves) != 0  # a full board has no moves: 0
    values = np.where(child_win, WIN - ply - 1, 0).astype(np.int64)
    scored = legal & ~child_win & (child_moves != 0)
    values[scored] = evaluate(child_me[scored], child_opp[scored])
    scores[legal] = -values[legal]
    return scores


def best_moves(me: UInt64[np.ndarray, " n"], opp: UInt64[np.ndarray, " n"], depth: int
               ) -> tuple[Bool[np.ndarray, "n 7"], Int[np.ndarray, " n"]]:
    """`connect_four_search.best_moves` for n positions (me to move): (best columns as a mask, score).

    An immediate win is returned alone: the first winning column in `ORDER`, score WIN - 1. Else the
    columns whose depth-limited minimax score is the best. Cost grows 7x per ply: see the
    `earl_jax.envs.vector` docstring for timings.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    n = len(me)
    chunk = max(1, MAX_LEAVES // COLS ** depth)
    if n > chunk:  # bounded memory: deep searches go a slice of the batch at a time
        parts = [best_moves(me[i:i + chunk], opp[i:i + chunk], depth) for i in range(0, n, chunk)]
        return np.concatenate([b for b, _ in parts]), np.concatenate([s for _, s in parts])
    mask = me | opp
    moves = (mask + BOTTOM_ROW) & BOARD
    if np.any(moves == 0):
        raise ValueError("no legal move: a board is full")
    wins_in_order = ((_winning_cells(me, mask) & moves)[:, None] & COLUMN[ORDER]) != 0  # (n, 7)
    has_win = wins_in_order.any(1)
    best = np.zeros((n, COLS), bool)
    score = np.full(n, WIN - 1, np.int64)
    best[np.flatnonzero(has_win), ORDER[wins_in_order.argmax(1)][has_win]] = True
    rest = np.flatnonzero(~has_win)
    scores = _child_scores(me[rest], opp[rest], depth - 1, 1)  # columns in id order: the result is sorted
    top = scores.max(1)
    best[rest] = scores == top[:, None]
    score[rest] = top
    return best, score


# ---- opponents --------------------------------------------------------------------------------------------
DEFAULT_ALPHABETA_DEPTH = 4


class AlphaBetaOpponent:
    """Per game: depth-limited alpha-beta over the game's history (connect_four_search); < 50 ms a move at
    depth 5. Ties among the best moves are broken by its own seeded RNG."""

    def __init__(self, depth: int, seed: int = 0):
        self.depth = depth
        self._rng = random.Random(seed)

    def reset(self, seed: int) -> None:
        self._rng.seed(seed)

    def act(self, state) -> int:
        return _ref.choose_move(state.history(), self.depth, self._rng)


class AlphaBetaOpponents(BatchedOpponent):
    """`AlphaBetaOpponent` for a batch: `best_moves`, then rng.randrange(len(best)) only when there are several."""

    def __init__(self, num_games: int, depth: int = DEFAULT_ALPHABETA_DEPTH):
        super().__init__(num_games)
        self.depth = depth

    def _best(self, me, opp):
        return best_moves(me, opp, self.depth)[0]

    def act(self, rows, me, opp, legal):
        best = self._best(me, opp)
        counts = best.sum(1)
        pick = np.zeros(len(rows), np.int64)
        ties = np.flatnonzero(counts > 1)  # choose_move draws only when it has a choice
        pick[ties] = self.streams.randbelow(rows[ties], counts[ties])
        return kth_true(best, pick)


class SolverOpponent:
    """Per game: the near-exact solver (connect_four_solver) with `budget` nodes a move, ties broken by its own seeded
    RNG as `AlphaBetaOpponent` breaks them."""

    def __init__(self, budget: int, seed: int = 0):
        self.budget = budget
        self._rng = random.Random(seed)

    def reset(self, seed: int) -> None:
        self._rng.seed(seed)

    def act(self, state) -> int:
        p0, p1 = _ref.bitboards_from_history(state.history())
        me, opp = (p0, p1) if len(state.history()) % 2 == 0 else (p1, p0)
        moves = _solver.solve(me, opp, self.budget)[0]
        return moves[self._rng.randrange(len(moves))] if len(moves) > 1 else moves[0]


class SolverOpponents(AlphaBetaOpponents):
    """`SolverOpponent` for a batch: one search per game (tens of ms a move on a CPU core), ties drawn as alpha-beta
    draws them."""

    per_game = True  # searches one game at a time: the curriculum gives it a bounded share of the groups

    def __init__(self, num_games: int, budget: int = _solver.DEFAULT_BUDGET):
        super().__init__(num_games)
        self.budget = budget

    def _best(self, me, opp):
        return _solver.best_moves(me, opp, self.budget)


def _budget(spec) -> int:
    """`solver` -> the default budget; `solver:K` -> K thousand nodes a move."""
    return spec.positive_int(_solver.DEFAULT_BUDGET // 1000) * 1000


# ---- blunder classes ----------------------------------------------------------------------------------------
def move_classes(me: UInt64[np.ndarray, " n"], opp: UInt64[np.ndarray, " n"], depth: int) -> Int[np.ndarray, "n 7"]:
    """+1 / 0 / -1 per column from a `depth`-ply search (`_child_scores`): depth 1 sees immediate wins and the
    opponent's immediate replies (a missed win, a missed block), each further ply one more."""
    if depth < 1:
        raise ValueError(f"blunder depth must be >= 1, got {depth}")
    mask = me | opp
    moves = (mask + BOTTOM_ROW) & BOARD
    wins = ((_winning_cells(me, mask) & moves)[:, None] & COLUMN) != 0  # (n, 7)
    scores = _child_scores(me, opp, depth - 1, 1)  # minus each child's value: mine, by column
    decided = WIN - 64  # a forced result within the horizon (|score| ~ WIN - plies)
    classes = np.where(scores >= decided, 1, np.where(scores <= -decided, -1, 0))
    return np.where(wins, 1, classes).astype(np.int64)


SPEC = register_game(GameSpec(
    name="connect_four",
    rules=Rules(num_actions=NUM_ACTIONS, legal_mask=legal_mask, drop=drop, is_win=is_win, is_full=is_full,
                print_index=print_index),
    text=GameText(
        name="connect_four",
        num_actions=NUM_ACTIONS,
        board_shape=BOARD_SHAPE,
        move_noun="column",
        rules=(
            "We play Connect Four on a board of 6 rows and 7 columns. You are X, your opponent is O. "
            "Players take turns dropping a piece into a column, numbered 0 to 6 from left to right; "
            "it falls to the lowest empty cell. The first to get four in a row, horizontally, "
            "vertically or diagonally, wins. A full board is a draw. An illegal answer is penalised."
        ),
        cell_labels="0 1 2 3 4 5 6",
    ),
    # ends at depth 3: depth 4 costs ~10x a depth-3 turn at 512 games (envs/vector/__init__.py)
    ladder=("random", "alphabeta:1", "alphabeta:2", "alphabeta:3"),
    move_classes=move_classes,
    opponents={"alphabeta": lambda spec, seed: AlphaBetaOpponent(spec.positive_int(DEFAULT_ALPHABETA_DEPTH), seed),
               "solver": lambda spec, seed: SolverOpponent(_budget(spec), seed)},
    batched_opponents={
        "alphabeta": lambda spec, n: AlphaBetaOpponents(n, spec.positive_int(DEFAULT_ALPHABETA_DEPTH)),
        "solver": lambda spec, n: SolverOpponents(n, _budget(spec))},
    refused_opponents={"solver": "the generic solver cannot solve Connect Four; its own 'solver' (a node-budgeted "
                                 "search) plays the standard 6x7 board only"},
))
