"""A near-exact Connect Four player: negamax with alpha-beta on bitboards, iterative deepening, a transposition table.

    moves, score = solve(me, opp, budget=DEFAULT_BUDGET)   # the side to move's equally best columns, and their score
    best_moves(me, opp, budget)                             # the same for arrays of positions (bool [n, 7])

Scores are from the side to move: `WIN - m` for a forced win completed with the m-th stone on the board, minus that
for a forced loss, 0 for a draw by a full board, and a heuristic (cells that would win, by row parity; centre;
|h| < 1000) where the search stopped before the game's end. So a score >= `DECIDED` is a proven win, and a search
that reached the end of every line is exact: the game-theoretic value, fastest win / slowest loss first.

How (Pascal Pons' solver, in Python and depth-limited): at every node a win in one is taken at once; a threat of
the opponent's that can be played now is blocked (two such threats: lost); no move is played under a cell that
would win for the opponent; moves are ordered by the transposition table's best move, then by how many winning
cells they make, centre first. The root deepens one ply at a time, scoring every move with a window that keeps ties
(`connect_four_search.best_moves`'s), until the result is proven, the search reached the end of the game, or
`budget` nodes are spent (the deepening that crosses it finishes, so a move costs up to a few times the budget).
The budget counts nodes, not seconds, so a move is a pure function of (position, budget): seeded games replay,
and the batched and per-game opponents agree move for move. Speed: docs/learning.md, experiments/solver_strength.py.

Bit layout as in `connect_four_search`: column c owns bits c*7 .. c*7+5, bottom row first.
"""
from __future__ import annotations

import functools

import numpy as np
from jaxtyping import Bool, UInt64

from earl_jax.envs.connect_four_search import BOARD, BOTTOM, CENTER, COLUMN, TOP

WIN = 1_000_000
DECIDED = WIN - 64  # scores beyond this are proven results
DEFAULT_BUDGET = 5_000  # nodes a move (`solver`); `solver:K` is K thousand
CELLS = 42
BOTTOM_ROW = sum(BOTTOM)
_ORDER = (3, 2, 4, 1, 5, 0, 6)  # centre first
_EXACT, _LOWER, _UPPER = 0, 1, 2


def winning_cells(p: int, mask: int) -> int:
    """Empty cells where a stone of p completes four (Pons' formula; unrolled: this is most of a node's time)."""
    r = (p << 1) & (p << 2) & (p << 3)  # vertical: only three below can complete it
    a, b = (p << 7) & (p << 14), (p >> 7) & (p >> 14)  # horizontal
    r |= (a & ((p << 21) | (p >> 7))) | (b & ((p << 7) | (p >> 21)))
    a, b = (p << 6) & (p << 12), (p >> 6) & (p >> 12)  # one diagonal
    r |= (a & ((p << 18) | (p >> 6))) | (b & ((p << 6) | (p >> 18)))
    a, b = (p << 8) & (p << 16), (p >> 8) & (p >> 16)  # the other
    r |= (a & ((p << 24) | (p >> 8))) | (b & ((p << 8) | (p >> 24)))
    return r & (BOARD ^ mask)


# rows 1, 3, 5 counted from the bottom: the first player's good threats (Allis); rows 2, 4, 6 the second's
_ODD_ROWS = sum(((1 << 0) | (1 << 2) | (1 << 4)) << (7 * c) for c in range(7))
_EVEN_ROWS = BOARD ^ _ODD_ROWS


def _heuristic(me: int, opp: int, mine: int, theirs: int, stones: int) -> int:
    """Cells that would win, mine minus theirs, those on the player's own row parity weighted 5x (what decides a full
    board: Allis' odd / even threats); centre stones. Weights from matches against alphabeta:3 (8,0,3 lost 14 of 60,
    2,8,2 5 of 60 at 2000 nodes a move)."""
    my_rows, their_rows = (_ODD_ROWS, _EVEN_ROWS) if stones % 2 == 0 else (_EVEN_ROWS, _ODD_ROWS)
    return (2 * (mine.bit_count() - theirs.bit_count())
            + 8 * ((mine & my_rows).bit_count() - (theirs & their_rows).bit_count())
            + 2 * ((me & CENTER).bit_count() - (opp & CENTER).bit_count()))


