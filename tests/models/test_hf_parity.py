"""Hugging Face checkpoints: the loaded model gives transformers' logits; loading lands each shard on its
own device; save_pretrained round-trips; broken checkpoints fail naming the tensor or file; tokenizers.

Fixtures come from tests/fixtures/make_parity_fixtures.py (transformers 5.24, float32, random biases).
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import assume, given, settings, strategies as st
from safetensors.numpy import load_file, save_file

from earl_jax.models import loader
from earl_jax.models.loader import CheckpointError, from_pretrained, save_pretrained
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.tokenizer import GAME_CHARS, GAME_SPECIALS, game_tokenizer, load_tokenizer, special_ids
from earl_jax.sharding.mesh import INFERENCE_RULES, TRAIN_RULES, MeshShape, make_mesh, state_shardings

FIXTURES = Path(__file__).parents[1] / "fixtures"
MODELS = ["qwen2_gqa_tied", "qwen2_mha_untied", "qwen2_headdim_untied"]
TOL = 1e-4


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def forward(model, tokens) -> jax.Array:
    """Float32 logits through one jitted call (much cheaper on CPU than op-by-op dispatch)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])(state, jnp.asarray(tokens, jnp.int32))


def reference(name):
    r = np.load(FIXTURES / name / "reference.npz")
    return r["tokens"], r["logits"]


