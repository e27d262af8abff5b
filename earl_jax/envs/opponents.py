"""Opponents the agent plays against, built from a short spec string, all seeded.

Every game has these (here):

    "random"         uniform over legal moves (microseconds)
    "mcts:N"         OpenSpiel's MCTSBot (its C++ one), N simulations, one random rollout per leaf ("mcts" = 200)
    "solver"         perfect play by memoised minimax (tiny games: Tic-Tac-Toe; not Connect Four)

and a registered game adds its own in its GameSpec (envs/games/), which come first, e.g. Connect Four's

    "alphabeta:D"    bitboard alpha-beta, D plies deep ("alphabeta" = 4)
    "solver:K"       near-exact search of K thousand nodes a move ("solver" = 5; envs/connect_four_solver.py)

Ties between equally good moves are broken by the opponent's own RNG, which the environment
reseeds on every `reset(seed=...)`, so a seeded game replays exactly.
"""
from __future__ import annotations

import functools
import random
from typing import Protocol

import pyspiel

from earl_jax.envs.games import OpponentSpec, find_game, game_names, spec_for

DEFAULT_MCTS_SIMULATIONS = 200
GENERIC = ('"random"', '"mcts:<simulations>"', '"solver"')


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
    """OpenSpiel's MCTSBot (UCT, c=2) with RandomRolloutEvaluator; `solve=True` finds forced wins. The C++ bot: the
    same search as OpenSpiel's Python port, 12x faster a move and as strong (mcts:100 in Connect Four, 400 games
    against the Python bot: score 0.492 +- 0.024; experiments/benchmarks/bench_mcts.py)."""

    MAX_MEMORY_MB = 1000  # the bot's tree limit: far above what a few hundred simulations take

    def __init__(self, game: pyspiel.Game, simulations: int, seed: int = 0, uct_c: float = 2.0):
        self.game, self.simulations, self.uct_c = game, simulations, uct_c
        self.reset(seed)

    def reset(self, seed: int) -> None:
        seed = seed % 2**31  # the C++ bot's seed is an int
        evaluator = pyspiel.RandomRolloutEvaluator(1, seed)
        self._bot = pyspiel.MCTSBot(self.game, evaluator, self.uct_c, self.simulations, self.MAX_MEMORY_MB, True,
                                    seed, False)

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


def spec_help() -> str:
    """The specs make_opponent knows, for error messages: the generic ones, then each registered game's own."""
    own = [f'"{kind}:..." ({name} only)' for name in game_names() for kind in find_game(name).opponents]
    return ", ".join(GENERIC + tuple(own))


def make_opponent(spec: str, game: pyspiel.Game, seed: int = 0) -> Opponent:
    """Builds the opponent a spec names for `game`. Bad spec -> ValueError that names it."""
    parsed = OpponentSpec.parse(spec, spec_help())
    kind, arg = parsed.kind, parsed.arg
    standard = spec_for(game)
    if standard is not None and kind in standard.opponents:  # the game's own first (Connect Four's solver)
        return standard.opponents[kind](parsed, seed)
    registered = find_game(game.get_type().short_name)  # any parameters: a refusal holds for every other board size
    if registered is not None and kind in registered.refused_opponents:
        raise ValueError(f"opponent {spec!r}: {registered.refused_opponents[kind]}")
    if kind == "random" and not arg:
        return RandomOpponent(seed)
    if kind == "mcts":
        return MCTSOpponent(game, parsed.positive_int(DEFAULT_MCTS_SIMULATIONS), seed)
    if kind == "solver" and not arg:
        return SolverOpponent(game, seed)
    offered = [name for name in game_names() if kind in find_game(name).opponents]
    if offered:
        raise ValueError(f"opponent {spec!r} is only implemented for standard {' / '.join(offered)}, not "
                         f"{str(game)!r}; use 'solver' or 'mcts:<simulations>'")
    raise ValueError(f"unknown opponent spec {spec!r}: expected {spec_help()}")
