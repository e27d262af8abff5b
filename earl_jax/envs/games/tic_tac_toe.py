"""Tic-Tac-Toe, the batched game: rules on 9-bit boards, a perfect-play table over every position, its text, the
batched solver opponent and exact blunder classes.

Bit k is cell k, row-major from the top left: OpenSpiel's action ids and its printed order. A batch
is `stones: uint64[n, 2]` (player 0's cells, player 1's cells), the layout the Connect Four module
uses, so the vector env treats both games alike. Player 0 is OpenSpiel's 'x' and moves first.
`SPEC` (at the end) is what the rest of the package reads.
"""
from __future__ import annotations

import functools

import numpy as np
from jaxtyping import Bool, Int, Int8, UInt16, UInt64

from earl_jax.envs.games import GameSpec, OpponentSpec, Rules, register_game
from earl_jax.envs.games.game_text import GameText
from earl_jax.envs.vector.batched_opponents import BatchedOpponent, kth_true

NUM_ACTIONS = 9
BOARD_SHAPE = (3, 3)
_U = np.uint64
CELL: UInt64[np.ndarray, " 9"] = np.array([1 << k for k in range(9)], _U)
BOARD = _U(0x1FF)
LINES: UInt64[np.ndarray, " 8"] = np.array(  # the eight winning lines, as cell masks
    [sum(1 << k for k in line) for line in (
        (0, 1, 2), (3, 4, 5), (6, 7, 8),  # rows
        (0, 3, 6), (1, 4, 7), (2, 5, 8),  # columns
        (0, 4, 8), (2, 4, 6),  # diagonals
    )], _U)
DISCOUNT = 0.99  # as opponents.SolverOpponent: win fast, lose late


def legal_mask(stones: UInt64[np.ndarray, "n 2"]) -> Bool[np.ndarray, "n 9"]:
    """Empty cells."""
    return ((stones[:, 0] | stones[:, 1])[:, None] & CELL) == 0


def drop(stones: UInt64[np.ndarray, "n 2"], actions: Int[np.ndarray, " n"]) -> UInt64[np.ndarray, " n"]:
    """The bit of each row's cell, 0 if it is taken (the same contract as connect_four.drop)."""
    bits = CELL[actions]
    return np.where(((stones[:, 0] | stones[:, 1]) & bits) == 0, bits, _U(0))


def is_win(p: UInt64[np.ndarray, " n"]) -> Bool[np.ndarray, " n"]:
    return ((p[:, None] & LINES) == LINES).any(1)


def is_full(stones: UInt64[np.ndarray, "n 2"]) -> Bool[np.ndarray, " n"]:
    return (stones[:, 0] | stones[:, 1]) == BOARD


def print_index(bits: UInt64[np.ndarray, " n"]) -> Int[np.ndarray, " n"]:
    """Where single-cell bitboards sit on the printed board: the cell number."""
    return np.bitwise_count(bits - _U(1)).astype(np.int64)


# ---- perfect play -------------------------------------------------------------------------------------
def solver_best_moves(stones: UInt64[np.ndarray, "n 2"]) -> UInt16[np.ndarray, " n"]:
    """The cells (as a 9-bit mask) that `opponents.SolverOpponent` chooses among, for the side to move."""
    x, o = stones[:, 0].astype(np.int64), stones[:, 1].astype(np.int64)
    return _solver_tables()[0][x | (o << 9)]


def solver_values(x: UInt64[np.ndarray, "..."], o: UInt64[np.ndarray, "..."]) -> Int8[np.ndarray, "..."]:
    """The game's exact value for X (+1 / 0 / -1) of every non-terminal position reachable in play; 0 for any
    other (a full board's draw included: read a win from the stones)."""
    return _solver_tables()[1][(x | (o << np.uint64(9))).astype(np.int64)]


