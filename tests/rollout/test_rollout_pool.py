"""A pool of games (continuous batching, `PlayConfig.slots`): S < N decode rows, a finished game's row emptied in
place and given to the next waiting game. With the real sampler every game plays exactly the tokens the lock-step
loop plays: each row draws from fold_in(fold_in(rng, the game's own turn), game id), whichever row and time it
started in."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.envs import EnvConfig
from earl_jax.envs.vector import make_vector_env
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.models.tokenizer import game_tokenizer, special_ids
from earl_jax.rollout.agent_loop import PlayConfig, play_games
from earl_jax.rollout.host_policies import ScriptedPolicy
from earl_jax.rollout.moves import MoveTokens
from earl_jax.rollout.policy import SamplerPolicy
from earl_jax.rollout.sampler import Sampler, SamplingConfig
from earl_jax.rollout.sampling import row_keys

TOK = game_tokenizer()
IDS = special_ids(TOK)
CFG = ModelConfig.tiny(vocab_size=TOK.get_vocab_size()).replace(num_hidden_layers=2, hidden_size=64,
                                                                 intermediate_size=128)
N = 16
BASE = PlayConfig(max_turn_tokens=3, max_turns=9, max_context=256)


@pytest.fixture(scope="session")
def model():
    graphdef, params = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32))
    return graphdef, params, Sampler(graphdef, CFG, cache_dtype=jnp.float32)


def _game_env():
    return make_vector_env(EnvConfig(game="tic_tac_toe", prompt_style="compact", max_retries=2), N)


def _rollout(model, cfg: PlayConfig, groups: int = 1, env=None, moves: MoveTokens | None = None, seed: int = 3,
             sampling=SamplingConfig(temperature=1.0)):
    graphdef, params, sampler = model
    env = env if env is not None else _game_env()
    policies = [SamplerPolicy(sampler, params, sampling, (IDS.eos_id,), cfg.max_turn_tokens, moves=moves)
                for _ in range(groups)]
    seeds = [7 + i // 4 for i in range(N)]  # GRPO-like groups of 4 share a start
    return play_games(policies, env, TOK, dataclasses.replace(cfg, pipeline_groups=groups), jax.random.key(seed),
                      seeds, bos_id=IDS.bos_id)


def _same(a, b):
    for field in ("tokens", "loss_mask", "rewards", "lengths", "num_turns", "truncated", "invalid"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    assert a.winners == b.winners and a.turn_context_lens == b.turn_context_lens


def test_turn_and_id_row_keys_are_the_lock_step_keys():
    rng = jax.random.key(5)
    turns, ids = np.array([0, 3, 1, 3]), np.array([4, 0, 9, 2])
    pooled = row_keys(rng, jnp.asarray(np.stack([turns, ids], 1), jnp.int32))
    for r in range(4):
        lock_step = row_keys(jax.random.fold_in(rng, int(turns[r])), jnp.asarray(ids, jnp.int32))[r]
        assert (jax.random.key_data(pooled[r]) == jax.random.key_data(lock_step)).all()


@pytest.mark.parametrize("slots", [4, 6])
def test_a_pool_plays_the_lock_step_games(model, slots):
    reference = _rollout(model, BASE)
    pooled = _rollout(model, dataclasses.replace(BASE, slots=slots))
    assert len(set(reference.num_turns.tolist())) > 1  # games of varied lengths: rows are refilled at varied times
    _same(reference, pooled)
    s = pooled.stats
    assert s.pool_occupancy is not None and s.pool_occupancy >= 0.9, s.pool_occupancy
    assert max(pooled.num_turns) > 1 and s.decode_rows >= sum(pooled.num_turns)  # every game's every turn decoded
    # the batch stays at `slots` rows (then compacts): far fewer decode rows than N rows a turn for the longest game
    assert s.busy_rows == sum(reference.num_turns) and s.decode_rows <= s.busy_rows + slots * max(reference.num_turns)
    assert reference.stats.pool_occupancy is None


def test_a_pool_without_compaction_and_over_two_pipeline_groups_plays_the_same_games(model):
    reference = _rollout(model, dataclasses.replace(BASE, overlap=False))
    _same(reference, _rollout(model, dataclasses.replace(BASE, slots=4, compact=False)))
    _same(reference, _rollout(model, dataclasses.replace(BASE, slots=8), groups=2))


def test_a_pool_truncates_at_max_turns_and_max_context_as_lock_step(model):
    for cfg in (dataclasses.replace(BASE, max_turns=3), dataclasses.replace(BASE, max_context=60)):
        reference = _rollout(model, cfg)
        assert reference.truncated.any()
        _same(reference, _rollout(model, dataclasses.replace(cfg, slots=4)))


@pytest.mark.parametrize("slots", [0, 4])
def test_the_kv_counts_recount_the_games_contexts(model, slots):
    """`kv_used`: each decode's games, their context at the turn's start plus the turn's budget (the cache holds
    both); `kv_allocated`: the decode batch's rows x its cache length, never less."""
    run = _rollout(model, dataclasses.replace(BASE, slots=slots))
    s = run.stats
    need = sum(c + min(BASE.max_turn_tokens, BASE.max_context - c) for t in run.turn_context_lens for c in t)
    assert s.kv_used == need and 0 < s.kv_used <= s.kv_allocated
    assert s.kv_allocated >= s.decode_rows * s.first_cache_len  # every decode row holds at least the first cache


