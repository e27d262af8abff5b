"""Which moves give away what the position held: the dense signal of `--env.blunder-penalty`.

Against a weak opponent the game's outcome rarely punishes a bad move (random seldom takes the win left to it),
so the outcome alone teaches blocking and finishing slowly. Here every legal move of the side to move gets an
outcome class: +1 it wins (by force), 0 open, -1 it loses (by force), judged by the game's GameSpec.move_classes
(envs/games/):

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

from earl_jax.envs.games import find_game, game_names

ILLEGAL = -9  # class of an illegal move: never the best, never chosen (the env checks legality first)


def move_classes(game: str, me: UInt64[np.ndarray, " n"], opp: UInt64[np.ndarray, " n"],
                 legal: Bool[np.ndarray, "n a"], depth: int = 1) -> Int[np.ndarray, "n a"]:
    """Outcome class (+1 / 0 / -1) of every move of the side to move (`me`), ILLEGAL where not legal."""
    spec = find_game(game)
    if spec is None or spec.move_classes is None:
        judged = tuple(name for name in game_names() if find_game(name).move_classes is not None)
        raise ValueError(f"blunder classes exist for {judged}, not {game!r}")
    classes = spec.move_classes(me, opp, depth)
    return np.where(legal, classes, ILLEGAL)


def blunders(game: str, me: UInt64[np.ndarray, " n"], opp: UInt64[np.ndarray, " n"], legal: Bool[np.ndarray, "n a"],
             moves: Int[np.ndarray, " n"], depth: int = 1) -> Int[np.ndarray, " n"]:
    """Classes lost by playing moves[k] (legal) instead of the best move: 0, 1 or 2."""
    classes = move_classes(game, me, opp, legal, depth)
    chosen = classes[np.arange(len(moves)), moves]
    if np.any(chosen == ILLEGAL):
        raise ValueError("blunders: a move is not legal")
    return (classes.max(1) - chosen).astype(np.int64)

