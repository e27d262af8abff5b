"""Speculative decoding of free-text answers with drafts from history (rollout/drafts.py), exact in distribution.

A row's draft is the answer that followed its context tail before: d_0..d_{m-1}, aligned with the answer it is
about to write (d_j is the guess for the answer's token j). The decode loop (`DraftDecoder`, one jitted
`lax.while_loop`, as `Sampler.generate`) feeds, at each step, a row's pending token (sampled, not yet in the cache)
and the next K draft tokens after it, d_{j+1}..d_{j+K}, in ONE forward over K + 1 positions; it gives the logits
predicting each draft token. The standard rule for a point-mass draft (Leviathan et al. 2023, Chen et al. 2023)
keeps every answer's distribution that of plain decoding:

    accept d_i with probability p_i(d_i), p_i the distribution the sampler draws from at position i (temperature,
    top-k, top-p, `sampling.truncate`; greedy: a point mass on the argmax);
    at the first rejection the next pending token is drawn from p_i with d_i removed, renormalized;
    all accepted: it is drawn from the logits after the last one, as plain decoding draws.

So a row advances 1 + (accepted) tokens a step, each row by its own count, and the loop ends when the slowest row
does: rows that follow their draft finish in a few steps, the others decode on at one token a step. A rejected
draft token's cache entry is dead: the row's length says so, attention is masked by position, and the next writes
overwrite it. After a rejection the row keeps proposing its draft by position (d_{j+1}.. for the answer's token
j + 1), which pays where answers differ in a token and agree after it. A step where no active row has a draft token
left runs the plain one-token forward (`lax.cond`), so a draft costs nothing once it is used up. An accepted stop
token ends the answer there, and so does the budget (a row's draft is cut to what its budget leaves). Log-probs are
recorded as the sampler records them (log_softmax(logits / temperature) at the token), so the trajectory and its
behaviour log-probs are those of plain decoding.

Randomness: step i's pending draw of row r is fold_in(row r's key, i + 1), plain decoding's; the acceptance uniforms
and the rejection draw come from fold_in(fold_in(row key, DRAFT_STREAM), i), a stream plain decoding never uses.
Where it pays: answers that repeat (a trained policy) on a device where a forward of K + 1 tokens costs about what
one costs (memory-bound decode); on random weights nothing repeats. Measurements: docs/results.md (drafts).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from earl_jax.distributed import global_to_host
from earl_jax.rollout.buckets import bucket
from earl_jax.rollout.drafts import NO_TOKEN, DraftIndex
from earl_jax.rollout.sampler import PAD_TOKEN, Generation, Sampler, SamplerState
from earl_jax.rollout.sampling import SamplingConfig, program_key, row_keys, runtime_values, sample_logits, truncate

DRAFT_STREAM = 0x7FFFFFFF  # fold_in data of the drafts' draws: far above any decode step index


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafted:
    generation: Generation  # as `Sampler.generate` returns it
    proposed: Int[Array, " b"]  # draft tokens a row fed (its draft cut to its budget and first stop token)
    accepted: Int[Array, " b"]  # of those, accepted
    steps: Int[Array, ""] | None  # decode steps the loop ran; None: plain decoding ran (as many as the longest answer)


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


class DraftDecoder:
    """The drafted decode program of one sampler (its model, mesh and rules): `Sampler.generate` with each row's
    draft verified K tokens a step (module docstring). One program per batch, cache size, answer length bucket,
    draft width, stop tokens and top-k / top-p, counted in the sampler's `compile_count`."""

    def __init__(self, sampler: Sampler, window: int):
        if window < 1:
            raise ValueError(f"DraftDecoder: window must be >= 1, got {window}")
        self.sampler, self.window = sampler, window
        self._decode = jax.jit(self._decode_impl, static_argnums=(4, 5, 6), donate_argnums=(1,))

    def __call__(self, params: nnx.State, state: SamplerState, rng: jax.Array, drafts, draft_lengths, *,
                 max_new_tokens: int, budget, stop_tokens: tuple[int, ...], sampling: SamplingConfig, row_ids
                 ) -> tuple[SamplerState, Drafted]:
        """Decode as `Sampler.generate(..., row_ids=row_ids, trim=False)` does, row r guessing its answer is
        drafts[r, :draft_lengths[r]], cut after its first stop token (`trim_drafts`: an accepted stop token ends
        the answer, so nothing after it is fed). Asynchronous; `state` is donated."""
        sp = self.sampler
        b = state.batch_size
        budget = np.broadcast_to(np.asarray(budget, np.int32), (b,))
        n = bucket(max(int(max_new_tokens), 1), sp.length_buckets)
        drafts = np.asarray(drafts, np.int32)
        width = bucket(max(drafts.shape[1], 1), sp.length_buckets)  # drafts padded past n: nothing reads them
        padded = np.zeros((b, width), np.int32)
        padded[:, :drafts.shape[1]] = drafts
        temperature, greedy = runtime_values(sampling)
        args = sp._put_rows(budget, padded, np.asarray(draft_lengths, np.int32), np.asarray(row_ids, np.int32))
        stops, pkey = tuple(int(t) for t in stop_tokens), program_key(sampling)
        # what the program service needs to compile this program at other shapes ahead (parallel/decode_shapes.py)
        statics = (n, stops, pkey, width, args[3].ndim)
        sp.shapes.generating(self.key(b, state.max_len, statics), int(np.count_nonzero(budget)))
        state, out = self._decode(params, state, rng, args, n, stops, pkey, np.int32(max_new_tokens), temperature,
                                  greedy)
        sp.shapes.drafted(self, params, state, statics, rng, temperature, greedy)
        return state, out

    def key(self, b: int, s: int, statics: tuple) -> tuple:
        """The program's key in a compile-ahead queue: batch, cache length, window and the call's static values
        (answer length bucket, stop tokens, sampling key, draft width bucket, row-id dimensions)."""
        return ("drafted", b, s, self.window) + statics

    def _decode_impl(self, params, state: SamplerState, rng, args, n: int, stop_tokens: tuple[int, ...],
                     sampling: SamplingConfig, max_new_tokens, temperature, greedy) -> tuple[SamplerState, Drafted]:
        sp = self.sampler
        sp._traces += 1
        budget, drafts, draft_lengths, row_ids = args
        with sp._ctx():
            model = sp._model(params)
            b, s, k = state.lengths.shape[0], state.cache.max_len, self.window
            limit = jnp.minimum(jnp.minimum(budget, max_new_tokens), s - state.lengths)
            stops = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)
            is_stop = lambda t: jnp.any(t[..., None] == stops, axis=-1) & bool(stop_tokens)  # noqa: E731
            keys = row_keys(rng, row_ids)
            draft_keys = jax.vmap(lambda key: jax.random.fold_in(key, DRAFT_STREAM))(keys)
            at = lambda x, i: jnp.take_along_axis(x, i[:, None, None] if x.ndim == 3 else i[:, None], 1)[:, 0]  # noqa

            def step(c, w: int):
                """Feed each active row's pending token and its next w draft tokens; accept, record, draw the next."""
                i, cache, lengths, h_last, tok, lp, toks, lps, num, stopped, done, proposed, accepted = c
                active = ~done
                room = limit - num - 1  # answer tokens left after the pending one
                offs = jnp.arange(w, dtype=jnp.int32)[None]
                cols = num[:, None] + 1 + offs  # the answer positions the draft tokens guess
                d = jnp.take_along_axis(drafts, jnp.minimum(cols, drafts.shape[1] - 1), axis=1)
                dl = jnp.clip(draft_lengths - num - 1, 0, w)
                dl = jnp.where(active & ~is_stop(tok), jnp.minimum(dl, jnp.maximum(room, 0)), 0)
                x = jnp.concatenate([tok[:, None], d], axis=1)  # b, w + 1
                idx = jnp.arange(w + 1, dtype=jnp.int32)[None]
                positions = jnp.where(active[:, None] & (idx <= dl[:, None]), lengths[:, None] + idx, s)
                h, cache = model.hidden(sp._constrain(x, ("batch", "length")), positions, cache)
                logits = model.logits(h)  # b, w + 1, v: after the pending token and after each draft token
                if w:
                    akeys = jax.vmap(lambda key: jax.random.fold_in(key, i))(draft_keys)
                    a, rej_tok, draft_lp, rej_lp = accept_drafts(akeys, logits[:, :w], d, dl, sampling,
                                                                 temperature, greedy)
                else:
                    a = jnp.zeros((b,), jnp.int32)
                    rej_tok, rej_lp, draft_lp = a, jnp.zeros((b,), jnp.float32), jnp.zeros((b, 0), jnp.float32)
                fed = jnp.concatenate([lp[:, None], draft_lp], axis=1)  # the log-probs of x
                valid = active[:, None] & (idx <= a[:, None])
                write = jnp.where(valid, num[:, None] + idx, toks.shape[1])  # out of range: dropped
                rows = jnp.broadcast_to(jnp.arange(b)[:, None], write.shape)
                toks = toks.at[rows, write].set(x, mode="drop")
                lps = lps.at[rows, write].set(fed, mode="drop")
                last = at(x, a)  # the last token fed and kept: the pending one, or the last accepted draft token
                hit = active & is_stop(last)
                add = jnp.where(active, a + 1, 0)
                num, lengths = num + add, lengths + add
                h_last = jnp.where(active[:, None], at(h, a), h_last)
                key = jax.vmap(lambda key: jax.random.fold_in(key, i + 1))(keys)  # plain decoding's draw i + 1
                new_tok, new_lp = sample_logits(key, at(logits, a), sampling, temperature, greedy)
                rejected = a < dl
                tok, lp = jnp.where(rejected, rej_tok, new_tok), jnp.where(rejected, rej_lp, new_lp)
                stopped = stopped | hit
                done = done | hit | (num >= limit)
                proposed, accepted = proposed + dl, accepted + jnp.where(active, a, 0)
                return i + 1, cache, lengths, h_last, tok, lp, toks, lps, num, stopped, done, proposed, accepted

            def body(c):
                num, done = c[8], c[10]
                any_draft = jnp.any(~done & (draft_lengths > num + 1))
                return jax.lax.cond(any_draft, lambda c: step(c, k), lambda c: step(c, 0), c)

            tok, lp = sample_logits(jax.vmap(lambda key: jax.random.fold_in(key, 0))(keys), state.next_logits,
                                    sampling, temperature, greedy)
            zeros = jnp.zeros((b,), jnp.int32)
            init = (jnp.int32(0), state.cache, state.lengths, jnp.zeros((b, sp.cfg.hidden_size), model.dtype), tok, lp,
                    sp._constrain(jnp.full((b, n), PAD_TOKEN, jnp.int32), ("batch", None)),
                    sp._constrain(jnp.zeros((b, n), jnp.float32), ("batch", None)), zeros, zeros.astype(bool),
                    limit <= 0, zeros, zeros)
            out = jax.lax.while_loop(lambda c: ~jnp.all(c[10]), body, init)
            steps, cache, lengths, h_last, _, _, toks, lps, num, stopped, _, proposed, accepted = out
            next_logits = jnp.where((num > 0)[:, None], model.logits(h_last[:, None])[:, 0], state.next_logits)
            state = sp._constrain_state(SamplerState(cache, lengths, next_logits))
            rows = lambda x: sp._constrain(x, ("batch",) + (None,) * (x.ndim - 1))  # noqa: E731
            generation = Generation(*map(rows, (toks, lps, num, stopped)))
            return state, Drafted(generation, rows(proposed), rows(accepted), steps)


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
    row's cache), the drafted decode, and the draft tokens it proposed and had accepted."""

    def __init__(self, index: DraftIndex, window: int | None = None):
        self.index = index
        self.window = window or index.width  # draft tokens verified a decode step
        self.proposed = self.accepted = self.steps = 0
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
        if not (lengths > 1).any():  # nothing to verify (a draft's first token is drawn plainly): plain decoding
            state, gen = sampler.generate(params, state, rng, max_new_tokens=max_new_tokens, budget=budgets,
                                          stop_tokens=stop_tokens, sampling=sampling, row_ids=row_ids, trim=False)
            zeros = np.zeros(len(budgets), np.int32)
            return state, lambda: self._answers(Drafted(gen, zeros, zeros, None), max_new_tokens)
        if sampler.drafted is None or sampler.drafted.window != self.window:  # kept with its other programs
            sampler.drafted = DraftDecoder(sampler, self.window)
        state, out = sampler.drafted(params, state, rng, drafts, lengths, max_new_tokens=max_new_tokens,
                                     budget=budgets, stop_tokens=stop_tokens, sampling=sampling, row_ids=row_ids)
        return state, lambda: self._answers(out, max_new_tokens)

    def _answers(self, out: Drafted, width: int) -> tuple[np.ndarray, ...]:
        """The answers on the host, trimmed to `width` columns; the rows' tails and the counters take them."""
        gen = out.generation
        tokens, logprobs, counts, stopped, proposed, accepted, steps = global_to_host(
            (gen.tokens, gen.logprobs, gen.num_tokens, gen.stopped, out.proposed, out.accepted, out.steps))
        self.proposed += int(proposed.sum())
        self.accepted += int(accepted.sum())
        self.steps += int(counts.max(initial=0) if steps is None else steps)  # plain decoding: the longest answer
        tokens, logprobs = tokens[:, :width], logprobs[:, :width]
        self.extended(tokens, counts)
        return tokens, logprobs, counts, stopped
