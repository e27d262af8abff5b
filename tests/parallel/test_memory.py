"""Memory model of the Parallelism Selector: numbers against hand computation, candidates, feasibility."""

import math
import types

import pytest
from hypothesis import example, given, settings, strategies as st

from earl_jax.models.attention import extend_query_block
from earl_jax.models.model_config import PRESETS, get_config
from earl_jax.parallel.memory import (
    GiB,
    MemoryConfig,
    MemoryModel,
    candidate_meshes,
    device_memory_budget,
    param_groups,
    params_per_device,
    valid_tensor_degree,
)
from earl_jax.sharding.mesh import MeshShape

H100 = 80 * GiB


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_groups_sum_to_num_params(name):
    cfg = get_config(name)
    assert sum(p.numel for p in param_groups(cfg)) == cfg.num_params()
    # one device, no sharding: every parameter once
    assert params_per_device(cfg, "rollout", MeshShape()) == cfg.num_params()


def test_half_b_bf16_on_one_device_is_0p99_gb():
    cfg = get_config("qwen2.5-0.5b")
    est = MemoryModel(cfg, MemoryConfig(budget_bytes=H100)).estimate("rollout", MeshShape(1, 1, 1), 1024, 1)
    assert est.params == cfg.num_params() * 2
    assert est.params == pytest.approx(0.988e9, rel=1e-3)


def test_72b_train_state_16_bytes_per_param_over_64_devices():
    cfg = get_config("qwen2.5-72b")  # configs only: nothing is allocated
    mm = MemoryModel(cfg, MemoryConfig(budget_bytes=H100))
    hand = cfg.num_params() * 16 / 64  # fp32 master + grad + 2 AdamW moments = 18.18 GB
    for mesh in (MeshShape(1, 64, 1), MeshShape(1, 8, 8), MeshShape(2, 4, 8)):
        est = mm.estimate("train", mesh, 2048, 64)
        # replicated pieces (q/k/v biases over fsdp, norm scales over tensor) cost < 0.1 %
        ideal = cfg.num_params() * 16 / (mesh.fsdp * mesh.tensor)
        assert ideal <= est.params <= ideal * 1.001, mesh
    assert mm.estimate("train", MeshShape(1, 64, 1), 2048, 64).params == pytest.approx(hand, rel=1e-3)
    assert hand == pytest.approx(18.18e9, rel=1e-3)


