"""One game's text conventions (`GameText`): its board as OpenSpiel prints it, read as rows of the agent `X`, the
opponent `O` and empty `.`, its move noun and chat rules. A registered game's `GameSpec.text` (envs/games/); how
observations are written from it is envs/text.py."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyspiel

AGENT, OPPONENT, EMPTY = "X", "O", "."


@dataclasses.dataclass(frozen=True)
class GameText:
    """Text conventions of one game. Presets (a registered game's `GameSpec.text`, envs/games/) know their board
    layout: OpenSpiel's str(state) is the board, rows of 'x' / 'o' / '.'. Others fall back to str(state)."""

    name: str
    num_actions: int  # size of the action vocabulary: answers are 0 .. num_actions-1
    board_shape: tuple[int, ...] | None  # None: the observation tensor's shape
    move_noun: str  # "column", "cell", "action": used in chat texts
    rules: str  # chat-style rules, shown in the first observation only
    cell_labels: str = ""  # chat style: a line or grid under the board naming the moves

    @property
    def is_preset(self) -> bool:
        return self.board_shape is not None

    # ---- board ---------------------------------------------------------------------------
    def board_text(self, state: pyspiel.State, agent_player: int) -> str:
        """Board rows joined by newlines, agent X, opponent O (no trailing newline)."""
        if not self.is_preset:  # the agent's own view: hidden information stays hidden
            game_type = state.get_game().get_type()
            if game_type.provides_observation_string:
                return state.observation_string(agent_player).strip("\n")
            return str(state).strip("\n")
        return str(state).strip("\n").translate(_TRANSLATE[agent_player])

    def board_array(self, state: pyspiel.State, agent_player: int) -> np.ndarray | None:
        """+1 agent, -1 opponent, 0 empty (presets); the agent's observation tensor otherwise
        (None for a game without one)."""
        if not self.is_preset:
            game = state.get_game()
            if not game.get_type().provides_observation_tensor:
                return None
            shape = game.observation_tensor_shape()
            return np.asarray(state.observation_tensor(agent_player), np.float32).reshape(shape)
        raw = str(state).replace("\n", "").encode("ascii")
        return _VALUE_LUT[agent_player][np.frombuffer(raw, np.uint8)].reshape(self.board_shape)

    def render_board(self, board_text: str, prompt_style: str) -> str:
        if prompt_style == "labeled" and self.is_preset:
            return self.label_moves(board_text)
        if prompt_style in ("compact", "minimal") or not self.is_preset:
            return board_text
        rows = [" ".join(row) for row in board_text.split("\n")]
        return "\n".join(rows + ([self.cell_labels] if self.cell_labels else []))

    def label_moves(self, board_text: str) -> str:
        """The labeled style's board: the cell a legal move fills shows the move's id (see the module doc)."""
        rows = [list(r) for r in board_text.split("\n")]
        if self.move_noun == "column":  # the piece lands on the lowest empty cell of its column
            for c in range(len(rows[0])):
                empty = [r for r in range(len(rows)) if rows[r][c] == EMPTY]
                if empty:
                    rows[empty[-1]][c] = self.action_text(c)
        else:  # a cell game: every empty cell is its own move, numbered row-major
            width = len(rows[0])
            for r, row in enumerate(rows):
                for c, ch in enumerate(row):
                    if ch == EMPTY:
                        row[c] = self.action_text(r * width + c)
        return "\n".join("".join(r) for r in rows)

    def action_text(self, action: int) -> str:
        return str(int(action))


def _translate_tables():
    # OpenSpiel prints player 0 as 'x' and player 1 as 'o' in the preset games (a registered game must).
    as_first = str.maketrans({"x": AGENT, "o": OPPONENT})
    as_second = str.maketrans({"x": OPPONENT, "o": AGENT})
    return (as_first, as_second)


def _value_luts():
    luts = []
    for agent in (0, 1):
        lut = np.zeros(256, np.int8)
        lut[ord("x")] = 1 if agent == 0 else -1
        lut[ord("o")] = -1 if agent == 0 else 1
        luts.append(lut)
    return tuple(luts)


_TRANSLATE = _translate_tables()
_VALUE_LUT = _value_luts()