def test_a_pool_of_constrained_moves_plays_the_same_games(model):
    env = _game_env()
    moves = MoveTokens.build(TOK, env.num_actions, IDS.eos_id)
    cfg = dataclasses.replace(BASE, constrain_moves=True)
    reference = _rollout(model, cfg, env=env, moves=moves)
    _same(reference, _rollout(model, dataclasses.replace(cfg, slots=4), env=_game_env(), moves=moves))


def test_a_pool_of_text_task_episodes_plays_the_same_episodes(model):
    from earl_jax.tasks import task_env_factory

    def env():
        return make_vector_env(EnvConfig(), N, task_env_factory("earl_jax/GuessNumber-v0", "{}", split="train"))

    cfg = dataclasses.replace(BASE, max_turn_tokens=6, max_turns=5)
    reference = _rollout(model, cfg, env=env())
    assert reference.loss_mask.sum() > N
    _same(reference, _rollout(model, dataclasses.replace(cfg, slots=4), env=env()))


def test_slots_at_least_the_games_is_the_lock_step_loop(model):
    reference = _rollout(model, BASE)
    for slots in (N, 2 * N):
        run = _rollout(model, dataclasses.replace(BASE, slots=slots))
        _same(reference, run)
        assert run.stats.decode_rows == reference.stats.decode_rows and run.stats.pool_occupancy is None


def test_a_scripted_policy_in_a_pool_plays_the_same_games():
    def play(slots):
        env = make_vector_env(EnvConfig(game="tic_tac_toe", prompt_style="compact", max_retries=1), N)
        policy = ScriptedPolicy(lambda text: str(len(text) % 9), TOK, IDS.eos_id)
        return play_games(policy, env, TOK, dataclasses.replace(BASE, slots=slots), jax.random.key(0),
                          list(range(N)), bos_id=IDS.bos_id)

    _same(play(0), play(3))


def test_slots_must_split_into_the_groups(model):
    with pytest.raises(ValueError, match="slots"):
        PlayConfig(slots=-1)
    with pytest.raises(ValueError, match="pipeline groups"):
        _rollout(model, dataclasses.replace(BASE, slots=5), groups=2)


@pytest.mark.parametrize("kind", ["game", "text_task"])
def test_the_job_plays_the_same_rollout_with_a_pool(tmp_path, kind):
    """--rollout.slots 3 (8 games): the job's rollout stage plays every episode the lock-step stage plays; with two
    pipeline groups the slots round up to whole groups (4)."""
    from test_rollout_pipeline import _same as same_job

    from earl_jax.rl.loop.trainer import Trainer
    from exact_cases import BASE as JOB, KINDS
    from jobs import job

    runs = []
    for slots, k in ((0, 1), (3, 1), (3, 2)):
        trainer = Trainer(job(**JOB, **KINDS[kind], rollout__max_turns=4, rollout__slots=slots,
                              rollout__pipeline_groups=k, run__run_dir=str(tmp_path / f"s{slots}k{k}")), log=False)
        seeds, group_ids, rng = trainer.rollout_inputs()
        traj, _ = trainer.play(trainer.matchmaker.train_env(0), seeds, group_ids, rng, trainer.sampling)
        runs.append(traj)
    assert runs[0].num_games == 8 and runs[0].stats.pool_occupancy is None
    assert runs[1].stats.pool_occupancy is not None and runs[1].stats.busy_rows == runs[0].stats.busy_rows
    same_job(runs[0], runs[1])
    same_job(runs[0], runs[2])


