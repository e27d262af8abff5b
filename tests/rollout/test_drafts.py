"""Drafts from history (rollout/drafts.py) verified by speculative decoding (rollout/speculate.py): the answers'
distribution is plain decoding's (a chi-square test that an always-accept rule fails), greedy answers and their
log-probs are plain decoding's token for token, the index proposes what followed a context tail before, and the
flag is off by default and refused where it cannot apply."""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.cli import ConfigError
from earl_jax.envs import EnvConfig
from earl_jax.envs.vector import make_vector_env
from earl_jax.models.init import init_sharded
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.models.tokenizer import game_tokenizer, special_ids
from earl_jax.rollout import speculate
from earl_jax.rollout.agent_loop import PlayConfig, play_games
from earl_jax.rollout.drafts import NO_TOKEN, DraftIndex
from earl_jax.rollout.moves import MoveTokens
from earl_jax.rollout.policy import SamplerPolicy
from earl_jax.rollout.rollout_config import RolloutConfig
from earl_jax.rollout.sampler import Sampler, SamplingConfig
from earl_jax.rollout.sampling import truncate
from earl_jax.sharding.mesh import INFERENCE_RULES, MeshShape, make_mesh
from exact_cases import _trainer
from jobs import job

V = 6  # a vocabulary small enough to enumerate every answer
STOP = 5
CFG = ModelConfig.tiny(vocab_size=V).replace(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                             num_attention_heads=2, num_key_value_heads=1)
CONTEXT = [1, 3, 2, 4]
GREEDY = SamplingConfig(greedy=True)


def _model(cfg):
    graphdef, params = nnx.split(Qwen2(cfg, rngs=nnx.Rngs(1), dtype=jnp.float32))
    # a larger embedding: peaked next-token distributions, so drafts are accepted often and rejected often
    return graphdef, jax.tree.map(lambda x: x * 3.0 if V in x.shape else x, params)


@pytest.fixture(scope="session")
def model():
    return _model(CFG)


@pytest.fixture(scope="session")
def untied():
    """Greedy answers that vary (a tied random model repeats its last token)."""
    return _model(CFG.replace(tie_word_embeddings=False))


class Fixed:
    """A draft source that proposes row r's drafts[r] whatever its context."""

    n = 8

    def __init__(self, drafts: list[list[int]]):
        self.drafts = drafts
        self.width = max(map(len, drafts)) or 1

    def propose(self, contexts):
        out = np.zeros((len(contexts), self.width), np.int32)
        lengths = np.zeros(len(contexts), np.int32)
        for r in range(len(contexts)):
            d = self.drafts[r % len(self.drafts)]
            out[r, :len(d)], lengths[r] = d, len(d)
        return out, lengths


def _answers(model, drafts, sampling, rows, budget=3, stops=(STOP,), sampler=None, contexts=None):
    """Every row answers once after its context (CONTEXT by default), drafting from `drafts` (None: off)."""
    graphdef, params = model
    sampler = sampler or Sampler(graphdef, nnx.merge(graphdef, params).cfg, cache_dtype=jnp.float32)
    policy = SamplerPolicy(sampler, params, sampling, stops, budget, drafts=drafts)
    contexts = contexts if contexts is not None else [CONTEXT] * rows
    policy.reset(rows, 32)
    ids = np.array([c + [0] * (8 - len(c)) for c in contexts], np.int32)
    policy.extend(ids, np.array([len(c) for c in contexts]))
    out = policy.generate(np.full(rows, budget, np.int32), jax.random.key(7), np.arange(rows, dtype=np.int32))()
    return out, policy


def _exact(model, sampling, budget=3):
    """The probability of every answer (up to `budget` tokens, ending at STOP), from teacher-forced next-token
    distributions of every prefix; and per prefix the log-probs a sampler records (log_softmax(logits / T))."""
    graphdef, params = model
    sampler = Sampler(graphdef, CFG, cache_dtype=jnp.float32)
    prefixes = [p for n in range(budget) for p in itertools.product(range(V), repeat=n) if STOP not in p]
    state = sampler.init_state(len(prefixes), 32)
    ids = np.array([CONTEXT + list(p) + [0] * (budget - len(p)) for p in prefixes], np.int32)
    state = sampler.extend(params, state, ids, np.array([len(CONTEXT) + len(p) for p in prefixes]))
    scaled = jnp.asarray(state.next_logits) / sampling.temperature
    probs = np.asarray(jax.nn.softmax(truncate(scaled, sampling.top_k, sampling.top_p), axis=-1), np.float64)
    nxt = dict(zip(prefixes, probs))
    recorded = dict(zip(prefixes, np.asarray(jax.nn.log_softmax(scaled, axis=-1))))
    exact = {}
    for prefix in prefixes:
        for t in range(V):
            answer = prefix + (t,)
            if t == STOP or len(answer) == budget:
                exact[answer] = math.prod(nxt[answer[:i]][answer[i]] for i in range(len(answer)))
    return exact, recorded


