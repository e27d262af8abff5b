"""Speculative decoding of free-text answers with drafts from history (rollout/drafts.py), exact in distribution.

At the start of a turn's answer (after its observation's extend) each decode row with a draft d_0..d_{m-1} runs ONE
forward over its draft tokens, appended at its own positions as an extend appends them; it gives the logits at every
draft position (position 0's are those the extend left, `next_logits`). The standard rule for a point-mass draft
(Leviathan et al. 2023, Chen et al. 2023) then keeps every answer's distribution that of plain decoding:

    accept d_i with probability p_i(d_i), p_i the distribution the sampler draws from at position i (temperature,
    top-k, top-p, `sampling.truncate`; greedy: a point mass on the argmax);
    at the first rejection draw the answer's next token from p_i with d_i removed, renormalized;
    all m accepted: the next token is the regular decode's (`Sampler.generate`, from the logits after d_{m-1}).

A token drawn at a rejection is fed in the same program (one decode step), so a row's cache ends at its accepted
length plus that token; the draft's entries past it are dead: the row's length says so, attention is masked by
position, and the next writes overwrite them. An accepted stop token ends the answer there, and so does the budget
(drafts are cut at their first stop token and at the row's budget before they run). Log-probs are recorded as the
sampler records them (log_softmax(logits / temperature) at the token), so the trajectory and its behaviour log-probs
are those of plain decoding. Then `Sampler.generate` goes on from the accepted length with the budget left.

Randomness: row r's acceptance uniforms and its rejection draw come from fold_in(row r's key, DRAFT_STREAM), a stream
the decode loop's draws (fold_in(row key, i), i < the answer budget) never use. One host sync a turn: the budget left
depends on what was accepted. Where it pays: answers that repeat (a trained policy); on random weights nothing does.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from earl_jax.distributed import global_to_host
from earl_jax.rollout.drafts import NO_TOKEN, DraftIndex
from earl_jax.rollout.sampler import PAD_TOKEN, Generation, Sampler, SamplerState
from earl_jax.rollout.sampling import SamplingConfig, program_key, row_keys, runtime_values, truncate

DRAFT_STREAM = 0x7FFFFFFF  # fold_in data of the drafts' draws: far above any decode step index


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Verified:
    tokens: Int[Array, "b k"]  # row r's answer so far: tokens[r, :counts[r]] (accepted drafts, then a drawn token)
    logprobs: Float[Array, "b k"]
    counts: Int[Array, " b"]
    stopped: Bool[Array, " b"]  # the answer ended on a stop token
    accepted: Int[Array, " b"]  # draft tokens accepted


def accept_drafts(keys: jax.Array, logits: Float[Array, "b k v"], drafts: Int[Array, "b k"], lengths: Int[Array, " b"],
                  sampling: SamplingConfig, temperature, greedy
                  ) -> tuple[Int[Array, " b"], Int[Array, " b"], Float[Array, "b k"], Float[Array, " b"]]:
    """The acceptance rule (module docstring) for drafts[r, :lengths[r]], logits[r, i] predicting drafts[r, i]; `keys`
    one per row, `temperature` and `greedy` as `sampling.runtime_values` gives them. Returns the accepted count per row,
    the token drawn at the first rejection (meaningful where count < length), the drafts' log-probs and that token's."""
    b, k, v = logits.shape
    scaled = logits.astype(jnp.float32) / temperature
    masked = truncate(scaled, sampling.top_k, sampling.top_p)
    top = jnp.argmax(scaled, axis=-1)  # b k: greedy's token, as sample_logits picks it
    at_draft = lambda x: jnp.take_along_axis(x, drafts[..., None], axis=-1)[..., 0]  # noqa: E731
    p_draft = jnp.where(greedy, (drafts == top).astype(jnp.float32),
                        jnp.exp(at_draft(masked) - jax.nn.logsumexp(masked, axis=-1)))
    draft_lp = at_draft(scaled) - jax.nn.logsumexp(scaled, axis=-1)
    split = jax.vmap(lambda key: jax.random.split(key))(keys)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,), jnp.float32))(split[:, 0])
    ok = (u < p_draft) & (jnp.arange(k)[None] < lengths[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    at = jnp.minimum(accepted, k - 1)[:, None]
    row = lambda x: jnp.take_along_axis(x, at[..., None] if x.ndim == 3 else at, axis=1)[:, 0]  # noqa: E731
    rejected = jnp.arange(v)[None] == row(drafts)[:, None]
    without = jnp.where(rejected, jnp.finfo(jnp.float32).min, row(masked))  # p_i with d_i removed
    drawn = jax.vmap(jax.random.categorical)(split[:, 1], without)
    token = jnp.where(greedy, row(top), drawn).astype(jnp.int32)
    scaled_at = row(scaled)
    token_lp = jnp.take_along_axis(scaled_at, token[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(scaled_at, axis=-1)
    return accepted, token, draft_lp, token_lp


class DraftVerifier:
    """The verification program of one sampler (its model, mesh and rules); one program per batch, cache size, draft
    width, stop tokens and top-k / top-p, counted in the sampler's `compile_count`."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._verify = jax.jit(self._verify_impl, static_argnums=(8, 9), donate_argnums=(1,))

    def __call__(self, params: nnx.State, state: SamplerState, drafts, lengths, rng: jax.Array, row_ids, *,
                 stop_tokens: tuple[int, ...], sampling: SamplingConfig) -> tuple[SamplerState, Verified]:
        """Verify row r's drafts[r, :lengths[r]] (cut at its first stop token and within its budget: `trim_drafts`);
        rows of length 0 are untouched. `row_ids` as `Sampler.generate` takes them. `state` is donated."""
        temperature, greedy = runtime_values(sampling)
        drafts, lengths, row_ids = self.sampler._put_rows(
            np.asarray(drafts, np.int32), np.asarray(lengths, np.int32), np.asarray(row_ids, np.int32))
        return self._verify(params, state, drafts, lengths, rng, row_ids, temperature, greedy,
                            tuple(int(t) for t in stop_tokens), program_key(sampling))

    def _verify_impl(self, params, state: SamplerState, drafts, lengths, rng, row_ids, temperature, greedy,
                     stop_tokens: tuple[int, ...], sampling: SamplingConfig) -> tuple[SamplerState, Verified]:
        sp = self.sampler
        sp._traces += 1
        with sp._ctx():
            model = sp._model(params)
            k, s = drafts.shape[1], state.cache.max_len
            idx = jnp.arange(k, dtype=jnp.int32)[None]
            positions = jnp.where(idx < lengths[:, None], state.lengths[:, None] + idx, s)  # slot s: no write
            h, cache = model.hidden(sp._constrain(drafts, ("batch", "length")), positions, state.cache)
            after = model.logits(h)  # b k v: the logits after each draft token
            before = jnp.concatenate([state.next_logits[:, None], after[:, :-1]], axis=1)  # predicting each one
            keys = jax.vmap(lambda key: jax.random.fold_in(key, DRAFT_STREAM))(row_keys(rng, row_ids))
            accepted, token, draft_lp, token_lp = accept_drafts(keys, before, drafts, lengths, sampling, temperature,
                                                                greedy)
            rejected = accepted < lengths

            def feed(cache):  # the drawn token into the cache at the rejected position, as a decode step writes it
                at = jnp.where(rejected, state.lengths + accepted, s)[:, None]
                h1, cache = model.hidden(sp._constrain(token[:, None], ("batch", "length")), at, cache)
                return cache, model.logits(h1)[:, 0]

            cache, fed = jax.lax.cond(jnp.any(rejected), feed, lambda c: (c, state.next_logits), cache)
            stops = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)
            last = jnp.maximum(lengths - 1, 0)[:, None]
            last_draft = jnp.take_along_axis(drafts, last, axis=1)[:, 0]
            stop_of = lambda t: jnp.any(t[:, None] == stops[None], axis=-1) & bool(stop_tokens)  # noqa: E731
            stopped = jnp.where(rejected, stop_of(token), (lengths > 0) & stop_of(last_draft))
            after_last = jnp.take_along_axis(after, last[..., None], axis=1)[:, 0]
            next_logits = jnp.where(rejected[:, None], fed,
                                    jnp.where((lengths > 0)[:, None], after_last, state.next_logits))
            counts = accepted + rejected.astype(jnp.int32)
            kept, drawn = idx < accepted[:, None], (idx == accepted[:, None]) & rejected[:, None]
            tokens = jnp.where(kept, drafts, jnp.where(drawn, token[:, None], PAD_TOKEN))
            logprobs = jnp.where(kept, draft_lp, jnp.where(drawn, token_lp[:, None], 0.0))
            state = sp._constrain_state(SamplerState(cache, state.lengths + counts, next_logits))
            rows = lambda x: sp._constrain(x, ("batch",) + (None,) * (x.ndim - 1))  # noqa: E731
            return state, Verified(*map(rows, (tokens, logprobs, counts, stopped, accepted)))


