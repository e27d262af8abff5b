"""--rollout.cache-growth: coarser KV cache sizes reach the sampler and the memory model, and compile fewer programs."""

from __future__ import annotations

import jax
import pytest

from earl_jax.models.model_config import ModelConfig
from earl_jax.parallel.memory import MemoryConfig, MemoryModel
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rollout.sampler import DEFAULT_CACHE_BUCKETS, geometric_cache_buckets
from earl_jax.sharding.mesh import MeshShape
from jobs import job, with_fields

# Games of at most 5 agent turns: contexts pass 256 tokens (default buckets 128, 256, 384, ...; coarse: 512 alone)
# with 3 against 12 decode programs, where whole games compiled 14 against 28 at 3x the test's time.
CFG = job(game="connect_four", prompt_style="compact", max_turn_tokens=8, max_context=2048, max_turns=5,
          groups=4, group_size=4, run__steps=1, sft__steps=0, eval__every=0, devices=1, checkpoint_every=0)


def test_geometric_buckets():
    assert geometric_cache_buckets(4)[:4] == (512, 2048, 8192, 32768)
    assert geometric_cache_buckets(2)[:4] == (256, 512, 1024, 2048)
    assert all(b % 128 == 0 for b in geometric_cache_buckets(1.5))
    with pytest.raises(ValueError, match="growth"):
        geometric_cache_buckets(1.2)
    with pytest.raises(ValueError, match="^--rollout.cache-growth: "):
        with_fields(CFG, rollout__cache_growth=1.2)


def test_memory_model_prices_the_padded_cache():
    cfg = ModelConfig.tiny(vocab_size=101)
    plain = MemoryModel(cfg, MemoryConfig(budget_bytes=2**34)).estimate("rollout", MeshShape(), 600, 64)
    coarse = MemoryModel(cfg, MemoryConfig(budget_bytes=2**34, cache_buckets=geometric_cache_buckets(4))
                         ).estimate("rollout", MeshShape(), 600, 64)
    assert coarse.kv_cache == pytest.approx(plain.kv_cache * 2048 / 600)  # 600 tokens sit in a 2048 cache


def _sampler_programs(tmp_path, **kw) -> tuple[Trainer, int]:
    """A trainer and the decode programs its first rollout compiled (the rollout alone: that is where they are)."""
    trainer = Trainer(with_fields(CFG, run_dir=str(tmp_path), **kw), log=False)
    n = CFG.batch_size
    trainer.play(trainer.env, list(range(n)), [i // CFG.rollout.group_size for i in range(n)], jax.random.key(0),
                 trainer.sampling)
    return trainer, sum(s.compile_count for s in trainer.rollout.samplers.values())


def test_coarse_cache_sizes_reach_the_stages_and_compile_fewer_decode_programs(tmp_path):
    coarse, n_coarse = _sampler_programs(tmp_path / "coarse", rollout__cache_growth=4.0)
    (sampler,) = coarse.rollout.samplers.values()
    assert sampler.cache_buckets == geometric_cache_buckets(4)
    assert coarse.policy.planner.selector.memory.mem.cache_buckets == geometric_cache_buckets(4)
    default, n_default = _sampler_programs(tmp_path / "default")
    assert next(iter(default.rollout.samplers.values())).cache_buckets == DEFAULT_CACHE_BUCKETS
    assert default.policy.planner.selector.memory.mem.cache_buckets is None
    assert n_coarse < n_default, (n_coarse, n_default)