class _Search:
    """One move's search: the node count and the transposition table (key -> (flag, depth, value, best bit))."""

    def __init__(self):
        self.nodes = 0
        self.table: dict[int, tuple[int, int, int, int]] = {}

    def negamax(self, me: int, mask: int, depth: int, alpha: int, beta: int) -> int:
        """The depth-limited value of the position for the side to move (`me`: its stones)."""
        self.nodes += 1
        stones = mask.bit_count()
        if stones == CELLS:
            return 0
        possible = (mask + BOTTOM_ROW) & BOARD
        mine = winning_cells(me, mask)
        if mine & possible:
            return WIN - stones - 1
        opp = me ^ mask
        threats = winning_cells(opp, mask)
        forced = possible & threats
        if forced:
            if forced & (forced - 1):  # two threats to block: the opponent wins with its next stone
                return -(WIN - stones - 2)
            possible = forced
        possible &= ~(threats >> 1)  # a stone under an opponent's winning cell hands it over
        if not possible:
            return -(WIN - stones - 2)
        if stones + 1 == CELLS:  # the last stone: no win (checked above), so a draw
            return 0
        if depth == 0:
            return _heuristic(me, opp, mine, threats, stones)
        # no win before stones + 3 (ours) or + 4 (theirs): bounds that cut without a search
        most, least = WIN - stones - 3, -(WIN - stones - 4)
        if beta > most:
            beta = most
            if alpha >= beta:
                return beta
        if alpha < least:
            alpha = least
            if alpha >= beta:
                return alpha
        key = me + mask
        entry = self.table.get(key)
        first = 0
        if entry is not None:
            flag, d, value, first = entry
            if d >= depth:
                if flag == _EXACT:
                    return value
                if flag == _LOWER and value >= beta:
                    return value
                if flag == _UPPER and value <= alpha:
                    return value
        alpha0, best, best_bit = alpha, -2 * WIN, 0
        for bit in _ordered(me, mask, possible, first, depth):
            score = -self.negamax(opp, mask | bit, depth - 1, -beta, -alpha)
            if score > best:
                best, best_bit = score, bit
                if score > alpha:
                    alpha = score
                    if alpha >= beta:
                        break
        flag = _LOWER if best >= beta else _UPPER if best <= alpha0 else _EXACT
        self.table[key] = (flag, depth, best, best_bit)
        return best


def _ordered(me: int, mask: int, possible: int, first: int, depth: int) -> list[int]:
    """The playable bits, the table's best first, then (away from the leaves) by winning cells made, centre first."""
    bits = [possible & COLUMN[c] for c in _ORDER if possible & COLUMN[c]]
    if depth > 2 and len(bits) > 1:
        bits.sort(key=lambda b: -winning_cells(me | b, mask | b).bit_count())  # stable: centre breaks ties
    if first and first in bits:
        bits.remove(first)
        bits.insert(0, first)
    return bits


@functools.lru_cache(maxsize=1 << 16)
def solve(me: int, opp: int, budget: int = DEFAULT_BUDGET) -> tuple[tuple[int, ...], int]:
    """The side to move's equally best columns (ascending) and their score (see the module docstring), searching
    deeper until a result is proven, the game's end is in reach or `budget` nodes are spent. Cached: a pure
    function of the position (openings repeat across games)."""
    mask = me | opp
    legal = [c for c in range(len(COLUMN)) if not mask & TOP[c]]
    if not legal:
        raise ValueError("no legal move: the board is full")
    stones = mask.bit_count()
    wins = [c for c in legal if winning_cells(me, mask) & ((mask + BOTTOM[c]) & COLUMN[c])]
    if wins:
        return tuple(wins), WIN - stones - 1
    search, order = _Search(), sorted(legal, key=_ORDER.index)
    best: list[int] = []
    best_score = -2 * WIN
    for depth in range(1, CELLS - stones + 1):
        scores: dict[int, int] = {}
        best, best_score = [], -2 * WIN
        for c in order:
            bit = (mask + BOTTOM[c]) & COLUMN[c]
            # window (best - 1, inf): moves that tie the best so far are scored exactly, worse ones cut early
            score = -search.negamax(opp, mask | bit, depth - 1, -2 * WIN, -(best_score - 1))
            scores[c] = score
            if score > best_score:
                best, best_score = [c], score
            elif score == best_score:
                best.append(c)
        proven = abs(best_score) >= DECIDED
        if proven or depth >= CELLS - stones or search.nodes >= budget:
            break
        order = sorted(order, key=lambda c: -scores[c])  # stable: the best first, ties in centre order
    return tuple(sorted(best)), best_score


def best_moves(me: UInt64[np.ndarray, " n"], opp: UInt64[np.ndarray, " n"], budget: int = DEFAULT_BUDGET
               ) -> Bool[np.ndarray, "n 7"]:
    """`solve`'s best columns for each position (the side to move's stones `me`), one search per position."""
    out = np.zeros((len(me), len(COLUMN)), bool)
    for i, (m, o) in enumerate(zip(me.tolist(), opp.tolist())):
        out[i, list(solve(int(m), int(o), budget)[0])] = True
    return out