@functools.cache
def _solver_tables() -> tuple[UInt16[np.ndarray, " 262144"], Int8[np.ndarray, " 262144"]]:
    """(best-moves mask, X's undiscounted value) indexed by x | o << 9, for every position reachable in play
    (~5.5k; 0 elsewhere).

    Values replay `opponents._solve` float for float: (v0, v1) per position, terminal returns as is,
    else 0.99 times the first child that is best for the mover; the best set keeps moves within
    1e-9 of the best, in cell order, as `SolverOpponent.act` does.
    """
    table = np.zeros(1 << 18, np.uint16)
    values = np.zeros(1 << 18, np.int8)  # the discount keeps the sign: win, draw or loss with perfect play
    memo: dict[tuple[int, int], tuple[float, float]] = {}
    lines = [int(line) for line in LINES]

    def won(p: int) -> bool:
        return any(p & line == line for line in lines)

    def children(x: int, o: int):
        player = bin(x | o).count("1") & 1
        for cell in range(9):
            bit = 1 << cell
            if not (x | o) & bit:
                yield cell, (x | bit, o) if player == 0 else (x, o | bit)

    def solve(x: int, o: int) -> tuple[float, float]:
        if won(x):
            return (1.0, -1.0)
        if won(o):
            return (-1.0, 1.0)
        if x | o == 0x1FF:
            return (0.0, 0.0)
        if (x, o) in memo:
            return memo[x, o]
        player = bin(x | o).count("1") & 1
        best = None
        for _, child in children(x, o):
            v = solve(*child)
            if best is None or v[player] > best[player]:
                best = v
        value = (DISCOUNT * best[0], DISCOUNT * best[1])
        memo[x, o] = value
        values[x | (o << 9)] = np.sign(value[0])
        player_moves = {}
        for cell, child in children(x, o):
            player_moves[cell] = solve(*child)[player]
        top = max(player_moves.values())
        table[x | (o << 9)] = sum(1 << c for c, v in player_moves.items() if v >= top - 1e-9)
        return value

    solve(0, 0)
    return table, values


# ---- the solver as a batched opponent, and blunder classes ---------------------------------------------------
class SolverOpponents(BatchedOpponent):
    """`opponents.SolverOpponent` for a batch: `solver_best_moves`, then rng.randrange(len(best)) every move (even
    of one), as the per-game solver draws."""

    def act(self, rows, me, opp, legal):
        # The table is indexed by (player 0's cells, player 1's cells); `me` is whoever is to move.
        me_first = (np.bitwise_count(me | opp) & 1) == 0
        x, o = np.where(me_first, me, opp), np.where(me_first, opp, me)
        masks = solver_best_moves(np.stack([x, o], 1)).astype(np.int64)
        best = ((masks[:, None] >> np.arange(NUM_ACTIONS)) & 1).astype(bool)
        return kth_true(best, self.streams.randbelow(rows, best.sum(1)))


def _solver_opponents(spec: OpponentSpec, num_games: int) -> SolverOpponents:
    if spec.arg:
        raise ValueError(f"opponent spec {spec.text!r}: the solver takes no argument")
    return SolverOpponents(num_games)


def move_classes(me: UInt64[np.ndarray, " n"], opp: UInt64[np.ndarray, " n"], depth: int = 1) -> Int[np.ndarray, "n 9"]:
    """+1 / 0 / -1 per cell: the exact game value after the move (the solver's table), so "open" is a draw.
    `depth` is ignored: the value is exact."""
    cells = np.arange(NUM_ACTIONS)
    bits = (np.uint64(1) << cells.astype(np.uint64))[None, :]
    mine = me[:, None] | bits  # (n, 9) my stones after each move (illegal ones are masked by the caller)
    won = is_win(mine.ravel()).reshape(mine.shape)
    # each child as (X stones, O stones): the solver's value for X, turned into mine
    x_first = (np.bitwise_count(me | opp) & 1) == 0  # I am X (player 0) when the board has an even count
    theirs = np.broadcast_to(opp[:, None], mine.shape)
    x, o = np.where(x_first[:, None], mine, theirs), np.where(x_first[:, None], theirs, mine)
    value_for_x = solver_values(x, o).astype(np.int64)  # the solver opponent's own search
    mover_value = np.where(x_first[:, None], value_for_x, -value_for_x)
    return np.where(won, 1, mover_value).astype(np.int64)


SPEC = register_game(GameSpec(
    name="tic_tac_toe",
    rules=Rules(num_actions=NUM_ACTIONS, legal_mask=legal_mask, drop=drop, is_win=is_win, is_full=is_full,
                print_index=print_index),
    text=GameText(
        name="tic_tac_toe",
        num_actions=NUM_ACTIONS,
        board_shape=BOARD_SHAPE,
        move_noun="cell",
        rules=(
            "We play Tic-Tac-Toe on a 3 by 3 board. You are X, your opponent is O. Players take "
            "turns marking an empty cell. Cells are numbered 0 to 8, row by row from the top left:\n"
            "0 1 2\n3 4 5\n6 7 8\n"
            "The first to get three in a row, horizontally, vertically or diagonally, wins. "
            "A full board is a draw. An illegal answer is penalised."
        ),
    ),
    # the perfect solver is the strongest rung; no batched opponent sits between (mcts:N rungs play per game)
    ladder=("random", "solver"),
    move_classes=move_classes,
    batched_opponents={"solver": _solver_opponents},
))
