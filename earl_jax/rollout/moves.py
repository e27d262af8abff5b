"""Constrained moves (`--rollout.constrain-moves`): the policy picks each move among the tokens of the LEGAL moves.

A turn is then two tokens: the move's token, drawn from the model's next-token logits restricted to the legal
moves' tokens (a masked softmax at the sampling temperature), and the stop token, appended without sampling.
The experience and train stages score the move token under the same restriction (`choice_logprobs`), so the
importance ratio compares like with like, and the forced stop token is outside the loss mask (it is no choice
of the policy). What this buys (docs/learning.md): no invalid answers, exploration only
over moves that mean something, one scored token per turn (no free tokens diluting a turn's credit), and no
decode loop in the rollout (the move comes straight from the logits the observation's extend produced).

Where it applies: every action's canonical text (`envs.parser.canonical_action_text`, its decimal id) must be a
single token of the tokenizer, and there are at most `MAX_ACTIONS` actions (the legal set travels as a bitmask
per token, `choices`): Connect Four (7) and Tic-Tac-Toe (9) with the game tokenizer or Qwen's. Free-text answers
(the EARL paper's setting, invalid answers forfeit) stay the default of pretrained-model presets.

The legal set of a constrained token is stored as an int32 bitmask over the action ids (bit a: action a is
legal); 0 marks a token that was not constrained (scored over the whole vocabulary).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from jaxtyping import Array, Bool, Float, Int

from earl_jax.envs.parser import canonical_action_text
from earl_jax.rollout.sampling import row_keys

MAX_ACTIONS = 31  # the legal set is an int32 bitmask


@dataclasses.dataclass(frozen=True)
class MoveTokens:
    """Token id of each action's canonical text (index = action id), and the stop token that ends a turn."""

    token_ids: tuple[int, ...]
    stop_id: int

    @classmethod
    def build(cls, tokenizer: tokenizers.Tokenizer, num_actions: int, stop_id: int) -> "MoveTokens":
        if not 0 < num_actions <= MAX_ACTIONS:
            raise ValueError(f"--rollout.constrain-moves: the game has {num_actions} actions; at most {MAX_ACTIONS} "
                             "are supported (the legal set is a 31-bit mask): use free-text answers")
        ids = []
        for a in range(num_actions):
            enc = tokenizer.encode(canonical_action_text(a), add_special_tokens=False).ids
            if len(enc) != 1:
                raise ValueError(f"--rollout.constrain-moves: action {a} ({canonical_action_text(a)!r}) is "
                                 f"{len(enc)} tokens in this tokenizer; every move must be one token: use free-text "
                                 "answers")
            ids.append(int(enc[0]))
        if len(set(ids)) != len(ids) or stop_id in ids:
            raise ValueError(f"--rollout.constrain-moves: the move tokens {ids} must be distinct and differ from the "
                             f"stop token {stop_id}")
        return cls(tuple(ids), int(stop_id))

    @property
    def num_actions(self) -> int:
        return len(self.token_ids)


def legal_bits(legal: Bool[np.ndarray, "b a"]) -> Int[np.ndarray, " b"]:
    """Legal masks as int32 bitmasks (bit a set: action a legal)."""
    legal = np.asarray(legal, bool)
    return (legal.astype(np.int64) @ (1 << np.arange(legal.shape[1], dtype=np.int64))).astype(np.int32)


def bits_to_mask(bits: Int[Array, "..."], num_actions: int) -> Bool[Array, "... a"]:
    return ((bits[..., None] >> jnp.arange(num_actions, dtype=jnp.int32)) & 1).astype(bool)


def _masked(scaled: Float[Array, "... a"], allowed: Bool[Array, "... a"]) -> Float[Array, "... a"]:
    return jnp.where(allowed, scaled, jnp.finfo(scaled.dtype).min)


def pick_moves(next_logits: Float[Array, "b v"], bits: Int[Array, " b"], rng: jax.Array, row_ids: Int[Array, " b"],
               temperature: jax.Array, greedy: jax.Array, *, token_ids: tuple[int, ...]
               ) -> tuple[Int[Array, " b"], Float[Array, " b"]]:
    """One legal action per row and its log-prob under the masked, tempered softmax over the move tokens.

    Row r draws from fold_in(rng, row_ids[r]) alone (as the sampler's rows do; [b, 2] rows: `sampling.row_keys`),
    so a game's move does not depend on its batch. Rows with bits 0 (no legal move, or an empty slot) return action 0
    and log-prob 0.
    Traced by `Sampler.pick_moves` (its mesh, its rows' sharding)."""
    sub = jnp.take(next_logits.astype(jnp.float32), jnp.asarray(token_ids), axis=-1) / temperature  # b a
    allowed = bits_to_mask(bits, len(token_ids))
    masked = _masked(sub, allowed)
    keys = row_keys(rng, row_ids)
    drawn = jax.vmap(jax.random.categorical)(keys, masked)
    action = jnp.where(greedy, jnp.argmax(masked, axis=-1), drawn).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(masked, axis=-1), action[:, None], axis=-1)[:, 0]
    any_legal = bits != 0
    return jnp.where(any_legal, action, 0), jnp.where(any_legal, logp, 0.0)


def choice_logprobs(logits: Float[Array, "... v"], targets: Int[Array, "..."], bits: Int[Array, "..."],
                    token_ids: tuple[int, ...], right: Int[Array, "..."] | None = None
                    ) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """log p(target) and the entropy of the move distribution restricted to the legal moves' tokens (`bits`),
    from (tempered) logits over the whole vocabulary; meaningful only where bits != 0. `right` (bitmasks, nonzero
    where given): log p(any of those moves) instead of log p(target)."""
    ids = jnp.asarray(token_ids)
    allowed = bits_to_mask(bits, len(token_ids))
    logp_all = jax.nn.log_softmax(_masked(jnp.take(logits, ids, axis=-1), allowed), axis=-1)
    index = jnp.argmax(targets[..., None] == ids, axis=-1)  # the target's action id (0 if it is no move token)
    logp = jnp.take_along_axis(logp_all, index[..., None], axis=-1)[..., 0]
    if right is not None:
        in_set = bits_to_mask(right, len(token_ids)) & allowed
        logp = jnp.where(right != 0, jax.nn.logsumexp(_masked(logp_all, in_set), axis=-1), logp)
    entropy = -jnp.sum(jnp.where(allowed, jnp.exp(logp_all) * logp_all, 0.0), axis=-1)
    return logp, entropy