def test_tensor_sharded_inference_params():
    cfg = get_config("qwen2.5-72b")
    for t in (4, 8):
        per = params_per_device(cfg, "rollout", MeshShape(8 // t, 1, t))
        assert cfg.num_params() / t <= per <= cfg.num_params() / t * 1.001
    # tiny (d 128, 4 q / 2 kv heads of 32, mlp 384, vocab 64 tied, 4 layers) on tensor 4, by hand:
    # kv_heads (2) is not divisible by 4, so k/v kernels and biases are replicated, as are the norms.
    tiny = get_config("tiny")
    q = o = 128 * 4 * 32 // 4
    layer = q + o + 128 // 4 + 2 * 128 * 2 * 32 + 2 * 2 * 32 + 3 * 128 * 384 // 4 + 2 * 128
    assert params_per_device(tiny, "rollout", MeshShape(2, 1, 4)) == 4 * layer + 64 * 128 // 4 + 128 == 249600


def test_kv_cache_hand_computation():
    cfg = get_config("qwen2.5-72b")
    mm = MemoryModel(cfg, MemoryConfig(budget_bytes=H100))
    assert cfg.kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2  # 320 KiB per token
    est = mm.estimate("rollout", MeshShape(2, 1, 4), 8192, 16)
    assert est.kv_cache == 8 * 8192 * cfg.kv_bytes_per_token() // 4  # 16 responses over data 2, heads over 4
    # data x tensor = 8 either way: the KV cache per device is the same for TP4 and TP8, weights are not
    est8 = mm.estimate("rollout", MeshShape(1, 1, 8), 8192, 16)
    assert est8.kv_cache == est.kv_cache
    assert est8.params == pytest.approx(est.params / 2, rel=1e-3)


def test_kv_heads_replication_when_tensor_exceeds_kv_heads():
    tiny = get_config("tiny")  # 4 q heads, 2 kv heads
    rep = MemoryModel(tiny, MemoryConfig(budget_bytes=GiB))
    assert rep.kv_heads_per_device(2) == 1
    assert rep.kv_heads_per_device(4) == 2  # logical_to_spec replicates the undivisible kv_heads axis
    e_rep = rep.estimate("rollout", MeshShape(2, 1, 4), 128, 8)
    assert e_rep.kv_cache == 4 * 128 * tiny.kv_bytes_per_token()


def test_candidate_enumeration_8_devices():
    tiny, half = get_config("tiny"), get_config("qwen2.5-0.5b")
    assert [str(m) for m in candidate_meshes(tiny, 8, "rollout")] == ["d8f1t1", "d4f1t2", "d2f1t4"]
    assert [str(m) for m in candidate_meshes(half, 8, "experience")] == ["d8f1t1", "d4f1t2"]  # 14 heads: no t4/t8
    train = candidate_meshes(half, 8, "train")
    assert {str(m) for m in train} == {"d8f1t1", "d4f2t1", "d2f4t1", "d1f8t1", "d4f1t2", "d2f2t2", "d1f4t2"}
    for cfg in (tiny, half, get_config("qwen2.5-72b")):
        for stage in ("rollout", "experience", "train"):
            for m in candidate_meshes(cfg, 8, stage):
                assert m.size == 8 and cfg.num_attention_heads % m.tensor == 0
                assert stage == "train" or m.fsdp == 1
    assert MeshShape(1, 1, 8) in candidate_meshes(get_config("qwen2.5-72b"), 8, "rollout")  # 8 | 8 kv heads
    assert valid_tensor_degree(get_config("qwen2.5-7b"), 4) and not valid_tensor_degree(get_config("qwen2.5-7b"), 8)
    with pytest.raises(ValueError, match="unknown stage"):
        candidate_meshes(tiny, 8, "decode")


def test_feasibility_flips_as_context_grows_72b_on_8_h100():
    """Like the paper's TP4 out-of-memory cell: long context -> TP4 no longer fits, TP8 still does."""
    cfg = get_config("qwen2.5-72b")
    mm = MemoryModel(cfg, MemoryConfig(budget_bytes=H100))
    tp4, tp8 = MeshShape(2, 1, 4), MeshShape(1, 1, 8)
    for ctx in (1024, 4096, 8192, 16384):
        assert mm.feasible("rollout", tp4, ctx, 24) and mm.feasible("rollout", tp8, ctx, 24)
    assert not mm.feasible("rollout", tp4, 32768, 24)
    assert mm.feasible("rollout", tp8, 32768, 24)
    # TP1 cannot even hold the bf16 weights (145 GB)
    assert not mm.feasible("rollout", MeshShape(8, 1, 1), 1024, 8)
    # and 72B training does not fit 8 GPUs at all (1.16 TB of train state), but fits 64
    assert not any(mm.feasible("train", m, 1024, 8) for m in candidate_meshes(cfg, 8, "train"))
    assert mm.feasible("train", MeshShape(1, 64, 1), 1024, 64)


def test_choose_takes_largest_power_of_two_that_fits():
    cfg = get_config("qwen2.5-0.5b")
    mm = MemoryModel(cfg, MemoryConfig(budget_bytes=16 * GiB))
    for stage in ("experience", "train"):
        fit = mm.choose(stage, MeshShape(4, 1, 2), 4096, 256)
        assert fit is not None
        per_shard = 256 // 4
        assert fit.micro_batch == per_shard or not mm.fits(mm.estimate(stage, MeshShape(4, 1, 2), 4096, 256,
                                                                       fit.micro_batch * 2, 128))
        assert fit.micro_batch & (fit.micro_batch - 1) == 0
        assert fit.logprob_chunk & (fit.logprob_chunk - 1) == 0 and 128 <= fit.logprob_chunk <= 4096
        assert fit.logprob_chunk == 4096 or not mm.fits(mm.estimate(stage, MeshShape(4, 1, 2), 4096, 256,
                                                                    fit.micro_batch, fit.logprob_chunk * 2))
        assert mm.fits(fit.estimate) and fit.estimate.total <= 16 * GiB * 0.9
    # a budget too small for anything
    assert MemoryModel(cfg, MemoryConfig(budget_bytes=GiB // 2)).choose("train", MeshShape(8, 1, 1), 1024, 8) is None


def test_rollout_holds_all_of_a_shards_responses():
    cfg = get_config("qwen2.5-72b")
    strict = MemoryModel(cfg, MemoryConfig(budget_bytes=H100))
    assert strict.choose("rollout", MeshShape(2, 1, 4), 32768, 128) is None  # 64 resident 32K caches do not fit
    fit = strict.choose("rollout", MeshShape(1, 1, 8), 8192, 16)
    assert fit is not None and fit.micro_batch is None and fit.logprob_chunk is None  # rollout has neither
    assert fit.estimate.micro_batch == 16  # every response of the shard is resident


def test_device_memory_budget():
    assert device_memory_budget() == 4 * GiB  # CPU reports no limit
    assert device_memory_budget(default_bytes=123) == 123
    fake = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 79 * GiB, "bytes_in_use": 0})
    assert device_memory_budget(fake) == 79 * GiB
    assert MemoryModel(get_config("tiny")).budget_bytes == 4 * GiB


def test_bad_memory_config():
    with pytest.raises(ValueError):
        MemoryConfig(safety_fraction=1.5)
    with pytest.raises(ValueError):
        MemoryConfig(max_logprob_chunk=0)


@settings(max_examples=40, deadline=None)
@example(ctx=31776, n=249, name="tiny", stage="rollout")  # crosses the query-block cliff (the docstring)
@given(ctx=st.integers(16, 40000), n=st.integers(1, 256), name=st.sampled_from(["tiny", "qwen2.5-0.5b", "qwen2.5-7b"]),
       stage=st.sampled_from(["rollout", "experience", "train"]))
def test_estimate_monotone_in_context_and_responses(ctx, n, name, stage):
    """More context or more responses never need less memory, except where a rollout extend starts attending in
    query blocks (the model's own rule, `extend_query_block`): its scores then fall from up to the 4 GiB limit to
    a block's, and the estimate follows the model (a falsifying example: tiny, 31776 tokens, 249 -> 257 responses
    on d8: 32 -> 33 rows a shard, 4.0 -> 2.0 GiB of scores)."""
    cfg = get_config(name)
    mm = MemoryModel(cfg, MemoryConfig(budget_bytes=H100))

    def block(mesh, context, responses):  # the extend's query block, as the estimate computes it
        rows = -(-responses // (mesh.data * mesh.fsdp))
        heads = math.ceil(cfg.num_attention_heads / mesh.tensor)
        return extend_query_block(rows, heads, min(mm.mem.prefill_len, context), context)

    for mesh in candidate_meshes(cfg, 8, stage):
        mb = None if stage == "rollout" else 2
        base = mm.estimate(stage, mesh, ctx, n, mb)
        if stage != "rollout" or block(mesh, ctx, n) == block(mesh, ctx + 64, n):
            assert mm.estimate(stage, mesh, ctx + 64, n, mb).total >= base.total
        if stage == "rollout" and block(mesh, ctx, n) == block(mesh, ctx, n + 8):
            assert mm.estimate(stage, mesh, ctx, n + 8).total >= base.total
        assert all(v >= 0 for v in (base.params, base.kv_cache, base.activations, base.logits, base.gather))
        assert math.isfinite(base.total)


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-0.5b"])
def test_params_per_device_matches_real_shardings_of_the_model(name):
    """The arithmetic equals the shard shapes the model's own logical axes produce on 8 CPU devices
    (abstract model: nothing allocated)."""
    import jax
    from flax import nnx

    from earl_jax.models.qwen2 import Qwen2
    from earl_jax.sharding.mesh import make_mesh, state_shardings
    from earl_jax.sharding.stage_registry import STAGE_RULES

    cfg = get_config(name)
    state = nnx.state(nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    values = jax.tree.leaves(state)
    for stage in ("rollout", "experience", "train"):
        for mesh in candidate_meshes(cfg, 8, stage):
            shardings = jax.tree.leaves(state_shardings(state, make_mesh(mesh), STAGE_RULES[stage]))
            assert len(shardings) == len(values)
            real = sum(math.prod(s.shard_shape(v.shape)) for v, s in zip(values, shardings))
            assert params_per_device(cfg, stage, mesh) == real, (stage, mesh)


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-0.5b"])
def test_kv_cache_matches_real_cache_shardings(name):
    import jax

    from earl_jax.models.cache import cache_shardings, init_cache
    from earl_jax.sharding.mesh import make_mesh
    from earl_jax.sharding.stage_registry import STAGE_RULES

    cfg = get_config(name)
    mm = MemoryModel(cfg, MemoryConfig(budget_bytes=H100))
    n, ctx = 16, 256
    for mesh in candidate_meshes(cfg, 8, "rollout"):
        sh = cache_shardings(cfg, n, ctx, make_mesh(mesh), STAGE_RULES["rollout"])
        layer = sh.layers[0]
        shape = jax.eval_shape(lambda: init_cache(cfg, n, ctx)).layers[0].k.shape  # abstract: no allocation
        per_layer = sum(math.prod(s.shard_shape(shape)) for s in (layer.k, layer.v)) * 2  # bf16
        assert mm.estimate("rollout", mesh, ctx, n).kv_cache == per_layer * cfg.num_hidden_layers, mesh


def test_rollout_estimate_from_measured_extends():
    """Measured extend widths replace the default 256-token chunk against the whole context: a short turn
    observation against the context, the prompt against its first cache (hand computation, tiny model)."""
    from earl_jax.parallel.plan import RolloutExtends

    cfg = get_config("tiny", vocab_size=101)  # 4 heads, 2 kv heads of 32
    mm = MemoryModel(cfg, MemoryConfig(budget_bytes=8 * GiB))
    mesh = MeshShape(1, 1, 1)
    ctx, rows = 32768, 32
    ext = RolloutExtends(prompt_tokens=100, first_cache_len=3100, observation_tokens=7)  # -> 128 x 4096, 8 x ctx
    default = mm.estimate("rollout", mesh, ctx, rows)
    measured = mm.estimate("rollout", mesh, ctx, rows, extends=ext)
    assert measured.kv_cache == default.kv_cache and measured.params == default.params
    scores = lambda q, k: 2 * rows * cfg.num_attention_heads * q * k * 4  # noqa: E731 (f32 scores + probs)
    workspace = lambda tok: tok * 2 * (3 * 128 + 2 * 128 + 2 * 64 + 3 * 384)  # noqa: E731
    extend = max(workspace(rows * 128) + scores(128, 4096), workspace(rows * 8) + scores(8, ctx))
    assert measured.activations == max(extend, 0.75 * measured.kv_cache)  # or the cache's growth copy
    assert default.activations == workspace(rows * 256) + scores(256, ctx)  # the extend is not query-blocked
    assert measured.total < default.total / 2
    # the selector reads them from ContextStats
    from earl_jax.parallel.plan import ContextStats
    from earl_jax.parallel.selector import ParallelismSelector
    from earl_jax.parallel.selector_config import SelectorConfig

    sel = ParallelismSelector(cfg, 1, memory=MemoryModel(cfg, MemoryConfig(budget_bytes=3 * GiB)),
                              config=SelectorConfig(stages=("rollout",)))
    with pytest.raises(Exception, match="no rollout layout"):
        sel.plan(ContextStats(ctx, ctx, rows))
    assert sel.plan(ContextStats(ctx, ctx, rows, 100, 3100, 7)).rollout.mesh == mesh


def test_drafts_price_k_plus_one_positions_a_row_in_the_rollout():
    """--rollout.drafts K: the drafted step's logits, layer workspace and scores on the cache are K + 1 positions a
    row (hand computation, tiny model, measured extends of one-token observations so the drafted step decides)."""
    from earl_jax.parallel.plan import RolloutExtends

    cfg = get_config("tiny", vocab_size=101)  # 4 heads, 2 kv heads of 32
    mesh, ctx, rows, k = MeshShape(1, 1, 1), 4096, 32, 32  # 33 queries: past the cache's growth copy
    ext = RolloutExtends(prompt_tokens=1, first_cache_len=4096, observation_tokens=1)
    plain = MemoryModel(cfg, MemoryConfig(budget_bytes=8 * GiB)).estimate("rollout", mesh, ctx, rows, extends=ext)
    drafted = MemoryModel(cfg, MemoryConfig(budget_bytes=8 * GiB, draft_tokens=k)).estimate(
        "rollout", mesh, ctx, rows, extends=ext)
    assert plain.logits == rows * (101 + 101) * 4
    assert drafted.logits == rows * ((k + 1) * 101 + 101) * 4
    scores = 2 * rows * cfg.num_attention_heads * (k + 1) * ctx * 4  # f32 scores + probs of K + 1 queries
    workspace = rows * (k + 1) * 2 * (3 * 128 + 2 * 128 + 2 * 64 + 3 * 384)
    assert drafted.activations == max(plain.activations, workspace + scores)
    assert drafted.activations > plain.activations and drafted.kv_cache == plain.kv_cache


def test_rollout_and_experience_are_planned_beside_the_resident_train_state():
    """The train state (fp32 master + 2 AdamW moments) stays on the devices while rollout and experience run:
    the selector plans train first and counts its state in the other two stages' estimates."""
    from earl_jax.parallel.plan import ContextStats
    from earl_jax.parallel.selector import ParallelismSelector

    cfg = get_config("qwen2.5-1.5b")
    sel = ParallelismSelector(cfg, 4, memory=MemoryConfig(budget_bytes=H100))
    plan = sel.plan(ContextStats(1024, 1024, 64))
    resident = sel.memory.train_resident_bytes(plan.train.mesh)
    shards = plan.train.mesh.fsdp * plan.train.mesh.tensor
    assert resident == pytest.approx(cfg.num_params() * 12 / shards, rel=0.01)  # replicated over data
    with_state = sel.memory.estimate("rollout", plan.rollout.mesh, 1024, 64)
    assert with_state.resident == resident and sel.memory.estimate("train", plan.train.mesh, 1024, 64).resident == 0
    sel.memory.resident_bytes = 0
    assert with_state.total - sel.memory.estimate("rollout", plan.rollout.mesh, 1024, 64).total == resident
