"""The agent loop with the real sampler: pipelined groups, overlap and compaction change no game.

Every game samples from its own key (fold_in(fold_in(rng, turn), game id)), so which group it decodes in,
which row it sits in and when the host steps it must not change a single token.
"""

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
from earl_jax.rollout.policy import SamplerPolicy
from earl_jax.rollout.sampler import Sampler, SamplingConfig

TOK = game_tokenizer()
IDS = special_ids(TOK)
CFG = ModelConfig.tiny(vocab_size=TOK.get_vocab_size()).replace(num_hidden_layers=2, hidden_size=64,
                                                                 intermediate_size=128)
N = 16


@pytest.fixture(scope="session")
def model():
    graphdef, params = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32))
    return graphdef, params, Sampler(graphdef, CFG, cache_dtype=jnp.float32)


def _rollout(model, cfg: PlayConfig, groups: int = 1, sampling=SamplingConfig(temperature=1.0),
             background: bool = False):
    graphdef, params, sampler = model
    env = make_vector_env(EnvConfig(game="tic_tac_toe", prompt_style="compact", max_retries=2), N)
    policies = [SamplerPolicy(sampler, params, sampling, (IDS.eos_id,), cfg.max_turn_tokens, background=background)
                for _ in range(groups)]
    seeds = [7 + i // 4 for i in range(N)]  # GRPO-like groups of 4 share a start
    return play_games(policies, env, TOK, dataclasses.replace(cfg, pipeline_groups=groups), jax.random.key(3), seeds,
                      bos_id=IDS.bos_id)


def _same(a, b):
    for field in ("tokens", "loss_mask", "rewards", "lengths", "num_turns", "truncated", "invalid"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    assert a.winners == b.winners and a.turn_context_lens == b.turn_context_lens


def test_overlapped_pipeline_plays_the_same_games_as_the_reference_schedule(model):
    base = PlayConfig(max_turn_tokens=3, max_turns=9, max_context=256, compact=False)
    reference = _rollout(model, dataclasses.replace(base, overlap=False), groups=2)
    overlapped = _rollout(model, base, groups=2)
    _same(reference, overlapped)
    assert reference.stats.turns_mean > 1.5  # the games went on for several turns: the test exercises extends
    # and one group of 16 rows (no pipelining) plays the same games too: each game draws from its own key
    _same(reference, _rollout(model, dataclasses.replace(base, overlap=False), groups=1))
    # and so do groups decoding from worker threads (how the trainer runs several groups)
    _same(reference, _rollout(model, base, groups=2, background=True))


def test_finished_games_leave_the_batch_without_changing_any_game(model):
    base = PlayConfig(max_turn_tokens=3, max_turns=9, max_context=256)
    full = _rollout(model, dataclasses.replace(base, compact=False))
    compacted = _rollout(model, base)
    _same(full, compacted)
    # fewer decode rows: the tail of the longest games no longer pays for finished ones
    assert compacted.stats.decode_rows < full.stats.decode_rows
    assert full.stats.decode_rows == N * max(full.num_turns)


def test_compiled_programs_stay_bounded(model):
    """Many rollouts of varied lengths compile a bounded set of programs (batch and length buckets)."""
    graphdef, params, _ = model
    sampler = Sampler(graphdef, CFG, cache_dtype=jnp.float32)
    counts = []
    for k in range(6):
        env = make_vector_env(EnvConfig(game="tic_tac_toe", prompt_style="compact", max_retries=k % 3), N)
        policy = SamplerPolicy(sampler, params, SamplingConfig(temperature=1.0), (IDS.eos_id,), 3)
        play_games(policy, env, TOK, PlayConfig(max_turn_tokens=3, max_turns=9, max_context=256),
                   jax.random.key(k), list(range(100 * k, 100 * k + N)), bos_id=IDS.bos_id)
        counts.append(sampler.compile_count)
    # batch buckets 16, 8, 4, 2, 1 x a few length buckets; the later rollouts add (almost) nothing
    assert counts[-1] <= 60 and counts[-1] - counts[2] <= 6, counts



@pytest.mark.parametrize("kind", ["text_task", "tool_task"])
def test_the_job_pipelines_a_task_rollout_without_changing_an_episode(tmp_path, kind):
    """--rollout.pipeline-groups 2: the job's rollout stage decodes two groups in turn while the host steps the
    other's episodes (task steps, tool calls); --env.step-workers 4 steps the episodes on four threads: every
    episode is the one a single group, stepped one by one, plays."""
    from earl_jax.rl.loop.trainer import Trainer
    from exact_cases import BASE, KINDS
    from jobs import job

    runs = []
    for k, workers in ((1, 1), (2, 1), (2, 4)):
        trainer = Trainer(job(**BASE, **KINDS[kind], rollout__max_turns=4, rollout__pipeline_groups=k,
                              env__step_workers=workers, run__run_dir=str(tmp_path / f"k{k}w{workers}")), log=False)
        seeds, group_ids, rng = trainer.rollout_inputs()
        traj, _ = trainer.play(trainer.matchmaker.train_env(0), seeds, group_ids, rng, trainer.sampling)
        assert trainer.rollout.pipeline_groups == k
        runs.append(traj)
    assert runs[0].num_games == 8 and runs[0].loss_mask.sum() > 8
    _same(runs[0], runs[1])
    _same(runs[0], runs[2])


def test_pipeline_groups_must_divide_the_batch():
    from earl_jax.rollout.rollout_config import RolloutConfig

    with pytest.raises(ValueError, match="pipeline_groups: must divide the batch"):
        RolloutConfig(groups=3, group_size=3, pipeline_groups=2)
