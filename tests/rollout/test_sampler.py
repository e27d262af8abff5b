"""The sampler: generation over a live ragged cache equals step-by-step full forwards; stops, budgets,
sampling distributions, bounded compiles, and the same outputs on every mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.models.init import init_sharded
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.rollout.sampler import Sampler
from earl_jax.rollout.sampling import SamplingConfig, program_key, runtime_values, sample_logits
from earl_jax.sharding.mesh import INFERENCE_RULES, MeshShape, make_mesh

CFG = ModelConfig.tiny(vocab_size=64).replace(num_attention_heads=8, num_key_value_heads=4, head_dim=16)
GREEDY = SamplingConfig(greedy=True)


def _sharpen(state):
    # Random init gives near-uniform logits; a larger embedding makes argmax robust to 1e-6 rounding.
    # Biases start at zero; random ones check that every code path applies them to the right heads.
    def one(path, x):
        if x.ndim == 2 and x.shape[0] == CFG.vocab_size:
            return x * 8.0
        if "bias" in jax.tree_util.keystr(path):
            seed = sum(map(ord, jax.tree_util.keystr(path)))
            return x + 0.5 * jax.random.normal(jax.random.key(seed), x.shape, x.dtype)
        return x
    return jax.tree_util.tree_map_with_path(one, state)


@pytest.fixture(scope="session")
def setup():
    model = Qwen2(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32)
    graphdef, params = nnx.split(model)
    params = _sharpen(params)
    return graphdef, params, nnx.merge(graphdef, params)


def _sampler(graphdef, **kw):
    return Sampler(graphdef, CFG, cache_dtype=jnp.float32, **kw)


_REF_LEN = 32


@nnx.jit
def _forward(model, tokens):
    return model(tokens)[0]


def _full_logits(model, seq):
    """Logits of one full forward (no cache) over a 1-D token sequence: [t, v]. Padded to a fixed
    length (causal, so the padding changes nothing before it) to compile once."""
    assert len(seq) <= _REF_LEN
    tokens = np.zeros((1, _REF_LEN), np.int32)
    tokens[0, :len(seq)] = seq
    return np.asarray(_forward(model, jnp.asarray(tokens))[0, :len(seq)])


def _log_softmax(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))


def _ragged(rows, width=None):
    width = width or max(len(r) for r in rows)
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out, np.array([len(r) for r in rows], np.int32)


def _check_generation(model, seqs, gen, budgets, greedy=True, stop_tokens=()):
    """seqs: each row's context before generating. Checks tokens (greedy) and logprobs against full
    forwards, and returns the contexts with the generated tokens appended."""
    out = []
    for r, seq in enumerate(seqs):
        n = int(gen.num_tokens[r])
        toks = [int(t) for t in np.asarray(gen.tokens[r, :n])]
        assert n <= budgets[r]
        ctx = list(seq)
        for i, tok in enumerate(toks):
            lp = _log_softmax(_full_logits(model, ctx)[-1])
            if greedy:
                assert tok == int(np.argmax(lp)), (r, i)
            np.testing.assert_allclose(gen.logprobs[r, i], lp[tok], rtol=1e-4, atol=1e-4)
            ctx.append(tok)
        assert np.all(np.asarray(gen.tokens[r, n:]) == 0)
        stopped = bool(gen.stopped[r])
        assert stopped == (n > 0 and toks[-1] in stop_tokens)
        if not stopped:
            assert n == budgets[r] or n == gen.tokens.shape[1]
        out.append(ctx)
    return out


def test_multi_turn_greedy_equals_full_forward(setup):
    """prefill -> generate -> extend with ragged observations -> generate; every token, log-prob and
    next_logits equal the full forward over the same sequence."""
    graphdef, params, model = setup
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 64, n)) for n in (5, 9, 2)]
    sampler = _sampler(graphdef)
    state = sampler.init_state(3, 40)
    tokens, n = _ragged(prompts)
    state = sampler.extend(params, state, tokens, n)
    for r, p in enumerate(prompts):
        np.testing.assert_allclose(state.next_logits[r], _full_logits(model, p)[-1], rtol=1e-5, atol=1e-5)

    budgets = [6, 3, 0]
    state, gen = sampler.generate(params, state, jax.random.key(0), max_new_tokens=6, budget=budgets,
                                  sampling=GREEDY)
    assert list(np.asarray(gen.num_tokens)) == budgets
    ctxs = _check_generation(model, prompts, gen, budgets)
    assert list(np.asarray(state.lengths)) == [len(c) for c in ctxs]
    for r, c in enumerate(ctxs):  # also the inactive row: next_logits untouched
        np.testing.assert_allclose(state.next_logits[r], _full_logits(model, c)[-1], rtol=1e-5, atol=1e-5)

    # Ragged observations; row 1 gets none this turn.
    obs = [list(rng.integers(1, 64, n)) for n in (4, 0, 7)]
    tokens, n = _ragged(obs)
    state = sampler.extend(params, state, tokens, n)
    ctxs = [c + o for c, o in zip(ctxs, obs)]
    assert list(np.asarray(state.lengths)) == [len(c) for c in ctxs]
    for r, c in enumerate(ctxs):
        np.testing.assert_allclose(state.next_logits[r], _full_logits(model, c)[-1], rtol=1e-5, atol=1e-5)

    budgets = [5, 5, 5]
    state, gen = sampler.generate(params, state, jax.random.key(1), max_new_tokens=5, budget=budgets,
                                  sampling=GREEDY)
    ctxs = _check_generation(model, ctxs, gen, budgets)
    for r, c in enumerate(ctxs):
        np.testing.assert_allclose(state.next_logits[r], _full_logits(model, c)[-1], rtol=1e-5, atol=1e-5)


def test_sampled_logprobs_equal_full_forward(setup):
    graphdef, params, model = setup
    prompts = [[3, 5, 7], [11, 13, 17, 19, 23]]
    sampler = _sampler(graphdef)
    state = sampler.extend(params, sampler.init_state(2, 32), *_ragged(prompts))
    sampling = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)
    state, gen = sampler.generate(params, state, jax.random.key(3), max_new_tokens=7, budget=7,
                                  sampling=sampling)
    for r, seq in enumerate(prompts):
        ctx = list(seq)
        for i in range(7):
            tok = int(gen.tokens[r, i])
            lp = _log_softmax(_full_logits(model, ctx)[-1] / 0.8)
            np.testing.assert_allclose(gen.logprobs[r, i], lp[tok], rtol=1e-4, atol=1e-4)
            assert lp[tok] >= np.sort(lp)[-20]  # inside the top-k
            ctx.append(tok)


def test_stop_tokens_and_budgets_per_row(setup):
    graphdef, params, model = setup
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    sampler = _sampler(graphdef)
    base = sampler.extend(params, sampler.init_state(3, 32), *_ragged(prompts))
    snapshot = jax.tree.map(jnp.copy, base)
    _, free = sampler.generate(params, base, jax.random.key(0), max_new_tokens=8, budget=8, sampling=GREEDY)
    free_toks = np.asarray(free.tokens)
    # Stop row 0 at its 3rd token: pick a token that first appears there in row 0's free run.
    stop = int(free_toks[0, 2])
    first = [int(np.argmax(free_toks[r] == stop)) if stop in free_toks[r] else None for r in range(3)]
    budgets = [8, 4, 8]
    state, gen = sampler.generate(params, snapshot, jax.random.key(0), max_new_tokens=8, budget=budgets,
                                  stop_tokens=(stop,), sampling=GREEDY)
    for r in range(3):
        want = budgets[r] if first[r] is None or first[r] >= budgets[r] else first[r] + 1
        assert int(gen.num_tokens[r]) == want, r
        assert bool(gen.stopped[r]) == (first[r] is not None and first[r] < budgets[r]), r
        np.testing.assert_array_equal(gen.tokens[r, :want], free_toks[r, :want])
        assert int(state.lengths[r]) == len(prompts[r]) + want  # the stop token is kept in the cache
    assert int(gen.num_tokens[0]) == first[0] + 1 and bool(gen.stopped[0])
    _check_generation(model, prompts, gen, budgets, stop_tokens=(stop,))


def test_generate_stops_at_cache_end(setup):
    graphdef, params, model = setup
    sampler = _sampler(graphdef, cache_buckets=(16,))
    state = sampler.extend(params, sampler.init_state(2, 16), *_ragged([[1] * 12, [2] * 3]))
    state, gen = sampler.generate(params, state, jax.random.key(0), max_new_tokens=10, budget=10,
                                  sampling=GREEDY)
    assert list(np.asarray(gen.num_tokens)) == [4, 10]
    assert list(np.asarray(state.lengths)) == [16, 13]
    state = sampler.ensure_capacity(state, 30)
    assert state.max_len == 32 and list(np.asarray(state.lengths)) == [16, 13]
    state, gen2 = sampler.generate(params, state, jax.random.key(0), max_new_tokens=4, budget=4,
                                   sampling=GREEDY)
    ctx = [[1] * 12 + list(np.asarray(gen.tokens[0, :4]))]
    _check_generation(model, ctx, Generation1(gen2, 0), [4])


class Generation1:
    """One row of a Generation, as a batch of one."""

    def __init__(self, gen, r):
        self.tokens, self.logprobs = gen.tokens[r:r + 1], gen.logprobs[r:r + 1]
        self.num_tokens, self.stopped = gen.num_tokens[r:r + 1], gen.stopped[r:r + 1]


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = jax.random.normal(jax.random.key(0), (64, 100)) * 3
    want = np.argmax(logits, -1)
    for cfg in (SamplingConfig(top_k=1), SamplingConfig(top_p=1e-6), SamplingConfig(top_k=5, top_p=1e-6),
                SamplingConfig(temperature=0.0), SamplingConfig(greedy=True, temperature=2.0)):
        for seed in range(3):
            tok, lp = sample_logits(jax.random.key(seed), logits, cfg)
            np.testing.assert_array_equal(tok, want)
            if cfg.is_greedy:  # the same answer with greedy as a traced flag (the sampler's programs)
                tok2, lp2 = _traced(jax.random.key(seed), logits, cfg)
                np.testing.assert_array_equal(tok2, want)
                np.testing.assert_allclose(lp2, lp, rtol=1e-5, atol=1e-6)
            t = cfg.temperature if cfg.temperature > 0 else 1.0
            np.testing.assert_allclose(lp, _log_softmax(logits / t)[np.arange(64), want], rtol=1e-5, atol=1e-6)


def _traced(rng, logits, cfg):
    """sample_logits as the sampler calls it: top-k / top-p static, temperature and greedy traced."""
    return jax.jit(lambda r, x, t, g: sample_logits(r, x, program_key(cfg), t, g))(rng, logits, *runtime_values(cfg))


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.5, top_k=3),
                                 SamplingConfig(top_p=0.8)])
def test_sampling_histogram_matches_probabilities(cfg, traced):
    logits = jnp.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    n = 40_000
    tok, lp = (_traced if traced else sample_logits)(jax.random.key(42), jnp.broadcast_to(logits, (n, 8)), cfg)
    p = np.exp(_log_softmax(logits / cfg.temperature))
    np.testing.assert_allclose(lp, np.log(p)[np.asarray(tok)], rtol=1e-5, atol=1e-6)  # untruncated
    order = np.argsort(-p)
    keep = np.zeros(8, bool)
    if cfg.top_k:
        keep[order[:cfg.top_k]] = True
    else:
        keep[:] = True
    if cfg.top_p < 1:
        mass_before = np.cumsum(p[order]) - p[order]
        nucleus = np.zeros(8, bool)
        nucleus[order[mass_before < cfg.top_p]] = True
        keep &= nucleus
    want = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    got = np.bincount(np.asarray(tok), minlength=8) / n
    np.testing.assert_allclose(got, want, atol=0.01)  # ~4 sigma at n=40k
    assert np.all(got[~keep] == 0)


def test_compile_count_stays_bounded(setup):
    graphdef, params, _ = setup
    sampler = _sampler(graphdef, length_buckets=(8, 16), cache_buckets=(64,))
    rng = np.random.default_rng(0)
    counts = []
    for round_ in range(3):
        state = sampler.init_state(2, 40)
        for t in (3, 7, 12):  # two length buckets
            toks = rng.integers(1, 64, (2, t))
            state = sampler.extend(params, state, toks, [t, t - 1])
            state, _ = sampler.generate(params, state, jax.random.key(t), max_new_tokens=t % 5 + 2,
                                        budget=[3, 2], stop_tokens=(5,), sampling=GREEDY)
        counts.append(sampler.compile_count)
    # init + extend x 2 buckets + generate x 1 bucket, all traced in the first round only.
    assert counts == [4, 4, 4]
    # sampled decoding (any temperature) runs greedy's program: temperature and greedy are runtime values
    state, _ = sampler.generate(params, sampler.init_state(2, 40), jax.random.key(0), max_new_tokens=4, budget=[3, 2],
                                stop_tokens=(5,), sampling=SamplingConfig(temperature=0.7))
    assert sampler.compile_count == 4


def _mesh_run(sampler, params):
    """Prefill, greedy turn, ragged extend, sampled turn: everything a mesh could change."""
    prompts = [list(np.random.default_rng(i).integers(1, 64, 1 + i)) for i in range(8)]
    sampling = SamplingConfig(temperature=1.0, top_k=10)
    state = sampler.extend(params, sampler.init_state(8, 32), *_ragged(prompts))
    state, g1 = sampler.generate(params, state, jax.random.key(7), max_new_tokens=6,
                                 budget=[6, 5, 4, 3, 6, 5, 4, 3], sampling=GREEDY)
    obs = [[9] * (i % 3) for i in range(8)]
    state = sampler.extend(params, state, *_ragged(obs, width=2))
    state, g2 = sampler.generate(params, state, jax.random.key(8), max_new_tokens=6, budget=6,
                                 sampling=sampling)
    return jax.device_get((g1, g2, state.lengths, state.next_logits))


@pytest.fixture(scope="session")
def mesh_reference(setup):
    graphdef, params, _ = setup
    return _mesh_run(_sampler(graphdef), params)


@pytest.mark.parametrize("shape", ["1x8", "2x4", "4x2"])
def test_same_outputs_on_every_mesh(setup, mesh_reference, shape):
    ref = mesh_reference
    mesh = make_mesh(MeshShape.parse(shape))
    _, params, _ = setup
    sharded_graphdef, layout = nnx.split(init_sharded(CFG, mesh, INFERENCE_RULES, seed=0, dtype=jnp.float32))
    # The reference's weights in init_sharded's shardings (init_sharded draws other values than Qwen2(Rngs(0))).
    sharded = jax.tree.map(lambda w, x: jax.device_put(w, x.sharding), params, layout)
    got = _mesh_run(Sampler(sharded_graphdef, CFG, mesh=mesh, rules=INFERENCE_RULES, cache_dtype=jnp.float32), sharded)
    for a, b in zip(ref[:2], got[:2]):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.num_tokens, b.num_tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(ref[2], got[2])
    np.testing.assert_allclose(ref[3], got[3], rtol=1e-4, atol=1e-4)


def test_fused_attention_and_multi_step_loop_give_the_same_generation(setup):
    """The single-device decode step with the Pallas write+attend kernel (interpret mode on CPU) and
    several decode steps per loop check change no token, log-prob, length or next_logits."""
    graphdef, params, _ = setup
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    obs = [[11, 12], [], [13, 14, 15]]

    def run(sampler):
        state = sampler.extend(params, sampler.init_state(3, 40), *_ragged(prompts))
        state, g1 = sampler.generate(params, state, jax.random.key(0), max_new_tokens=7, budget=[7, 3, 5],
                                     stop_tokens=(17, 33), sampling=GREEDY)
        state = sampler.extend(params, state, *_ragged(obs))
        state, g2 = sampler.generate(params, state, jax.random.key(1), max_new_tokens=5, budget=5,
                                     sampling=SamplingConfig(temperature=0.9))
        return jax.device_get((g1, g2, state.lengths, state.next_logits))

    ref = run(_sampler(graphdef, decode_impl="xla"))
    for kw in (dict(decode_impl="pallas_interpret"), dict(decode_impl="xla", steps_per_check=3)):
        got = run(_sampler(graphdef, **kw))
        for a, b in zip(ref[:2], got[:2]):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.num_tokens, b.num_tokens)
            np.testing.assert_array_equal(a.stopped, b.stopped)
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(ref[2], got[2])
        np.testing.assert_allclose(ref[3], got[3], rtol=1e-4, atol=1e-4)
