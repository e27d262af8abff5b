"""Partial rollouts (--rollout.token-budget N): a rollout ends at a token budget, the groups whose games all ended
train, the others are carried whole into the next rollout and continued there (CPU, 8 fake devices, a tiny model).

In the agent loop: a carried game continues exactly where it stopped (same env row, its cache prefilled again from its
tokens), first in the next pool. In the trainer: a budget nothing reaches is the run without one, bit for bit; with a
small one, carried episodes train in a later iteration with each token's version and its sampler log-prob, which the
old weights reproduce; groups are never split; a resume plays the carried groups again from their start.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.cli import ConfigError
from earl_jax.envs import EnvConfig
from earl_jax.envs.vector import make_vector_env
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.models.tokenizer import game_tokenizer, special_ids
from earl_jax.rl.loop.partial import PartialRollouts
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rollout.agent_loop import Carried, PlayConfig, play_games
from earl_jax.rollout.host_policies import ScriptedPolicy
from earl_jax.rollout.policy import SamplerPolicy
from earl_jax.rollout.sampler import Sampler, SamplingConfig
from jobs import job, with_fields

TOK = game_tokenizer()
IDS = special_ids(TOK)
N, G = 8, 2  # games, games per group
GROUPS = np.repeat(np.arange(N // G), G)
SEEDS = [11 + i // G for i in range(N)]  # a group's games share a start
CFG = PlayConfig(max_turn_tokens=3, max_turns=12, max_context=512)
EPISODE = ("tokens", "loss_mask", "rewards", "lengths", "num_turns", "truncated", "invalid")


def _lowest_legal(context: str) -> str:
    return context.rsplit("moves:", 1)[1].split()[0]


def _env():
    return make_vector_env(EnvConfig(game="connect_four", max_retries=1), N)


def _same_rows(a, b, rows_a, rows_b=None):
    rows_b = rows_a if rows_b is None else rows_b
    for field in EPISODE:
        x, y = getattr(a, field)[rows_a], getattr(b, field)[rows_b]
        if x.ndim == 2:
            w = max(x.shape[1], y.shape[1])
            x, y = (np.pad(v, ((0, 0), (0, w - v.shape[1]))) for v in (x, y))
        np.testing.assert_array_equal(x, y, err_msg=field)
    assert [a.winners[r] for r in rows_a] == [b.winners[r] for r in rows_b]
    assert [a.turn_context_lens[r] for r in rows_a] == [b.turn_context_lens[r] for r in rows_b]


def _carry(part) -> Carried:
    """The groups `part` left unfinished, whole."""
    rows = np.flatnonzero(np.isin(GROUPS, GROUPS[part.unfinished]))
    return Carried(rows, part.rows(rows), part.unfinished[rows], None if part.legal is None else part.legal[rows])


class Recorded(ScriptedPolicy):
    """A scripted policy that records the (turn, game) rows of each decode."""

    def generate(self, budgets, rng, row_ids, legal=None):
        ids = np.asarray(row_ids)  # [b] ids in lock-step, [b, 2] (turn, id) where games are at their own turns
        self.decodes.append([tuple(r) if ids.ndim == 2 else r for r, b in zip(ids.tolist(), budgets) if b > 0])
        return super().generate(budgets, rng, row_ids, legal)


def _recorded():
    policy = Recorded(_lowest_legal, TOK, IDS.eos_id)
    policy.decodes = []
    return policy


@pytest.mark.parametrize("slots", [0, 4])
def test_a_carried_game_continues_where_the_budget_stopped_it_first_in_the_next_pool(slots):
    """Scripted answers (a function of the context): the games played in two calls are the games played in one."""
    whole = play_games(_recorded(), _env(), TOK, CFG, None, SEEDS, GROUPS, bos_id=IDS.bos_id)
    cfg = dataclasses.replace(CFG, slots=slots)
    env = _env()
    first = play_games(_recorded(), env, TOK, dataclasses.replace(cfg, token_budget=12), None, SEEDS, GROUPS,
                       bos_id=IDS.bos_id)
    assert first.unfinished.any() and not first.truncated[first.unfinished].any()
    ended = np.flatnonzero(~np.isin(GROUPS, GROUPS[first.unfinished]))  # whole groups that ended
    assert len(ended) and first.stats.answer_tokens >= 12
    _same_rows(first, whole, ended)
    carried = _carry(first)
    policy = _recorded()
    second = play_games(policy, env, TOK, cfg, None, SEEDS, GROUPS, bos_id=IDS.bos_id, carried=carried)
    _same_rows(second, whole, np.arange(N))  # the carried games went on in their env rows; the others began anew
    # the carried games still playing decoded first, each at its own turn: its keys, had the policy drawn any
    live = carried.games[carried.live]
    assert policy.decodes[0][:len(live)] == [(int(first.num_turns[g]), int(g)) for g in live]
    assert second.stats.answer_tokens == int(second.loss_mask.sum() - carried.episodes.loss_mask.sum())


def test_a_budget_that_is_never_reached_changes_nothing():
    whole = play_games(_recorded(), _env(), TOK, CFG, None, SEEDS, GROUPS, bos_id=IDS.bos_id)
    budget = play_games(_recorded(), _env(), TOK, dataclasses.replace(CFG, token_budget=10**6), None, SEEDS, GROUPS,
                        bos_id=IDS.bos_id)
    _same_rows(whole, budget, np.arange(N))
    assert not budget.unfinished.any() and whole.unfinished is None


@pytest.fixture(scope="session")
def model():
    cfg = ModelConfig.tiny(vocab_size=TOK.get_vocab_size()).replace(num_hidden_layers=2, hidden_size=64,
                                                                     intermediate_size=128)
    graphdef, params = nnx.split(Qwen2(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32))
    return params, Sampler(graphdef, cfg, cache_dtype=jnp.float32)


@pytest.mark.parametrize("paged", [False, True])
def test_a_carried_game_sampled_again_from_a_prefilled_cache_draws_the_same_tokens(model, paged):
    """The model as the policy, the same weights and key in both calls: a carried game's cache, prefilled again from
    its tokens, gives the next turns the logits the growing cache gave, and its keys are its own turn's. `paged`: both
    budgeted calls over a paged cache with pages for ~2 games (games preempted, their histories recomputed)."""
    params, sampler = model
    paged_sampler = Sampler(sampler.graphdef, sampler.cfg, cache_dtype=jnp.float32, page_size=8)

    def play(env, budget=0, carried=None, pages=0):
        policy = SamplerPolicy(paged_sampler if pages else sampler, params, SamplingConfig(temperature=1.0),
                               (IDS.eos_id,), 3, kv_pages=pages)
        return play_games(policy, env, TOK, dataclasses.replace(CFG, token_budget=budget), jax.random.key(4), SEEDS,
                          GROUPS, bos_id=IDS.bos_id, carried=carried)

    whole = play(_env())
    pages = 2 * -(-int(whole.lengths.max()) // 8) + 2 if paged else 0
    env = _env()
    first = play(env, budget=40, pages=pages)
    assert first.unfinished.any()
    second = play(env, carried=_carry(first), pages=pages)
    assert len(set(whole.num_turns.tolist())) > 1
    _same_rows(second, whole, np.arange(N))
    np.testing.assert_allclose(second.logprobs[:, :whole.tokens.shape[1]], whole.logprobs, atol=2e-5)
    assert (first.stats.preempted + second.stats.preempted > 0) == paged


# ---- the trainer -----------------------------------------------------------------------------------------------------
GAME = job(groups=8, group_size=G, run__steps=3, eval__every=0, eval__games=8, checkpoint_every=100,
           checkpoint_minutes=0, max_turns=20, max_context=512, constrain_moves=True, devices=8,
           policy_loss="decoupled_ppo", group_seeds="per_game", cache_dtype="float32", token_budget=40,
           entropy_coef=0.01, filter_constant_groups=False, warmup_steps=0,  # a gradient every iteration
           ppo_mini_batches=2)  # the second holds carried groups' empty rows only when half the groups carry
TASK = with_fields(GAME, env__task="exact_cases:make_echo_task", constrain_moves=False, max_turn_tokens=5,
                   max_turns=4, max_context=256, token_budget=24, sft__steps=0)


class Spy:
    """Per rollout (in step order): the batch (`Sampled`) and the groups it carried out; per iteration k its weights
    (version k)."""

    def __init__(self, monkeypatch):
        self.done, self.carried, self.weights = [], [], []
        take, iteration = PartialRollouts.take, Trainer.iteration

        def spy_take(partial, step, *a):
            done = take(partial, step, *a)
            self.done.append(done)
            self.carried.append(partial.carry)
            return done

        def spy_iteration(trainer):
            self.weights.append(jax.tree.map(jnp.copy, trainer.state.params))  # the train stage donates them
            return iteration(trainer)

        monkeypatch.setattr(PartialRollouts, "take", spy_take)
        monkeypatch.setattr(Trainer, "iteration", spy_iteration)


def _scored(trainer, params, batch) -> np.ndarray:
    """The experience stage's log-probs of `batch`'s tokens under `params`, in the batch's row order."""
    from earl_jax.rl.algorithm.packing import scored_spans

    kept, trainer.state.params = trainer.state.params, params
    try:
        out = trainer.policy.planner.run("experience",
                                         lambda run: trainer._experience(run, batch, scored_spans(batch.loss_mask),
                                                                         None))
    finally:
        trainer.state.params = kept
    old = np.empty(np.shape(out.batch.old_logp), np.float32)
    old[out.arranged] = np.asarray(out.batch.old_logp)
    return old


