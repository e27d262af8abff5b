"""cuDNN attention runs per shard (shard_map) under a stage's mesh rules: the specs that split rows and heads
must give the same result as the unsplit computation (checked on CPU with XLA's attention in the kernel's
place, 8 fake devices)."""

import jax
import numpy as np
import pytest

from earl_jax.models.attention import _per_shard
from earl_jax.sharding.context import use_mesh_rules
from earl_jax.sharding.mesh import MeshShape, make_mesh
from earl_jax.sharding.stage_registry import STAGE_RULES


def _xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("mesh, stage, kv", [("d8f1t1", "train", 2), ("d2f2t2", "train", 2), ("d1f8t1", "train", 2),
                                             ("d2f1t4", "experience", 4), ("d4f1t2", "experience", 2)])
def test_per_shard_attention_equals_the_whole(mesh, stage, kv):
    b, t, n, h = 8, 16, 8, 16
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, n, h))
    k, v = (jax.random.normal(kk, (b, t, kv, h)) for kk in keys[1:])
    jmesh = make_mesh(MeshShape.parse(mesh))

    @jax.jit
    def run(q, k, v):
        with use_mesh_rules(jmesh, STAGE_RULES[stage]):
            return _per_shard(q, k, v, fn=_xla)

    out = run(q, k, v)
    assert out is not None
    np.testing.assert_allclose(np.asarray(out), np.asarray(_xla(q, k, v)), rtol=1e-5, atol=1e-5)


def test_per_shard_repeats_replicated_kv_heads_when_query_heads_are_split():
    """tensor 4 over 2 kv heads (3B on TP4): kv replicated, queries split; cuDNN needs both split alike."""
    b, t, n, h = 8, 16, 8, 16
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (b, t, n, h))
    k, v = (jax.random.normal(kk, (b, t, 2, h)) for kk in keys[1:])
    jmesh = make_mesh(MeshShape.parse("d2f1t4"))
    seen = []

    def kernel(q, k, v):  # what each shard's kernel gets: its own query heads and as many kv heads
        seen.append((q.shape, k.shape))
        return _xla(q, k, v)

    @jax.jit
    def run(q, k, v):
        with use_mesh_rules(jmesh, STAGE_RULES["experience"]):
            return _per_shard(q, k, v, fn=kernel)

    np.testing.assert_allclose(np.asarray(run(q, k, v)), np.asarray(_xla(q, k, v)), rtol=1e-5, atol=1e-5)
    assert seen and seen[0] == ((b // 2, t, n // 4, h), (b // 2, t, n // 4, h))
    assert _per_shard(q, k, v, fn=_xla) is None  # no rules active: the caller's global call
