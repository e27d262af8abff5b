"""Partial rollouts (`--rollout.token-budget N`): an iteration's rollout ends at a token budget, the groups whose games
all ended train, and the others are carried whole into the next iteration's rollout.

    iteration k   the pool: the carried groups in their own slots (their env rows, not reset), first to get decode
                  rows, each game's KV cache prefilled again from its tokens under version k's weights; new groups in
                  the other slots, with iteration k's seeds of those slots
                  played until the answers reach N tokens and some group has ended (rollout/agent_loop.py)
    the batch     the groups whose games all ended, first; the rows of the others left empty
    carried       the other groups, whole: their tokens, sampler log-probs, versions and env rows

A group's baseline compares its games only once all have ended, so a group is never split between batches: a game
that ended waits for the rest of its group. The batch keeps its B x G rows, the carried groups' rows empty (no scored
token: no estimator, loss or metric counts them), so the plan, the micro-batches and every program keep their shapes;
the trained rows come first, so a PPO mini-batch is filled with them before any empty row, and a mini-batch of
empty rows makes no update (rl/stages/train_stage.py).

Each token keeps the version of the weights that sampled it (`Sampled.versions`; rl/stages/staleness.py), a carried
episode's
earlier tokens their older one, and its sampler log-prob: `--loss.policy-loss decoupled_ppo` weighs each token by
proximal / behaviour with that log-prob as the behaviour policy; any other loss is warned about once.

With rollouts ahead (`--rollout.max-staleness K`, rl/loop/overlap.py) its one background thread plays the batches in
step order, each carrying into the next, with the weights of the batch's version (step - K): the bound holds for the
tokens of the rollout that finishes a batch, and a carried episode's earlier tokens are older by the rollouts it
waited, as at K = 0 (`rollout/staleness_max` counts them; `check_bound(newest=True)`).

The env: a carried game continues in its row of the training env. When the matchmaker hands the next iteration
another env or other opponents (a curriculum promotion), the carried groups play again from their start (their seeds)
in their slots, as after a resume: `rollout/replayed` counts those games.

Checkpoints hold the carried groups' slots, seeds and first iterations, not their episodes: a game's env state is
arbitrary Python (a task's tools, an opponent's random streams) that no checkpoint can hold in general. A resumed run
plays those groups again from their first observation with the restored weights, says so in one line and counts them
in `rollout/replayed`; it is then not the run that never stopped (one that stopped with nothing carried is, bit for
bit). With rollouts ahead, the checkpoint holds the finished batches of the next K iterations, and the groups
carried into the first batch it does not hold.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import numpy as np
from jaxtyping import Bool, Int

from earl_jax.envs.outcomes import NO_WINNER, WINNERS
from earl_jax.rl.algorithm.losses import BEHAVIOUR_LOSSES
from earl_jax.rl.matchups.game_seeds import rollout_inputs
from earl_jax.rl.stages.staleness import Sampled
from earl_jax.rollout.episodes import Carried, RolloutStats, Trajectories, episode_stats

log = logging.getLogger("earl_jax.rl.loop.trainer")


@dataclasses.dataclass
class CarriedGroups:
    """The groups a rollout left unfinished, for the next one: per game (whole groups) its batch row, seed and the
    iteration its group started in; with `episodes` None they play again from their start."""

    rows: Int[np.ndarray, " c"]
    seeds: Int[np.ndarray, " c"]
    origin: Int[np.ndarray, " c"]
    episodes: Trajectories | None = None
    live: Bool[np.ndarray, " c"] | None = None  # still playing (the others ended, and wait for their group)
    legal: Bool[np.ndarray, "c a"] | None = None
    versions: Int[np.ndarray, "c t"] | None = None  # each token's policy version
    env: Any = None  # the env whose rows hold them, and its opponents' assignment
    assigned: Any = None

    def replayed(self) -> CarriedGroups:
        return CarriedGroups(self.rows, self.seeds, self.origin)


class PartialRollouts:
    def __init__(self, trainer):
        """`trainer`: the Trainer whose training rollouts these are (its config, matchmaker, play)."""
        cfg = trainer.cfg
        if jax.process_count() > 1:
            raise ValueError("--rollout.token-budget: partial rollouts run in one process only (a carried game stays "
                             "in its process's env rows); use --rollout.token-budget 0")
        self.t, self.budget = trainer, cfg.rollout.token_budget
        self.carry: CarriedGroups | None = None  # into the next iteration
        self._began: tuple[int, CarriedGroups | None] | None = None  # the last iteration taken, and what it carried in
        if cfg.loss.policy_loss not in BEHAVIOUR_LOSSES:
            log.warning("--rollout.token-budget %d with --loss.policy-loss %s: a carried episode's earlier tokens were "
                        "sampled by older weights, and the ratio is taken against the weights at train time with no "
                        "correction for them (decoupled_ppo corrects it)", self.budget, cfg.loss.policy_loss)

    def take(self, step: int, play: Callable[..., tuple[Trajectories, float]] | None = None,
             version: int | None = None) -> Sampled:
        """Iteration `step`'s batch: the carried groups continued and new ones played to the budget (module doc).

        `play(env, seeds, group_ids, rng, token_budget=, carried=)` and `version` (the weights' version that plays
        it): rl/loop/overlap.py's, on its thread; by default the loop's own rollout with version `step`."""
        t = self.t
        cfg = t.cfg
        version = step if version is None else version
        seeds, group_ids, rng = rollout_inputs(cfg.rollout, cfg.run.seed, step, cfg.env.agent_player is None)
        seeds, origin = np.asarray(seeds, np.int64), np.full(len(seeds), step, np.int64)
        env = t.matchmaker.train_env(step)
        if play is None:
            t.env = env

            def play(env, seeds, group_ids, rng, **kw):
                return t.play(env, seeds, group_ids, rng, t.sampling, **kw)
        assigned = t.matchmaker.plan(step).assigned
        carry, carried = self.carry, None
        if carry is not None and carry.episodes is not None and (carry.env is not env or carry.assigned != assigned):
            log.info("iteration %d: the training env's opponents changed; %d carried game(s) play again from their "
                     "start", step + 1, len(carry.rows))
            carry = carry.replayed()
        if carry is not None:
            seeds[carry.rows], origin[carry.rows] = carry.seeds, carry.origin
            if carry.episodes is not None:
                carried = Carried(carry.rows, carry.episodes, carry.live, carry.legal)
        traj, weights_s = play(env, seeds.tolist(), group_ids, rng, token_budget=self.budget, carried=carried)
        self._began = (step, self.carry)
        versions = None if carried is None else _versions(traj, version, carry)
        open_rows = np.isin(group_ids, group_ids[traj.unfinished])
        rows = np.flatnonzero(open_rows)
        self.carry = None if not len(rows) else CarriedGroups(
            rows, seeds[rows], origin[rows], traj.rows(rows), traj.unfinished[rows],
            None if traj.legal is None else traj.legal[rows],
            np.full((len(rows), traj.tokens.shape[1]), version, np.int32) if versions is None else versions[rows],
            env, assigned)
        metrics = {"rollout/carried_over": len(rows), "rollout/trained_groups": len(np.unique(group_ids[~open_rows])),
                   "rollout/replayed": 0 if carry is None or carried is not None else len(carry.rows),
                   "rollout/answer_tokens": traj.stats.answer_tokens}
        if len(rows):
            traj, versions = _trained_first(traj, open_rows, versions)
        return Sampled(step, version, traj, weights_s, None, t.matchmaker.mix_games(), versions=versions,
                       metrics=metrics)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self, step: int) -> dict[str, list[int]] | None:
        """The rows, seeds and first iterations of the groups carried into iteration `step` (what a resumed run plays
        again): an iteration abandoned after its rollout (a stop signal) did not train, so its carry-in is kept."""
        c = self._began[1] if self._began is not None and self._began[0] == step else self.carry
        return None if c is None else {"rows": c.rows.tolist(), "seeds": c.seeds.tolist(), "origin": c.origin.tolist()}

    def load_state_dict(self, state: dict[str, list[int]] | None, step: int) -> None:
        if not state:
            return
        carry = CarriedGroups(*(np.asarray(state[k], np.int64) for k in ("rows", "seeds", "origin")))
        size, batch = self.t.cfg.rollout.group_size, self.t.cfg.rollout.batch_size
        groups = np.unique(carry.rows // size)
        if carry.rows.max() >= batch or len(carry.rows) != len(groups) * size:  # not whole groups of this batch
            log.warning("resume: the %d game(s) carried at step %d are not whole groups of --rollout.groups x "
                        "--rollout.group-size now: dropped", len(carry.rows), step)
            return
        self.carry = carry
        log.info("resume: %d game(s) carried at step %d (groups started in iteration(s) %s) play again from their "
                 "first observation with the restored weights; their episodes are not in the checkpoint",
                 len(carry.rows), step, sorted({int(o) + 1 for o in carry.origin}))


def _versions(traj: Trajectories, version: int, carry: CarriedGroups) -> Int[np.ndarray, "n t"]:
    """Each token's policy version: `version` for what this rollout wrote, the carried tokens' own before it."""
    versions = np.full(traj.tokens.shape, version, np.int32)
    old, lengths = carry.versions, carry.episodes.lengths
    w = min(old.shape[1], versions.shape[1])
    versions[carry.rows, :w] = np.where(np.arange(w) < lengths[:, None], old[:, :w], version)
    return versions


def _trained_first(traj: Trajectories, open_rows: Bool[np.ndarray, " n"], versions: np.ndarray | None
                   ) -> tuple[Trajectories, Int[np.ndarray, "n t"] | None]:
    """The batch: the trained rows first, then the carried groups' rows left empty; its stats those of the trained."""
    order = np.concatenate([np.flatnonzero(~open_rows), np.flatnonzero(open_rows)])
    played = ~open_rows[order]
    width = max(int(traj.lengths[~open_rows].max(initial=0)), 1)
    out = traj.rows(order)
    cols = {name: _zero_rows(getattr(out, name)[:, :width], ~played)
            for name in ("tokens", "loss_mask", "logprobs", "choices", "rewards")}
    rows = {name: _zero_rows(getattr(out, name), ~played) for name in ("lengths", "returns", "num_turns", "truncated",
                                                                       "invalid")}
    out = dataclasses.replace(
        out, **cols, **rows,
        winners=[w if p else None for w, p in zip(out.winners, played.tolist())],
        turn_context_lens=[c if p else [] for c, p in zip(out.turn_context_lens, played.tolist())],
        unfinished=None, legal=None, played=played, stats=_stats(traj, ~open_rows))
    return out, None if versions is None else versions[order, :width]


def _zero_rows(x: np.ndarray, rows: Bool[np.ndarray, " n"]) -> np.ndarray:
    """A copy of `x` with rows `rows` zero (its dtype kept)."""
    x = x.copy()
    x[rows] = 0
    return x


def _stats(traj: Trajectories, trained: Bool[np.ndarray, " n"]) -> RolloutStats:
    """The rollout's stats with the outcomes, lengths and tokens of the rows `trained` only."""
    rows = np.flatnonzero(trained)
    winner = np.array([NO_WINNER if traj.winners[r] is None else WINNERS.index(traj.winners[r]) for r in rows])
    turns = max((len(traj.turn_context_lens[r]) for r in rows), default=0)
    turn_ctx = np.full((len(rows), max(turns, 1)), -1, np.int64)
    for k, r in enumerate(rows.tolist()):
        turn_ctx[k, :len(traj.turn_context_lens[r])] = traj.turn_context_lens[r]
    return dataclasses.replace(traj.stats, **episode_stats(
        winner, traj.invalid[rows], traj.lengths[rows], turn_ctx, traj.num_turns[rows], traj.truncated[rows],
        traj.loss_mask[rows]))
