"""The Qwen2 decoder: incremental decoding equals one full forward; the same logits on every mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.models.cache import cache_shardings, init_cache
from earl_jax.models.init import abstract_model, init_sharded
from earl_jax.models.model_config import PRESETS, ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.sharding.context import use_mesh_rules
from earl_jax.sharding.mesh import INFERENCE_RULES, TRAIN_RULES, MeshShape, make_mesh

CFG = ModelConfig.tiny(vocab_size=64).replace(num_attention_heads=8, num_key_value_heads=4, head_dim=16)


def _model(cfg=CFG, **kw):
    return Qwen2(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, **kw)


def _one_device_init(seed=0):
    """init_sharded's values on one device: the reference for the sharded models (same seed, same values)."""
    return init_sharded(CFG, make_mesh(MeshShape(), jax.devices()[:1]), INFERENCE_RULES, seed=seed, dtype=jnp.float32)


def test_param_count_matches_config():
    for name, make in PRESETS.items():
        cfg = make()
        n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract_model(cfg))))
        assert n == cfg.num_params(), name
    # Published sizes of the Qwen2.5 family (billions, rounded as on the model cards).
    assert round(PRESETS["qwen2.5-0.5b"]().num_params() / 1e9, 2) == 0.49
    assert round(PRESETS["qwen2.5-72b"]().num_params() / 1e9, 1) == 72.7


def test_every_param_has_logical_axes():
    state = nnx.state(abstract_model(PRESETS["qwen2.5-7b"]()))
    for path, var in nnx.to_flat_state(state):
        axes = var.get_metadata().get("logical_axes")
        assert axes is not None and len(axes) == var.get_value().ndim, path


@pytest.mark.parametrize("chunks", [(10,), (6, 3, 1), (1,) * 10])
def test_cached_prefill_and_extend_equal_full_forward(chunks):
    model = _model()
    tokens = jax.random.randint(jax.random.key(1), (3, 10), 0, CFG.vocab_size)
    full, _ = model(tokens)
    cache = init_cache(CFG, 3, 16, jnp.float32)
    outs, start = [], 0
    for n in chunks:
        pos = jnp.broadcast_to(jnp.arange(start, start + n), (3, n))
        logits, cache = model(tokens[:, start:start + n], pos, cache)
        outs.append(logits)
        start += n
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_ragged_rows_in_one_cache():
    """Rows at different lengths extend in one call; each equals its own unbatched forward."""
    model = _model()
    seqs = [jax.random.randint(jax.random.key(i), (n,), 0, CFG.vocab_size) for i, n in enumerate([5, 9])]
    cache = init_cache(CFG, 2, 16, jnp.float32)
    # Prefill 3 tokens each, then extend row 0 by 2 and row 1 by 6 (padded to 6).
    first = jnp.stack([s[:3] for s in seqs])
    _, cache = model(first, jnp.broadcast_to(jnp.arange(3), (2, 3)), cache)
    ext = jnp.stack([jnp.pad(seqs[0][3:], (0, 4)), seqs[1][3:]])
    logits, cache = model(ext, 3 + jnp.broadcast_to(jnp.arange(6), (2, 6)), cache)
    for row, (s, n_new) in enumerate(zip(seqs, [2, 6])):
        ref, _ = model(s[None])
        np.testing.assert_allclose(logits[row, :n_new], ref[0, 3:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", ["1x8", "2x4", "4x2", "8x1"])
def test_same_logits_on_every_mesh(shape):
    mesh_shape = MeshShape.parse(shape)
    mesh = make_mesh(mesh_shape)
    ref_model = _one_device_init()
    tokens = jax.random.randint(jax.random.key(2), (8, 12), 0, CFG.vocab_size)
    ref, _ = ref_model(tokens)

    model = init_sharded(CFG, mesh, INFERENCE_RULES, seed=0, dtype=jnp.float32)
    q = model.layers[0].attn.q_dnh[...]
    if mesh_shape.tensor > 1:  # really split over heads, not silently replicated
        assert q.sharding.shard_shape(q.shape)[1] == CFG.num_attention_heads // mesh_shape.tensor
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens, cache):
        with use_mesh_rules(mesh, INFERENCE_RULES):
            m = nnx.merge(graphdef, state)
            pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            return m(tokens, pos, cache)

    cache = jax.jit(lambda: init_cache(CFG, 8, 16, jnp.float32),
                    out_shardings=cache_shardings(CFG, 8, 16, mesh, INFERENCE_RULES))()
    logits, cache = fwd(state, tokens, cache)
    np.testing.assert_allclose(logits, ref, rtol=2e-5, atol=2e-5)


def test_train_rules_shard_params_over_fsdp_and_tensor():
    mesh = make_mesh(MeshShape(2, 2, 2))
    model = init_sharded(CFG, mesh, TRAIN_RULES, dtype=jnp.float32)
    w = model.layers[0].mlp.gate_df[...]
    assert w.sharding.shard_shape(w.shape) == (CFG.hidden_size // 2, CFG.intermediate_size // 2)
    ref, _ = _one_device_init()(jnp.arange(8)[None] % CFG.vocab_size)
    out, _ = model(jnp.arange(8)[None] % CFG.vocab_size)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.tiny().replace(num_attention_heads=4, num_key_value_heads=3)


def test_blocked_causal_attention_equals_full_attention_and_its_gradient():
    from earl_jax.models.attention import causal_attention

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 300, 4, 16))
    k, v = (jax.random.normal(kk, (2, 300, 2, 16)) for kk in keys[1:])
    full = lambda q: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    blocked = lambda q: causal_attention(q, k, v, q_block=64)  # noqa: E731
    np.testing.assert_allclose(blocked(q), full(q), atol=1e-5)
    np.testing.assert_allclose(jax.grad(lambda q: blocked(q).sum())(q), jax.grad(lambda q: full(q).sum())(q),
                               atol=1e-5)


@pytest.mark.parametrize("remat", [False, True])
def test_layers_are_traced_once_and_compute_what_a_plain_loop_does(monkeypatch, remat):
    """The decoder layers run as one nested program traced once for all layers of the same shapes; the logits and
    gradients equal those of calling each layer in a Python loop (to float rounding), under a mesh's sharding names
    too."""
    from earl_jax.models import qwen2

    model = _model(CFG.replace(num_hidden_layers=4), remat=remat)
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, CFG.vocab_size, (2, 12)), jnp.int32)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(tokens)[0] ** 2)

    traced = []
    call = qwen2.DecoderLayer.__call__
    monkeypatch.setattr(qwen2.DecoderLayer, "__call__", lambda self, *a: (traced.append(1), call(self, *a))[1])
    mesh = make_mesh(MeshShape.parse("d2f1t1"), jax.devices()[:2])
    with use_mesh_rules(mesh, TRAIN_RULES):
        nested = jax.jit(jax.value_and_grad(loss))(params)
    assert len(traced) == 1, len(traced)  # one trace serves the four layers (forward and gradient)

    monkeypatch.setattr(qwen2, "_apply_layer", lambda layer, x, positions, cache, remat: layer(x, positions, cache))
    with use_mesh_rules(mesh, TRAIN_RULES):
        plain = jax.jit(jax.value_and_grad(loss))(params)
    assert len(traced) == 5
    # float rounding: XLA may fuse the two differently
    for a, b in zip(jax.tree.leaves(nested), jax.tree.leaves(plain)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(b).max())))