def _chi_square(exact, out) -> tuple[float, float]:
    """(statistic, its 1e-5 critical value): observed answers against the exact probabilities, cells of expected
    count < 5 pooled; the critical value by Wilson-Hilferty."""
    observed = {}
    for row, n in zip(out.tokens.tolist(), out.counts.tolist()):
        observed[tuple(row[:n])] = observed.get(tuple(row[:n]), 0) + 1
    assert set(observed) <= set(exact), set(observed) - set(exact)
    total = len(out.counts)
    cells, pooled = [], [0.0, 0]
    for answer, p in exact.items():
        if p * total >= 5:
            cells.append((p * total, observed.get(answer, 0)))
        else:
            pooled[0] += p * total
            pooled[1] += observed.get(answer, 0)
    cells.append(tuple(pooled))
    stat = sum((o - e) ** 2 / e for e, o in cells if e > 0)
    dof = len(cells) - 1
    z = 4.265  # the standard normal's 1 - 1e-5 quantile
    return stat, dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _drafts(exact) -> list[list[int]]:
    """Drafts of every kind for one batch: the likeliest answer, its start then a less likely turn, its start then the
    stop token, a less likely answer, a single token, none."""
    top = list(max(exact, key=exact.get))
    other = next(t for t in range(V) if t not in (top[0], STOP))
    return [top, [top[0], other, top[0]], [top[0], STOP], [other] * 3, [other], []]


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3)])
def test_answers_with_drafts_have_plain_decodings_distribution(model, sampling):
    exact, recorded = _exact(model, sampling)
    plain, _ = _answers(model, None, sampling, rows=4096)
    drafted, policy = _answers(model, Fixed(_drafts(exact)), sampling, rows=4096)
    assert 0.1 < policy.speculation.accepted / policy.speculation.proposed < 0.9  # both branches of the rule run
    for out in (plain, drafted):  # every token's log-prob is the one plain decoding records
        for row, logp, n in zip(out.tokens.tolist(), out.logprobs, out.counts.tolist()):
            np.testing.assert_allclose(logp[:n], [recorded[tuple(row[:i])][row[i]] for i in range(n)], atol=1e-5)
    for out in (plain, drafted):
        stat, critical = _chi_square(exact, out)
        assert stat < critical, (stat, critical)


def test_an_always_accept_rule_fails_the_distribution_test(model, monkeypatch):
    real = speculate.accept_drafts

    def always(keys, logits, drafts, lengths, *a):
        accepted, token, draft_lp, token_lp = real(keys, logits, drafts, lengths, *a)
        return lengths, token, draft_lp, token_lp

    monkeypatch.setattr(speculate, "accept_drafts", always)
    sampling = SamplingConfig(temperature=1.0)
    exact, _ = _exact(model, sampling)
    drafted, _ = _answers(model, Fixed(_drafts(exact)), sampling, rows=4096)
    stat, critical = _chi_square(exact, drafted)
    assert stat > 10 * critical, (stat, critical)


