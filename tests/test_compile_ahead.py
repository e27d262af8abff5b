"""Compiling the rollout's next programs ahead: the real calls find them compiled, results do not change."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.compile_cache import count_compiles
from earl_jax.models.config import ModelConfig
from earl_jax.models.init import init_sharded
from earl_jax.models.qwen2 import Qwen2
from earl_jax.rl.config import RLConfig
from earl_jax.rl.trainer import Trainer, compile_ahead_now
from earl_jax.rollout.compile_ahead import CompileAhead
from earl_jax.rollout.sampler import Sampler
from earl_jax.sharding.mesh import INFERENCE_RULES, MeshShape, make_mesh

CFG = ModelConfig.tiny(vocab_size=64).replace(num_attention_heads=8, num_key_value_heads=4, head_dim=16)
B = 16


def _turns(sampler: Sampler, params, state, first: int, last: int, active: int | None = None):
    """Generate + observation extend turns first..last-1 (each turn its own key), as the agent loop does; `active`:
    only the first rows decode (the others' games have ended)."""
    outs = []
    for turn in range(first, last):
        state = sampler.ensure_capacity(state, int(np.asarray(state.lengths).max()) + 9)
        budget = np.where(np.arange(state.batch_size) < (active or state.batch_size), 4, 0)
        state, gen = sampler.generate(params, state, jax.random.fold_in(jax.random.key(0), turn), max_new_tokens=4,
                                      budget=budget, stop_tokens=(1,), row_ids=np.arange(state.batch_size))
        outs.append(np.asarray(gen.tokens))
        state = sampler.extend(params, state, np.full((state.batch_size, 5), 7, np.int32),
                               np.full(state.batch_size, 5))
    return state, outs


def _rollout(sampler: Sampler, params, check_ahead: bool):
    """Two turns at cache 32, the second with half the games over, then (drained, if compiling ahead) a turn that
    grows the cache to 64 and one at a compacted batch of 4: the shapes the sampler predicts from the first two."""
    state = sampler.init_state(B, 32)
    sampler.prepare_generate(params, state, max_new_tokens=4, stop_tokens=(1,))
    state = sampler.extend(params, state, np.ones((B, 10), np.int32), np.full(B, 10))
    state, outs = _turns(sampler, params, state, 0, 1)
    state, second = _turns(sampler, params, state, 1, 2, active=B // 2)
    outs += second
    if sampler.ahead is not None:
        sampler.ahead.drain()
    with count_compiles() as c:
        state, more = _turns(sampler, params, state, 2, 3, active=B // 2)  # lengths 24 + 9 > 32: the cache grows to 64
        state = sampler.take_rows(state, np.arange(4), 4)
        state, last = _turns(sampler, params, state, 3, 4)
    programs = {name for name in c.seconds_by_name if "_impl" in name}
    if check_ahead:
        assert state.max_len == 64 and not programs, programs  # every decode program was ready
        assert c.ahead == 0 or sampler.ahead.submitted > 0
        assert not sampler.ahead.failed, sampler.ahead.failed
    return outs + more + last, programs


@pytest.mark.parametrize("mesh_shape", [None, "d2f1t1", "d1f1t2"])
def test_predicted_programs_are_compiled_before_the_calls_and_change_nothing(mesh_shape):
    if mesh_shape is None:
        model = Qwen2(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32)
        graphdef, params = nnx.split(jax.device_put(model, jax.devices()[0]))  # committed, as the trainer's
        kw = {}
    else:
        shape = MeshShape.parse(mesh_shape)
        mesh = make_mesh(shape, jax.devices()[:shape.size])
        graphdef, params = nnx.split(init_sharded(CFG, mesh, INFERENCE_RULES, seed=0))
        kw = {"mesh": mesh, "rules": INFERENCE_RULES}
    ahead, _ = _rollout(Sampler(graphdef, CFG, cache_buckets=(32, 64, 128), compile_ahead=True, max_len=64, **kw),
                        params, check_ahead=True)
    plain, programs = _rollout(Sampler(graphdef, CFG, cache_buckets=(32, 64, 128), **kw), params, check_ahead=False)
    assert {"jit(_grow_impl)", "jit(_take_impl)"} <= programs  # without, the same calls compile (the check can fail)
    for a, b in zip(ahead, plain):
        np.testing.assert_array_equal(a, b)


def test_a_failed_ahead_compile_is_recorded_and_changes_nothing():
    ahead = CompileAhead()

    def broken():
        raise RuntimeError("no such program")

    ahead.submit("x", broken)
    ahead.submit("x", broken)  # once per key
    ahead.drain()
    assert ahead.submitted == 1 and ahead.failed == [("x", "RuntimeError: no such program")]
    ahead.wait("x")  # done: returns at once


def test_trainer_plays_the_same_games_with_and_without_compiling_ahead(tmp_path):
    """Free-text Connect Four (the decode loop) on the CPU with --compile-ahead true: same trajectories and
    metrics as without, the ahead compiles logged, none failed."""
    cfg = RLConfig(groups=2, group_size=4, steps=1, format_warmup_steps=0, devices=1, eval_games=8, eval_every=0,
                   checkpoint_every=0, max_context=256, constrain_moves=False, prompt_style="compact",
                   progress=False, wandb_mode="disabled")
    records = {}
    for mode in ("true", "false"):
        trainer = Trainer(dataclasses.replace(cfg, compile_ahead=mode, run_dir=str(tmp_path / mode)), log=False)
        records[mode] = trainer.iteration()
        for sp in trainer._samplers.values():
            assert (sp.ahead is not None) == (mode == "true")
    on, off = records["true"], records["false"]
    assert on["compile/ahead"] > 0 and on["compile/ahead_failed"] == 0 and off["compile/ahead"] == 0
    for k in ("episode/return_mean", "rollout/tokens", "rollout/context_len_max", "train/loss"):
        assert on[k] == off[k], (k, on[k], off[k])


def test_auto_compiles_ahead_on_accelerators_after_the_first_rollout():
    assert not compile_ahead_now("auto", 0, "gpu") and compile_ahead_now("auto", 1, "gpu")
    assert not compile_ahead_now("auto", 5, "cpu") and compile_ahead_now("true", 0, "cpu")
    assert not compile_ahead_now("false", 5, "gpu")
