"""Sharded random init: every parameter in its target sharding, the right distribution, deterministic per
seed, and a bounded number of compiled programs that does not grow with depth."""

import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.compile_cache import count_compiles
from earl_jax.models import init
from earl_jax.models.model_config import PRESETS, ModelConfig
from earl_jax.models.qwen2 import INITIALIZERS
from earl_jax.sharding.mesh import INFERENCE_RULES, TRAIN_RULES, MeshShape, make_mesh, state_shardings

# Untied head and 8 query heads, so every kind of parameter exists and heads split over tensor=4.
CFG = ModelConfig.tiny(vocab_size=256).replace(num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                                tie_word_embeddings=False, num_hidden_layers=2)
MESHES = ["d1f8t1", "d2f1t4", "d8f1t1"]


def _flat(model):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="session")
def models():
    """seed 0 on every mesh (train rules: params split over fsdp and tensor), and seed 1 on the first."""
    out = {m: init.init_sharded(CFG, make_mesh(MeshShape.parse(m)), TRAIN_RULES, seed=0) for m in MESHES}
    out["seed1"] = init.init_sharded(CFG, make_mesh(MeshShape.parse(MESHES[0])), TRAIN_RULES, seed=1)
    return out


@pytest.mark.parametrize("mesh_name", MESHES)
def test_every_param_is_created_in_its_target_sharding(models, mesh_name):
    mesh = make_mesh(MeshShape.parse(mesh_name))
    model = models[mesh_name]
    targets = {".".join(map(str, p)): s.get_value()
               for p, s in nnx.to_flat_state(state_shardings(nnx.state(model), mesh, TRAIN_RULES))}
    split = 0
    for name, x in _flat(model).items():
        assert x.sharding == targets[name], name
        want = targets[name].shard_shape(x.shape)
        assert len(x.addressable_shards) == 8 and all(s.data.shape == want for s in x.addressable_shards), name
        split += want != x.shape
    # fsdp / tensor really split parameters; data (8x1x1) replicates them on every device
    assert (split > 0) == (mesh_name != "d8f1t1")


def test_programs_never_hold_a_whole_sharded_parameter():
    """Per device, XLA's own memory plan: the output is the shard, and the temporaries (random bits)
    stay below the whole parameter, so no device ever materializes all of it."""
    mesh = make_mesh(MeshShape.parse("d1f8t1"))
    state = nnx.state(init.abstract_model(CFG))
    plan = init.init_plan(state, state_shardings(state, mesh, TRAIN_RULES))
    for p in (p for p in plan if p.kind == "normal" and p.sharding.shard_shape(p.shape) != p.shape):
        mem = init._lower(p).compile().memory_analysis()
        whole = np.prod(p.shape) * 4
        assert mem.output_size_in_bytes == whole // 8 and mem.temp_size_in_bytes < whole, (p.path, mem)


def test_values_do_not_depend_on_the_mesh_and_change_with_the_seed(models):
    ref = {k: np.asarray(v) for k, v in _flat(models[MESHES[0]]).items()}
    for m in MESHES[1:]:
        for k, v in _flat(models[m]).items():
            np.testing.assert_array_equal(np.asarray(v), ref[k], err_msg=f"{m} {k}")
    again = init.init_sharded(CFG, make_mesh(MeshShape.parse(MESHES[0])), TRAIN_RULES, seed=0)
    for k, v in _flat(again).items():
        np.testing.assert_array_equal(np.asarray(v), ref[k], err_msg=k)
    other = _flat(models["seed1"])
    for k, v in ref.items():
        if v.std() > 0:  # random ones differ; zeros and ones do not depend on the seed
            assert not np.allclose(np.asarray(other[k]), v), k


def test_distribution_normal_matrices_zero_biases_unit_norms(models):
    flat = {k: np.asarray(v) for k, v in _flat(models[MESHES[0]]).items()}
    kinds = {".".join(map(str, p)): v.get_metadata()["init"]
             for p, v in nnx.to_flat_state(nnx.state(init.abstract_model(CFG)))}
    assert set(kinds.values()) == {"normal", "zeros", "ones"}
    for k, v in flat.items():
        assert v.dtype == np.float32, k  # float32 masters by default
        if kinds[k] == "normal":
            assert abs(v.std() - 0.02) < 0.002 and abs(v.mean()) < 0.002, (k, v.std(), v.mean())
        else:
            np.testing.assert_array_equal(v, 0.0 if kinds[k] == "zeros" else 1.0, err_msg=k)
    # One sizeable matrix, tight: 256 x 128 normals.
    e = flat["embed_vd"]
    assert e.shape == (256, 128) and abs(e.std() - 0.02) < 0.0005 and abs(e.mean()) < 0.0005
    # Distinct parameters of one shape draw distinct values (their own salts).
    assert not np.allclose(flat["layers.0.attn.k_dkh"], flat["layers.0.attn.v_dkh"])
    assert not np.allclose(flat["layers.0.mlp.gate_df"], flat["layers.1.mlp.gate_df"])
    assert set(kinds) == set(flat)


