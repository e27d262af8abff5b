"""A wide rollout extend attends its new tokens in query blocks once its float32 scores would pass a per-device
size: the same values, bounded memory, and the memory model counts what the model does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.models.attention import EXTEND_SCORES_BYTES, extend_query_block
from earl_jax.models.model_config import get_config
from earl_jax.models.qwen2 import cached_attention
from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel
from earl_jax.sharding.context import use_mesh_rules
from earl_jax.sharding.mesh import MeshShape, make_mesh
from earl_jax.sharding.stage_registry import STAGE_RULES


def test_block_is_everything_when_it_fits_else_the_largest_power_of_two_that_does():
    per_query = 8 * 4 * 1024 * 4  # rows x heads x slots x 4 bytes
    assert extend_query_block(8, 4, 100, 1024, limit_bytes=100 * per_query) == 100
    assert extend_query_block(8, 4, 100, 1024, limit_bytes=99 * per_query) == 64
    assert extend_query_block(8, 4, 100, 1024, limit_bytes=5 * per_query) == 4
    assert extend_query_block(8, 4, 100, 1024, limit_bytes=1) == 1  # never zero


def _inputs(b=4, t=13, n=8, kv=2, s=32, h=16):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, n, h))
    k, v = (jax.random.normal(kk, (b, kv, s, h)) for kk in keys[1:])
    start = jnp.array([0, 3, 7, 19])[:b]  # each row's own position: rows at different lengths
    return q, k, v, start[:, None] + jnp.arange(t)[None, :]


@pytest.mark.parametrize("limit", [1, 4 * 2 * 32 * 4 * 3])  # blocks of 1, and of 2 (13 queries: padded to 14)
def test_blocked_extend_equals_the_whole(limit):
    q, k, v, pos = _inputs()
    whole = cached_attention(q, k, v, pos, limit_bytes=2**40)
    blocked = jax.jit(lambda *a: cached_attention(*a, limit_bytes=limit))(q, k, v, pos)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_the_block_follows_each_devices_rows_and_heads_under_a_mesh():
    """Under d4f1t2 a device holds a quarter of the rows and half the heads: a limit the whole batch passes but one
    device's share does not leave the extend unblocked (one program, the same values)."""
    q, k, v, pos = _inputs(b=4, t=8, n=8)
    whole_bytes = 4 * 8 * 8 * 32 * 4
    limit = whole_bytes // 8  # exactly one device's share: rows 4/4, heads 8/2
    mesh = make_mesh(MeshShape.parse("d4f1t2"))

    def attend(*a):
        with use_mesh_rules(mesh, STAGE_RULES["rollout"]):
            return cached_attention(*a, limit_bytes=limit)

    np.testing.assert_allclose(np.asarray(jax.jit(attend)(q, k, v, pos)), np.asarray(cached_attention(q, k, v, pos)),
                               rtol=1e-5, atol=1e-5)
    assert "scan" not in str(jax.make_jaxpr(attend)(q, k, v, pos))  # one device's share fits: unblocked
    # the whole batch on one device (no rules) passes the same limit: blocked
    assert "scan" in str(jax.make_jaxpr(lambda *a: cached_attention(*a, limit_bytes=limit))(q, k, v, pos))


def test_blocking_bounds_the_compiled_programs_temporaries():
    b, t, n, s, h = 64, 256, 4, 4096, 16  # 1 GiB of float32 scores at once
    args = (jax.ShapeDtypeStruct((b, t, n, h), jnp.float32), jax.ShapeDtypeStruct((b, 1, s, h), jnp.float32),
            jax.ShapeDtypeStruct((b, 1, s, h), jnp.float32), jax.ShapeDtypeStruct((b, t), jnp.int32))

    def temp(limit):
        compiled = jax.jit(lambda *a: cached_attention(*a, limit_bytes=limit)).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full, blocked = temp(2**40), temp(64 * 2**20)
    assert full >= 2**30 and blocked * 4 < full, (full, blocked)


def test_memory_model_counts_the_blocks_the_model_uses():
    mm = MemoryModel(get_config("tiny"), MemoryConfig(budget_bytes=64 * GiB))
    heads = get_config("tiny").num_attention_heads
    small = mm._extend_scores(8, 64, 1024, 1)
    assert small == 2 * 8 * heads * 64 * 1024 * 4  # under the limit: the whole extend at once
    rows, q_len, slots = 8192, 64, 1536  # NOTES.md call 63: 12 GiB of scores in one GPU's rollout
    assert rows * heads * q_len * slots * 4 > EXTEND_SCORES_BYTES
    block = extend_query_block(rows, heads, q_len, slots)
    assert mm._extend_scores(rows, q_len, slots, 1) == 2 * rows * heads * block * slots * 4 <= 2 * EXTEND_SCORES_BYTES
    # so the selector finds one GPU enough for the 8192-game job at 1.5K tokens, as the model now runs it
    est = mm.estimate("rollout", MeshShape(1, 1, 1), 1536, 8192)
    assert mm.fits(est)
