"""Opponents the agent plays against, built from a short spec string, all seeded.

    "random"         uniform over legal moves (microseconds)
    "mcts:N"         OpenSpiel's MCTSBot, N simulations, one random rollout per leaf ("mcts" = 200)
    "solver"         perfect play by memoised minimax (tiny games: Tic-Tac-Toe; not Connect Four)
    "alphabeta:D"    Connect Four bitboard alpha-beta, D plies deep ("alphabeta" = 4)

Ties between equally good moves are broken by the opponent's own RNG, which the environment
reseeds on every `reset(seed=...)`, so a seeded game replays exactly.
"""
from __future__ import annotations

import functools
import random
from typing import Protocol

import numpy as np
import pyspiel
from open_spiel.python.algorithms import mcts

from earl_jax.envs import connect_four_search

DEFAULT_MCTS_SIMULATIONS = 200
DEFAULT_ALPHABETA_DEPTH = 4
SPEC_HELP = '"random", "mcts:<simulations>", "solver" or "alphabeta:<depth>" (Connect Four only)'


class Opponent(Protocol):
    def reset(self, seed: int) -> None: ...

    def act(self, state: pyspiel.State) -> int:
        """A legal action for `state.current_player()`. Must not change `state`."""
        ...


class RandomOpponent:
    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def reset(self, seed: int) -> None:
        self._rng.seed(seed)

    def act(self, state: pyspiel.State) -> int:
        legal = state.legal_actions()
        return legal[self._rng.randrange(len(legal))]


class MCTSOpponent:
    """OpenSpiel's MCTSBot (UCT, c=2) with RandomRolloutEvaluator; `solve=True` finds forced wins."""

    def __init__(self, game: pyspiel.Game, simulations: int, seed: int = 0, uct_c: float = 2.0):
        self.game, self.simulations, self.uct_c = game, simulations, uct_c
        self.reset(seed)

    def reset(self, seed: int) -> None:
        rng = np.random.RandomState(seed)
        evaluator = mcts.RandomRolloutEvaluator(n_rollouts=1, random_state=rng)
        self._bot = mcts.MCTSBot(
            self.game, self.uct_c, self.simulations, evaluator, solve=True, random_state=rng
        )

    def act(self, state: pyspiel.State) -> int:
        return self._bot.step(state)


class SolverOpponent:
    """Perfect play: among the moves with the best game-theoretic value, a random one.

    Values are discounted by 0.99 per ply, so it wins as fast as it can and loses as late as it
    can. The memo is keyed by (str(state), player to move) and shared by all solvers of a game.
    """

    def __init__(self, game: pyspiel.Game, seed: int = 0):
        self.game = game
        self._rng = random.Random(seed)
        self._values = _solver_memo(str(game))

    def reset(self, seed: int) -> None:
        self._rng.seed(seed)

    def act(self, state: pyspiel.State) -> int:
        player = state.current_player()
        scored = []
        for a in state.legal_actions():
            child = state.child(a)
            scored.append((_solve(child, self._values)[player], a))
        best = max(v for v, _ in scored)
        moves = [a for v, a in scored if v >= best - 1e-9]
        return moves[self._rng.randrange(len(moves))]


@functools.lru_cache(maxsize=None)
def _solver_memo(game_key: str) -> dict:
    return {}


def _solve(state: pyspiel.State, memo: dict) -> tuple[float, float]:
    """(value for player 0, value for player 1) under perfect play, discounted 0.99 per ply."""
    if state.is_terminal():
        r = state.returns()
        return (r[0], r[1])
    key = (str(state), state.current_player())
    if key in memo:
        return memo[key]
    if state.is_chance_node():
        v0 = v1 = 0.0
        for a, p in state.chance_outcomes():
            c0, c1 = _solve(state.child(a), memo)
            v0, v1 = v0 + p * c0, v1 + p * c1
        value = (0.99 * v0, 0.99 * v1)
    else:
        player = state.current_player()
        best = None
        for a in state.legal_actions():
            v = _solve(state.child(a), memo)
            if best is None or v[player] > best[player]:
                best = v
        value = (0.99 * best[0], 0.99 * best[1])
    memo[key] = value
    return value


class AlphaBetaOpponent:
    """Connect Four depth-limited alpha-beta (see connect_four_search); < 50 ms a move at depth 5."""

    def __init__(self, depth: int, seed: int = 0):
        self.depth = depth
        self._rng = random.Random(seed)

    def reset(self, seed: int) -> None:
        self._rng.seed(seed)

    def act(self, state: pyspiel.State) -> int:
        return connect_four_search.choose_move(state.history(), self.depth, self._rng)


def make_opponent(spec: str, game: pyspiel.Game, seed: int = 0) -> Opponent:
    """Builds the opponent a spec names for `game`. Bad spec -> ValueError that names it."""
    if not isinstance(spec, str):
        raise ValueError(f"opponent spec must be a string, one of {SPEC_HELP}; got {spec!r}")
    kind, _, arg = spec.strip().lower().partition(":")
    short = game.get_type().short_name
    if kind == "random" and not arg:
        return RandomOpponent(seed)
    if kind == "mcts":
        return MCTSOpponent(game, _positive_int(spec, arg, DEFAULT_MCTS_SIMULATIONS), seed)
    if kind == "solver" and not arg:
        if short == "connect_four":
            raise ValueError(
                f"opponent {spec!r}: Connect Four is too large to solve here; use 'alphabeta:<depth>'"
            )
        return SolverOpponent(game, seed)
    if kind == "alphabeta":
        if str(game) != "connect_four()":
            raise ValueError(
                f"opponent {spec!r} is only implemented for standard connect_four, not {str(game)!r}; "
                "use 'solver' or 'mcts:<simulations>'"
            )
        return AlphaBetaOpponent(_positive_int(spec, arg, DEFAULT_ALPHABETA_DEPTH), seed)
    raise ValueError(f"unknown opponent spec {spec!r}: expected {SPEC_HELP}")


def _positive_int(spec: str, arg: str, default: int) -> int:
    if not arg:
        return default
    try:
        value = int(arg)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"opponent spec {spec!r}: {arg!r} is not a positive integer")
    return value
