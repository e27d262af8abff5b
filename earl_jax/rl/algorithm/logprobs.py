"""Per-token log-probabilities and entropies without materializing [b, t, vocab] logits.

The hidden states are computed once; the vocabulary projection, log-softmax and the gather of the
target token run over chunks of the sequence under `jax.checkpoint`, so the backward pass recomputes
one chunk of logits at a time (a 152K vocabulary times 4K tokens would otherwise be 2.5 GB per row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from earl_jax.models.qwen2 import Qwen2
from earl_jax.rollout.moves import choice_logprobs


def _chunk_stats(model: Qwen2, h: Float[Array, "b c d"], targets: Int[Array, "b c"], choices: Int[Array, "b c"] | None,
                 right: Int[Array, "b c"] | None, temperature: float, choice_tokens: tuple[int, ...]):
    logits = model.logits(h) / temperature  # b c v, float32
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    logp = target_logit - lse
    if choices is not None:  # constrained moves: the legal moves' tokens only, as the rollout sampled them
        c_logp, c_entropy = choice_logprobs(logits, targets, choices, choice_tokens, right)
        logp, entropy = jnp.where(choices != 0, c_logp, logp), jnp.where(choices != 0, c_entropy, entropy)
    return logp, entropy


def token_logprobs(model: Qwen2, tokens: Int[Array, "b t"], *, chunk: int = 512, temperature: float = 1.0,
                   positions: Int[Array, "b t"] | None = None, choices: Int[Array, "b t"] | None = None,
                   choice_tokens: tuple[int, ...] = (), right: Int[Array, "b t"] | None = None
                   ) -> tuple[Float[Array, "b t"], Float[Array, "b t"]]:
    """log p(tokens[:, t] | tokens[:, :t]) and the entropy of that distribution, aligned with `tokens`.

    Position 0 has no prediction and holds 0. `chunk` (sequence positions per vocabulary chunk) is what
    the Parallelism Selector sizes from the memory model. `choices` (rollout/moves.py): where nonzero, the
    token was drawn among the legal moves' tokens `choice_tokens` (bitmask of the legal ones), and its
    log-prob and entropy are those of that restricted distribution. `right` (with `choices`; bitmasks of equally
    right moves where nonzero): the log-prob there is that of any of those moves.
    """
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    h, _ = model.hidden(tokens, positions)
    h, targets = h[:, :-1], tokens[:, 1:]  # hidden at t predicts token t+1
    n = t - 1
    chunk = max(1, min(chunk, n))
    pad = (-n) % chunk
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    num_chunks = (n + pad) // chunk
    h_c = h.reshape(b, num_chunks, chunk, -1).swapaxes(0, 1)
    t_c = targets.reshape(b, num_chunks, chunk).swapaxes(0, 1)
    if choices is not None and not choice_tokens:
        raise ValueError("token_logprobs: choices need choice_tokens (the move token of each action)")
    if right is not None and choices is None:
        raise ValueError("token_logprobs: right-move sets need constrained moves (choices)")
    chunked = lambda x: None if x is None else (  # noqa: E731  None is an empty pytree: lax.map passes it through
        jnp.pad(x[:, 1:], ((0, 0), (0, pad))).reshape(b, num_chunks, chunk).swapaxes(0, 1))
    stats = jax.checkpoint(lambda hc, tc, cc, rc: _chunk_stats(model, hc, tc, cc, rc, temperature, choice_tokens))
    lp, ent = jax.lax.map(lambda xs: stats(*xs), (h_c, t_c, chunked(choices), chunked(right)))
    lp = lp.swapaxes(0, 1).reshape(b, -1)[:, :n]
    ent = ent.swapaxes(0, 1).reshape(b, -1)[:, :n]
    zero = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([zero, lp], 1), jnp.concatenate([zero, ent], 1)
