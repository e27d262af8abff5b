"""Observation text for a batch of preset-game boards: the strings `text.format_observation` writes.

Boards are rendered for the whole batch in one pass over a byte array (cell -> 'X'/'O'/'.' by the
agent's seat, newlines and chat-style spaces from a fixed template). The common observation (the
opponent's reply, the board, the legal moves) and a retry's are glued here from cached pieces as NUL-padded
byte rows (`turn_bytes`, `retry_bytes`): the codec maps those to token ids without a string per game, and
`turn_texts` cuts the same bytes into strings. In the compact style the env keeps each game's board as such a
byte row, updated move by move (`keeps_blocks`), so a turn's observation is three copies. Every rarer text (first
observations, results, forfeits) comes from `format_observation` itself, so the vector env cannot drift from the
reference in those.
"""
from __future__ import annotations

import numpy as np
from jaxtyping import Bool, Int, Int8, UInt8

from earl_jax.envs.games.game_text import AGENT, EMPTY, OPPONENT, GameText
from earl_jax.envs.text import format_observation

# [agent_player * 3 + cell code] -> what the agent sees; cell codes: 0 empty, 1 player 0, 2 player 1.
_CHARS = np.array([ord(EMPTY), ord(AGENT), ord(OPPONENT), ord(EMPTY), ord(OPPONENT), ord(AGENT)], np.uint8)
_VALUES = np.array([0, 1, -1, 0, -1, 1], np.int8)
_CHAR_TABLE = _CHARS.tobytes() + bytes(256 - len(_CHARS))  # the same for bytes.translate (C speed)
# The same shifted by one, every other byte unchanged: text with boards as codes 1..6 (never in the text: it is
# printable ASCII and newlines) -> text with the boards' characters, in one translate.
_CODED_TABLE = bytes([0]) + _CHARS.tobytes() + bytes(range(len(_CHARS) + 1, 256))


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
        # The same pieces as padded byte tables (row = action or legal code): glued per batch by array code.
        self._opp_bytes, self._moves_bytes = _table(self.opponent_lines), _table(self.moves_lines)
        self._minimal_bytes, self._retry_bytes = _table(self.minimal_texts), _table(self.retry_texts)
        opp_len = self._opp_bytes[1]
        self._opp_width = int(opp_len[0]) if len(opp_len) and (opp_len == opp_len[0]).all() else None
        # The compact board as a byte row per game, kept up to date by the env move by move (`keeps_blocks`):
        # printed cell k sits at block_index[k] (a newline ends each row).
        pieces = "".join(self.opponent_lines + self.moves_lines)  # no byte 1..6 in them: see _CODED_TABLE
        self.keeps_blocks = (prompt_style == "compact" and self._opp_width is not None
                             and not any(chr(c) in pieces for c in range(1, len(_CHARS) + 1)))
        k = np.arange(self.rows * self.cols)
        self.block_index = k + k // self.cols
        self.empty_block = self._compact(np.zeros((1, self.rows * self.cols), np.uint8), np.zeros(1, np.int64),
                                         labeled=False)[0]

    def block_rows(self, cells, agent_player) -> UInt8[np.ndarray, "n w"]:
        """The compact boards (what `keeps_blocks` keeps), rendered whole."""
        return self._compact(cells, agent_player, labeled=False)

    @staticmethod
    def stone_chars(agent_player: Int[np.ndarray, " n"]) -> UInt8[np.ndarray, "n 2"]:
        """[game, player]: the character player's stones show in that game ('X' the agent's, 'O' the other's)."""
        return _CHARS[(np.asarray(agent_player, np.int64) * 3)[:, None] + np.array([1, 2])]

    # ---- boards --------------------------------------------------------------------------------
    def values(self, cells: UInt8[np.ndarray, "n c"], agent_player: Int[np.ndarray, " n"]) -> Int8[np.ndarray, "n h w"]:
        """info["board"]: +1 agent, -1 opponent, 0 empty, top row first."""
        return _VALUES.take(agent_player[:, None] * 3 + cells).reshape(-1, self.rows, self.cols)

    def board_texts(self, cells: UInt8[np.ndarray, "n c"], agent_player: Int[np.ndarray, " n"]) -> list[str]:
        """`GameText.board_text` per game: rows joined by newlines, no trailing newline (compact form)."""
        rows = self._compact(cells, agent_player, labeled=False)
        return row_texts(rows, np.full(len(rows), rows.shape[1] - 1))

    def _block_rows(self, cells, agent_player) -> UInt8[np.ndarray, "n w"]:
        """The boards as this style prints them, each with its closing newline: a byte row per game."""
        if self.style != "chat":
            return self._compact(cells, agent_player, labeled=self.style == "labeled")
        n = len(cells)
        out = np.full((n, self.rows, 2 * self.cols), ord(" "), np.uint8)
        out[:, :, 0::2] = _chars(cells, agent_player).reshape(n, self.rows, self.cols)
        out[:, :, -1] = ord("\n")
        out = out.reshape(n, self.rows * 2 * self.cols)
        if self._labels:  # Connect Four's column numbers under every board
            labels = np.frombuffer(self._labels.encode("ascii"), np.uint8)
            out = np.concatenate([out, np.broadcast_to(labels, (n, len(labels)))], 1)
        return out

    def _compact(self, cells, agent_player, labeled: bool) -> UInt8[np.ndarray, "n w"]:
        n = len(cells)
        out = np.empty((n, self.rows, self.cols + 1), np.uint8)
        out[:, :, :-1] = _chars(cells, agent_player).reshape(n, self.rows, self.cols)
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
        return out.reshape(n, self.rows * (self.cols + 1))

    # ---- observations ---------------------------------------------------------------------------
    def turn_texts(self, cells, agent_player, opponent_action: Int[np.ndarray, " n"],
                   legal_code: Int[np.ndarray, " n"]) -> list[str]:
        """Observations of games still running after a valid move and the opponent's reply."""
        if self.style == "minimal":  # the board once at the start, then only the reply
            texts = self.minimal_texts
            return [texts[x] for x in opponent_action.tolist()]
        return row_texts(*self.turn_bytes(cells, agent_player, opponent_action, legal_code))

    def turn_bytes(self, cells, agent_player, opponent_action: Int[np.ndarray, " n"],
                   legal_code: Int[np.ndarray, " n"], blocks: UInt8[np.ndarray, "n w"] | None = None
                   ) -> tuple[UInt8[np.ndarray, "n t"], Int[np.ndarray, " n"]]:
        """`turn_texts` as NUL-padded ASCII byte rows and their lengths. `blocks`: the boards as `block_rows` renders
        them, where the caller keeps them (`keeps_blocks`)."""
        if self.style == "minimal":
            return _pick(self._minimal_bytes, opponent_action)
        if self.keeps_blocks:  # fixed-width reply and board: one buffer
            return self._compact_turn_bytes(cells, agent_player, opponent_action, legal_code, blocks)
        board = self._block_rows(cells, agent_player)
        w = board.shape[1]
        return _glue(_pick(self._opp_bytes, opponent_action), (board, np.full(len(cells), w)),
                     _pick(self._moves_bytes, legal_code))

    def _compact_turn_bytes(self, cells, agent_player, opponent_action, legal_code, blocks=None) -> Rows:
        """`turn_bytes` of the compact style written straight into one buffer (what `_glue` makes of the reply's
        line, the board and the moves line when the reply lines all have one width). With `blocks` (the env keeps
        the rendered boards) nothing is rendered: three copies. Without, the board goes in as cell codes 1..6
        (`_CODED_TABLE`) and one translate of the whole buffer turns them into 'X'/'O'/'.'."""
        n, a, b = len(opponent_action), self._opp_width, self.rows * (self.cols + 1)
        moves, moves_len = self._moves_bytes
        out = np.empty((n, a + b + moves.shape[1]), np.uint8)
        out[:, :a] = self._opp_bytes[0].take(opponent_action, 0)
        out[:, a + b:] = moves.take(legal_code, 0)
        if blocks is not None:
            out[:, a:a + b] = blocks
        else:
            board = out[:, a:a + b].reshape(n, self.rows, self.cols + 1)
            board[:, :, :-1] = (cells + (agent_player.astype(np.uint8) * 3 + 1)[:, None]).reshape(
                n, self.rows, self.cols)
            board[:, :, -1] = ord("\n")
            out = np.frombuffer(out.tobytes().translate(_CODED_TABLE), np.uint8).reshape(out.shape)
        return out, moves_len.take(legal_code) + (a + b)

    def retry_obs(self, legal_code: Int[np.ndarray, " n"]) -> list[str]:
        return [self.retry_texts[c] for c in legal_code.tolist()]

    def retry_bytes(self, legal_code: Int[np.ndarray, " n"]) -> tuple[UInt8[np.ndarray, "n t"], Int[np.ndarray, " n"]]:
        return _pick(self._retry_bytes, legal_code)

    def texts(self, cells, agent_player, legal: Bool[np.ndarray, "n a"], opponent_action: Int[np.ndarray, " n"],
              results: list[str | None], first: bool) -> list[str]:
        """Any observation through `format_observation` (first observations, results): one call per distinct
        observation (the games of a GRPO group start from the same position: one call for the group)."""
        # What an observation depends on, one byte row per game: distinct rows are rendered once.
        result_ids = {r: k for k, r in enumerate(dict.fromkeys(results))}
        result_column = list(map(result_ids.__getitem__, results))
        key = np.concatenate([cells, legal, np.stack([opponent_action + 1, agent_player, result_column], 1)],
                             1).astype(np.uint8)
        rows = np.ascontiguousarray(key).view(np.dtype((np.void, key.shape[1]))).reshape(-1)  # a row as one value
        _, first_of, where = np.unique(rows, return_index=True, return_inverse=True)
        boards = self.board_texts(cells[first_of], agent_player[first_of])
        distinct = []
        for board, k in zip(boards, first_of.tolist()):
            opp = int(opponent_action[k])
            distinct.append(format_observation(
                self.gt, self.style, board=board,
                legal_actions=None if results[k] is not None else np.flatnonzero(legal[k]).tolist(),
                opponent_action=None if opp < 0 else opp, result=results[k], first=first,
                agent_player=int(agent_player[k])))
        return list(map(distinct.__getitem__, where.reshape(-1).tolist()))