def test_greedy_drafts_give_plain_greedy_tokens_and_logprobs(untied):
    contexts = [CONTEXT, [2, 2, 1], [4, 0, 3, 3, 1], [3], [0, 2, 2, 4], [1, 4], [3, 1, 1]]
    plain, _ = _answers(untied, None, GREEDY, rows=len(contexts), budget=4, contexts=contexts, stops=())
    stop = int(plain.tokens[3, 2])  # row 3's third token is the stop token: its answer ends there
    assert stop not in plain.tokens[3, :2]
    plain, _ = _answers(untied, None, GREEDY, rows=len(contexts), budget=4, contexts=contexts, stops=(stop,))
    g = plain.tokens.tolist()
    wrong = lambda t: next(w for w in range(V) if w not in (t, stop))  # noqa: E731
    drafts = [g[0][:4],  # the whole answer
              [g[1][0], wrong(g[1][1]), g[1][2]],  # right, then wrong
              [],  # none
              [g[3][0], g[3][1], stop, 1],  # holds the stop token: the answer ends there
              g[4][:2],  # right and shorter than the budget: plain decoding goes on after it
              [g[5][0], stop],  # a stop token plain decoding does not take
              [wrong(g[6][0])]]  # wrong from the start
    assert plain.counts.tolist()[3] == 3 and plain.stopped[3] and stop != g[5][1] and plain.counts[4] > 2
    drafted, policy = _answers(untied, Fixed(drafts), GREEDY, rows=len(contexts), budget=4, contexts=contexts,
                               stops=(stop,))
    np.testing.assert_array_equal(drafted.tokens, plain.tokens)
    np.testing.assert_array_equal(drafted.counts, plain.counts)
    np.testing.assert_array_equal(drafted.stopped, plain.stopped)
    np.testing.assert_allclose(drafted.logprobs, plain.logprobs, atol=1e-5)
    # the first token is drawn as plain decoding draws it; the drafts guess the tokens after it, by position:
    # row 1 proposes 2 (1 rejected), then its third token after the rejection's draw (accepted)
    assert policy.speculation.proposed == (plain.counts[0] - 1) + 3 + 2 + 1 + 1
    assert policy.speculation.accepted == (plain.counts[0] - 1) + 1 + 2 + 1
    assert policy.speculation.steps == plain.counts.max()  # row 2 (no draft) decodes a token a step
    tails = [_tail((context + g[r][:plain.counts[r]])[-8:]) for r, context in enumerate(contexts)]
    np.testing.assert_array_equal(policy.speculation.tails, tails)  # each row's key next turn: its last tokens
    policy.take_rows(np.array([3, 0]), 4)  # compaction and a pool's emptied row move and clear the tails too
    policy.reset_rows(np.array([1]))
    np.testing.assert_array_equal(policy.speculation.tails, [tails[3], _tail([]), _tail([]), _tail([])])


@pytest.mark.parametrize("window", [1, 2, 4])
def test_rows_that_follow_their_drafts_advance_window_plus_one_tokens_a_step(untied, window):
    contexts = [CONTEXT, [2, 2, 1], [4, 0, 3, 3, 1], [3], [0, 2, 2, 4]]
    plain, _ = _answers(untied, None, GREEDY, rows=len(contexts), budget=7, contexts=contexts, stops=())
    answers = [row[:n] for row, n in zip(plain.tokens.tolist(), plain.counts.tolist())]
    graphdef, params = untied
    policy = SamplerPolicy(Sampler(graphdef, nnx.merge(graphdef, params).cfg, cache_dtype=jnp.float32), params,
                           GREEDY, (), 7, drafts=Fixed(answers))
    policy.speculation.window = window
    policy.reset(len(contexts), 32)
    policy.extend(np.array([c + [0] * (8 - len(c)) for c in contexts], np.int32), np.array(list(map(len, contexts))))
    drafted = policy.generate(np.full(len(contexts), 7, np.int32), jax.random.key(7), np.arange(len(contexts)))()
    np.testing.assert_array_equal(drafted.tokens, plain.tokens)
    steps = math.ceil(7 / (window + 1))  # plain decoding: 7 steps
    assert policy.speculation.steps == steps
    assert policy.speculation.accepted == policy.speculation.proposed == (7 - steps) * len(contexts)


@pytest.mark.parametrize("shape", ["d4f2t1", "d2f1t4"])
def test_drafts_verify_on_a_mesh_as_on_one_device(untied, shape):
    graphdef, params = untied
    cfg = nnx.merge(graphdef, params).cfg
    contexts = [CONTEXT, [2, 2, 1], [4, 0, 3, 3, 1], [3], [0, 2, 2, 4], [1, 4], [3, 1, 1], [2]]
    plain, _ = _answers(untied, None, GREEDY, rows=8, budget=4, contexts=contexts, stops=(STOP,))
    g = plain.tokens.tolist()
    drafts = [g[0][:4], [g[1][0], (g[1][1] + 1) % V], [], g[3][:2], [STOP], [g[5][0]], [1, 1, 1], g[7][:1]]
    mesh = make_mesh(MeshShape.parse(shape))
    sharded_graphdef, layout = nnx.split(init_sharded(cfg, mesh, INFERENCE_RULES, seed=0, dtype=jnp.float32))
    sharded = jax.tree.map(lambda w, x: jax.device_put(w, x.sharding), params, layout)
    sampler = Sampler(sharded_graphdef, cfg, mesh=mesh, rules=INFERENCE_RULES, cache_dtype=jnp.float32)
    drafted, policy = _answers((sharded_graphdef, sharded), Fixed(drafts), GREEDY, rows=8, budget=4,
                               contexts=contexts, stops=(STOP,), sampler=sampler)
    np.testing.assert_array_equal(drafted.tokens, plain.tokens)
    np.testing.assert_array_equal(drafted.counts, plain.counts)
    np.testing.assert_allclose(drafted.logprobs, plain.logprobs, atol=1e-4)
    assert policy.speculation.accepted > 0


