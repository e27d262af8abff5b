"""Games whose opponent is a policy, not a rule: `ModelOpponentEnv`, for self-play against frozen snapshots.

    env = ModelOpponentEnv(EnvConfig.connect_four(opponent="random"), 64)
    env.assign(policy, games)       # these games' opponent is `policy`; the rest play the config's opponent
    first = env.reset(seeds)        # then env.step(...) as any VectorTextEnv

The env stays model-agnostic: once per opponent turn it calls `policy(games, observations)` for every game
where the policy is to move (one call: one decode for the batch), with the texts the env would show an
agent in that seat (the board rendered from the other side, the agent's move as "opp 3"). So a frozen copy
of the agent's own policy reads exactly the kind of context it was trained on, in either seat.

Decisions:
- The agent's seat is whatever the config says: agent_player None draws it per game from the seed, so the
  agent plays both seats against its past selves.
- An invalid answer from the policy gets the agent's rule: the retry text ("invalid move" and the legal
  moves) and another answer, up to max_retries; then a uniformly random legal move from the game's own
  opponent stream (deterministic per seed), counted in `policy_fallbacks`. Not a forfeit: a frozen policy's
  mistakes must not hand the agent free wins.
- The policy's contexts start at `reset` (`OpponentPolicy.reset(games)`), which must then reset every policy
  game at once (the agent loop resets the whole batch); a partial reset of policy games is refused.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
from jaxtyping import Int

from earl_jax.envs.vector.batched_opponents import kth_true
from earl_jax.envs.vector.env import VectorTextEnv
from earl_jax.envs.vector.step import VectorStep


class OpponentPolicy(Protocol):
    def reset(self, games: Int[np.ndarray, " g"]) -> None:
        """New games in the env's rows `games` (the only rows it will be asked about until the next reset)."""
        ...

    def __call__(self, games: Int[np.ndarray, " r"], observations: Sequence[str]) -> Int[np.ndarray, " r"]:
        """Append observations[k] to game games[k]'s context and answer; the move each answer names, as the
        agent loop reads answers (ObservationCodec.answers_to_moves), -1 where it names none."""
        ...


class ModelOpponentEnv(VectorTextEnv):
    def __init__(self, config, num_games: int):
        super().__init__(config, num_games)
        self._policy: OpponentPolicy | None = None
        self._policy_game = np.zeros(num_games, bool)
        self._last_move = np.full(num_games, -1, np.int64)  # the last stone played in each game
        self._seen = np.zeros(num_games, bool)  # the policy has had its first observation of the game
        self.policy_moves = 0  # moves the policy was asked for since the last reset
        self.policy_fallbacks = 0  # of those, replaced by a random legal move after the retries

    def assign(self, policy: OpponentPolicy | None, games: Sequence[int] | np.ndarray | None = None) -> None:
        """`policy` plays the games in `games` (indices, or a boolean mask) from the next reset on; None: none."""
        mask = np.zeros(self.num_games, bool)
        if policy is not None and games is not None:
            mask[np.asarray(games)] = True
        self._policy, self._policy_game = (policy if mask.any() else None), mask

    @property
    def policy_games(self) -> np.ndarray:
        return self._policy_game.copy()

    def reset(self, seeds, rows=None, histories=None) -> VectorStep:
        all_rows = np.arange(self.num_games) if rows is None else np.asarray(rows, np.int64)
        if self._policy is not None:
            games = np.flatnonzero(self._policy_game)
            if not np.isin(games, all_rows).all():
                raise ValueError("ModelOpponentEnv: reset every game the policy plays at once (its contexts "
                                 "start together)")
            self._policy.reset(games)
            self.policy_moves = self.policy_fallbacks = 0
        self._last_move[all_rows] = -1
        self._seen[all_rows] = False
        return super().reset(seeds, rows, histories)

    # ---- hooks into VectorTextEnv -------------------------------------------------------------
    def _play(self, rows, actions, players) -> None:
        super()._play(rows, actions, players)
        self._last_move[rows] = actions  # the policy's next observation names the agent's last move

    def _opponent_moves(self, rows, agent=None):
        if self._policy is None:
            return super()._opponent_moves(rows, agent)
        mine = self._policy_game[rows]
        out = np.zeros(len(rows), np.int64)
        out[~mine] = super()._opponent_moves(rows[~mine], None if agent is None else agent[~mine])
        if mine.any():
            out[mine] = self._policy_moves(rows[mine])
        return out

    def _policy_moves(self, games: np.ndarray) -> np.ndarray:
        """Ask the policy for a move in each of `games` (it is to move there), with retries; play them."""
        seat = 1 - self.agent_player[games]
        legal = self.rules.legal_mask(self.stones[games])
        code = legal @ (1 << np.arange(self.num_actions))
        first = ~self._seen[games]
        obs: list[str] = [""] * len(games)

        def put(where, texts):
            for k, t in zip(np.flatnonzero(where).tolist(), texts):
                obs[k] = t

        if first.any():  # the board, the legal moves and the agent's opening move if any: a first observation
            put(first, self.renderer.texts(self.cells[games[first]], seat[first], legal[first],
                                           self._last_move[games[first]], [None] * int(first.sum()), first=True))
        if (~first).any():
            put(~first, self.renderer.turn_texts(self.cells[games[~first]], seat[~first],
                                                 self._last_move[games[~first]], code[~first]))
        self._seen[games] = True
        moves = self._ask(games, obs, legal)
        ok = _legal(moves, legal)
        for _ in range(self.config.max_retries):
            bad = np.flatnonzero(~ok)
            if not len(bad):
                break
            moves[bad] = self._ask(games[bad], self.renderer.retry_obs(code[bad]), legal[bad])
            ok[bad] = _legal(moves[bad], legal[bad])
        bad = np.flatnonzero(~ok)
        if len(bad):
            draw = self.opponent.streams.randbelow(games[bad], legal[bad].sum(1))
            moves[bad] = kth_true(legal[bad], draw)
        self.policy_moves += len(games)
        self.policy_fallbacks += len(bad)
        self._play(games, moves, seat)
        return moves

    def _ask(self, games: np.ndarray, observations: list[str], legal: np.ndarray) -> np.ndarray:
        if getattr(self._policy, "wants_legal", False):  # a constrained policy draws among the legal moves
            moves = np.asarray(self._policy(games, observations, legal=legal), np.int64)
        else:
            moves = np.asarray(self._policy(games, observations), np.int64)
        if moves.shape != games.shape:
            raise ValueError(f"the opponent policy answered {moves.shape} moves for {len(games)} games")
        return moves


def _legal(moves: np.ndarray, legal: np.ndarray) -> np.ndarray:
    in_range = (moves >= 0) & (moves < legal.shape[1])
    return in_range & legal[np.arange(len(moves)), np.where(in_range, moves, 0)]