def _check_carried_run(trainer, spy, history) -> None:
    constrained, groups = trainer.policy.moves is not None, trainer.cfg.rollout.groups
    later = skipped = older = 0  # carried groups that trained later; mini-batches without a scored token
    for k, (done, record) in enumerate(zip(spy.done, history)):
        now = done.version  # the weights that played this rollout: k, or k - K with rollouts ahead
        carry, batch, traj = spy.carried[k], done.batch(constrained), done.traj
        # whole groups: a group's rows all trained or all carried (left empty, after the trained ones)
        played = np.ones(len(traj.lengths), bool) if traj.played is None else traj.played
        trained_groups, counts = np.unique(traj.group_ids[played], return_counts=True)
        assert (counts == G).all() and not played[np.argmin(played):].any()
        assert not np.isin(traj.group_ids[~played], trained_groups).any() and not batch.loss_mask[~played].any()
        assert record["rollout/carried_over"] == (0 if carry is None else len(carry.rows))
        assert record["rollout/trained_groups"] == len(trained_groups) == groups - record["rollout/carried_over"] // G
        # a mini-batch of empty rows makes no optimizer step (its momentum alone would move the weights)
        minis = batch.loss_mask.reshape(trainer.cfg.optim.ppo_mini_batches, -1).any(axis=1)
        assert record["train/updates"] == minis.sum() * trainer.cfg.optim.ppo_epochs
        skipped += int((~minis).sum())
        # each scored token's sampler log-prob is what the weights of its version give it, and only those
        scored = batch.loss_mask
        for v in np.unique(batch.versions[scored]):
            at = scored & (batch.versions == v)
            gap = np.abs(_scored(trainer, spy.weights[v], batch)[at] - batch.sampler_logp[at])
            assert gap.max() <= 2e-5, (k, v, gap.max())
            if v < now:  # the newer weights give an older token another log-prob: the versions matter
                assert np.abs(_scored(trainer, spy.weights[now], batch)[at] - batch.sampler_logp[at]).max() > 1e-3
        if k == 0 or spy.carried[k - 1] is None:
            continue
        before = spy.carried[k - 1]  # groups carried into this iteration: those that trained now kept their tokens
        for j, row in enumerate(before.rows.tolist()):
            slot, within = divmod(row, G)
            if slot not in trained_groups:
                continue
            r = np.flatnonzero(traj.group_ids == slot)[within]
            n = int(before.episodes.lengths[j])
            np.testing.assert_array_equal(traj.tokens[r, :n], before.episodes.tokens[j, :n])
            np.testing.assert_array_equal(traj.loss_mask[r, :n], before.episodes.loss_mask[j, :n])
            np.testing.assert_array_equal(traj.logprobs[r, :n], before.episodes.logprobs[j, :n])
            mask, versions = batch.loss_mask[r], batch.versions[r]  # older tokens keep their version
            np.testing.assert_array_equal(versions[:n][mask[:n]], before.versions[j, :n][mask[:n]])
            assert (versions[n:][mask[n:]] == now).all()
            later += bool(before.live[j] and mask[n:].any())
            older += bool((versions[mask] < now).any())
    assert later, "no carried episode went on in a later iteration"
    assert older, "no carried episode trained with tokens of older weights than its last rollout's"
    assert skipped, "no iteration had a mini-batch of carried groups only"
    assert max(r["rollout/staleness_max"] for r in history) >= 1


