"""Observation text for a batch of preset-game boards: the strings `text.format_observation` writes.

Boards are rendered for the whole batch in one pass over a byte array (cell -> 'X'/'O'/'.' by the
agent's seat, newlines and chat-style spaces from a fixed template), decoded once and cut into one
string per game. The common observation (the opponent's reply, the board, the legal moves) is glued
here from cached pieces; every rarer text (first observations, results, retries, forfeits) comes from
`format_observation` itself, so the vector env cannot drift from the reference in those.
"""
from __future__ import annotations

import numpy as np
from jaxtyping import Bool, Int, Int8, UInt8

from earl_jax.envs.text import AGENT, EMPTY, OPPONENT, GameText, format_observation

# [agent_player * 3 + cell code] -> what the agent sees; cell codes: 0 empty, 1 player 0, 2 player 1.
_CHARS = np.array([ord(EMPTY), ord(AGENT), ord(OPPONENT), ord(EMPTY), ord(OPPONENT), ord(AGENT)], np.uint8)
_VALUES = np.array([0, 1, -1, 0, -1, 1], np.int8)


class BoardRenderer:
    """Text and int8 views of n boards of one preset game, in one prompt style."""

    def __init__(self, gt: GameText, prompt_style: str):
        if not gt.is_preset:
            raise ValueError(f"{gt.name!r} is not a preset game: its text is OpenSpiel's str(state)")
        self.gt, self.style = gt, prompt_style
        self.rows, self.cols = gt.board_shape
        a = gt.num_actions
        legal_sets = [tuple(int(x) for x in np.flatnonzero((c >> np.arange(a)) & 1)) for c in range(1 << a)]
        chat = prompt_style == "chat"
        # What follows the board in a normal turn, per legal set (bit a of the code: action a legal): the
        # reference's text with nothing else in it is exactly that line.
        self.moves_lines = [format_observation(gt, "chat" if chat else "compact", board=None, legal_actions=list(legal))
                            for legal in legal_sets]
        # After an invalid answer with retries left: the whole observation, per legal set.
        self.retry_texts = [
            format_observation(gt, prompt_style, board=None, legal_actions=list(legal), invalid=True)
            for legal in legal_sets
        ]
        self.forfeit_text = format_observation(gt, prompt_style, board=None, legal_actions=None, invalid=True,
                                               result="loss")
        self.opponent_lines = [
            f"Your opponent played {gt.move_noun} {gt.action_text(x)}.\n" if chat else f"opp {gt.action_text(x)}\n"
            for x in range(a)
        ]
        self._labels = (gt.cell_labels + "\n") if chat and gt.cell_labels else ""
        self.minimal_texts = [line + "> " for line in self.opponent_lines]  # a minimal-style turn, whole

    # ---- boards --------------------------------------------------------------------------------
    def values(self, cells: UInt8[np.ndarray, "n c"], agent_player: Int[np.ndarray, " n"]) -> Int8[np.ndarray, "n h w"]:
        """info["board"]: +1 agent, -1 opponent, 0 empty, top row first."""
        return _VALUES.take(agent_player[:, None] * 3 + cells).reshape(-1, self.rows, self.cols)

    def board_texts(self, cells: UInt8[np.ndarray, "n c"], agent_player: Int[np.ndarray, " n"]) -> list[str]:
        """`GameText.board_text` per game: rows joined by newlines, no trailing newline (compact form)."""
        text, width = self._compact(cells, agent_player, labeled=False)
        return [text[i:i + width - 1] for i in range(0, len(text), width)]

    def blocks(self, cells: UInt8[np.ndarray, "n c"], agent_player: Int[np.ndarray, " n"]) -> tuple[str, int]:
        """The boards as this style prints them, each with its closing newline, back to back: (text, width)."""
        if self.style != "chat":
            return self._compact(cells, agent_player, labeled=self.style == "labeled")
        n = len(cells)
        out = np.full((n, self.rows, 2 * self.cols), ord(" "), np.uint8)
        out[:, :, 0::2] = _CHARS.take(agent_player[:, None] * 3 + cells).reshape(n, self.rows, self.cols)
        out[:, :, -1] = ord("\n")
        if self._labels:  # Connect Four's column numbers under every board
            labels = np.frombuffer(self._labels.encode("ascii"), np.uint8)
            out = np.concatenate([out.reshape(n, self.rows * 2 * self.cols), np.broadcast_to(labels, (n, len(labels)))], 1)
        return out.tobytes().decode("ascii"), out[0].size if n else 0

    def _compact(self, cells, agent_player, labeled: bool) -> tuple[str, int]:
        n = len(cells)
        out = np.empty((n, self.rows, self.cols + 1), np.uint8)
        out[:, :, :-1] = _CHARS.take(agent_player[:, None] * 3 + cells).reshape(n, self.rows, self.cols)
        if labeled:  # GameText.label_moves for the whole batch: the cell a legal move fills shows its id
            board = cells.reshape(n, self.rows, self.cols)
            if self.gt.move_noun == "column":
                empty = board == 0
                lowest = self.rows - 1 - np.argmax(empty[:, ::-1, :], axis=1)  # (n, cols): lowest empty row
                g, c = np.nonzero(empty.any(axis=1))
                out[g, lowest[g, c], c] = ord("0") + c
            else:
                g, r, c = np.nonzero(board == 0)
                out[g, r, c] = ord("0") + r * self.cols + c
        out[:, :, -1] = ord("\n")
        return out.tobytes().decode("ascii"), self.rows * (self.cols + 1)

    # ---- observations ---------------------------------------------------------------------------
    def turn_texts(self, cells, agent_player, opponent_action: Int[np.ndarray, " n"],
                   legal_code: Int[np.ndarray, " n"]) -> list[str]:
        """Observations of games still running after a valid move and the opponent's reply."""
        if self.style == "minimal":  # the board once at the start, then only the reply
            texts = self.minimal_texts
            return [texts[x] for x in opponent_action.tolist()]
        opp = self.opponent_lines
        text, w = self.blocks(cells, agent_player)
        moves = self.moves_lines
        return [opp[x] + text[k * w:k * w + w] + moves[c]
                for k, (x, c) in enumerate(zip(opponent_action.tolist(), legal_code.tolist()))]

    def retry_obs(self, legal_code: Int[np.ndarray, " n"]) -> list[str]:
        return [self.retry_texts[c] for c in legal_code.tolist()]

    def texts(self, cells, agent_player, legal: Bool[np.ndarray, "n a"], opponent_action: Int[np.ndarray, " n"],
              results: list[str | None], first: bool) -> list[str]:
        """Any observation through `format_observation` (first observations, results): one call per distinct
        observation (the games of a GRPO group start from the same position: one call for the group)."""
        out, seen = [], {}
        codes = (legal @ (1 << np.arange(legal.shape[1]))).tolist()
        for k, board in enumerate(self.board_texts(cells, agent_player)):
            key = (board, int(opponent_action[k]), results[k], int(agent_player[k]), codes[k])
            if key not in seen:
                opp = key[1]
                seen[key] = format_observation(
                    self.gt, self.style, board=board,
                    legal_actions=None if results[k] is not None else np.flatnonzero(legal[k]).tolist(),
                    opponent_action=None if opp < 0 else opp, result=results[k], first=first,
                    agent_player=key[3])
            out.append(seen[key])
        return out