def trim_drafts(drafts: np.ndarray, lengths: np.ndarray, limit: np.ndarray, stop_tokens: tuple[int, ...]
                ) -> np.ndarray:
    """Draft lengths cut to each row's `limit` (its budget) and after a row's first stop token (nothing follows it)."""
    lengths = np.minimum(lengths, limit).astype(np.int32)
    if stop_tokens:
        is_stop = np.isin(drafts, stop_tokens) & (np.arange(drafts.shape[1])[None] < lengths[:, None])
        lengths = np.where(is_stop.any(1), np.argmax(is_stop, axis=1) + 1, lengths).astype(np.int32)
    return lengths


class Speculation:
    """One model policy's drafting (rollout/policy.py): its rows' context tails (the last `index.n` tokens of each
    row's cache), the verification before each decode, and the draft tokens it proposed and had accepted."""

    def __init__(self, index: DraftIndex):
        self.index = index
        self.proposed = self.accepted = 0
        self.tails = np.full((0, index.n), NO_TOKEN, np.int32)

    def reset(self, batch: int) -> None:
        self.tails = np.full((batch, self.index.n), NO_TOKEN, np.int32)

    def reset_rows(self, rows: np.ndarray) -> None:
        self.tails[rows] = NO_TOKEN

    def take_rows(self, rows: np.ndarray, batch: int) -> None:
        tails = np.full((batch, self.index.n), NO_TOKEN, np.int32)
        tails[:len(rows)] = self.tails[rows]
        self.tails = tails

    def extended(self, tokens: Int[np.ndarray, "b t"], counts: Int[np.ndarray, " b"]) -> None:
        """Row r's cache grew by tokens[r, :counts[r]]."""
        both = np.concatenate([self.tails, np.asarray(tokens, np.int32)], axis=1)
        self.tails = np.take_along_axis(both, np.asarray(counts, np.int64)[:, None] + np.arange(self.index.n)[None], 1)

    def generate(self, sampler: Sampler, params: nnx.State, state: SamplerState, rng: jax.Array, budgets: np.ndarray,
                 row_ids: np.ndarray, *, max_new_tokens: int, stop_tokens: tuple[int, ...], sampling: SamplingConfig
                 ) -> tuple[SamplerState, Callable[[], tuple[np.ndarray, ...]]]:
        """`Sampler.generate` with drafts: (the state, a function that waits for the answers: tokens [b,
        max_new_tokens], log-probs, counts, stopped, on the host). `state` is donated."""
        budgets = np.asarray(budgets, np.int32)
        drafts, lengths = self.index.propose(self.tails)
        lengths = trim_drafts(drafts, lengths, np.minimum(budgets, max_new_tokens), stop_tokens)
        kw = dict(max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, sampling=sampling, row_ids=row_ids,
                  trim=False)
        verified = None
        if lengths.any():
            if sampler.verify is None:  # kept with the sampler, as its other compiled programs are
                sampler.verify = DraftVerifier(sampler)
            state, out = sampler.verify(params, state, drafts, lengths, rng, row_ids, stop_tokens=stop_tokens,
                                        sampling=sampling)
            verified = global_to_host(out)  # the budget left depends on what was accepted
            self.proposed += int(lengths.sum())
            self.accepted += int(verified.accepted.sum())
            budgets = np.where(verified.stopped, 0, budgets - verified.counts).astype(np.int32)
        generated = None
        if budgets.any():
            state, generated = sampler.generate(params, state, rng, budget=budgets, **kw)
        return state, lambda: self._answers(verified, generated, len(budgets), max_new_tokens)

    def _answers(self, verified: Verified | None, generated: Generation | None, b: int, width: int
                 ) -> tuple[np.ndarray, ...]:
        """The verified tokens, then the decoded ones after them (host arrays); the rows' tails take them."""
        tokens, logprobs = np.full((b, width), PAD_TOKEN, np.int32), np.zeros((b, width), np.float32)
        counts, stopped = np.zeros(b, np.int32), np.zeros(b, bool)
        if verified is not None:
            w = min(width, verified.tokens.shape[1])  # counts <= the budget <= width
            tokens[:, :w], logprobs[:, :w] = verified.tokens[:, :w], verified.logprobs[:, :w]
            counts, stopped = np.asarray(verified.counts, np.int32), np.asarray(verified.stopped, bool)
        if generated is not None:
            g_tokens, g_logprobs, g_counts, g_stopped = global_to_host(
                (generated.tokens, generated.logprobs, generated.num_tokens, generated.stopped))
            valid = np.arange(g_tokens.shape[1])[None] < g_counts[:, None]
            rows, cols = np.nonzero(valid)
            tokens[rows, counts[rows] + cols], logprobs[rows, counts[rows] + cols] = g_tokens[valid], g_logprobs[valid]
            counts, stopped = counts + g_counts, stopped | g_stopped
        self.extended(tokens, counts)
        return tokens, logprobs, counts, stopped
