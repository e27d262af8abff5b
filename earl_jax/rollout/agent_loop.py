"""The multi-turn agent loop: N games in lock-step, one growing KV cache per game.

Each turn: every live game decodes its answer (one jitted decode loop for the whole batch), the answers
are parsed and stepped in their environments, and each game's next observation is appended to its own
cache row (`extend`, no re-prefill of the history). Finished games get a zero budget, so they stop
costing decode steps; the batch shrinks in work, not in shape (shapes stay bucketed and compiled once).

The result is a `Trajectories` batch ready for the experience stage: token ids, a loss mask on generated
tokens only, the sampler's log-probs, per-turn rewards at the last generated token of each turn, and
the context length of every turn (the numbers the Parallelism Selector reacts to).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np
import tokenizers
from jaxtyping import Bool, Float, Int

from earl_jax.envs.openspiel_env import OpenSpielTextEnv


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    max_turn_tokens: int = 4  # tokens the policy may generate per turn
    max_turns: int = 32  # agent turns per game, then truncated
    max_context: int = 2048  # tokens per episode (prompt + all turns), then truncated


class Policy(Protocol):
    """What the loop needs from a policy: a batch of growing contexts it can extend and decode from."""

    def reset(self, batch: int, max_len: int) -> None: ...

    def extend(self, new_tokens: Sequence[Sequence[int]]) -> None: ...

    def generate(self, budgets: np.ndarray, rng: jax.Array) -> list[tuple[list[int], list[float], bool]]:
        """Per row: (generated tokens incl. the stop token, their log-probs, stopped at a stop token)."""
        ...


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """What one `play_games` call measured: outcomes, context lengths (what the selector reacts to), timing."""

    win_rate: float
    draw_rate: float
    loss_rate: float
    invalid_rate: float  # games ended by an invalid answer
    context_len_mean: float  # final episode lengths
    context_len_max: int
    turn_context_len_mean: float  # context length when each turn's decoding started
    turns_mean: float
    truncated_rate: float
    generated_tokens: int
    tokens: int
    env_s: float  # host time stepping games, parsing and tokenizing
    rollout_s: float
    prompt_tokens: int  # widest first extend (the prompt)
    first_cache_len: int  # the cache the prompt was written into
    observation_tokens: int  # widest later extend (a turn's observation); 0 if none


@dataclasses.dataclass
class Trajectories:
    """A batch of finished episodes, right-padded to a common length T."""

    tokens: Int[np.ndarray, "n t"]
    loss_mask: Bool[np.ndarray, "n t"]  # tokens the policy generated (never prompt or observation)
    logprobs: Float[np.ndarray, "n t"]  # sampler log-prob of each generated token, 0 elsewhere
    rewards: Float[np.ndarray, "n t"]  # each turn's reward at its last generated token
    lengths: Int[np.ndarray, " n"]
    returns: Float[np.ndarray, " n"]
    num_turns: Int[np.ndarray, " n"]
    truncated: Bool[np.ndarray, " n"]  # hit max_turns or max_context before the game ended
    group_ids: Int[np.ndarray, " n"]
    winners: list[str | None]  # "agent" | "opponent" | "draw" | None (truncated)
    invalid: Bool[np.ndarray, " n"]  # ended by an invalid move
    turn_context_lens: list[list[int]]  # context length when each turn's decoding started
    stats: RolloutStats

    @property
    def num_games(self) -> int:
        return len(self.lengths)


def _outcome_stats(winners: Sequence[str | None], invalid: np.ndarray) -> dict[str, float]:
    n = max(len(winners), 1)
    return {
        "win_rate": sum(w == "agent" for w in winners) / n,
        "draw_rate": sum(w == "draw" for w in winners) / n,
        "loss_rate": sum(w == "opponent" for w in winners) / n,
        "invalid_rate": float(np.mean(invalid)) if len(invalid) else 0.0,
    }


def play_games(policy: Policy, envs: Sequence[OpenSpielTextEnv], tokenizer: tokenizers.Tokenizer,
               cfg: RolloutConfig, rng: jax.Array, seeds: Sequence[int], group_ids: Sequence[int] | None = None,
               bos_id: int | None = None, progress: Callable[[int, int], Any] | None = None) -> Trajectories:
    """Play one game per env to the end (or a budget) and return the episodes.

    `seeds[i]` resets env i: games of one GRPO group share a seed, so they start from the same
    position against the same opponent randomness.
    """
    n = len(envs)
    t_start = time.perf_counter()
    env_s = 0.0
    seq: list[list[int]] = [[] for _ in range(n)]
    mask: list[list[bool]] = [[] for _ in range(n)]
    logp: list[list[float]] = [[] for _ in range(n)]
    rew: list[list[float]] = [[] for _ in range(n)]
    winners: list[str | None] = [None] * n
    invalid = np.zeros(n, bool)
    truncated = np.zeros(n, bool)
    turns = np.zeros(n, np.int32)
    turn_ctx: list[list[int]] = [[] for _ in range(n)]
    live = np.ones(n, bool)

    def append(i: int, toks: Sequence[int], gen: bool, lps: Sequence[float] | None = None):
        seq[i].extend(toks)
        mask[i].extend([gen] * len(toks))
        logp[i].extend(lps if lps is not None else [0.0] * len(toks))
        rew[i].extend([0.0] * len(toks))

    t0 = time.perf_counter()
    first = [env.reset(seed=int(s))[0] for env, s in zip(envs, seeds)]
    env_s += time.perf_counter() - t0
    prefix = [bos_id] if bos_id is not None else []
    new_tokens = [prefix + tokenizer.encode(o).ids for o in first]
    for i, toks in enumerate(new_tokens):
        if len(toks) + 1 > cfg.max_context:
            raise ValueError(f"the first observation is {len(toks)} tokens: more than max_context={cfg.max_context}")
        append(i, toks, False)
    prompt_tokens = max(len(t) for t in new_tokens)
    first_cache_len = min(cfg.max_context, prompt_tokens + cfg.max_turn_tokens)
    observation_tokens = 0  # widest later extend: with the prompt's, what the selector's rollout memory estimate needs
    policy.reset(n, first_cache_len)
    policy.extend(new_tokens)

    for turn in range(cfg.max_turns):
        lens = np.array([len(s) for s in seq])
        budgets = np.where(live, np.minimum(cfg.max_turn_tokens, cfg.max_context - lens), 0)
        out_of_room = live & (budgets <= 0)
        truncated |= out_of_room
        live &= ~out_of_room
        if not live.any():
            break
        for i in np.flatnonzero(live):
            turn_ctx[i].append(int(lens[i]))
        generated = policy.generate(budgets.astype(np.int32), jax.random.fold_in(rng, turn))
        new_tokens = [[] for _ in range(n)]
        t0 = time.perf_counter()
        for i in np.flatnonzero(live):
            toks, lps, _ = generated[i]
            append(i, toks, True, lps)
            turns[i] += 1
            answer = tokenizer.decode(toks, skip_special_tokens=True)
            obs, reward, term, trunc, info = envs[i].step(answer)
            rew[i][-1] += reward  # the turn's reward sits on its last generated token
            if term or trunc:
                live[i] = False
                winners[i] = info.get("winner")
                invalid[i] = bool(info.get("invalid", False)) and term
                truncated[i] |= trunc and not term
                continue
            obs_ids = tokenizer.encode(obs).ids
            if len(seq[i]) + len(obs_ids) + 1 > cfg.max_context:  # no room to answer the next turn
                live[i] = False
                truncated[i] = True
                continue
            append(i, obs_ids, False)
            new_tokens[i] = obs_ids
        env_s += time.perf_counter() - t0
        if progress is not None:
            progress(turn + 1, int(live.sum()))
        if not live.any():
            break
        observation_tokens = max(observation_tokens, max(len(t) for t in new_tokens))
        policy.extend(new_tokens)
    truncated |= live  # still playing after max_turns

    lengths = np.array([len(s) for s in seq], np.int32)
    t_len = int(lengths.max())
    pad = lambda rows, dtype: np.array([r + [0] * (t_len - len(r)) for r in rows], dtype)  # noqa: E731
    rewards = pad(rew, np.float32)
    all_ctx = [c for row in turn_ctx for c in row] or [0]
    total_s = time.perf_counter() - t_start
    stats = RolloutStats(
        **_outcome_stats(winners, invalid),
        context_len_mean=float(np.mean(lengths)), context_len_max=int(np.max(lengths)),
        turn_context_len_mean=float(np.mean(all_ctx)), turns_mean=float(np.mean(turns)),
        truncated_rate=float(np.mean(truncated)), generated_tokens=int(sum(sum(m) for m in mask)),
        tokens=int(lengths.sum()), env_s=env_s, rollout_s=total_s, prompt_tokens=int(prompt_tokens),
        first_cache_len=int(first_cache_len), observation_tokens=int(observation_tokens))
    return Trajectories(
        tokens=pad(seq, np.int32), loss_mask=pad(mask, bool), logprobs=pad(logp, np.float32), rewards=rewards,
        lengths=lengths, returns=rewards.sum(1), num_turns=turns, truncated=truncated,
        group_ids=np.asarray(group_ids if group_ids is not None else np.arange(n), np.int32),
        winners=winners, invalid=invalid, turn_context_lens=turn_ctx, stats=stats)


class ScriptedPolicy:
    """A policy without a model: `answer(context_text) -> answer text`, for tests and baselines."""

    def __init__(self, answer: Callable[[str], str], tokenizer: tokenizers.Tokenizer, stop_id: int):
        self.answer, self.tokenizer, self.stop_id = answer, tokenizer, stop_id

    def reset(self, batch: int, max_len: int) -> None:
        self.context = [[] for _ in range(batch)]

    def extend(self, new_tokens):
        for row, toks in zip(self.context, new_tokens):
            row.extend(toks)

    def generate(self, budgets, rng):
        out = []
        for row, budget in zip(self.context, budgets):
            if budget <= 0:
                out.append(([], [], False))
                continue
            text = self.tokenizer.decode(row, skip_special_tokens=True)
            toks = (self.tokenizer.encode(self.answer(text), add_special_tokens=False).ids + [self.stop_id])[:budget]
            row.extend(toks)
            out.append((toks, [0.0] * len(toks), toks[-1] == self.stop_id))
        return out
