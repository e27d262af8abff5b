"""A model as the opponent of `envs.vector.ModelOpponentEnv`: an agent-loop `Policy` (e.g. a `SamplerPolicy`
over frozen weights) that keeps one context per game it plays and answers for a batch of them at once.

    opponent = FrozenPolicyOpponent(SamplerPolicy(sampler, frozen_params, sampling, stops, turn_tokens),
                                    codec, rng, max_turn_tokens=turn_tokens, bos_id=ids.bos_id)
    env.assign(opponent, league_games)

Each call is one `extend` (the new observations of the games to move; the other slots get nothing) and
one `generate` over its slots (the others have budget 0): one decode for every game where the frozen
policy is to move. Answers are read as the agent loop reads them (`ObservationCodec.answers_to_moves`).
Slot k holds the k-th game of the last `reset` (the batch padded to `min_batch`, the rollout mesh's data
shards); its draws come from fold_in(fold_in(rng, call), game).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from earl_jax.envs.vector import ObservationCodec
from earl_jax.rollout.agent_loop import Policy


class FrozenPolicyOpponent:
    def __init__(self, policy: Policy, codec: ObservationCodec, rng: jax.Array, *, max_turn_tokens: int,
                 bos_id: int | None = None, first_cache_len: int = 128, min_batch: int = 1):
        self.policy, self.codec, self.rng, self.min_batch = policy, codec, rng, min_batch
        self.max_turn_tokens, self.bos_id, self.first_cache_len = max_turn_tokens, bos_id, first_cache_len
        self.games = np.zeros(0, np.int64)

    def reset(self, games: np.ndarray) -> None:
        self.games = np.asarray(games, np.int64)
        self._slot = {int(g): k for k, g in enumerate(self.games.tolist())}
        self._started = np.zeros(len(self.games), bool)
        self._calls = 0
        self._batch = -(-max(len(self.games), 1) // self.min_batch) * self.min_batch  # whole rows per data shard
        self.policy.reset(self._batch, self.first_cache_len)

    @property
    def wants_legal(self) -> bool:
        """A constrained policy (`SamplerPolicy(moves=...)`) needs each game's legal moves to draw from."""
        return getattr(self.policy, "moves", None) is not None

    def __call__(self, games: np.ndarray, observations: Sequence[str], legal: np.ndarray | None = None) -> np.ndarray:
        slots = np.array([self._slot[int(g)] for g in np.asarray(games).tolist()], np.int64)
        ids, counts = self.codec.encode_padded(list(observations))
        fresh = ~self._started[slots]
        if self.bos_id is not None and fresh.any():  # a game's first text starts with BOS, as the agent's does
            ids = np.concatenate([np.zeros((len(slots), 1), ids.dtype), ids], 1)
            ids[~fresh] = np.roll(ids[~fresh], -1, axis=1)
            ids[fresh, 0] = self.bos_id
            counts = counts + fresh
        self._started[slots] = True
        b = self._batch
        tokens = np.zeros((b, ids.shape[1]), np.int32)
        new = np.zeros(b, np.int32)
        tokens[slots], new[slots] = ids, counts
        self.policy.extend(tokens, new)
        budgets = np.zeros(b, np.int32)
        budgets[slots] = self.max_turn_tokens
        row_ids = np.zeros(b, np.int32)
        row_ids[:len(self.games)] = self.games
        kw = {}
        if legal is not None:
            kw["legal"] = np.zeros((b, np.shape(legal)[1]), bool)
            kw["legal"][slots] = legal
        out = self.policy.generate(budgets, jax.random.fold_in(self.rng, self._calls), row_ids, **kw)()
        self._calls += 1
        answers = [out.tokens[s, :out.counts[s]].tolist() for s in slots.tolist()]
        return self.codec.answers_to_moves(answers)
