"""Expert games played again from their moves: in another prompt style or rollout limits, or mirrored.

    compact = replay_games(games, env_cfg, tokenizer, eos_id=..., bos_id=..., constrained=True)   # env_cfg's style
    more = concat_games([train, replay_games(train, env_cfg, tokenizer, ..., mirror=True)])     # twice the data

The search is what costs (Connect Four's alpha-beta at depth 5: 0.15 s a game on one core); a transcript is cheap.
A replay steps the same env with both sides' recorded moves (the seat and the opening from each game's seed and
opening length) and writes the transcript exactly as `expert_games` does (rl/expert_games._play), so legal moves,
tactics, winner and truncation are recomputed for the new format, and the expert's best-move sets, which need the
search, are carried over turn by turn. `mirror`: the board reflected left to right (the game's `MIRRORS` entry): every
move and every move set mapped through it; the reflection of a game is a game of the same value, so the expert's best
moves stay best. A game cut short by the old limits is dropped: its later best sets were never computed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tokenizers

from earl_jax.envs.vector.batched_opponents import BatchedOpponent
from earl_jax.envs.vector.codec import ObservationCodec
from earl_jax.rl.supervised.expert_games import ExpertGames, _play
from earl_jax.rollout.moves import MoveTokens

# the action each action becomes when the board is reflected left to right
MIRRORS: dict[str, tuple[int, ...]] = {"connect_four": (6, 5, 4, 3, 2, 1, 0),
                                       "tic_tac_toe": (2, 1, 0, 5, 4, 3, 8, 7, 6)}


def _map_bits(masks: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Bitmasks over actions with bit a moved to bit perm[a]."""
    out = np.zeros_like(masks)
    for a, b in enumerate(perm.tolist()):
        out |= ((masks >> a) & 1) << b
    return out


class _Script(BatchedOpponent):
    """Both sides' recorded moves: the opponent plays game i's next move, and so does `choose` for the agent; the
    agent's best-move sets come out in the order its expert turns came."""

    def __init__(self, moves: list[tuple[int, ...]], best: list[list[int]], num_actions: int):
        super().__init__(len(moves))
        self.moves, self.best, self.num_actions = moves, best, num_actions
        self.ply, self.turn = np.zeros(len(moves), np.int64), np.zeros(len(moves), np.int64)

    def _next(self, rows: np.ndarray) -> np.ndarray:
        out = np.array([self.moves[r][k] for r, k in zip(rows.tolist(), self.ply[rows].tolist())], np.int64)
        self.ply[rows] += 1
        return out

    def act(self, rows, me, opp, legal):
        return self._next(np.asarray(rows))

    def choose(self, rows, me, opp, legal, opening):
        move = self._next(rows)
        expert = rows[~opening]
        masks = np.array([self.best[r][k] for r, k in zip(expert.tolist(), self.turn[expert].tolist())], np.int64)
        self.turn[expert] += 1
        best = ((masks[:, None] >> np.arange(self.num_actions)) & 1).astype(bool)
        return move, best.reshape(len(expert), self.num_actions)


def replay_games(games: ExpertGames, env_cfg, tokenizer: tokenizers.Tokenizer, *, eos_id: int, bos_id: int | None,
                 constrained: bool, max_context: int = 2048, max_turns: int = 32, max_turn_tokens: int = 4,
                 mirror: bool = False) -> ExpertGames:
    """`games` (finished ones) written again in `env_cfg`'s prompt style and these rollout limits; `mirror`:
    reflected."""
    from earl_jax.envs.vector import VectorTextEnv

    if mirror and env_cfg.game not in MIRRORS:
        raise ValueError(f"expert replay: no mirror for {env_cfg.game!r} (have {sorted(MIRRORS)})")
    done = np.flatnonzero(games.winner >= 0)
    if not len(done):
        raise ValueError("expert replay: no finished game to replay")
    games = games.take(done)
    env = VectorTextEnv(dataclasses.replace(env_cfg, opponent="random", blunder_penalty=0.0), len(games))
    perm = np.asarray(MIRRORS[env_cfg.game] if mirror else range(env.num_actions))
    moves = [tuple(int(perm[a]) for a in m) for m in games.moves]
    rows, cols = games.expert_turns()
    masks = _map_bits(games.best[rows, cols].astype(np.int64), perm)
    best: list[list[int]] = [[] for _ in range(len(games))]
    for r, m in zip(rows.tolist(), masks.tolist()):
        best[r].append(m)
    script = _Script(moves, best, env.num_actions)
    env.opponent = script
    token_moves = MoveTokens.build(tokenizer, env.num_actions, eos_id) if constrained else None
    out = _play(env, script.choose, ObservationCodec(tokenizer), tokenizer, token_moves, eos_id, bos_id,
                games.seeds.tolist(), games.opening, max_context, max_turns, max_turn_tokens)
    kept = all(m[:len(o)] == o for o, m in zip(out.moves, moves))  # a prefix where the new limits cut a game
    if not kept or not np.array_equal(out.agent_player, games.agent_player):
        raise ValueError("expert replay: the replayed games left their recorded moves (a different game or seat rule?)")
    return dataclasses.replace(out, opponent=games.opponent, opponents=games.opponents)
