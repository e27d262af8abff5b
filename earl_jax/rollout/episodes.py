"""What a rollout produces: one turn's decoded answers (`Decoded`), what the loop's turn hook sees (`Turn`), the
episode buffers the agent loop fills (`_Episodes`), and the batch it hands to the experience stage (`Trajectories`,
with its `RolloutStats`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol

import jax
import numpy as np
from jaxtyping import Bool, Float, Int

from earl_jax.envs.outcomes import NO_WINNER, WINNERS


@dataclasses.dataclass(frozen=True)
class Decoded:
    """One turn's answers, per slot of the decode batch (host arrays)."""

    tokens: Int[np.ndarray, "b t"]  # slot r's answer is tokens[r, :counts[r]]
    logprobs: Float[np.ndarray, "b t"]
    counts: Int[np.ndarray, " b"]
    stopped: Bool[np.ndarray, " b"]
    scored: Bool[np.ndarray, "b t"] | None = None  # tokens the policy chose (None: all); a forced stop token is not
    choices: Int[np.ndarray, "b t"] | None = None  # legal-move bitmask of constrained tokens, 0 elsewhere
    moves: Int[np.ndarray, " b"] | None = None  # the action each slot's answer names, where known (no parsing)
    texts: list[str | None] | None = None  # what each slot's answer says, where known (a host policy's: no decoding)
    notes: dict[str, np.ndarray] | None = None  # a host policy's per-slot values for the turn hook

    def rows(self, slots: Int[np.ndarray, " k"]) -> "Decoded":
        """Slots `slots` only, in that order."""
        take = {f.name: getattr(self, f.name)[slots] for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}
        texts = None if self.texts is None else [self.texts[s] for s in slots.tolist()]
        notes = None if self.notes is None else {k: v[slots] for k, v in self.notes.items()}
        return dataclasses.replace(self, **take, texts=texts, notes=notes)


@dataclasses.dataclass(frozen=True)
class Turn:
    """What `play_games`' turn hook sees after each env step (after the reset: `answers`, `start`, `legal` None)."""

    games: Int[np.ndarray, " k"]
    step: Any  # the env's VectorStep for these games (rewards, ends, opponent moves, infos)
    answers: Decoded | None = None  # their answers, rows in the order of `games`
    start: Int[np.ndarray, " k"] | None = None  # where each answer begins in its game's tokens
    legal: Bool[np.ndarray, "k a"] | None = None  # the legal moves the answers were chosen among (where tracked)


class Policy(Protocol):
    """What the loop needs from a policy: a batch of slots with growing contexts to extend and decode from."""

    def reset(self, batch: int, max_len: int) -> None: ...

    def extend(self, tokens: Int[np.ndarray, "b t"], counts: Int[np.ndarray, " b"]) -> None:
        """Append slot r's tokens[r, :counts[r]] to its context (counts 0: unchanged)."""
        ...

    def generate(self, budgets: Int[np.ndarray, " b"], rng: jax.Array, row_ids: Int[np.ndarray, " b"],
                 legal: Bool[np.ndarray, "b a"] | None = None) -> Callable[[], Decoded]:
        """Start decoding up to budgets[r] tokens per slot (slot r draws from fold_in(rng, row_ids[r]); [b, 2] row
        ids (turn, id): from fold_in(fold_in(rng, turn), id), `sampling.row_keys`); returns a function that waits
        for the answers. Nothing else is called on the policy before it.
        `legal` (constrained moves, or a policy whose `reads_legal` is True): each slot's legal moves; the answer is
        one of them."""
        ...

    def reset_rows(self, rows: Int[np.ndarray, " k"]) -> None:
        """Empty slots `rows` in place (a pool of games: the next game's first observation is extended into them)."""
        ...

    def take_rows(self, rows: Int[np.ndarray, " k"], batch: int) -> None:
        """Keep slots `rows` (in that order) in a batch of `batch` slots."""
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
    env_s: float  # host time in the games: stepping, reading answers, tokenizing observations
    wait_s: float  # host time waiting for the device's answers
    rollout_s: float
    decode_rows: int  # decode-batch slots summed over turns (compaction lowers it)
    prompt_tokens: int  # widest first extend (the prompt)
    first_cache_len: int  # the cache the prompt was written into
    observation_tokens: int  # widest later extend (a turn's observation); 0 if none
    blunder_rate: float | None = None  # share of judged moves that gave an outcome away (env's blunder_penalty)
    judged: int = 0  # moves the env judged for blunders
    busy_rows: int = 0  # decode-batch slots holding a game that decodes, summed over decodes (/ decode_rows: occupancy)
    pool_occupancy: float | None = None  # a pool of games (PlayConfig.slots): busy / decode rows while games waited
    # KV cache positions summed over decodes: those holding a decoding game's tokens (its context and the turn's
    # budget) and those allocated (rows x the cache's length): what a paged cache would not hold (this process's)
    kv_used: int = 0
    kv_allocated: int = 0
    preempted: int = 0  # a paged cache's pool: games that gave their row back for want of pages (recomputed)
    # a rollout split by process (rollout/process_split.py): the gather of the trajectories, the part of it spent
    # waiting for the slowest process, and each process's own time for its games
    gather_s: float = 0.0
    gather_wait_s: float = 0.0
    process_rollout_s: tuple[float, ...] = ()
    answer_tokens: int = 0  # answer tokens this rollout decoded (what PlayConfig.token_budget counts)
    # drafts (--rollout.drafts, rollout/speculate.py): draft tokens proposed and accepted; None: drafts off
    draft_proposed: int | None = None
    draft_accepted: int | None = None