@pytest.mark.parametrize("kind", ["game", "task"])
def test_carried_episodes_train_later_with_the_version_and_log_prob_of_each_token(tmp_path, monkeypatch, kind):
    spy = Spy(monkeypatch)
    trainer = Trainer(with_fields(GAME if kind == "game" else TASK, run_dir=str(tmp_path)), log=False)
    history = trainer.run()
    assert sum(r["rollout/carried_over"] for r in history) > 0
    if kind == "task":  # tool results came back mid-episode, some in a later iteration than the call
        assert sum(r.get("task/tool_calls", 0) for r in history) > 0
    _check_carried_run(trainer, spy, history)


def _stop_in_iteration_2(monkeypatch, cls):
    """SIGTERM once iteration 2 has its batch from `cls.take` (it is abandoned before its experience); the real take."""
    take = cls.take

    def stop(obj, step, *a):
        done = take(obj, step, *a)
        if step == 1:
            signal.raise_signal(signal.SIGTERM)
        return done

    monkeypatch.setattr(cls, "take", stop)
    return take


def test_partial_rollouts_ahead_of_training_keep_the_bound_on_each_rollouts_own_tokens(tmp_path, monkeypatch):
    """--rollout.max-staleness 1 with a token budget: the background thread plays the batches in step order, each
    carrying into the next; a batch's newest tokens are 1 version behind its iteration, a carried episode's older."""
    spy = Spy(monkeypatch)
    trainer = Trainer(with_fields(GAME, max_staleness=1, run__steps=4, run_dir=str(tmp_path)), log=False)
    history = trainer.run()
    assert [(d.step, d.version) for d in spy.done] == [(0, 0), (1, 0), (2, 1), (3, 2)]
    assert sum(r["rollout/carried_over"] for r in history) > 0
    _check_carried_run(trainer, spy, history)
    for k, (done, record) in enumerate(zip(spy.done, history)):
        batch = done.batch(True)
        versions = batch.versions[batch.loss_mask]
        assert versions.max() == max(0, k - 1)  # the rollout that finished the batch: within the bound
        assert record["rollout/staleness_max"] == k - versions.min()
    assert max(r["rollout/staleness_max"] for r in history) > 1  # carried tokens: older, as at staleness 0