N = 8
TOK = game_tokenizer()
IDS = special_ids(TOK)
GAME_CFG = ModelConfig.tiny(vocab_size=TOK.get_vocab_size()).replace(num_hidden_layers=2, hidden_size=64,
                                                                      intermediate_size=128)


@pytest.mark.parametrize("slots,groups,pages", [(0, 1, 0), (4, 1, 0), (0, 2, 0), (4, 1, 40)])
def test_a_greedy_rollout_drafted_from_its_own_answers_plays_the_same_games(slots, groups, pages):
    """Also over a paged cache with pages for a few games (drafts write ahead of a row's length, into its pages)."""
    graphdef, params = nnx.split(Qwen2(GAME_CFG, rngs=nnx.Rngs(0), dtype=jnp.float32))
    sampler = Sampler(graphdef, GAME_CFG, cache_dtype=jnp.float32, page_size=8 if pages else 0)
    cfg = PlayConfig(max_turn_tokens=4, max_turns=6, max_context=256, slots=slots, pipeline_groups=groups)
    seeds = [3 + i // 2 for i in range(N)]

    def rollout(index):
        env = make_vector_env(EnvConfig(game="tic_tac_toe", prompt_style="minimal", max_retries=2), N)
        policies = [SamplerPolicy(sampler, params, GREEDY, (IDS.eos_id,), cfg.max_turn_tokens, drafts=index,
                                  kv_pages=pages) for _ in range(groups)]
        return play_games(policies, env, TOK, cfg, jax.random.key(0), seeds, bos_id=IDS.bos_id), policies

    index = DraftIndex(width=4)
    reference, _ = rollout(None)
    index.add_trajectories(reference)
    drafted, policies = rollout(index)
    for field in ("tokens", "loss_mask", "rewards", "lengths", "num_turns"):
        np.testing.assert_array_equal(getattr(drafted, field), getattr(reference, field), err_msg=field)
    np.testing.assert_allclose(drafted.logprobs, reference.logprobs, atol=1e-5)
    proposed, accepted = (sum(getattr(p.speculation, k) for p in policies) for k in ("proposed", "accepted"))
    assert proposed >= reference.loss_mask.sum() // 2 and accepted >= 0.8 * proposed, (proposed, accepted)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)[0]


def test_a_sampled_rollout_with_drafts_records_the_log_probs_of_plain_decoding():
    """Temperature 1 with a peaked policy: many drafts accepted, many rejected; every generated token's log-prob is
    log_softmax of one full forward over the episode at that token, as plain decoding records it."""
    graphdef, params = nnx.split(Qwen2(GAME_CFG, rngs=nnx.Rngs(0), dtype=jnp.float32))
    params = jax.tree.map(lambda x: x * 6.0 if x.shape[0] == GAME_CFG.vocab_size else x, params)
    sampler = Sampler(graphdef, GAME_CFG, cache_dtype=jnp.float32)
    cfg = PlayConfig(max_turn_tokens=4, max_turns=6, max_context=256)
    index = DraftIndex(width=4)

    def rollout(seed, drafts):
        env = make_vector_env(EnvConfig(game="tic_tac_toe", prompt_style="minimal", max_retries=2), N)
        policy = SamplerPolicy(sampler, params, SamplingConfig(), (IDS.eos_id,), cfg.max_turn_tokens, drafts=drafts)
        return play_games(policy, env, TOK, cfg, jax.random.key(seed), [3] * N, bos_id=IDS.bos_id), policy

    index.add_trajectories(rollout(0, None)[0])
    traj, policy = rollout(1, index)
    s = policy.speculation
    assert 0.2 < s.accepted / s.proposed < 0.95, (s.proposed, s.accepted)
    logits = np.asarray(_forward(nnx.merge(graphdef, params), jnp.asarray(traj.tokens)))
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[:, :-1]), axis=-1))
    rows, cols = np.nonzero(traj.loss_mask)
    np.testing.assert_allclose(traj.logprobs[rows, cols], logp[rows, cols - 1, traj.tokens[rows, cols]], atol=2e-5)