def test_slots_below_minus_one_are_refused_in_the_job_config():
    from earl_jax.rollout.rollout_config import RolloutConfig

    with pytest.raises(ValueError, match="slots"):
        RolloutConfig(slots=-2)


def test_rows_that_fit_are_the_most_whole_shards_the_memory_model_holds():
    from earl_jax.models.model_config import get_config
    from earl_jax.parallel.memory import GiB, MemoryConfig
    from earl_jax.parallel.selector import ParallelismSelector

    sel = ParallelismSelector(get_config("qwen2.5-0.5b"), 8, memory=MemoryConfig(budget_bytes=4 * GiB))
    rows = sel.rows_that_fit("rollout", 4096, 4096)
    assert 0 < rows < 4096
    fits = [(m, sel.memory.fits(sel.memory.estimate("rollout", m, 4096, rows))) for m in sel.candidates_of("rollout")]
    assert any(ok and rows % (m.data * m.fsdp) == 0 for m, ok in fits)  # some mesh holds them, in whole shards
    for m in sel.candidates_of("rollout"):  # and no mesh holds one more shard of its rows
        unit = m.data * m.fsdp
        more = (rows // unit + 1) * unit
        assert not sel.memory.fits(sel.memory.estimate("rollout", m, 4096, more)), m
    assert sel.rows_that_fit("rollout", 4096, 8) == 8  # never more than asked
    assert ParallelismSelector(get_config("qwen2.5-0.5b"), 1, memory=MemoryConfig(budget_bytes=GiB // 4)
                               ).rows_that_fit("rollout", 4096, 64) == 0  # the weights alone do not fit


def test_slots_minus_one_give_the_rollout_the_rows_the_planner_sized(tmp_path, monkeypatch, caplog):
    """--rollout.slots -1: the planner asks the memory model how many rows decode at --rollout.max-context; the
    rollout stage gets that pool and the selector plans the rollout's memory for those rows; all 8: no pool."""
    from earl_jax.parallel.selector import NoFeasibleLayoutError, ParallelismSelector
    from earl_jax.rl.loop.trainer import Trainer
    from exact_cases import BASE as JOB, KINDS
    from jobs import job

    cfg = job(**JOB, **KINDS["game"], rollout__max_turns=4, rollout__slots=-1, run__run_dir=str(tmp_path / "all"))
    assert Trainer(cfg, log=False).rollout.slots == 0  # the tiny model: every game fits
    asked = []
    monkeypatch.setattr(ParallelismSelector, "rows_that_fit",
                        lambda self, stage, ctx, most: asked.append((stage, ctx, most)) or 4)
    with caplog.at_level("INFO", logger="earl_jax"):
        trainer = Trainer(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(tmp_path / "four"))),
                          log=False)
    assert asked == [("rollout", cfg.rollout.max_context, 8)] and "4 rows of 8 decode at once" in caplog.text
    assert trainer.rollout.slots == 4 and trainer.policy.planner.selector.decode_rows == 4
    seeds, group_ids, rng = trainer.rollout_inputs()
    traj, _ = trainer.play(trainer.matchmaker.train_env(0), seeds, group_ids, rng, trainer.sampling)
    assert traj.num_games == 8 and traj.stats.pool_occupancy is not None  # played as a pool of 4 rows
    monkeypatch.setattr(ParallelismSelector, "rows_that_fit", lambda self, stage, ctx, most: 0)
    with pytest.raises(NoFeasibleLayoutError, match="--rollout.max-context"):
        Trainer(cfg, log=False)