def test_a_resume_with_rollouts_ahead_keeps_the_waiting_batches_and_the_carry_into_the_next(tmp_path, monkeypatch):
    """Stopped once iteration 2 has its batch: the checkpoint of step 1 holds batch 1 (sampled ahead, with its
    per-token versions) and the groups batch 1 carried into batch 2, which the resumed run plays again from their
    start with the restored weights."""
    from earl_jax.rl.loop.overlap import Overlap

    cfg = with_fields(GAME, max_staleness=1, run__steps=3, run_dir=str(tmp_path))
    spy = Spy(monkeypatch)
    take = _stop_in_iteration_2(monkeypatch, Overlap)
    first = Trainer(cfg, log=False)
    first.run()
    assert first.stopped_by == "SIGTERM" and first.step == 1
    assert [d.step for d in spy.done] == [0, 1, 2]  # batch 2 ran ahead before the stop and is not kept
    waiting, carry_in = spy.done[1], spy.carried[1]
    assert carry_in is not None, "batch 1 carried no group: a larger budget is needed for this test"
    monkeypatch.setattr(Overlap, "take", take)
    resumed = Trainer(with_fields(cfg, resume=True), log=False)
    assert sorted(resumed.overlap.pending) == [1]
    kept = resumed.overlap.pending[1]
    np.testing.assert_array_equal(kept.versions, waiting.versions)
    np.testing.assert_array_equal(kept.traj.tokens, waiting.traj.tokens)
    np.testing.assert_array_equal(resumed.partial.carry.rows, carry_in.rows)
    spy.done.clear()
    history = resumed.run()
    assert [(d.step, d.version) for d in spy.done] == [(2, 1)]  # batch 2 sampled again, from the restored weights
    assert spy.done[0].metrics["rollout/replayed"] == len(carry_in.rows)
    batch = kept.batch(True)
    assert history[0]["rollout/staleness_max"] == 1 - batch.versions[batch.loss_mask].min()  # as saved


CLOCKED = {f"rollout/{k}" for k in ("env_frac", "wait_frac", "gather_frac", "gather_wait_frac", "process_min_s",
                                    "process_max_s")}


def _compared(record: dict) -> dict:
    """A record's numbers that do not depend on the clock."""
    return {k: v for k, v in record.items()
            if not k.startswith(("time/", "compile/", "throughput/", "memory/")) and k not in CLOCKED}


