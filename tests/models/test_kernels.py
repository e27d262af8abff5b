"""The Pallas decode kernels (earl_jax/kernels) against XLA, under the Pallas interpreter on CPU: each kernel
computes the function its XLA twin computes, and the Sampler's Pallas decode step generates the same tokens
(greedy and sampled) with the same log-probs as the model's own step, also after the weights change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.kernels import tuning
from earl_jax.kernels.decode_attention import decode_attention, decode_attention_xla, inv_frequencies, num_splits
from earl_jax.kernels.linear import LinearConfig, linear, linear_xla
from earl_jax.models.cache import LayerCache
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.rollout.sampler import AUTO_MIN_CACHE, Sampler
from earl_jax.rollout.sampling import SamplingConfig

# Query groups of 3 (not a power of two: the kernel loads 16 rows and masks 13), biases on, 2 layers.
CFG = ModelConfig.tiny(vocab_size=64).replace(num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                              num_hidden_layers=2, attention_bias=True)


def _normal(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


@pytest.mark.parametrize("case", ["norm_bias", "swiglu", "residual_ragged", "kn_layout"])
def test_linear_matches_xla(case):
    m, k, n = (5, 64, 32) if case == "residual_ragged" else (16, 64, 48)
    kw, layout = {}, "nk"
    if case == "norm_bias":
        kw = dict(norm_eps=1e-6, bias=_normal(1, (n,)))
    elif case == "swiglu":
        kw = dict(norm_eps=1e-6, swiglu=True)
    elif case == "residual_ragged":
        kw = dict(residual=_normal(2, (m, n)))
    else:
        layout = "kn"
    n_w = 2 * n if case == "swiglu" else n
    x = _normal(3, (m, k))
    w = _normal(4, (n_w, k) if layout == "nk" else (k, n_w), 0.1)
    launch = LinearConfig(bm=16, bn=16, bk=32)  # several column programs and K steps
    got = linear(x, w, w_layout=layout, config=launch, interpret=True, **kw)
    np.testing.assert_allclose(got, linear_xla(x, w, w_layout=layout, **kw), rtol=1e-5, atol=1e-5)


def test_linear_rejects_mismatched_shapes_in_one_line():
    with pytest.raises(ValueError, match="x has K=64 but W"):
        linear(jnp.zeros((4, 64)), jnp.zeros((32, 48)), interpret=True)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_matches_the_models_attention(splits):
    b, n, kv, h, s = 4, 6, 2, 16, 256
    qkv = _normal(5, (b, n + 2 * kv, h))
    cache = LayerCache(_normal(6, (b, kv, s, h)), _normal(7, (b, kv, s, h)))
    pos = jnp.asarray([s, 0, 77, s - 1], jnp.int32)  # a finished row (writes nowhere), an empty one, the last slot
    want_o, want_c = decode_attention_xla(qkv, cache, pos, 1e4, n)
    got_o, got_c = decode_attention(qkv, cache, pos, inv_frequencies(h, 1e4), n, splits=splits, block=32,
                                    interpret=True)
    np.testing.assert_allclose(got_o[1:], want_o[1:], rtol=1e-5, atol=1e-5)  # row 0 attends nothing new
    np.testing.assert_allclose(got_c.k, want_c.k, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got_c.v, want_c.v)


def test_splits_fill_the_gpu_only_for_long_caches():
    assert num_splits(128, 2, 384, 128) == 1
    assert num_splits(32, 2, 24576, 128) == 4  # 64 programs -> 256, chunks of 6144 slots


@pytest.fixture(scope="session")
def model_params():
    graphdef, params = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32))
    # Random init gives near-uniform logits; a larger embedding makes argmax robust to float rounding.
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x * 8.0 if x.ndim == 2 and x.shape[0] == CFG.vocab_size else
        x + 0.5 * jax.random.normal(jax.random.key(len(jax.tree_util.keystr(p))), x.shape) if "bias" in
        jax.tree_util.keystr(p) else x, params)
    return graphdef, params


def _rollout(sampler, params):
    prompts = np.array([[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9], [10, 0, 0, 0, 0, 0]], np.int32)
    state = sampler.extend(params, sampler.init_state(3, 48), prompts, [3, 6, 1])
    state, g1 = sampler.generate(params, state, jax.random.key(0), max_new_tokens=6, budget=[6, 2, 5],
                                 stop_tokens=(17,), sampling=SamplingConfig(greedy=True))
    state = sampler.extend(params, state, np.array([[11, 12], [0, 0], [13, 14]], np.int32), [2, 0, 2])
    state, g2 = sampler.generate(params, state, jax.random.key(1), max_new_tokens=4, budget=4,
                                 sampling=SamplingConfig(temperature=0.9))
    return jax.device_get((g1, g2, state.lengths))


def _assert_same(got, want):
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.num_tokens, b.num_tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[2], want[2])


def test_pallas_decode_step_generates_what_the_model_does_also_after_a_weight_update(model_params):
    graphdef, params = model_params
    pallas = Sampler(graphdef, CFG, cache_dtype=jnp.float32, decode_impl="pallas_interpret")
    xla = Sampler(graphdef, CFG, cache_dtype=jnp.float32, decode_impl="xla")
    _assert_same(_rollout(pallas, params), _rollout(xla, params))
    laid_out = pallas.decode_weights(params, 48)
    assert pallas.decode_weights(params, 48) is laid_out  # once per weight version, not per generate call
    updated = jax.tree.map(lambda x: x * 1.1 if x.ndim == 2 else x, params)
    assert pallas.decode_weights(updated, 48) is not laid_out
    _assert_same(_rollout(pallas, updated), _rollout(xla, updated))


def test_auto_plan_takes_pallas_only_where_measured_faster(monkeypatch):
    cfg = ModelConfig.qwen2p5_1p5b()
    fast, slow = LinearConfig(32, 64, 128), LinearConfig(32, 32, 128)
    monkeypatch.setitem(tuning.MEASURED, "qkv", {(1536, 2048, 32): (fast, 4.0, 6.0)})
    monkeypatch.setitem(tuning.MEASURED, "down", {(8960, 1536, 32): (slow, 9.0, 7.0)})
    plan = tuning.plan(cfg, 32, 384, "auto")
    assert plan.qkv == fast and plan.down is None and plan.out is None  # out unmeasured: XLA
    assert plan.attention is not None  # the attention kernel wherever it applies
    assert tuning.plan(cfg, 32, 384, "pallas").down == slow


def test_sampler_names_the_bad_decode_impl():
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Qwen2(CFG, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match="decode_impl must be auto, xla, pallas"):
        Sampler(graphdef, CFG, decode_impl="triton")


def test_auto_runs_the_kernels_only_on_long_caches_of_one_gpu():
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Qwen2(CFG, rngs=nnx.Rngs(0))))
    assert Sampler(graphdef, CFG, decode_impl="auto").decode_impl == "xla"  # CPU: the XLA step
    pallas = Sampler(graphdef, CFG, decode_impl="pallas_interpret")
    assert pallas.kernel_step(384) and not pallas.kernel_step(100)  # every cache the kernel's blocks divide
    auto = Sampler(graphdef, CFG, decode_impl="pallas_interpret")
    auto.decode_impl = "auto"  # what one GPU gets: the threshold alone decides
    assert not auto.kernel_step(AUTO_MIN_CACHE // 2) and auto.kernel_step(AUTO_MIN_CACHE)
