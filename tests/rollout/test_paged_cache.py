"""Paged KV cache (models/paged_cache.py): rows hold pages of a shared pool through a block table. The sampler decodes
the contiguous cache's tokens whatever pages a row holds and in whatever order; the agent loop's pool plays the
lock-step games with fewer pages than its rows would fill, preempting a game (its history recomputed) when they run
out."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_rollout_pool import BASE, CFG, IDS, TOK, N, _same

from earl_jax.envs import EnvConfig
from earl_jax.envs.vector import make_vector_env
from earl_jax.models.paged_cache import PagesExhausted, PageTable
from earl_jax.models.qwen2 import Qwen2
from earl_jax.rollout.agent_loop import PlayConfig, play_games
from earl_jax.rollout.moves import MoveTokens
from earl_jax.rollout.policy import SamplerPolicy
from earl_jax.rollout.sampler import Sampler, SamplingConfig


@pytest.fixture(scope="module")
def model():
    graphdef, params = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32))
    return graphdef, params


def test_the_page_table_hands_out_pages_and_takes_them_back():
    t = PageTable(num_pages=6, page_size=8, rows=3)
    assert t.shortfall(np.array([8, 9, 0])) == 0
    t.reserve(np.array([8, 9, 0]))  # 1 + 2 pages
    assert [len(p) for p in t.rows] == [1, 2, 0] and t.used == 3
    assert t.shortfall(np.array([8, 9, 40])) == 2  # 5 more for row 2, 3 free
    with pytest.raises(PagesExhausted, match="--rollout.kv-pages"):
        t.reserve(np.array([8, 9, 40]))
    assert t.used == 3  # a refused reservation takes nothing
    table = t.table(4)
    assert table.shape == (3, 4) and (table[2] == 6).all() and (table[0, 1:] == 6).all()
    t.release([1])
    assert t.used == 1 and t.rows[1] == []
    held = t.rows[0]
    t.take([0], 2)  # row 0 stays (its pages with it), the others go
    assert t.rows == [held, []] and t.used == 1
    with pytest.raises(ValueError, match="page-size"):
        PageTable(4, 12, 1)


def _scrambled(table: PageTable, seed: int) -> PageTable:
    table.free = np.random.default_rng(seed).permutation(table.num_pages).tolist()  # rows get scattered pages
    return table


MESHES = {"one": None, "data2_tensor2": dict(data=2, tensor=2)}  # the mesh case covers both kinds of axis


@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_paged_sampler_decodes_the_contiguous_caches_tokens(model, mesh):
    """Prefill, decode, extend, decode again, a larger cache, rows taken: the same sampled tokens (each row by its own
    key), log-probs to 1e-6, on one device and on meshes (pages split by kv head over the tensor axis, whole on each
    batch shard)."""
    from earl_jax.sharding.mesh import INFERENCE_RULES, MeshShape, make_mesh

    graphdef, params = model
    on = {}
    if MESHES[mesh]:
        shape = MeshShape(**MESHES[mesh])
        on = dict(mesh=make_mesh(shape, jax.devices()[:shape.size]), rules=INFERENCE_RULES)
    sampling = SamplingConfig(temperature=1.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 40, n) for n in (5, 30, 2, 17)]
    observations = [rng.integers(1, 40, n) for n in (4, 0, 125, 7)]
    runs = []
    for page_size in (0, 8):
        sampler = Sampler(graphdef, CFG, cache_dtype=jnp.float32, page_size=page_size, **on)
        policy = SamplerPolicy(sampler, params, sampling, (), 6, kv_pages=64 if page_size else 0)
        policy.reset(4, 40)
        if page_size:
            _scrambled(policy.pages, 1)
        out = []
        for turn, tokens in enumerate((prompts, observations)):
            ids = np.zeros((4, max(map(len, tokens))), np.int32)
            for r, t in enumerate(tokens):
                ids[r, :len(t)] = t
            policy.extend(ids, np.array([len(t) for t in tokens]))
            fetch = policy.generate(np.array([6, 6, 3, 6]), jax.random.key(turn), np.arange(4, dtype=np.int32))
            out.append(fetch())
        policy.take_rows(np.array([3, 0]), 2)
        out.append(policy.generate(np.array([5, 5]), jax.random.key(9), np.arange(2, dtype=np.int32))())
        runs.append((out, np.asarray(policy.state.next_logits), policy.state.max_len))
        if page_size and on:  # the pages are split by kv head over the tensor axis, whole over the batch axes
            k = policy.state.cache.pages[0].k
            tensor = MESHES[mesh].get("tensor", 1)
            assert {s.data.shape[1] for s in k.addressable_shards} == {CFG.num_key_value_heads // tensor}
            assert {s.data.shape[0] for s in k.addressable_shards} == {64}
            # an extend's collectives move the new tokens' keys and values, never a layer's pages
            ids, lens = sampler._put_rows(np.ones((2, 8), np.int32), np.full(2, 8, np.int32))
            hlo = sampler._extend.lower(params, policy.state, ids, lens).compile().as_text()
            pool = k.addressable_shards[0].data.size
            collective = re.compile(r"= (.+?) (?:all-gather|all-reduce|collective-permute|all-to-all)(?:-start)?\(")
            moved = [_elements(m.group(1)) for m in map(collective.search, hlo.splitlines()) if m]
            assert moved and max(moved) < pool, (max(moved), pool)
    (contiguous, logits_c, len_c), (paged, logits_p, len_p) = runs
    assert len_p == len_c > 128  # the cache grew past its first size
    for a, b in zip(contiguous, paged):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.counts, b.counts)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logits_c, logits_p, rtol=1e-5, atol=1e-5)


def _elements(hlo_shape: str) -> int:
    """Elements of an HLO result shape (the largest array of a tuple)."""
    shapes = re.findall(r"\[([\d,]*)\]", hlo_shape)
    return max(math.prod(int(d) for d in s.split(",") if d) for s in shapes) if shapes else 0


def _rollout(model, cfg: PlayConfig, page_size: int = 0, kv_pages: int = 0, env=None, moves=None):
    graphdef, params = model
    sampler = Sampler(graphdef, CFG, cache_dtype=jnp.float32, page_size=page_size)
    policy = SamplerPolicy(sampler, params, SamplingConfig(temperature=1.0), (IDS.eos_id,), cfg.max_turn_tokens,
                           moves=moves, kv_pages=kv_pages)
    env = env if env is not None else make_vector_env(
        EnvConfig(game="tic_tac_toe", prompt_style="compact", max_retries=2), N)
    seeds = [7 + i // 4 for i in range(N)]
    return play_games(policy, env, TOK, cfg, jax.random.key(3), seeds, bos_id=IDS.bos_id)


@pytest.fixture(scope="module")
def reference(model):
    return _rollout(model, BASE)


def test_a_paged_cache_with_room_for_every_game_plays_the_lock_step_games(model, reference):
    roomy = _rollout(model, BASE, page_size=8, kv_pages=N * 32)
    _same(reference, roomy)
    assert roomy.stats.preempted == 0


def test_a_paged_pool_short_of_pages_preempts_and_plays_the_same_games(model, reference):
    """Pages for ~3 of the longest games in a pool of 6 rows: rows wait, and games in flight give their pages back when
    others grow (their histories recomputed when they are back)."""
    pages = 3 * -(-int(reference.lengths.max()) // 8) + 2
    tight = _rollout(model, dataclasses.replace(BASE, slots=6), page_size=8, kv_pages=pages)
    _same(reference, tight)
    assert tight.stats.preempted > 0


def test_a_paged_pool_of_constrained_moves_plays_the_same_games(model):
    env = make_vector_env(EnvConfig(game="tic_tac_toe", prompt_style="compact", max_retries=2), N)
    moves = MoveTokens.build(TOK, env.num_actions, IDS.eos_id)
    cfg = dataclasses.replace(BASE, constrain_moves=True)
    reference = _rollout(model, cfg, env=env, moves=moves)
    env2 = make_vector_env(EnvConfig(game="tic_tac_toe", prompt_style="compact", max_retries=2), N)
    tight = _rollout(model, dataclasses.replace(cfg, slots=8), page_size=8,
                     kv_pages=3 * -(-int(reference.lengths.max()) // 8) + 2, env=env2, moves=moves)
    _same(reference, tight)
    assert tight.stats.preempted > 0


def test_pages_too_few_for_one_game_name_the_flag(model):
    with pytest.raises(PagesExhausted, match="--rollout.kv-pages"):
        _rollout(model, BASE, page_size=8, kv_pages=4)


def test_the_job_config_refuses_pages_with_the_pallas_step_and_an_odd_page_size():
    from earl_jax.rollout.rollout_config import RolloutConfig

    with pytest.raises(ValueError, match="decode-impl"):
        RolloutConfig(kv_pages=64, decode_impl="pallas")
    with pytest.raises(ValueError, match="page_size"):
        RolloutConfig(kv_pages=64, page_size=12)
    with pytest.raises(ValueError, match="kv_pages"):
        RolloutConfig(kv_pages=-2)
    with pytest.raises(ValueError, match="--rollout.slots a number"):  # -1 sizes pages for the rows slots gives
        RolloutConfig(kv_pages=-1, slots=-1)


def test_a_paged_sampler_refuses_an_odd_page_size(model):
    graphdef, _ = model
    with pytest.raises(ValueError, match="page-size"):
        Sampler(graphdef, CFG, page_size=12)


@pytest.mark.parametrize("kind,mesh", [("game", None), ("text_task", None), ("game", "d2f1t2")])
def test_the_job_plays_the_same_rollout_with_a_paged_cache(tmp_path, kind, mesh):
    """--rollout.kv-pages: the job's rollout stage plays every episode of the contiguous cache's rollout, with pages
    for about two of its episodes (so it preempts), and its metrics say how many games waited for pages; also on a
    rollout mesh of 4 devices."""
    from test_rollout_pipeline import _same as same_job

    from earl_jax.rl.loop.trainer import Trainer
    from exact_cases import BASE as JOB, KINDS
    from jobs import job

    runs = []
    for pages in (0, 24):
        on = dict(planner__devices=4, planner__rollout_thresholds=f"0:{mesh}") if mesh else {}
        trainer = Trainer(job(**{**JOB, **on}, **KINDS[kind], rollout__max_turns=4, rollout__kv_pages=pages,
                              rollout__page_size=8, run__run_dir=str(tmp_path / f"p{pages}")), log=False)
        # the memory model plans for the pages the rollout's sampler holds
        assert trainer.policy.planner.selector.memory.mem.kv_positions == pages * 8
        seeds, group_ids, rng = trainer.rollout_inputs()
        traj, _ = trainer.play(trainer.matchmaker.train_env(0), seeds, group_ids, rng, trainer.sampling)
        assert all(sp.page_size == (8 if pages else 0) for sp in trainer.rollout.samplers.values())
        if mesh:
            assert {sp.mesh.devices.size for sp in trainer.rollout.samplers.values()} == {4}
        runs.append(traj)
    same_job(runs[0], runs[1])
    assert runs[0].stats.preempted == 0 and runs[1].stats.preempted > 0
    assert runs[1].stats.kv_allocated > 0


def test_the_memory_model_prices_a_paged_cache_by_its_pages():
    """The rollout's KV is the pages' (not rows x context) plus one layer's gathered view; as many pages as the rows
    fill is the contiguous cache's KV; `--rollout.slots -1` then sizes rows by what is left beside the pages."""
    from earl_jax.models.model_config import get_config
    from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel
    from earl_jax.sharding.mesh import MeshShape

    cfg, one = get_config("qwen2.5-1.5b"), MeshShape()
    contiguous = MemoryModel(cfg, MemoryConfig(budget_bytes=80 * GiB)).estimate("rollout", one, 4096, 256)
    full = MemoryModel(cfg, MemoryConfig(budget_bytes=80 * GiB, kv_positions=256 * 4096)).estimate(
        "rollout", one, 4096, 256)
    quarter = MemoryModel(cfg, MemoryConfig(budget_bytes=80 * GiB, kv_positions=64 * 4096)).estimate(
        "rollout", one, 4096, 256)
    assert full.kv_cache == contiguous.kv_cache and quarter.kv_cache == contiguous.kv_cache / 4
    assert quarter.activations >= contiguous.kv_cache / cfg.num_hidden_layers  # one layer's view of every row
    assert quarter.total < contiguous.total
    # on a mesh: the pool whole on every batch shard, split by kv head over the tensor axis
    quarter_mem = MemoryModel(cfg, MemoryConfig(budget_bytes=80 * GiB, kv_positions=64 * 4096))
    assert quarter_mem.estimate("rollout", MeshShape(data=2), 4096, 256).kv_cache == quarter.kv_cache
    assert quarter_mem.estimate("rollout", MeshShape(tensor=2), 4096, 256).kv_cache == quarter.kv_cache / 2


def test_pages_too_few_end_the_job_with_one_line_naming_the_flag(tmp_path, capsys):
    from pathlib import Path

    from earl_jax.rl.job.entry import main

    root = Path(__file__).resolve().parents[2]
    code = main(["--rollout.kv-pages", "2", "--rollout.page-size", "8", "--planner.devices", "1",
                 "--run-dir", str(tmp_path / "run"),
                 "--run.progress", "false", "--run.wandb-mode", "disabled", "--rollout.groups", "4",
                 "--eval.games", "8", "--sft.steps", "0", "--optim.ppo-mini-batches", "1", "--steps", "1"],
                name="train", configs=root / "experiments" / "configs" / "train")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("train: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "--rollout.kv-pages" in errors[0] and "--resume auto" in errors[0], errors