def params(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def copy_fixture(name, tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


# ---- parity ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_stored_transformers_reference(name):
    tokens, ref = reference(name)
    model, tok = from_pretrained(FIXTURES / name, dtype=jnp.float32)
    out = forward(model, tokens)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < TOL
    assert tok is not None and special_ids(tok).eos_id == 2


def test_parity_has_teeth(tmp_path):
    """A checkpoint off by one detail (RoPE theta) misses the reference by far more than the tolerance."""
    d = copy_fixture("qwen2_mha_untied", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 10_000.0
    (d / "config.json").write_text(json.dumps(cfg))
    tokens, ref = reference("qwen2_mha_untied")
    model, _ = from_pretrained(d, dtype=jnp.float32)
    assert rel_err(forward(model, tokens), ref) > 100 * TOL


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_live_transformers(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(FIXTURES / name, attn_implementation="eager",
                                                       dtype=torch.float32).eval()
    tokens = np.random.default_rng(7).integers(0, 128, (2, 40))
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens)).logits.numpy()
    model, _ = from_pretrained(FIXTURES / name, dtype=jnp.float32)
    assert rel_err(forward(model, tokens), ref) < TOL


def test_save_pretrained_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokens, ref = reference("qwen2_gqa_tied")
    model, tok = from_pretrained(FIXTURES / "qwen2_gqa_tied", dtype=jnp.float32)
    save_pretrained(model, tmp_path / "export", tok)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager",
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(hf(torch.from_numpy(tokens).long()).logits.numpy(), ref) < TOL


# ---- sharded loading ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_load_into_2x4_mesh_shards_every_split_param(name):
    mesh = make_mesh(MeshShape.parse("2x4"))
    model, _ = from_pretrained(FIXTURES / name, mesh=mesh, rules=INFERENCE_RULES, dtype=jnp.float32)
    state = nnx.state(model)
    expected = state_shardings(state, mesh, INFERENCE_RULES)
    split = []
    for (path, var), (_, want) in zip(nnx.to_flat_state(state), nnx.to_flat_state(expected)):
        x = var.get_value()
        assert x.sharding.is_equivalent_to(want, x.ndim), path
        full, shard = x.shape, x.sharding.shard_shape(x.shape)
        if any(want.spec):
            assert shard != full and all(s.data.shape == shard for s in x.addressable_shards), path
            split.append(path[-1])
    cfg = model.cfg
    assert {"embed_vd", "q_dnh", "o_nhd", "gate_df", "down_fd"} <= set(split)  # vocab, heads, mlp split
    assert ("k_dkh" in split) == (cfg.num_key_value_heads % 4 == 0)  # 1-2 kv heads stay replicated
    tokens, ref = reference(name)
    assert rel_err(forward(model, tokens), ref) < TOL


def test_load_with_train_rules_splits_embed_over_fsdp():
    mesh = make_mesh(MeshShape(2, 2, 2))
    model, _ = from_pretrained(FIXTURES / "qwen2_mha_untied", mesh=mesh, rules=TRAIN_RULES, dtype=jnp.float32)
    o = model.layers[0].attn.o_nhd[...]  # (n h) merged on the HF side, embed split over fsdp here
    assert o.sharding.shard_shape(o.shape) == (2, 16, 32)
    tokens, ref = reference("qwen2_mha_untied")
    assert rel_err(forward(model, tokens), ref) < TOL


@pytest.mark.parametrize("spec", sorted({layout for _, _, layout in loader.PARAM_TABLE}))
def test_layout_block_reads_equal_slices_of_the_full_transform(spec):
    """Any block (head_dim split too) read from the HF array equals that block of the transformed array."""
    layout = loader.Layout.parse(spec)
    rng = np.random.default_rng(0)
    sizes = {"v": 12, "d": 8, "n": 4, "k": 2, "h": 6, "f": 10}
    target_shape = tuple(sizes[a] for a in layout.target)
    hf = rng.standard_normal(layout.hf_shape(target_shape)).astype(np.float32)
    full = layout.read(lambda idx: hf[idx], target_shape, tuple(slice(None) for _ in target_shape))
    np.testing.assert_array_equal(layout.to_hf(full), hf)
    for _ in range(20):
        block = []
        for n in target_shape:
            parts = int(rng.choice([p for p in (1, 2, n) if n % p == 0]))
            i = int(rng.integers(parts))
            block.append(slice(i * n // parts, (i + 1) * n // parts))
        np.testing.assert_array_equal(layout.read(lambda idx: hf[idx], target_shape, tuple(block)),
                                      full[tuple(block)])


def test_each_device_gets_only_its_shard_read_from_file(monkeypatch):
    """The callback reads just the rows of q_proj a device's shard covers, once per distinct shard."""
    reads = []
    real = loader._read_fn

    def spy(handle, name, dtype):
        get = real(handle, name, dtype)
        return lambda index: reads.append((name, index)) or get(index)

    monkeypatch.setattr(loader, "_read_fn", spy)
    mesh = make_mesh(MeshShape.parse("2x4"))
    from_pretrained(FIXTURES / "qwen2_mha_untied", mesh=mesh, dtype=jnp.float32)
    q = [idx for name, idx in reads if name == "model.layers.0.self_attn.q_proj.weight"]
    # 4 heads of 16 over tensor=4: rows [0:16], [16:32], ... each read once (data replicas reuse it).
    assert sorted(idx[0].start for idx in q) == [0, 16, 32, 48]
    assert all(idx[0].stop - idx[0].start == 16 for idx in q)


# ---- save / load round trip -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2_gqa_tied", "qwen2_headdim_untied"])
def test_save_pretrained_round_trip_is_exact(name, tmp_path):
    model, tok = from_pretrained(FIXTURES / name, dtype=jnp.float32)
    save_pretrained(model, tmp_path / "out", tok)
    # Same tensors, bit for bit, as transformers wrote (tied: no lm_head.weight).
    ours, theirs = load_file(tmp_path / "out" / "model.safetensors"), load_file(FIXTURES / name / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    again, tok2 = from_pretrained(tmp_path / "out", dtype=jnp.float32)
    assert again.cfg.replace(name="x") == model.cfg.replace(name="x")
    for k, v in params(model).items():
        np.testing.assert_array_equal(params(again)[k], v, err_msg=k)
    assert tok2.to_str() == tok.to_str()


def test_sharded_bf16_checkpoint_round_trip(tmp_path):
    """Multi-file checkpoint with an index, stored in bfloat16, loaded into float32 and bf16 params."""
    model, _ = from_pretrained(FIXTURES / "qwen2_mha_untied", dtype=jnp.float32)
    save_pretrained(model, tmp_path / "out", dtype=jnp.bfloat16, max_shard_bytes=40_000)
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for param_dtype in (jnp.float32, jnp.bfloat16):
        again, _ = from_pretrained(tmp_path / "out", dtype=jnp.float32, param_dtype=param_dtype)
        for k, v in params(model).items():
            got = params(again)[k]
            assert got.dtype == param_dtype, k
            np.testing.assert_array_equal(got.astype(np.float32), v.astype(jnp.bfloat16).astype(np.float32))
    # Several files and no index (some exports): the folder's *.safetensors are read together.
    (tmp_path / "out" / "model.safetensors.index.json").unlink()
    again, _ = from_pretrained(tmp_path / "out", dtype=jnp.float32)
    assert params(again).keys() == params(model).keys()


def test_qwen2p5_config_json_gives_the_preset():
    """config.json of Qwen/Qwen2.5-0.5B-Instruct as published (transformers 4.x spelling)."""
    hf = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
          "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
          "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
          "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
          "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
          "use_sliding_window": False, "vocab_size": 151936, "rope_scaling": None}
    cfg = loader.config_from_hf(hf, name="qwen2.5-0.5b")
    assert cfg == ModelConfig.qwen2p5_0p5b()
    assert loader.config_from_hf(loader.config_to_hf(cfg), name=cfg.name) == cfg


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
    d = copy_fixture("qwen2_gqa_tied", tmp_path)
    t = load_file(d / "model.safetensors")
    save_file({**t, "lm_head.weight": t["model.embed_tokens.weight"]}, d / "model.safetensors")
    tokens, ref = reference("qwen2_gqa_tied")
    model, _ = from_pretrained(d, dtype=jnp.float32)
    assert rel_err(forward(model, tokens), ref) < TOL


# ---- broken checkpoints ---------------------------------------------------------------------------
def _rewrite(d: Path, edit) -> None:
    t = load_file(d / "model.safetensors")
    edit(t)
    save_file(t, d / "model.safetensors")


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"), r"missing .*model\.layers\.1\.mlp\.down_proj\.weight"),
    (lambda t: t.pop("lm_head.weight"), r"missing .*lm_head\.weight"),
    (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((96, 64), np.float32)}),
     r"unexpected .*model\.layers\.2\.mlp\.up_proj\.weight"),
    (lambda t: t.update({"model.vision_tower.weight": np.zeros(3, np.float32)}), r"unexpected .*vision_tower"),
])
def test_mismatched_tensors_are_named(tmp_path, edit, match):
    d = copy_fixture("qwen2_headdim_untied", tmp_path)  # kv=1: k_proj is [32, 64]
    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(d, dtype=jnp.float32)


