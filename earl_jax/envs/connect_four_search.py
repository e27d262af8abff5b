"""Connect Four alpha-beta on bitboards: fast enough for a depth-5 opponent in pure Python.

Layout (the classic one): column c owns bits c*7 .. c*7+5, bottom row first; bit c*7+6 is an
always-empty sentinel, so shifted four-in-a-row tests never wrap from one column into the next.
OpenSpiel's Python minimax walks `State.clone()` trees and is orders of magnitude slower.
"""
from __future__ import annotations

import random

ROWS, COLS = 6, 7
H1 = ROWS + 1
BOTTOM = tuple(1 << (c * H1) for c in range(COLS))
TOP = tuple(1 << (c * H1 + ROWS - 1) for c in range(COLS))
COLUMN = tuple(((1 << ROWS) - 1) << (c * H1) for c in range(COLS))
BOARD = sum(COLUMN)
CENTER = COLUMN[3]
ORDER = (3, 2, 4, 1, 5, 0, 6)  # centre first: the best moves are searched first, so more cut-offs
WIN = 1_000_000  # minus the ply count, so faster wins score higher and slower losses less badly
_DIRECTIONS = (1, H1, H1 - 1, H1 + 1)  # vertical, horizontal, two diagonals


def bitboards_from_history(history: list[int]) -> tuple[int, int]:
    """(player 0 stones, player 1 stones) after the given column sequence."""
    stones = [0, 0]
    mask = 0
    for i, col in enumerate(history):
        bit = (mask + BOTTOM[col]) & COLUMN[col]
        stones[i & 1] |= bit
        mask |= bit
    return stones[0], stones[1]


def is_win(p: int) -> bool:
    for d in _DIRECTIONS:
        m = p & (p >> d)
        if m & (m >> (2 * d)):
            return True
    return False


def _open_threes(p: int, empty: int) -> int:
    """Windows of four holding three of p's stones and one empty cell."""
    n = 0
    for d in _DIRECTIONS:
        p1, p2, p3 = p >> d, p >> (2 * d), p >> (3 * d)
        e1, e2, e3 = empty >> d, empty >> (2 * d), empty >> (3 * d)
        n += (
            (empty & p1 & p2 & p3).bit_count()
            + (p & e1 & p2 & p3).bit_count()
            + (p & p1 & e2 & p3).bit_count()
            + (p & p1 & p2 & e3).bit_count()
        )
    return n


def evaluate(me: int, opp: int) -> int:
    """Heuristic for the side to move: open threes and centre stones, mine minus theirs."""
    empty = BOARD & ~(me | opp)
    return (
        8 * (_open_threes(me, empty) - _open_threes(opp, empty))
        + 3 * ((me & CENTER).bit_count() - (opp & CENTER).bit_count())
    )


def _negamax(me: int, opp: int, depth: int, alpha: int, beta: int, ply: int) -> int:
    mask = me | opp
    moves = [(mask + BOTTOM[c]) & COLUMN[c] for c in ORDER if not mask & TOP[c]]
    if not moves:
        return 0  # full board: draw
    for bit in moves:
        if is_win(me | bit):
            return WIN - ply - 1
    if depth == 0:
        return evaluate(me, opp)
    for bit in moves:
        score = -_negamax(opp, me | bit, depth - 1, -beta, -alpha, ply + 1)
        if score >= beta:
            return score
        if score > alpha:
            alpha = score
    return alpha


def best_moves(history: list[int], depth: int) -> tuple[list[int], int]:
    """Columns that reach the best depth-limited score for the side to move, and that score.

    `depth` counts the plies searched beyond the root move; immediate wins are found at every
    node regardless, so depth 1 already blocks an opponent's immediate win.
    """
    p0, p1 = bitboards_from_history(history)
    me, opp = (p0, p1) if len(history) % 2 == 0 else (p1, p0)
    mask = me | opp
    legal = [c for c in ORDER if not mask & TOP[c]]
    if not legal:
        raise ValueError("no legal move: the board is full")
    for c in legal:
        if is_win(me | ((mask + BOTTOM[c]) & COLUMN[c])):
            return [c], WIN - 1
    best, best_score = [], -2 * WIN
    for c in legal:
        bit = (mask + BOTTOM[c]) & COLUMN[c]
        # Window (best-1, inf): moves equal to the best so far are scored exactly (ties kept),
        # worse ones cut off early.
        score = -_negamax(opp, me | bit, depth - 1, -2 * WIN, -(best_score - 1), 1)
        if score > best_score:
            best, best_score = [c], score
        elif score == best_score:
            best.append(c)
    return sorted(best), best_score


def choose_move(history: list[int], depth: int, rng: random.Random) -> int:
    """A best column, ties broken by `rng` so seeded games differ but replay exactly."""
    moves, _ = best_moves(history, depth)
    return moves[rng.randrange(len(moves))] if len(moves) > 1 else moves[0]