def test_a_budget_nothing_reaches_is_the_run_without_one_bit_for_bit(tmp_path):
    base = with_fields(GAME, token_budget=0, run__steps=2)
    plain = Trainer(with_fields(base, run_dir=str(tmp_path / "a")), log=False)
    budget = Trainer(with_fields(base, token_budget=10**9, run_dir=str(tmp_path / "b")), log=False)
    want, got = plain.run(), budget.run()
    assert [r["rollout/carried_over"] for r in got] == [0, 0]
    assert [_compared(r) for r in want] == [{k: v for k, v in _compared(r).items() if k in _compared(w)}
                                            for r, w in zip(got, want)]
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(budget.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_resume_plays_the_carried_groups_again_from_their_start(tmp_path, monkeypatch, caplog):
    """Stopped after iteration 2's rollout (not trained): the checkpoint of step 1 holds what iteration 1 carried."""
    from earl_jax.rl.matchups.game_seeds import rollout_inputs

    cfg = with_fields(GAME, run__steps=2, run_dir=str(tmp_path))
    spy = Spy(monkeypatch)
    take = _stop_in_iteration_2(monkeypatch, PartialRollouts)
    first = Trainer(cfg, log=False)
    first.run()
    carry = spy.carried[0]
    assert first.stopped_by == "SIGTERM" and first.step == 1 and len(spy.done) == 2 and carry is not None
    plays = []
    play = Trainer.play

    def spy_play(trainer, env, seeds, *a, **kw):
        plays.append((list(seeds), kw.get("carried")))
        return play(trainer, env, seeds, *a, **kw)

    monkeypatch.setattr(Trainer, "play", spy_play)
    monkeypatch.setattr(PartialRollouts, "take", take)
    with caplog.at_level(logging.INFO, logger="earl_jax.rl.loop.trainer"):
        resumed = Trainer(with_fields(cfg, resume=True), log=False)
    assert f"resume: {len(carry.rows)} game(s) carried at step 1" in caplog.text
    np.testing.assert_array_equal(resumed.partial.carry.rows, carry.rows)
    record = resumed.run()[0]
    assert record["rollout/replayed"] == len(carry.rows)
    seeds, carried = plays[0]  # in iteration 2 the carried groups began again, in their slots, with iteration 1's seeds
    started = rollout_inputs(cfg.rollout, cfg.run.seed, 0, cfg.env.agent_player is None)[0]
    assert carried is None and [seeds[r] for r in carry.rows] == [started[r] for r in carry.rows]
    now = rollout_inputs(cfg.rollout, cfg.run.seed, 1, cfg.env.agent_player is None)[0]
    assert [seeds[r] for r in carry.rows] != [now[r] for r in carry.rows]


def test_another_env_for_the_next_iteration_plays_the_carried_groups_again(tmp_path):
    trainer = Trainer(with_fields(GAME, run_dir=str(tmp_path)), log=False)
    carried = trainer.iteration()["rollout/carried_over"]
    assert carried > 0
    trainer.matchmaker._env = None  # as a curriculum promotion does: the next iteration gets a new env
    assert trainer.iteration()["rollout/replayed"] == carried


def test_a_budget_refuses_what_it_cannot_carry_and_warns_once_of_an_uncorrected_loss(caplog):
    for fields, says in ((dict(league_size=2), "--curriculum.league-size 0"),
                         (dict(rehearsal_share=0.25, ladder="random,alphabeta:1"), "--curriculum.rehearsal-share"),
                         (dict(mix_opponent="alphabeta:1"), "--curriculum.mix-opponent")):
        with pytest.raises(ConfigError, match=f"--rollout.token-budget: .*{says}"):
            with_fields(GAME, **fields)
    with caplog.at_level(logging.WARNING, logger="earl_jax.rl.loop.trainer"):
        PartialRollouts(SimpleNamespace(cfg=with_fields(GAME, policy_loss="ppo_clip")))
        PartialRollouts(SimpleNamespace(cfg=GAME))
    warned = [r for r in caplog.records if "--rollout.token-budget" in r.getMessage()]
    assert len(warned) == 1 and "decoupled_ppo corrects it" in warned[0].getMessage()


def test_a_minimum_share_of_ended_groups_holds_the_budget_until_that_many_have_ended():
    whole = play_games(_recorded(), _env(), TOK, CFG, None, SEEDS, GROUPS, bos_id=IDS.bos_id)

    def ended_groups(budget_min_ended):
        cfg = dataclasses.replace(CFG, token_budget=12, budget_min_ended=budget_min_ended)
        part = play_games(_recorded(), _env(), TOK, cfg, None, SEEDS, GROUPS, bos_id=IDS.bos_id)
        ended = np.flatnonzero(~np.isin(GROUPS, GROUPS[part.unfinished]))
        _same_rows(part, whole, ended)  # what ended is what the whole rollout played
        return len(ended) // G

    first, half, every = ended_groups(0.0), ended_groups(0.5), ended_groups(1.0)
    assert first < N // G // 2 <= half < N // G and every == N // G  # 4 groups: one, at least two, all
    with pytest.raises(ValueError, match="budget_min_ended"):
        PlayConfig(token_budget=12, budget_min_ended=1.5)
