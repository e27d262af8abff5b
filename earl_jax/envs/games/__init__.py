"""One `GameSpec` per batched game: its rules, text, opponents, blunder classes and default ladder, in one file.

    spec = get_game("connect_four")
    spec.rules.legal_mask(stones)        # array rules over a batch of boards (VectorTextEnv)
    spec.text                            # GameText: board layout, move noun, chat rules (envs/text.py)
    spec.batched_opponents["alphabeta"]  # the game's own opponents (random, mcts and solver are every game's)
    spec.move_classes(me, opp, depth)    # outcome class of every move (--env.blunder-penalty)
    spec.ladder                          # the default curriculum ladder

Every module of this folder is a game: the first read of the registry imports them all, and each calls
`register_game`. Adding a batched game is one new file here plus its tests (docs/fork.md lists what the spec
holds). A fork's game defined elsewhere registers the same way once its module is imported.

A registered game plays batched only with OpenSpiel's default parameters (`spec_for`); other parameters
("connect_four(rows=5)") are any OpenSpiel game to the rest of the package: per-game env, generic text.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
from jaxtyping import Bool, Int, UInt64

from earl_jax.envs.games.game_text import GameText

if TYPE_CHECKING:
    import pyspiel


@dataclasses.dataclass(frozen=True)
class Rules:
    """A two-player board game as array code over a batch: `stones: uint64[n, 2]`, player 0's stones and player
    1's as bitboards (player 0 is OpenSpiel's player 0 and moves first; the layout of the bits is the game's)."""

    num_actions: int  # OpenSpiel's distinct actions: answers are 0 .. num_actions - 1
    legal_mask: Callable[[UInt64[np.ndarray, "n 2"]], Bool[np.ndarray, "n a"]]
    # the bit a move sets per row (0 where the move is not legal): actions are OpenSpiel's ids
    drop: Callable[[UInt64[np.ndarray, "n 2"], Int[np.ndarray, " n"]], UInt64[np.ndarray, " n"]]
    is_win: Callable[[UInt64[np.ndarray, " n"]], Bool[np.ndarray, " n"]]  # one player's stones win
    is_full: Callable[[UInt64[np.ndarray, "n 2"]], Bool[np.ndarray, " n"]]  # no move left: a draw unless won
    # the printed board's cell (str(state) order, row by row) of single-stone bitboards
    print_index: Callable[[UInt64[np.ndarray, " n"]], Int[np.ndarray, " n"]]


@dataclasses.dataclass(frozen=True)
class OpponentSpec:
    """An opponent spec string read as kind and argument: "alphabeta:2" -> ("alphabeta", "2"), "random" ->
    ("random", ""). `text` is the string as given, for error messages."""

    text: str
    kind: str
    arg: str

    @classmethod
    def parse(cls, text: Any, expected: str) -> "OpponentSpec":
        if not isinstance(text, str):
            raise ValueError(f"opponent spec must be a string, one of {expected}; got {text!r}")
        kind, _, arg = text.strip().lower().partition(":")
        return cls(text, kind, arg)

    def positive_int(self, default: int) -> int:
        """The argument as a count or depth (`default` when there is none); ValueError naming the spec otherwise."""
        if not self.arg:
            return default
        try:
            value = int(self.arg)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"opponent spec {self.text!r}: {self.arg!r} is not a positive integer")
        return value


# (me, opp, depth) -> the outcome class of each of the side to move's moves
MoveClasses = Callable[[UInt64[np.ndarray, " n"], UInt64[np.ndarray, " n"], int], Int[np.ndarray, "n a"]]


@dataclasses.dataclass(frozen=True, eq=False)
class GameSpec:
    """Everything the package knows about one batched game (see the module docstring)."""

    name: str  # OpenSpiel's short name ("connect_four"): the game it is, with its default parameters
    rules: Rules
    text: GameText  # how its boards and moves read (envs/text.py); board_shape is the printed board's
    ladder: tuple[str, ...]  # the default curriculum, weakest first (rl/matchups/curriculum.py)
    # Outcome class (+1 wins by force, 0 open, -1 loses by force) of every move of the side to move (`me`), for
    # --env.blunder-penalty (envs/vector/blunders.py); `depth`: plies a search may look ahead. None: no blunder check.
    move_classes: MoveClasses | None = None
    # Opponent kinds only this game has, by the kind of their spec ("alphabeta"):
    # per game over an OpenSpiel state, (spec, seed) -> an `envs.opponents.Opponent`, the reference ...
    opponents: Mapping[str, Callable[[OpponentSpec, int], Any]] = dataclasses.field(default_factory=dict)
    # ... and batched, (spec, num_games) -> a `vector.batched_opponents.BatchedOpponent` that replays it move for move.
    # A generic kind (solver) may be batched here too; without an entry a kind plays per game (make_vector_env).
    batched_opponents: Mapping[str, Callable[[OpponentSpec, int], Any]] = dataclasses.field(default_factory=dict)
    # generic kinds ("solver", "mcts") this game refuses, with the reason the error gives
    refused_opponents: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        """What the batched path assumes (docs/fork.md): refused here rather than rendered wrong later."""
        shape, actions = self.text.board_shape, self.rules.num_actions
        problems = [
            (shape is None or int(np.prod(shape)) > 64, f"text.board_shape must be a board of at most 64 cells "
                                                        f"(one uint64 per player), got {shape}"),
            (self.text.num_actions != actions, f"text.num_actions ({self.text.num_actions}) must equal "
                                               f"rules.num_actions ({actions})"),
            (not 0 < actions <= 10, f"rules.num_actions must be 1 .. 10 (the renderer caches text per legal set "
                                    f"and labels a move with one digit), got {actions}"),
            (not self.ladder, "ladder needs at least one rung"),
        ]
        for bad, why in problems:
            if bad:
                raise ValueError(f"GameSpec {self.name!r}: {why}")


_REGISTRY: dict[str, GameSpec] = {}


def register_game(spec: GameSpec) -> GameSpec:
    """Adds `spec` under `spec.name`; a second, different spec under a registered name is refused."""
    if not isinstance(spec, GameSpec):
        raise ValueError(f"register_game takes a GameSpec, got {type(spec).__name__}")
    if _REGISTRY.get(spec.name, spec) is not spec:
        raise ValueError(f"game {spec.name!r} is registered already")
    _REGISTRY[spec.name] = spec
    return spec


@functools.cache
def _discover() -> None:
    """Imports every module of this folder once: each registers its game."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def game_names() -> tuple[str, ...]:
    _discover()
    return tuple(sorted(_REGISTRY))


def find_game(name: str) -> GameSpec | None:
    """The spec registered under the OpenSpiel short name `name`, or None."""
    _discover()
    return _REGISTRY.get(name)


def get_game(name: str) -> GameSpec:
    spec = find_game(name)
    if spec is None:
        raise ValueError(f"no batched game {name!r}: registered are {game_names()} (earl_jax/envs/games/)")
    return spec


def spec_for(game: pyspiel.Game) -> GameSpec | None:
    """The spec of a loaded OpenSpiel game when it is a registered game with its default parameters, else None."""
    spec = find_game(game.get_type().short_name)
    if spec is None or game.get_parameters() != _default_params(spec.name):
        return None
    return spec


@functools.cache
def _default_params(short_name: str) -> dict:
    import pyspiel  # here: the registry and the rules load without OpenSpiel

    return pyspiel.load_game(short_name).get_parameters()