def test_every_parameter_has_a_known_initializer():
    """Every variant of the parameter set (tied or not, q/k/v bias or not); big presets: see below."""
    for tie in (False, True):
        for bias in (False, True):
            state = nnx.state(init.abstract_model(CFG.replace(tie_word_embeddings=tie, attention_bias=bias)))
            plan = init.init_plan(state, state)  # shardings are not needed to plan
            assert len(plan) == len(nnx.to_flat_state(state)) and {p.kind for p in plan} <= set(INITIALIZERS)


def test_a_parameter_without_an_initializer_is_refused():
    state = nnx.state(init.abstract_model(CFG))
    flat = list(nnx.to_flat_state(state))
    path, var = flat[0]
    bare = nnx.Param(var.get_value(), logical_axes=var.get_metadata()["logical_axes"])  # no "init"
    state = nnx.from_flat_state([(path, bare)] + flat[1:])
    with pytest.raises(ValueError, match="initializer None"):
        init.init_plan(state, state)


def _programs(cfg, mesh):
    init.clear_program_cache()  # count this model's programs from scratch
    with count_compiles() as count:
        model = init.init_sharded(cfg, mesh, TRAIN_RULES, seed=0)
    jax.block_until_ready(nnx.state(model))
    state = nnx.state(init.abstract_model(cfg))
    plan = init.init_plan(state, state)
    return count.lowered, len({(p.kind, p.shape, p.dtype) for p in plan})


def test_compiled_programs_are_bounded_and_do_not_grow_with_depth():
    mesh = make_mesh(MeshShape.parse("d2f2t2"))
    shallow, distinct = _programs(CFG, mesh)
    deep, distinct_deep = _programs(CFG.replace(num_hidden_layers=8), mesh)
    assert distinct == distinct_deep == 10  # embed, q, k|v, o, q bias, k|v bias, norm, gate|up, down, head
    assert 0 < shallow == deep <= distinct  # at most one program per distinct (kind, shape, dtype) on one mesh
    # A second model of the same shapes on the same mesh reuses them all.
    with count_compiles() as again:
        init.init_sharded(CFG.replace(num_hidden_layers=3), mesh, TRAIN_RULES, seed=5)
    assert again.lowered == 0


def test_big_models_need_about_ten_programs():
    """7B and 14B on a 4-device fsdp mesh, abstractly (nothing allocated): as many programs as 2 layers."""
    mesh = make_mesh(MeshShape(1, 4, 1), jax.devices()[:4])
    for name in ("qwen2.5-7b", "qwen2.5-14b"):
        state = nnx.state(init.abstract_model(PRESETS[name]()))
        plan = init.init_plan(state, state_shardings(state, mesh, TRAIN_RULES))
        assert len(plan) > 300 and len({p.key for p in plan}) == 10, name


def test_forward_pass_of_a_sharded_init_gives_finite_logits(models):
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, CFG.vocab_size)
    logits = nnx.jit(lambda m, t: m(t)[0])(models["d2f1t4"], tokens)
    assert logits.shape == (2, 12, CFG.vocab_size) and bool(jnp.isfinite(logits).all())
    assert float(logits.std()) > 0


def test_bf16_params_and_inference_rules():
    mesh = make_mesh(MeshShape.parse("d2f1t4"))
    model = init.init_sharded(CFG, mesh, INFERENCE_RULES, seed=0, param_dtype=jnp.bfloat16)
    q = model.layers[0].attn.q_dnh[...]
    assert q.dtype == jnp.bfloat16 and q.sharding.shard_shape(q.shape)[1] == CFG.num_attention_heads // 4
    assert abs(float(q.astype(jnp.float32).std()) - 0.02) < 0.003


def test_init_and_loading_log_what_they_do_and_how_long_it_took(caplog):
    from earl_jax.models.loader import from_pretrained

    caplog.set_level(logging.INFO, logger="earl_jax")
    init.init_sharded(CFG, make_mesh(MeshShape.parse("d2f2t2")), TRAIN_RULES)
    folder = Path(__file__).parents[1] / "fixtures" / "qwen2_gqa_tied"
    from_pretrained(folder, mesh=make_mesh(MeshShape.parse("d2f1t4")))
    lines = [r.getMessage() for r in caplog.records if r.name == "earl_jax"]
    assert lines[0] == "model: tiny, 0.5M params, init on mesh d2f2t2 ..."
    # programs an earlier test of this process (or run) compiled come from the cache, and the line says how many
    assert re.fullmatch(r"model: tiny, 0.5M params, init on mesh d2f2t2 \(\d+ programs(, \d+ from cache)?\): \d+\.\d s",
                        lines[1])
    assert lines[2].startswith("model: qwen2_gqa_tied, ")
    assert lines[2].endswith(f"loading {folder} onto mesh d2f1t4 ...")
    assert re.fullmatch(re.escape(lines[2][:-4]) + r": \d+\.\d s", lines[3])
