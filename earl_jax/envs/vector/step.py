"""What a vector env returns for the games it reset or stepped: arrays per row, info dicts on demand."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
from jaxtyping import Bool, Float, Int, Int8, UInt8

from earl_jax.envs.outcomes import NO_WINNER, WINNERS


@dataclasses.dataclass
class VectorStep:
    """Entry k is game `rows[k]`. -1 stands for None in `action` and `opponent_action`.

    `legal` and `board` are filled by `VectorTextEnv`; the per-game wrapper leaves them None (its
    envs may have no such fields) and `infos()` returns its envs' own dicts. `obs` may be rendered on first
    read (`_obs` a function): the agent loop reads only the games that go on, as token ids from
    `obs_bytes` where the env can give them, so a finished game's last text is never built.
    """

    rows: Int[np.ndarray, " r"]
    _obs: list[str] | Callable[[], list[str]] = dataclasses.field(repr=False)
    reward: Float[np.ndarray, " r"]  # float64: the same numbers as the reference's Python floats
    terminated: Bool[np.ndarray, " r"]
    truncated: Bool[np.ndarray, " r"]
    invalid: Bool[np.ndarray, " r"]
    winner: Int8[np.ndarray, " r"]  # NO_WINNER or an index into WINNERS ("agent", "opponent", "draw")
    action: Int[np.ndarray, " r"] | None = None
    opponent_action: Int[np.ndarray, " r"] | None = None
    turn: Int[np.ndarray, " r"] | None = None
    retries_left: Int[np.ndarray, " r"] | None = None
    agent_player: Int[np.ndarray, " r"] | None = None
    legal: Bool[np.ndarray, "r a"] | None = None  # the agent's legal moves now (all False once over)
    blunder: Int[np.ndarray, " r"] | None = None  # outcome classes the agent's move gave away; -1: not judged
    _infos: list[dict[str, Any]] | None = dataclasses.field(default=None, repr=False)
    _board: Callable[[], Int8[np.ndarray, "r h w"]] | np.ndarray | None = dataclasses.field(default=None, repr=False)
    # where -> the observations of entries `where` as NUL-padded ASCII bytes + lengths, or None if it cannot
    _obs_bytes: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray] | None] | None = dataclasses.field(
        default=None, repr=False)

    @property
    def obs(self) -> list[str]:
        """The observation text per entry, as `OpenSpielTextEnv` returns it."""
        if callable(self._obs):
            self._obs = self._obs()
        return self._obs

    def obs_bytes(self, where: Bool[np.ndarray, " r"]) -> tuple[UInt8[np.ndarray, "k t"], Int[np.ndarray, " k"]] | None:
        """The observations of the entries `where` as NUL-padded ASCII byte rows and their lengths, without a
        string per entry; None where the env cannot give them that way (then read `obs`)."""
        return None if self._obs_bytes is None else self._obs_bytes(np.asarray(where, bool))

    @property
    def board(self) -> Int8[np.ndarray, "r h w"] | None:
        """+1 agent, -1 opponent, 0 empty, top row first. Built on first use: the loop never reads it."""
        if callable(self._board):
            self._board = self._board()
        return self._board

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def winners(self) -> list[str | None]:
        return [None if w == NO_WINNER else WINNERS[w] for w in self.winner.tolist()]

    def infos(self) -> list[dict[str, Any]]:
        """The info dict `OpenSpielTextEnv.step` would return, per entry (built here, on demand)."""
        if self._infos is not None:
            return self._infos
        opp, act = self.opponent_action.tolist(), self.action.tolist()
        return [
            {
                "legal_actions": np.flatnonzero(self.legal[k]).tolist(),
                "board": self.board[k].copy(),
                "opponent_action": None if opp[k] < 0 else opp[k],
                "action": None if act[k] < 0 else act[k],
                "winner": winner,
                "invalid": bool(self.invalid[k]),
                "turn": int(self.turn[k]),
                "agent_player": int(self.agent_player[k]),
                "retries_left": int(self.retries_left[k]),
            }
            for k, winner in enumerate(self.winners)
        ]


def check_rows(rows, num_games: int, live: np.ndarray, check_live: bool) -> Int[np.ndarray, " r"]:
    """Game indices as int64, or a clear error: not 1-D integers, out of range, repeated, or (stepping)
    a game that is not running. Checked before anything changes, so a bad call leaves the batch as it was."""
    rows = np.asarray(rows)
    if rows.ndim != 1 or (len(rows) and rows.dtype.kind not in "iu"):  # np.issubdtype(dtype, np.integer)
        raise ValueError(f"rows must be a 1-D sequence of game indices, got {rows!r}")
    rows = rows.astype(np.int64)
    # Increasing rows (the agent loop's) are unique, and their ends are their extremes: two numpy calls.
    increasing = len(rows) > 1 and bool((rows[1:] > rows[:-1]).all())
    if len(rows) and ((rows[0] if increasing else rows.min()) < 0
                      or (rows[-1] if increasing else rows.max()) >= num_games):
        raise ValueError(f"rows must be in [0, {num_games}), got {rows[(rows < 0) | (rows >= num_games)].tolist()}")
    if not increasing:
        seen = np.zeros(num_games, bool)
        seen[rows] = True
        if np.count_nonzero(seen) != len(rows):  # cheaper than np.unique: no sort
            raise ValueError("rows must be unique: one answer per game per step")
    if check_live and not live[rows].all():
        raise RuntimeError(f"step() on finished (or never reset) games {rows[~live[rows]].tolist()}; reset them first")
    return rows


def check_answers(rows: Int[np.ndarray, " r"], answers, moves) -> tuple[list | None, Int[np.ndarray, " r"] | None]:
    """Exactly one of answers (one per row, not a bare string) or moves (one integer per row, -1: none)."""
    if (answers is None) == (moves is None):
        raise ValueError("give exactly one of answers (texts) or moves (parsed moves)")
    if answers is not None:
        if isinstance(answers, str) or len(answers) != len(rows):
            raise ValueError(f"{1 if isinstance(answers, str) else len(answers)} answers for {len(rows)} games")
        return answers, None
    moves = np.asarray(moves)
    if moves.shape != rows.shape or moves.dtype.kind not in "iu":  # np.issubdtype(dtype, np.integer)
        raise ValueError(f"moves must be {len(rows)} integers, got {moves.dtype} {moves.shape}")
    return None, moves.astype(np.int64)


def check_reset(rows: Int[np.ndarray, " r"], seeds, histories) -> None:
    """A seed per row (a non-negative integer, or None: continue the game's stream), a history per row if any."""
    if isinstance(seeds, (str, bytes)) or len(seeds) != len(rows):
        raise ValueError(f"{len(seeds)} seeds for {len(rows)} games")
    if set(map(type, seeds)) == {int} and min(seeds) >= 0:  # the common case, checked without a Python loop
        seeds = ()
    for seed in seeds:
        if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0):
            raise ValueError(f"seeds must be non-negative integers or None, got {seed!r}")
    if histories is not None and len(histories) != len(rows):
        raise ValueError(f"{len(histories)} histories for {len(rows)} games")