def _chars(cells: UInt8[np.ndarray, "n c"], agent_player: Int[np.ndarray, " n"]) -> UInt8[np.ndarray, "n c"]:
    """What the agent sees in each cell ('X', 'O', '.')."""
    key = cells + (agent_player.astype(np.uint8) * 3)[:, None]
    return np.frombuffer(key.tobytes().translate(_CHAR_TABLE), np.uint8).reshape(cells.shape)


# ---- byte rows -------------------------------------------------------------------------------------------
Rows = tuple[UInt8[np.ndarray, "n t"], Int[np.ndarray, " n"]]  # NUL-padded ASCII rows and their lengths


def _table(texts: list[str]) -> Rows:
    """Fixed texts as a padded byte table (all of this module's pieces are ASCII: `encode` says if not; and
    without NUL, so that NUL means padding to the codec)."""
    if any("\0" in t for t in texts):
        raise ValueError(f"a NUL in observation text: {[t for t in texts if chr(0) in t][:1]!r}")
    lengths = np.array([len(t) for t in texts], np.int64)
    out = np.zeros((len(texts), int(lengths.max(initial=0))), np.uint8)
    for k, t in enumerate(texts):
        out[k, :len(t)] = np.frombuffer(t.encode("ascii"), np.uint8)
    return out, lengths


def _pick(table: Rows, index: Int[np.ndarray, " n"]) -> Rows:
    return table[0][index], table[1][index]


def _glue(*parts: Rows) -> Rows:
    """Each row's parts back to back (row k: parts[0][k], then parts[1][k], ...), NUL-padded."""
    data = np.concatenate([p for p, _ in parts], 1)
    if all((n == p.shape[1]).all() for p, n in parts[:-1]):  # only the last part's length varies: no gather
        return data, sum(n for _, n in parts)
    valid = np.concatenate([np.arange(p.shape[1]) < n[:, None] for p, n in parts], 1)
    lengths = sum(n for _, n in parts)
    out = np.zeros((len(lengths), int(lengths.max(initial=0))), np.uint8)
    out[np.arange(out.shape[1]) < lengths[:, None]] = data[valid]  # row-major: each row's bytes in order
    return out, lengths


def row_texts(rows: UInt8[np.ndarray, "n t"], lengths: Int[np.ndarray, " n"]) -> list[str]:
    """Padded byte rows back to strings."""
    text = rows.tobytes().decode("ascii")
    w = rows.shape[1]
    return [text[k * w:k * w + n] for k, n in enumerate(lengths.tolist())]