def _tail(tokens):
    return np.array([NO_TOKEN] * (8 - len(tokens)) + list(tokens), np.int32)


def test_the_index_proposes_what_followed_the_same_tail_and_nothing_for_an_unseen_one():
    index = DraftIndex(width=3, n=8, keep=2)
    # row 0: prompt [1..9], answer [20 21 22 23] (longer than the width), observation [5 6], answer [30 31]
    tokens = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21, 22, 23, 5, 6, 30, 31, 0],
                       [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21, 40, 7, 7, 0, 0, 0, 0]], np.int32)
    mask = np.zeros_like(tokens, bool)
    mask[0, 9:13] = mask[0, 15:17] = mask[1, 9:12] = True
    index.add(tokens, mask, [[9, 15], [9]])
    contexts = np.stack([tokens[0, 1:9], tokens[0, 7:15], _tail([8, 9]), _tail([5, 6]), _tail([9, 9])])
    drafts, lengths = index.propose(contexts)
    # the prompt's tail was followed by [20 21 22 ...] and by [20 21 40] once each: a tie goes to the later one
    np.testing.assert_array_equal(lengths, [3, 2, 0, 0, 0])
    np.testing.assert_array_equal(drafts[0], [20, 21, 40])
    np.testing.assert_array_equal(drafts[1, :2], [30, 31])
    index.add(tokens[:1], mask[:1], [[9]])  # a newer rollout: [20 21 22] now seen twice in the window
    np.testing.assert_array_equal(index.propose(contexts[:1])[0][0], [20, 21, 22])
    index.add(tokens[:1, :9], mask[:1, :9], [[]])
    index.add(tokens[:1, :9], mask[:1, :9], [[]])  # two rollouts without answers: the old ones are forgotten
    assert len(index) == 0 and index.propose(contexts)[1].sum() == 0


def test_the_flag_is_off_by_default_and_refused_where_it_cannot_apply(model, monkeypatch):
    assert job().rollout.drafts == 0 and job(drafts=4).rollout.drafts == 4
    with pytest.raises(ConfigError, match=r"^--rollout.drafts: a constrained move is one token a turn"):
        job(drafts=4, constrain_moves=True)
    with pytest.raises(ConfigError, match=r"^--rollout.drafts: must be >= 0"):
        job(drafts=-1)
    graphdef, params = model
    sampler = Sampler(graphdef, CFG)
    with pytest.raises(ValueError, match="drafts need free-text answers"):
        SamplerPolicy(sampler, params, GREEDY, (STOP,), 2, moves=MoveTokens((1, 2), STOP), drafts=DraftIndex(2))

    from earl_jax.rl.stages import rollout_stage

    monkeypatch.setattr(rollout_stage.jax, "process_count", lambda: 2)
    policy = dataclasses.make_dataclass("P", ["graphdef", "model_cfg", "tokenizer", "ids", "codec", "moves",
                                              "cache_buckets", "planner", "rollout_planner"])
    planner = dataclasses.make_dataclass("Planner", ["shapes", "decode_rows"])(None, 0)
    with pytest.raises(ValueError, match=r"^--rollout.drafts: drafts run in one process only"):
        rollout_stage.RolloutStage(RolloutConfig(drafts=4), policy(*[None] * 7, planner, None), 64)
    rollout_stage.RolloutStage(RolloutConfig(), policy(*[None] * 7, planner, None), 64)  # off: any process count


def test_a_job_keeps_its_index_across_iterations_and_logs_what_was_drafted(tmp_path):
    trainer = _trainer(tmp_path, "text_task", rollout__drafts=4, run__steps=2, eval__every=0)
    first, second = trainer.run()
    assert (first["rollout/draft_proposed"], first["rollout/draft_accepted"]) == (0, 0)  # nothing seen yet
    assert second["rollout/draft_proposed"] > 0  # every episode starts from the same observation
    assert second["rollout/draft_acceptance"] == second["rollout/draft_accepted"] / second["rollout/draft_proposed"]
    assert len(trainer.rollout.drafts) > 0