@dataclasses.dataclass
class Trajectories:
    """A batch of finished episodes, right-padded to a common length T."""

    tokens: Int[np.ndarray, "n t"]
    loss_mask: Bool[np.ndarray, "n t"]  # tokens the policy generated (never prompt or observation, nor a forced stop)
    logprobs: Float[np.ndarray, "n t"]  # sampler log-prob of each generated token, 0 elsewhere
    choices: Int[np.ndarray, "n t"]  # legal-move bitmask where a constrained move was drawn, 0 elsewhere
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
    # A rollout split by process whose token columns were not gathered (rollout/process_split.py): the five [n, t]
    # arrays above hold only the batch's rows `local_rows`; every per-row field holds the whole batch, `spans` too.
    local_rows: slice | None = None
    spans: Int[np.ndarray, " n"] | None = None  # packing.scored_spans of every row of the batch
    # A token budget (PlayConfig.token_budget): the games it stopped before their end (continued by a later call, as
    # `Carried`), and every game's legal moves then (where the loop tracked them)
    unfinished: Bool[np.ndarray, " n"] | None = None
    legal: Bool[np.ndarray, "n a"] | None = None
    # rows that hold an episode (None: all); a partial rollout's batch leaves the rows of the groups it carried empty
    played: Bool[np.ndarray, " n"] | None = None

    @property
    def num_games(self) -> int:
        return len(self.lengths)

    def rows(self, rows: Int[np.ndarray, " k"]) -> "Trajectories":
        """Rows `rows` only, in that order, with the batch's stats (a batch whose token columns are all here)."""
        if self.local_rows is not None:
            raise ValueError("Trajectories.rows: a rollout split by process holds only its own token columns")
        take = {f.name: v[rows] for f in dataclasses.fields(self)
                if isinstance(v := getattr(self, f.name), np.ndarray)}
        return dataclasses.replace(self, **take, winners=[self.winners[r] for r in rows.tolist()],
                                   turn_context_lens=[self.turn_context_lens[r] for r in rows.tolist()])


@dataclasses.dataclass(frozen=True)
class Carried:
    """Episodes an earlier `play_games` left unfinished at its token budget, with the other games of their groups,
    for the next call to continue in the same env rows: game games[k] starts from episodes.rows(k) as it stood
    (tokens, loss mask, log-probs, rewards, turns, outcome), its KV cache prefilled again from those tokens under the
    next call's policy. A game that had ended (`live` False) only waits for its group."""

    games: Int[np.ndarray, " c"]  # their rows in the next call's batch (their env rows)
    episodes: Trajectories  # c rows
    live: Bool[np.ndarray, " c"]
    legal: Bool[np.ndarray, "c a"] | None = None  # their legal moves (where the loop tracks them)


