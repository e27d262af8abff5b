"""The multi-turn agent loop: N games in lock-step, one growing KV cache row per live game.

Each turn: every live game decodes its answer (one jitted decode loop for its batch), the answers are
read and stepped in a vector environment (`envs.vector`: every game of the batch in one call), and each
game's next observation is appended to its own cache row (`extend`, no re-prefill of the history).

What keeps the host and the padding off the critical path:
- batched game rules, a batched parser and table-driven tokenization (`envs.vector`), and numpy
  buffers for the episodes (no per-game Python lists);
- finished games leave the decode batch: when half of a batch's rows have finished, the live rows are
  gathered into the next smaller batch bucket (`min_batch` x a power of two), so compiled programs stay
  bounded while the tail of long games stops paying for finished rows;
- pipelining: the games are split into `pipeline_groups` groups that take turns on the device; the host
  steps one group's games while the device decodes another's. Each game samples from its own key
  (fold_in(fold_in(rng, turn), game id)), so what a game plays does not depend on its group, its row,
  compaction or the schedule: `overlap=False` (each decode waited for at once) gives identical games.
- a pool of games (`slots` S < N, continuous batching): only S games hold a decode row at a time. When a game
  ends, its row is emptied in place (`reset_rows`: its length 0, nothing reallocated) and the next waiting game's
  first observation is extended into it with the other rows' observations, so the decode batch stays full until
  no game waits; then the tail compacts as above. Games start at different times, so each row draws from
  fold_in(fold_in(rng, the game's own turn), game id) ((turn, id) row ids): the keys of the lock-step loop, and
  the same games.
- a paged KV cache (a policy whose `paged` is True, models/paged_cache.py): always the pool's path; a waiting game
  takes a row only while every row's next extend and answer fit the free pages, and when the going games' next
  positions do not, the game that got its row last gives it back and waits again, its history its first extend when
  it is back (recompute preemption; its keys by its own turn: the same games).
- a token budget (`token_budget`, partial rollouts): once the answers reach it and some GRPO group has ended, no game
  starts another turn; the games still playing are returned unfinished (`Trajectories.unfinished`), and a later call
  continues them (`carried`: `Carried`) in the same env rows, first in its pool, each game's cache prefilled again
  from its tokens and its keys by its own turn, as a pool's.

The policy may be the model (rollout/policy.py) or a policy without one (rollout/host_policies.py: random legal moves,
a text task's own answers, the expert games' expert), and a turn hook sees every step (`Turn`: the games, their
answers and where they begin, their legal moves, the env's step), so this one loop writes the RL rollout, the format
warm-up's games and the expert games alike.

The result is a `Trajectories` batch ready for the experience stage: token ids, a loss mask on generated
tokens only, the sampler's log-probs, per-turn rewards at the last generated token of each turn, and the
context length of every turn (the numbers the Parallelism Selector reacts to).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any, Callable, Sequence

import jax
import numpy as np
import tokenizers

from earl_jax.envs.vector.codec import ObservationCodec
from earl_jax.models.paged_cache import PagesExhausted
from earl_jax.rollout.episodes import (  # noqa: F401
    Carried,
    Decoded,
    Policy,
    RolloutStats,
    Trajectories,
    Turn,
    _Episodes,
    episode_stats,
)


@dataclasses.dataclass(frozen=True)
class PlayConfig:
    max_turn_tokens: int = 4  # tokens the policy may generate per turn
    max_turns: int = 32  # agent turns per game, then truncated
    max_context: int = 2048  # tokens per episode (prompt + all turns), then truncated
    pipeline_groups: int = 1  # groups of games that take turns on the device (2: host work overlaps decoding)
    overlap: bool = True  # False: wait for each decode at once (the reference schedule; same games)
    compact: bool = True  # finished games leave the decode batch
    min_batch: int = 1  # decode batches are multiples of this (the rollout mesh's data shards)
    constrain_moves: bool = False  # the policy picks among the legal moves' tokens (rollout/moves.py)
    # decode rows over all pipeline groups (a pool of games, continuous batching): 0, or >= the games, gives every game
    # a row from the start; fewer: a finished game's row takes the next waiting game (module docstring)
    slots: int = 0
    whole_answers: bool = False  # an answer its budget cut ends its game, unwritten (the format warm-up's games)
    token_budget: int = 0  # answer tokens after which no game starts a turn once a group has ended (0: no budget)
    budget_min_ended: float = 0.0  # ... once this share of the groups has ended (0: one group)

    def __post_init__(self):
        if self.pipeline_groups < 1 or self.min_batch < 1:
            raise ValueError(f"PlayConfig: pipeline_groups and min_batch must be >= 1, got {self}")
        if self.slots < 0 or self.token_budget < 0 or not 0 <= self.budget_min_ended <= 1:
            raise ValueError(f"PlayConfig: slots and token_budget must be >= 0, budget_min_ended in [0, 1], got {self}")


@dataclasses.dataclass
class _Group:
    """Games that decode together: slot r of `policy` holds game games[r] (-1: an empty slot)."""

    policy: Policy
    games: np.ndarray
    first_batch: int = 0
    turn: int = 0
    fetch: Callable[[], Decoded] | None = None
    budgets: np.ndarray | None = None
    turns: np.ndarray | None = None  # a pool's decode: each slot's game's turn (the slot's key)


@partial(jax.jit, static_argnums=1)
def _turn_keys(rng: jax.Array, turns: int) -> tuple[jax.Array, ...]:
    """fold_in(rng, t) for t < turns in one program: an eager fold_in per turn cost ~0.35 ms of host time each (a
    2-core CPU, ~7 ms of a 512-game host-only rollout's ~33 ms)."""
    return tuple(jax.random.fold_in(rng, t) for t in range(turns))


def play_games(policy: Policy | Sequence[Policy], env: Any, tokenizer: tokenizers.Tokenizer, cfg: PlayConfig,
               rng: jax.Array | None, seeds: Sequence[int], group_ids: Sequence[int] | None = None,
               bos_id: int | None = None, codec: ObservationCodec | None = None, game_offset: int = 0,
               interrupt: Callable[[], None] | None = None, hook: Callable[[Turn], None] | None = None,
               carried: Carried | None = None) -> Trajectories:
    """Play one game per row of the vector env `env` (`envs.vector.make_vector_env`) to its end (or a budget).

    `seeds[i]` resets game i: games of one GRPO group share a seed, so they start from the same position
    against the same opponent randomness. `policy`: one policy, or one per pipeline group (games are split
    in contiguous, equal parts; `cfg.pipeline_groups` is then len(policy)). `game_offset`: the id of game 0 in a
    larger batch whose other games are played elsewhere (rollout/process_split.py): a game samples by its id.
    `interrupt()` runs before every turn's host step: it raises to abandon the rollout (a stop signal).
    `rng` None: policies that draw no JAX key (host policies). `hook(turn)` runs after the reset and after every
    env step (`Turn`). `carried`: games an earlier call stopped at its token budget, in their rows of `env` (not
    reset; `seeds` and `group_ids` as the earlier call had them); `group_ids` name the groups the budget waits for."""
    policies = [policy] if not isinstance(policy, (list, tuple)) else list(policy)
    n = len(seeds)
    if n != env.num_games:
        raise ValueError(f"{n} seeds for an env of {env.num_games} games")
    if n % len(policies):
        raise ValueError(f"{n} games do not split into {len(policies)} pipeline groups")
    # carried games continue at their own turns: a pool's path, with a row for every game unless slots are fewer; a
    # paged cache's rows too (a game may be preempted, and waits for a row again)
    paged = any(getattr(p, "paged", False) for p in policies)
    pool = 0 < cfg.slots < n or carried is not None or paged
    pool_size = cfg.slots if 0 < cfg.slots < n else n
    if pool and (pool_size % len(policies) or (pool_size // len(policies)) % cfg.min_batch):
        raise ValueError(f"slots={pool_size} do not split into {len(policies)} pipeline groups of a multiple of "
                         f"min_batch={cfg.min_batch} rows")
    codec = codec or ObservationCodec(tokenizer)
    t_start = time.perf_counter()
    env_s = wait_s = 0.0
    decode_rows = 0
    live = np.ones(n, bool)
    legal = None  # constrained moves: every game's legal moves now

    t0 = time.perf_counter()
    new_games = np.arange(n) if carried is None else np.setdiff1d(np.arange(n), carried.games)
    # a carried game is not reset: its env row goes on (other envs take no rows=)
    first = (env.reset(list(map(int, seeds))) if carried is None else
             env.reset([int(seeds[i]) for i in new_games.tolist()], rows=new_games))
    ids, counts = codec.encode_padded(first.obs)
    if bos_id is not None:
        ids, counts = np.concatenate([np.full((len(new_games), 1), bos_id, np.int32), ids], 1), counts + 1
    env_s += time.perf_counter() - t0
    if counts.max(initial=0) + 1 > cfg.max_context:
        raise ValueError(f"the first observation is {int(counts.max())} tokens: "
                         f"more than max_context={cfg.max_context}")
    ep = _Episodes(n, cfg.max_turns)
    ep.append(new_games, ids, counts, False)
    ep.finish(live, new_games, first)  # games over at reset (possible only in odd games)
    if hook is not None:
        hook(Turn(new_games, first))
    if cfg.constrain_moves or any(getattr(p, "reads_legal", False) for p in policies):
        if getattr(env, "num_actions", None) is None:
            raise ValueError("constrained moves need an env that knows its number of actions (env.num_actions)")
        legal = _legal_moves(first, env.num_actions)
    # a pool's games without a row, as a stack (the next last): carried ones first, their first extend their history
    waiting: list[int] = np.flatnonzero(live)[::-1].tolist() if pool else []
    if carried is not None:
        ids, counts, legal = _carry_in(ep, live, carried, new_games, ids, counts, legal)
        waiting = np.concatenate([carried.games[carried.live], new_games[live[new_games]]])[::-1].tolist()
    prompt_tokens = int(counts.max())
    first_cache_len = min(cfg.max_context, prompt_tokens + cfg.max_turn_tokens)
    observation_tokens = 0  # widest later extend: with the prompt's, what the selector's rollout memory estimate needs

    busy_rows = pool_rows = pool_busy = 0  # rows decoding a game; a pool's decode rows and busy rows while games wait
    kv_used = kv_allocated = 0  # cache positions a decode's games need and those its cache holds (rows x length)
    answer_tokens, stopped = 0, False  # answer tokens so far; whether the token budget ended the rollout
    groups = []
    first_ids, first_counts = ids, counts  # every game's first observation (a pool extends it when the game starts)
    resume = np.zeros(n, bool)  # preempted games (paged cache): their history is their first extend when back
    admitted = np.zeros(n, np.int64)  # when each game last got a row: the last admitted is preempted first
    admissions = preempted = 0
    turn_keys: tuple[jax.Array, ...] = ()

    def turn_key(turn: int) -> jax.Array | None:
        """fold_in(rng, turn): every turn's key from one device call, on the first draw (generate runs only for
        turns < max_turns)."""
        nonlocal turn_keys
        if rng is None:
            return None
        if not turn_keys:
            turn_keys = _turn_keys(rng, cfg.max_turns)
        return turn_keys[turn]

    def stop() -> bool:
        """Whether the token budget ends the rollout: the answers reached it and some group (at least
        `budget_min_ended` of them) has ended."""
        nonlocal stopped
        if not stopped and cfg.token_budget and answer_tokens >= cfg.token_budget:
            group_of = np.unique(np.arange(n) if group_ids is None else group_ids, return_inverse=True)[1]
            ended = np.bincount(group_of.reshape(-1), weights=live) == 0
            stopped = bool(ended.any() and ended.mean() >= cfg.budget_min_ended)
        return stopped

    def first_extends(rows: int, free: np.ndarray, fresh: np.ndarray, width: int = 0) -> tuple[np.ndarray, ...]:
        """[rows, t] ids and counts with each fresh game's first extend in its slot: its first observation, or a
        preempted game's history."""
        back = resume[fresh]
        hist = ep.tokens_of(fresh[back]) if back.any() else (np.zeros((0, 1), np.int32), np.zeros(0, np.int64))
        resume[fresh] = False
        width = max(width, first_ids.shape[1] if len(fresh) else 0, hist[0].shape[1] if back.any() else 0)
        new, new_counts = np.zeros((rows, width), np.int32), np.zeros(rows, np.int64)
        new_rows, old = free[~back], fresh[~back]
        if len(old):
            new[new_rows, :first_ids.shape[1]], new_counts[new_rows] = first_ids[old], first_counts[old]
        if back.any():
            new[free[back], :hist[0].shape[1]], new_counts[free[back]] = hist
        return new, new_counts

    def admit(g: _Group, extra: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The next waiting games into the group's empty slots: (the slots, their games). A paged cache takes a game
        only while every row's next extend (`extra`, and the game's own) and next answer fit its free pages."""
        nonlocal admissions
        free = np.flatnonzero(g.games < 0)[:0 if stop() else len(waiting)]
        if paged and len(free):
            need = extra + np.where((g.games >= 0), cfg.max_turn_tokens, 0)
            for k, slot in enumerate(free.tolist()):
                game = waiting[-1 - k]
                need[slot] = (ep.length[game] if resume[game] else first_counts[game]) + cfg.max_turn_tokens
                if (g.games >= 0).any() or k:  # one game alone always gets a row (a too-small pool then says so)
                    if g.policy.page_shortfall(need):
                        free = free[:k]
                        break
        fresh = np.array([waiting.pop() for _ in range(len(free))], np.int64)
        g.games[free] = fresh
        admitted[fresh] = admissions + np.arange(len(fresh))
        admissions += len(fresh)
        return free, fresh

    def preempt(g: _Group, extra: np.ndarray, decode: bool) -> np.ndarray:
        """A paged cache: while the group's rows cannot add extra[r] positions each (an extend's tokens, or with
        `decode` an answer's budget), the game that got its row last leaves it and waits again, its pages freed and
        its history extended again when it is back (recompute preemption, as vLLM's). The slots emptied."""
        nonlocal preempted
        out = []
        while paged and g.policy.page_shortfall(extra, decode):
            held = np.flatnonzero(g.games >= 0)
            if len(held) <= 1:
                raise PagesExhausted(f"one game's next {int(extra.max())} positions do not fit the KV cache's pages: "
                                     "raise --rollout.kv-pages (or lower --rollout.max-context)")
            slot = int(held[np.argmax(admitted[g.games[held]])])
            game = int(g.games[slot])
            g.policy.reset_rows(np.array([slot]))
            g.games[slot], extra[slot] = -1, 0
            waiting.append(game)
            resume[game] = True
            preempted += 1
            out.append(slot)
        return np.array(out, np.int64)

    def issue(g: _Group) -> None:
        """Start the group's next decode, or retire it when none of its games can go on (or the budget is spent)."""
        nonlocal decode_rows, wait_s, busy_rows, pool_rows, pool_busy, kv_used, kv_allocated
        slots = np.flatnonzero(g.games >= 0)
        games = g.games[slots]
        going = live[games]
        if pool:  # each game at its own turn (those at max_turns left their rows in `advance`)
            turns = ep.turns[games]
            ep.truncated[games[going & (turns >= cfg.max_turns)]] = True
            live[games[turns >= cfg.max_turns]] = False
            going &= turns < cfg.max_turns
        elif g.turn >= cfg.max_turns:
            ep.truncated[games[going]] = True
            live[games] = False
            going[:] = False
        room = cfg.max_context - ep.length[games]
        out_of_room = going & (room <= 0)
        ep.truncated[games[out_of_room]] = True
        live[games[out_of_room]] = False
        going &= ~out_of_room
        if not going.any() or stop():
            g.fetch = None
            return
        budgets = np.zeros(len(g.games), np.int32)
        budgets[slots[going]] = np.minimum(cfg.max_turn_tokens, room[going])
        if paged and len(gone := preempt(g, budgets.astype(np.int64), decode=True)):
            budgets[gone] = 0
            going &= ~np.isin(slots, gone)
        row_ids = np.where(g.games >= 0, g.games + game_offset, 0).astype(np.int32)
        if pool:
            ep.turn_ctx[games[going], turns[going]] = ep.length[games[going]]
            g.turns = np.zeros(len(g.games), np.int32)
            g.turns[slots] = turns
            row_ids, key = np.stack([g.turns, row_ids], 1), rng  # (turn, id) rows: fold_in(fold_in(rng, turn), id)
            if waiting:
                pool_rows, pool_busy = pool_rows + len(g.games), pool_busy + int(going.sum())
        else:
            ep.turn_ctx[games[going], g.turn] = ep.length[games[going]]
            key = turn_key(g.turn)
        busy_rows += int(going.sum())
        g.budgets = budgets
        kw = {}
        if legal is not None:
            kw["legal"] = np.zeros((len(g.games), legal.shape[1]), bool)
            kw["legal"][slots[going]] = legal[games[going]]
        t0 = time.perf_counter()  # a GPU decode loop may hold the launching thread until it ends: that is waiting
        g.fetch = g.policy.generate(budgets, key, row_ids, **kw)
        decode_rows += len(g.games)
        if (shape := getattr(g.policy, "cache_shape", None)) is not None:  # a host policy holds no cache
            kv_allocated += getattr(g.policy, "kv_positions", shape[0] * shape[1])
            kv_used += int(np.minimum(ep.length[games[going]] + budgets[slots[going]], shape[1]).sum())
        if not cfg.overlap:  # the reference schedule: nothing else runs while this group decodes
            g.fetch = _ready(g.fetch())
        wait_s += time.perf_counter() - t0

    def answer(g: _Group, out: Decoded, slots: np.ndarray) -> tuple[np.ndarray, ...]:
        """Write the answers of the group's `slots`, step their games: (the games that go on, their slots, their
        next observations' ids and counts)."""
        nonlocal env_s, answer_tokens
        games = g.games[slots]
        answer_tokens += int(out.counts[slots].sum())
        scored = None if out.scored is None else out.scored[slots]
        start = ep.length[games]
        last = start + _last_scored(out.counts[slots], scored)  # the turn's reward goes here
        ep.append(games, out.tokens[slots], out.counts[slots], True, out.logprobs[slots], scored,
                  None if out.choices is None else out.choices[slots])
        ep.turns[games] += 1
        chosen_among = legal[games] if hook is not None and legal is not None else None  # before the step
        t0 = time.perf_counter()
        if getattr(env, "accepts_moves", False):
            moves = (out.moves[slots] if out.moves is not None  # a constrained or host answer names its move
                     else codec.padded_answers_to_moves(out.tokens[slots], out.counts[slots]))
            step = env.step(games, moves=moves)
        else:
            kw = {"stopped": out.stopped[slots]} if getattr(env, "takes_stopped", False) else {}
            texts = ([out.texts[s] for s in slots.tolist()] if out.texts is not None else
                     codec.decode([row[:c] for row, c in zip(out.tokens[slots].tolist(), out.counts[slots].tolist())]))
            step = env.step(games, texts, **kw)
        ep.add_rewards(games, last, step.reward)  # the turn's reward at its last choice
        if getattr(step, "blunder", None) is not None:
            ep.judged += int(np.sum(step.blunder >= 0))
            ep.blunders += int(np.sum(step.blunder > 0))
        done = step.terminated | step.truncated
        ep.finish(live, games, step)
        if legal is not None:
            legal[games] = _legal_moves(step, legal.shape[1])
        going = ~done
        ids, counts = codec.encode_step(step, going) if going.any() else (np.zeros((0, 0), np.int32),
                                                                          np.zeros(0, np.int64))
        env_s += time.perf_counter() - t0
        if hook is not None:
            hook(Turn(games, step, out.rows(slots), start, chosen_among))
        return games[going], slots[going], ids, counts

    def advance(g: _Group, out: Decoded) -> None:
        """Write the group's answers, step its games, extend the survivors' caches, maybe compact."""
        nonlocal observation_tokens
        slots = np.flatnonzero(g.budgets > 0)
        if cfg.whole_answers and not out.stopped[slots].all():  # a cut answer ends its game, unwritten
            cut = g.games[slots[~out.stopped[slots]]]
            ep.truncated[cut] = True
            live[cut] = False
            slots = slots[out.stopped[slots]]
        cont_games, cont_slots, ids, counts = answer(g, out, slots) if len(slots) else _NOTHING
        no_room = ep.length[cont_games] + counts + 1 > cfg.max_context  # no room to answer the next turn
        ep.truncated[cont_games[no_room]] = True
        live[cont_games[no_room]] = False
        keep = ~no_room
        if pool:
            _refill(g, cont_games[keep], cont_slots[keep], ids[keep], counts[keep])
        elif keep.any():
            if not keep.all():  # the common case (room for every game) copies no rows
                cont_games, cont_slots, ids, counts = cont_games[keep], cont_slots[keep], ids[keep], counts[keep]
            ep.append(cont_games, ids, counts, False)
            observation_tokens = max(observation_tokens, int(counts.max()))
            new = np.zeros((len(g.games), ids.shape[1]), np.int32)
            new_counts = np.zeros(len(g.games), np.int32)
            new[cont_slots], new_counts[cont_slots] = ids, counts
            if not stop():  # no game decodes again: a cache extended now would not be read
                g.policy.extend(new, new_counts)
        g.turn += 1
        if cfg.compact and not (pool and waiting):  # a pool's rows are refilled while games wait
            _compact(g, live, cfg.min_batch)

    def _refill(g: _Group, cont_games, cont_slots, obs, obs_counts) -> None:
        """A pool's extend: the going games' observations (those at max_turns leave: truncated, as the lock-step
        loop truncates them before their next decode), and the next waiting games' first observations in the rows
        of games that ended (emptied in place)."""
        nonlocal observation_tokens
        if len(cont_games):
            ep.append(cont_games, obs, obs_counts, False)
            observation_tokens = max(observation_tokens, int(obs_counts.max()))
        over = ep.turns[cont_games] >= cfg.max_turns
        ep.truncated[cont_games[over]] = True
        live[cont_games[over]] = False
        cont_slots, obs, obs_counts = cont_slots[~over], obs[~over], obs_counts[~over]
        ended = np.flatnonzero((g.games >= 0) & ~live[np.maximum(g.games, 0)])
        if paged:  # an ended game's pages go back at once, and the going games' observations may preempt one
            if len(ended):
                g.games[ended] = -1
                g.policy.reset_rows(ended)
            extra = np.zeros(len(g.games), np.int64)
            extra[cont_slots] = obs_counts
            if len(gone := preempt(g, extra, decode=False)):
                keep = ~np.isin(cont_slots, gone)
                cont_slots, obs, obs_counts = cont_slots[keep], obs[keep], obs_counts[keep]
            free, fresh = admit(g, extra)
        else:  # the first empty or ended slots take the next waiting games
            free = g.games < 0
            free[ended] = True
            g.games[np.flatnonzero(free)[:len(waiting)]] = -1
            free, fresh = admit(g, np.zeros(len(g.games), np.int64))
            if len(free):
                g.policy.reset_rows(free)
        if (not len(cont_slots) and not len(free)) or stop():
            return
        new, new_counts = first_extends(len(g.games), free, fresh, obs.shape[1] if len(cont_slots) else 0)
        new[cont_slots, :obs.shape[1]], new_counts[cont_slots] = obs, obs_counts
        g.policy.extend(new, new_counts)

    if not pool:
        size = n // len(policies)
        for k, pol in enumerate(policies):
            games = np.arange(k * size, (k + 1) * size)
            pol.reset(size, first_cache_len)
            pol.extend(ids[games], counts[games])
            groups.append(_Group(pol, games, first_batch=len(games)))
    else:  # each group's rows take the next waiting games (not those over at reset): the queue is shared
        size = pool_size // len(policies)
        for pol in policies:
            pol.reset(size, first_cache_len)
            groups.append(g := _Group(pol, np.full(size, -1, np.int64), first_batch=size))
            free, fresh = admit(g, np.zeros(size, np.int64))
            new, new_counts = first_extends(size, free, fresh)
            pol.extend(new, new_counts)

    for g in groups:
        issue(g)
    while any(g.fetch is not None for g in groups):
        if interrupt is not None:
            interrupt()
        for g in groups:
            if g.fetch is None:
                continue
            t0 = time.perf_counter()
            out = g.fetch()
            wait_s += time.perf_counter() - t0
            advance(g, out)
            issue(g)
    if not stopped:
        ep.truncated |= live  # still playing after max_turns

    return ep.trajectories(
        np.arange(n) if group_ids is None else group_ids, t_start, env_s=env_s, wait_s=wait_s,
        decode_rows=decode_rows, prompt_tokens=prompt_tokens, first_cache_len=first_cache_len,
        observation_tokens=observation_tokens, busy_rows=busy_rows,
        pool_occupancy=pool_busy / pool_rows if pool_rows else None, answer_tokens=answer_tokens,
        kv_used=kv_used, kv_allocated=kv_allocated, preempted=preempted,
        unfinished=None if not cfg.token_budget else live.copy() if stopped else np.zeros(n, bool),
        legal=legal if cfg.token_budget else None)


def _carry_in(ep: _Episodes, live: np.ndarray, carried: Carried, fresh: np.ndarray, ids: np.ndarray,
              counts: np.ndarray, legal: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The carried games written into `ep` and `live`; every game's first extend ([n, t] ids and counts: a fresh game's
    first observation, a carried one's tokens so far) and legal moves."""
    n, hist = ep.n, carried.episodes
    ep.carry_in(carried.games, hist)
    live[carried.games] = carried.live
    width = max(ids.shape[1], int(hist.lengths.max(initial=0)))
    all_ids, all_counts = np.zeros((n, width), np.int32), np.zeros(n, np.int64)
    all_ids[fresh, :ids.shape[1]], all_counts[fresh] = ids, counts
    w = min(width, hist.tokens.shape[1])
    all_ids[carried.games, :w], all_counts[carried.games] = hist.tokens[:, :w], hist.lengths
    if legal is None:
        return all_ids, all_counts, None
    if carried.legal is None:
        raise ValueError("play_games: carried games need their legal moves (Carried.legal) for this policy")
    all_legal = np.zeros((n, legal.shape[1]), bool)
    all_legal[fresh], all_legal[carried.games] = legal, carried.legal
    return all_ids, all_counts, all_legal


def _last_scored(counts: np.ndarray, scored: np.ndarray | None) -> np.ndarray:
    """Offset of each row's last token the policy chose (its last token when all are, or none is)."""
    counts = np.asarray(counts, np.int64)
    if scored is None:
        return counts - 1
    valid = scored & (np.arange(scored.shape[1])[None, :] < counts[:, None])
    return np.where(valid.any(1), scored.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1), counts - 1)


def _legal_moves(step, num_actions: int) -> np.ndarray:
    """The agent's legal moves per game of a vector-env step (`VectorStep.legal`, else from its info dicts)."""
    if step.legal is not None:
        return np.array(step.legal, bool)
    infos = step.infos()
    out = np.zeros((len(infos), num_actions), bool)
    for k, info in enumerate(infos):
        out[k, info.get("legal_actions", [])] = True
    return out


_NOTHING = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0), np.int32), np.zeros(0, np.int64))


def _ready(out: Decoded) -> Callable[[], Decoded]:
    return lambda: out


COMPACT_FACTOR = 4  # a batch shrinks by 4x at a time...
COMPACT_LEVELS = 2  # ...at most twice (B -> B/4 -> B/16): each level compiles its own decode / extend programs


def _compact(g: _Group, live: np.ndarray, min_batch: int) -> None:
    """Gather the live games into a 4x smaller batch once three quarters of the batch has finished. Decode
    programs are compiled per batch size, so the sizes are few: B, B/4, B/16 (B the group's first batch)."""
    slots = np.flatnonzero((g.games >= 0) & live[np.maximum(g.games, 0)])
    batch = len(g.games)
    floor = max(min_batch, g.first_batch // COMPACT_FACTOR ** COMPACT_LEVELS)
    target = batch // COMPACT_FACTOR
    if not len(slots) or len(slots) > target or target < floor or target % min_batch:
        return
    g.policy.take_rows(slots, target)
    games = np.full(target, -1, np.int64)
    games[:len(slots)] = g.games[slots]
    g.games = games