def test_wrong_shape_names_tensor_and_expected_shape(tmp_path):
    d = copy_fixture("qwen2_headdim_untied", tmp_path)
    _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape "
                                              r"\[64, 64\], the config needs \[32, 64\]"):
        from_pretrained(d, dtype=jnp.float32)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_is_a_clear_error(tmp_path, damage):
    d = copy_fixture("qwen2_gqa_tied", tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x13\x37" * 500, "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(corrupt|truncated)"):
        from_pretrained(d, dtype=jnp.float32)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    d = copy_fixture("qwen2_gqa_tied", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="yarn"):
        from_pretrained(d)


# ---- tokenizers -----------------------------------------------------------------------------------
GAME_TOK = game_tokenizer()


def test_game_tokenizer_special_ids_and_size():
    info = special_ids(GAME_TOK)
    assert (info.pad_id, info.bos_id, info.eos_id, info.unk_id) == (0, 1, 2, 3)
    assert info.vocab_size == GAME_TOK.get_vocab_size() <= 128
    # One token per character; the stop token decodes only when asked.
    text = "Board:\n. X O\nYour move: 4"
    ids = GAME_TOK.encode(text).ids
    assert len(ids) == len(text) and 0 not in ids
    assert GAME_TOK.decode(ids + [info.eos_id]) == text
    assert GAME_TOK.decode(ids + [info.eos_id], skip_special_tokens=False) == text + "<eos>"
    assert GAME_TOK.encode("é").ids == [info.unk_id]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=GAME_CHARS, max_size=80))
def test_game_tokenizer_round_trips_any_game_text(text):
    # Like every Hugging Face tokenizer, the literal names of special tokens in text are those tokens.
    assume(not any(name in text for name in GAME_SPECIALS))
    assert GAME_TOK.decode(GAME_TOK.encode(text).ids) == text


def test_game_tokenizer_json_round_trip(tmp_path):
    GAME_TOK.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    text = "  x  \n\n\t o|o|x  \n"
    assert tok.encode(text).ids == GAME_TOK.encode(text).ids and tok.decode(tok.encode(text).ids) == text
    assert special_ids(tok) == special_ids(GAME_TOK)


def test_byte_level_bpe_tokenizer_json_loads():
    tok = load_tokenizer(FIXTURES / "bpe_tokenizer" / "tokenizer.json")
    text = "Your move (1-9): 5\nCafé ünïcode ✓"
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode())  # merges learned, not bytes only
    assert tok.decode(ids) == text
    info = special_ids(tok)
    assert info.eos_id == tok.token_to_id("<|im_end|>") and info.pad_id == tok.token_to_id("<|endoftext|>")
    assert info.bos_id is None


def test_bad_tokenizer_file_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