class _Episodes:
    """The episodes being written: per game its length, turns and outcome, and its tokens as the appends that made
    them (each a batch of rows at their own offsets), laid out in [n, T] arrays once, when the rollout asks.

    Writing every append straight into [n, width] buffers meant growing them (a copy of every buffer each time a
    game outgrew the width) or touching n x max_context of memory; growth and scatters were about a third of a
    2048-game rollout's host time (an instant policy on the 2-core CPU). Laid out once, at the longest game's
    width, the host time fell 13% at 2048 games and 5% at 512 (experiments/results/bench_host_rollout_cpu.json)."""

    FIELDS = (("tokens", np.int32), ("mask", bool), ("logp", np.float32), ("rewards", np.float32),
              ("choices", np.int32))

    def __init__(self, n: int, max_turns: int):
        self.n = n
        self._appends: list[tuple] = []  # (games, start offsets, ids, counts, mask source, logp, choices)
        self._rewards: list[tuple] = []  # (games, positions, values)
        self.length = np.zeros(n, np.int64)
        self.turns = np.zeros(n, np.int32)
        self.turn_ctx = np.full((n, max_turns), -1, np.int64)
        self.winner = np.full(n, NO_WINNER, np.int8)
        self.invalid = np.zeros(n, bool)
        self.truncated = np.zeros(n, bool)
        self.judged = self.blunders = 0  # moves the env judged (blunder_penalty), and those that gave an outcome away

    def append(self, games, ids, counts, generated: bool, logp=None, scored=None, choices=None) -> None:
        """Game games[k] gets ids[k, :counts[k]] after its current length; `scored` ([k, t]) narrows the loss
        mask of generated tokens to the policy's own choices. The arrays are kept, not copied: callers pass
        arrays they do not write to again."""
        counts = np.asarray(counts, np.int64)
        if not len(counts):
            return
        games = np.asarray(games)
        self._appends.append((games, self.length[games], ids, counts, generated if scored is None else scored,
                              logp, choices))
        self.length[games] += counts

    def tokens_of(self, games: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Games `games`' tokens so far as ([k, width] ids, counts): a preempted game's history, extended again
        when it gets a row back (a paged cache's pool, rollout/agent_loop.py)."""
        games = np.asarray(games, np.int64)
        counts = self.length[games]
        out = np.zeros((len(games), max(int(counts.max(initial=0)), 1)), np.int32)
        where = {g: k for k, g in enumerate(games.tolist())}
        for app_games, start, ids, app_counts, *_ in self._appends:
            for j in np.flatnonzero(np.isin(app_games, games)).tolist():
                k, c = where[int(app_games[j])], int(app_counts[j])
                out[k, start[j]:start[j] + c] = ids[j, :c]
        return out, counts

    def carry_in(self, games: np.ndarray, episodes: Trajectories) -> None:
        """Games `games` start as `episodes` stands (`Carried`): its rows are kept as one append, not copied."""
        counts = np.asarray(episodes.lengths, np.int64)
        self._appends.append((games, np.zeros(len(games), np.int64), episodes.tokens, counts, episodes.loss_mask,
                              episodes.logprobs, episodes.choices))
        r, c = np.nonzero(episodes.rewards)  # one entry per (game, position): `+=` stays exact
        self._rewards.append((games[r], c, episodes.rewards[r, c]))
        self.length[games], self.turns[games] = counts, episodes.num_turns
        for g, ctx in zip(games.tolist(), episodes.turn_context_lens):
            self.turn_ctx[g, :len(ctx)] = ctx
        self.winner[games] = [NO_WINNER if w is None else WINNERS.index(w) for w in episodes.winners]
        self.invalid[games], self.truncated[games] = episodes.invalid, episodes.truncated

    def finish(self, live: np.ndarray, games: np.ndarray, step) -> None:
        """Record the games `step` ended (a vector-env step of `games`): winner, forfeit, truncation; no longer live."""
        done = step.terminated | step.truncated
        if not done.any():
            return
        ended = games[done]
        live[ended] = False
        self.winner[ended] = step.winner[done]
        self.invalid[ended] = step.invalid[done] & step.terminated[done]
        self.truncated[ended] |= step.truncated[done] & ~step.terminated[done]

    def add_rewards(self, games, positions, values) -> None:
        """rewards[games[k], positions[k]] += values[k]; the games of one call are unique (a turn's)."""
        self._rewards.append((np.asarray(games), np.asarray(positions), np.asarray(values, np.float32)))

    def arrays(self) -> dict[str, np.ndarray]:
        """tokens, mask, logp, rewards, choices as [n, T] arrays (T: the longest game), zero past each game's end;
        built from the appends on every call (once per rollout)."""
        width = max(int(self.length.max(initial=0)), 1)
        out = {name: np.zeros((self.n, width), dtype) for name, dtype in self.FIELDS}
        flat = {name: a.reshape(-1) for name, a in out.items()}
        for games, start, ids, counts, mask, logp, choices in self._appends:
            at = (games * width + start)[:, None] + np.arange(ids.shape[1])
            # rows as wide as their counts (a turn's answers, most observations) need no boolean selection
            valid = None if counts.min() == ids.shape[1] else np.arange(ids.shape[1]) < counts[:, None]
            at = _select(at, valid)
            flat["tokens"][at] = _select(ids, valid)
            if np.ndim(mask) or mask:  # an observation's (all False) is already there
                flat["mask"][at] = mask if np.ndim(mask) == 0 else _select(mask, valid)
            if logp is not None:
                flat["logp"][at] = _select(logp, valid)
            if choices is not None:
                flat["choices"][at] = _select(choices, valid)
        for games, positions, values in self._rewards:  # unique games per call: `+=` does what np.add.at did
            flat["rewards"][games * width + positions] += values
        return out

    def trajectories(self, group_ids: Int[np.ndarray, " n"], started: float, unfinished: np.ndarray | None = None,
                     legal: np.ndarray | None = None, **measured) -> Trajectories:
        """The finished episodes as a batch for the experience stage. `started`: the rollout's perf_counter start;
        `unfinished`, `legal`: a token budget's (`Trajectories`); `measured`: the other `RolloutStats` fields the loop
        timed and counted."""
        a = self.arrays()
        stats = RolloutStats(
            **episode_stats(self.winner, self.invalid, self.length, self.turn_ctx, self.turns, self.truncated,
                            a["mask"]),
            rollout_s=time.perf_counter() - started, judged=self.judged,
            blunder_rate=self.blunders / self.judged if self.judged else None, **measured)
        rewards = a["rewards"]
        return Trajectories(
            tokens=a["tokens"], loss_mask=a["mask"], logprobs=a["logp"], choices=a["choices"], rewards=rewards,
            lengths=self.length.astype(np.int32), returns=rewards.sum(1), num_turns=self.turns,
            truncated=self.truncated, group_ids=np.asarray(group_ids, np.int32),
            winners=[None if w == NO_WINNER else WINNERS[w] for w in self.winner.tolist()], invalid=self.invalid,
            turn_context_lens=_turn_contexts(self.turn_ctx), stats=stats, unfinished=unfinished, legal=legal)


def _turn_contexts(turn_ctx: np.ndarray) -> list[list[int]]:
    """Each row's turn contexts: its leading entries >= 0 (a game's turns are a prefix; -1 after). One tolist and
    slices: a boolean selection per row was ~1.5 ms of a 512-game host-only rollout."""
    counts = (turn_ctx >= 0).sum(1).tolist()
    return [row[:k] for row, k in zip(turn_ctx.tolist(), counts)]


def _select(a: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
    """a[valid], or all of `a` when valid is None."""
    return a if valid is None else a[valid]


def episode_stats(winner: np.ndarray, invalid: np.ndarray, lengths: np.ndarray, turn_ctx: np.ndarray,
                  turns: np.ndarray, truncated: np.ndarray, loss_mask: np.ndarray) -> dict[str, Any]:
    """The `RolloutStats` fields read off a batch's arrays: outcomes (winner codes index WINNERS), lengths, turns
    and token counts. `turn_ctx[i, t]`: the context when game i's turn t started, -1 past its last turn.
    `loss_mask` is only summed: per-row counts of generated tokens do as well."""
    n = max(len(winner), 1)
    ctx = turn_ctx[turn_ctx >= 0]
    return {"win_rate": float(np.sum(winner == 0)) / n, "loss_rate": float(np.sum(winner == 1)) / n,
            "draw_rate": float(np.sum(winner == 2)) / n,
            "invalid_rate": float(np.mean(invalid)) if len(invalid) else 0.0,
            "context_len_mean": float(lengths.mean()), "context_len_max": int(lengths.max()),
            "turn_context_len_mean": float(ctx.mean()) if len(ctx) else 0.0, "turns_mean": float(turns.mean()),
            "truncated_rate": float(truncated.mean()), "generated_tokens": int(loss_mask.sum()),
            "tokens": int(lengths.sum())}
