"""A long extend runs through the layer stack in chunks of positions, with the same result as one piece."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from earl_jax.models.model_config import get_config
from earl_jax.models.qwen2 import Qwen2
from earl_jax.parallel.memory import MemoryConfig, MemoryModel
from earl_jax.parallel.plan import RolloutExtends
from earl_jax.parallel.shapes import ProgramShapes
from earl_jax.rollout.sampler import Sampler
from earl_jax.sharding.mesh import MeshShape

CFG = get_config("tiny", vocab_size=101)


def test_a_prompt_in_chunks_gives_the_cache_and_logits_of_one_piece():
    graphdef, params = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32))
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, CFG.vocab_size, (3, 40)).astype(np.int32)
    num_new = np.array([40, 23, 0], np.int32)  # a row shorter than a chunk boundary, a row with nothing
    out = {}
    for chunk in (1024, 16):  # one piece, then chunks of 16 positions (three calls)
        sampler = ProgramShapes().watch(Sampler(graphdef, CFG, cache_dtype=jnp.float32, prefill_chunk=chunk))
        state = sampler.extend(params, sampler.init_state(3, 64), tokens, num_new)
        out[chunk] = (np.asarray(state.next_logits), np.asarray(state.lengths),
                      [np.asarray(x) for x in jax.tree.leaves(state.cache)])
        if chunk == 16:
            assert sorted(sampler.shapes.extend_widths) == [8, 16]  # 16 + 16 + 8 (the last chunk's bucket)
    (one_logits, one_len, one_cache), (ch_logits, ch_len, ch_cache) = out[1024], out[16]
    np.testing.assert_array_equal(one_len, ch_len)
    np.testing.assert_allclose(ch_logits[:2], one_logits[:2], rtol=1e-5, atol=1e-5)
    assert (ch_logits[:2].argmax(-1) == one_logits[:2].argmax(-1)).all()
    for a, b in zip(one_cache, ch_cache):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_memory_model_prices_a_long_prompt_in_chunks():
    cfg = get_config("qwen2.5-1.5b")
    long = RolloutExtends(prompt_tokens=16384, first_cache_len=16512, observation_tokens=0)
    chunked = MemoryModel(cfg, MemoryConfig(budget_bytes=140 * 2**30))
    whole = MemoryModel(cfg, MemoryConfig(budget_bytes=140 * 2**30, prefill_chunk=1 << 20))
    est = [m.estimate("rollout", MeshShape(1, 1, 1), 16512, 32, extends=long) for m in (chunked, whole)]
    # a 1024-position chunk, not 16K positions at once (what remains is the copy of a growing cache, 3/4 of the KV)
    assert est[0].activations * 3 < est[1].activations and est[0].activations <= 0.75 * est[0].kv_cache + 1
    assert chunked.fits(est[0])
