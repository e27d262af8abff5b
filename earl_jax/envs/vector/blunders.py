"""Which moves give away what the position held: the dense signal of `--blunder-penalty`.

Against a weak opponent the game's outcome rarely punishes a bad move (random seldom takes the win left to it),
so the outcome alone teaches blocking and finishing slowly. Here every legal move of the side to move gets an
outcome class: +1 it wins (by force), 0 open, -1 it loses (by force), judged by

* Tic-Tac-Toe: the exact game value (the solver opponent's table, `tic_tac_toe.solver_values`), so "open" is a draw;
* Connect Four: a `depth`-ply search (the batched alpha-beta's `_child_scores`): depth 1 sees immediate wins and
  the opponent's immediate replies (a missed win, a missed block), each further ply one more.

A move's blunder is (best class among the legal moves) - (its class): 0 for a move that keeps the best outcome in
reach, 1 or 2 for one that throws it away (win -> open / loss, open -> loss). The env subtracts
penalty x blunder from that turn's reward. It does not reward play beyond the horizon; it is potential-based
shaping only for a perfect judge (Tic-Tac-Toe), where it cannot change the optimal policy.
"""
from __future__ import annotations

import numpy as np
from jaxtyping import Bool, Int, UInt64

from earl_jax.envs.vector import connect_four, tic_tac_toe

GAMES = ("connect_four", "tic_tac_toe")
ILLEGAL = -9  # class of an illegal move: never the best, never chosen (the env checks legality first)


def move_classes(game: str, me: UInt64[np.ndarray, " n"], opp: UInt64[np.ndarray, " n"],
                 legal: Bool[np.ndarray, "n a"], depth: int = 1) -> Int[np.ndarray, "n a"]:
    """Outcome class (+1 / 0 / -1) of every move of the side to move (`me`), ILLEGAL where not legal."""
    if game == "tic_tac_toe":
        classes = _ttt_classes(me, opp)
    elif game == "connect_four":
        classes = _c4_classes(me, opp, depth)
    else:
        raise ValueError(f"blunder classes exist for {GAMES}, not {game!r}")
    return np.where(legal, classes, ILLEGAL)


def blunders(game: str, me: UInt64[np.ndarray, " n"], opp: UInt64[np.ndarray, " n"], legal: Bool[np.ndarray, "n a"],
             moves: Int[np.ndarray, " n"], depth: int = 1) -> Int[np.ndarray, " n"]:
    """Classes lost by playing moves[k] (legal) instead of the best move: 0, 1 or 2."""
    classes = move_classes(game, me, opp, legal, depth)
    chosen = classes[np.arange(len(moves)), moves]
    if np.any(chosen == ILLEGAL):
        raise ValueError("blunders: a move is not legal")
    return (classes.max(1) - chosen).astype(np.int64)


# ---- Tic-Tac-Toe: exact values ---------------------------------------------------------------------------
def _ttt_classes(me, opp) -> Int[np.ndarray, "n 9"]:
    cells = np.arange(tic_tac_toe.NUM_ACTIONS)
    bits = (np.uint64(1) << cells.astype(np.uint64))[None, :]
    mine = me[:, None] | bits  # (n, 9) my stones after each move (illegal ones are masked by the caller)
    won = tic_tac_toe.is_win(mine.ravel()).reshape(mine.shape)
    # each child as (X stones, O stones): the solver's value for X, turned into mine
    x_first = (np.bitwise_count(me | opp) & 1) == 0  # I am X (player 0) when the board has an even count
    theirs = np.broadcast_to(opp[:, None], mine.shape)
    x, o = np.where(x_first[:, None], mine, theirs), np.where(x_first[:, None], theirs, mine)
    value_for_x = tic_tac_toe.solver_values(x, o).astype(np.int64)  # the solver opponent's own search
    mover_value = np.where(x_first[:, None], value_for_x, -value_for_x)
    return np.where(won, 1, mover_value).astype(np.int64)


# ---- Connect Four: a depth-limited search ----------------------------------------------------------------
def _c4_classes(me, opp, depth: int) -> Int[np.ndarray, "n 7"]:
    if depth < 1:
        raise ValueError(f"blunder depth must be >= 1, got {depth}")
    mask = me | opp
    moves = (mask + connect_four.BOTTOM_ROW) & connect_four.BOARD
    wins = ((connect_four._winning_cells(me, mask) & moves)[:, None] & connect_four.COLUMN) != 0  # (n, 7)
    scores = connect_four._child_scores(me, opp, depth - 1, 1)  # minus each child's value: mine, by column
    decided = connect_four.WIN - 64  # a forced result within the horizon (|score| ~ WIN - plies)
    classes = np.where(scores >= decided, 1, np.where(scores <= -decided, -1, 0))
    return np.where(wins, 1, classes).astype(np.int64)
