"""Compiling the rollout's next programs ahead: the real calls find them compiled, results do not change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.compile_cache import count_compiles
from earl_jax.models.init import init_sharded
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.parallel.decode_shapes import DecodeShapes
from earl_jax.parallel.shapes import ProgramShapes
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rollout.agent_loop import COMPACT_FACTOR, COMPACT_LEVELS
from earl_jax.rollout.compile_ahead import CompileAhead
from earl_jax.rollout.sampler import Sampler
from earl_jax.rollout.sampling import SamplingConfig
from earl_jax.rollout.speculate import DraftDecoder
from earl_jax.sharding.mesh import INFERENCE_RULES, MeshShape, make_mesh
from jobs import job, with_fields

CFG = ModelConfig.tiny(vocab_size=64).replace(num_attention_heads=8, num_key_value_heads=4, head_dim=16)
B = 16


def _watched(sampler: Sampler, ahead: bool) -> Sampler:
    """`sampler` as a rollout's (its shapes recorded by a program service), compiling ahead from the start or not."""
    ProgramShapes().watch(sampler, max_len=64)
    if ahead:
        sampler.shapes.start()
    return sampler


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
    if sampler.shapes.ahead is not None:
        sampler.shapes.ahead.drain()
    with count_compiles() as c:
        state, more = _turns(sampler, params, state, 2, 3, active=B // 2)  # lengths 24 + 9 > 32: the cache grows to 64
        state = sampler.take_rows(state, np.arange(4), 4)
        state, last = _turns(sampler, params, state, 3, 4)
    programs = {name for name in c.seconds_by_name if "_impl" in name}
    if check_ahead:
        assert state.max_len == 64 and not programs, programs  # every decode program was ready
        assert c.ahead == 0 or sampler.shapes.ahead.submitted > 0
        assert not sampler.shapes.ahead.failed, sampler.shapes.ahead.failed
    return outs + more + last, programs


# no mesh, and one that splits the model (data-only: plan tests)
@pytest.mark.parametrize("mesh_shape", [None, "d1f1t2"])
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
    ahead, _ = _rollout(_watched(Sampler(graphdef, CFG, cache_buckets=(32, 64, 128), **kw), ahead=True), params,
                        check_ahead=True)
    plain, programs = _rollout(_watched(Sampler(graphdef, CFG, cache_buckets=(32, 64, 128), **kw), ahead=False),
                               params, check_ahead=False)
    assert {"jit(_grow_impl)", "jit(_take_impl)"} <= programs  # without, the same calls compile (the check can fail)
    for a, b in zip(ahead, plain):
        np.testing.assert_array_equal(a, b)


def _drafted_rollout(sampler: Sampler, params, check_ahead: bool):
    """`_rollout`'s shapes with every generate drafted (each row guesses the same 3-token answer): after two turns at
    cache 32, the turn that grows the cache to 64 and the one at a compacted batch of 4 find their drafted programs
    compiled ahead."""
    decoder = DraftDecoder(sampler, window=2)
    drafts = np.tile(np.array([[5, 6, 1]], np.int32), (B, 1))

    def turns(state, first, last, active=None):
        outs = []
        for turn in range(first, last):
            state = sampler.ensure_capacity(state, int(np.asarray(state.lengths).max()) + 9)
            b = state.batch_size
            budget = np.where(np.arange(b) < (active or b), 4, 0)
            state, out = decoder(params, state, jax.random.fold_in(jax.random.key(0), turn), drafts[:b],
                                 np.full(b, 3), max_new_tokens=4, budget=budget, stop_tokens=(1,),
                                 sampling=SamplingConfig(), row_ids=np.arange(b))
            outs.append(np.asarray(out.generation.tokens))
            state = sampler.extend(params, state, np.full((b, 5), 7, np.int32), np.full(b, 5))
        return state, outs

    state = sampler.init_state(B, 32)
    state = sampler.extend(params, state, np.ones((B, 10), np.int32), np.full(B, 10))
    state, outs = turns(state, 0, 1)
    state, second = turns(state, 1, 2, active=B // 2)
    if sampler.shapes.ahead is not None:
        sampler.shapes.ahead.drain()
    with count_compiles() as c:
        state, more = turns(state, 2, 3, active=B // 2)
        state = sampler.take_rows(state, np.arange(4), 4)
        state, last = turns(state, 3, 4)
    programs = {name for name in c.seconds_by_name if "_impl" in name}
    if check_ahead:
        assert state.max_len == 64 and not programs, programs
        assert not sampler.shapes.ahead.failed, sampler.shapes.ahead.failed
    return outs + second + more + last, programs


def test_drafted_programs_are_compiled_ahead_and_change_nothing():
    model = Qwen2(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32)
    graphdef, params = nnx.split(jax.device_put(model, jax.devices()[0]))
    ahead, _ = _drafted_rollout(_watched(Sampler(graphdef, CFG, cache_buckets=(32, 64, 128)), ahead=True), params,
                                check_ahead=True)
    plain, programs = _drafted_rollout(_watched(Sampler(graphdef, CFG, cache_buckets=(32, 64, 128)), ahead=False),
                                       params, check_ahead=False)
    assert "jit(_decode_impl)" in programs  # without, the drafted calls compile in the foreground (the check can fail)
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
    """Free-text Connect Four (the decode loop) on the CPU with --rollout.compile-ahead true: same trajectories and
    metrics as without, the ahead compiles logged, none failed."""
    cfg = job(groups=2, group_size=4, run__steps=1, sft__steps=0, devices=1, eval__games=8, eval__every=0,
              checkpoint_every=0, max_context=256, constrain_moves=False, prompt_style="compact")
    records = {}
    for mode in ("true", "false"):
        trainer = Trainer(with_fields(cfg, compile_ahead=mode, run_dir=str(tmp_path / mode)), log=False)
        records[mode] = trainer.iteration()
        for sp in trainer.rollout.samplers.values():
            assert (sp.shapes.ahead is not None) == (mode == "true")
    on, off = records["true"], records["false"]
    assert on["compile/ahead"] > 0 and on["compile/ahead_failed"] == 0 and off["compile/ahead"] == 0
    for k in ("episode/return_mean", "rollout/tokens", "rollout/context_len_max", "train/loss"):
        assert on[k] == off[k], (k, on[k], off[k])


def _policy(rule: str):
    """The program service's rule `rule` as a function of (mode, training rollouts done, backend); `mode` is
    --rollout.compile-ahead and --rollout.compact-finished alike."""
    def now(mode: str, rollouts_done: int, backend: str) -> bool:
        shapes = ProgramShapes(compile_ahead=mode, compact_finished=mode, backend=backend)
        shapes.rollouts_done = rollouts_done
        return getattr(shapes, rule)()
    return now


def test_auto_compiles_ahead_on_accelerators_after_the_first_rollout():
    decode_ahead_now = _policy("decode_ahead_now")
    assert not decode_ahead_now("auto", 0, "gpu") and decode_ahead_now("auto", 1, "gpu")
    assert not decode_ahead_now("auto", 5, "cpu") and decode_ahead_now("true", 0, "cpu")
    assert not decode_ahead_now("false", 5, "gpu")


def test_auto_stage_programs_compile_ahead_on_accelerators_from_the_start():
    stage_ahead_now = _policy("stage_ahead_now")
    assert stage_ahead_now("auto", 0, "gpu") and not stage_ahead_now("auto", 0, "cpu")
    assert stage_ahead_now("true", 0, "cpu") and not stage_ahead_now("false", 0, "tpu")
    assert ProgramShapes(compile_ahead="auto", backend="gpu").stage_queue is not None  # the queue follows the rule
    assert ProgramShapes(compile_ahead="auto", backend="cpu").stage_queue is None


def test_auto_compaction_on_cpus_always_and_on_accelerators_after_the_first_rollout():
    compact_now = _policy("compact_now")
    assert compact_now("auto", 0, "cpu") and not compact_now("auto", 0, "gpu") and compact_now("auto", 1, "gpu")
    assert compact_now("true", 0, "gpu") and not compact_now("false", 3, "cpu")


def test_the_compaction_setting_is_what_the_rollout_does(tmp_path):
    """--rollout.compact-finished true / false reach the decode loop: the decode batch shrinks as games end, or not."""
    rows = {}
    for mode in ("true", "false"):
        cfg = job(groups=2, group_size=4, run__steps=1, sft__steps=0, devices=1, eval__games=8, eval__every=0,
                  checkpoint_every=0, max_context=256, prompt_style="compact", compact_finished=mode,
                  model__name="tiny", run_dir=str(tmp_path / mode))  # its random games end at different turns
        trainer = Trainer(cfg, log=False)
        traj, _ = trainer.play(trainer.env, list(range(8)), None, jax.random.key(3), trainer.sampling)
        rows[mode] = (traj.stats.decode_rows, 8 * int(max(traj.num_turns)))
    assert rows["false"][0] == rows["false"][1] and rows["true"][0] < rows["true"][1], rows


def test_deferred_widths_of_experience_and_train_are_compiled_ahead():
    """Run the grouped experience and train steps at the widest width with a narrower one deferred (what
    limit_new_widths does on a cold start); after the background compiles, the next run at the narrower width
    compiles no model program in the foreground, and the results equal a run without compiling ahead."""
    import optax

    from earl_jax.parallel.planner import ProgramCache, StageLayout, StageRun
    from earl_jax.rl.algorithm import micro_steps as stages
    from earl_jax.rl.algorithm.losses import LossConfig
    from earl_jax.rl.algorithm.packing import grouped_logprobs, grouped_update
    from earl_jax.sharding.stage_registry import STAGE_RULES

    shape = MeshShape.parse("d2f1t1")
    mesh = make_mesh(shape, jax.devices()[:2])
    n, t = 8, 64
    tokens = np.random.default_rng(0).integers(1, CFG.vocab_size, (n, t)).astype(np.int32)
    mask = np.zeros((n, t), bool)
    mask[:, 4:] = True
    opt = optax.sgd(0.1)
    results = []
    for with_ahead in (True, False):
        shapes = ProgramShapes(compile_ahead="true" if with_ahead else "false")
        run = StageRun("train", StageLayout(shape, 4, 32), mesh, STAGE_RULES["train"], ProgramCache(shapes))
        graphdef, params = nnx.split(init_sharded(CFG, mesh, run.rules, seed=0, dtype=jnp.float32))
        x = run.put_rows({"tokens": tokens, "loss_mask": mask})
        micro = run.micro_batches(n)
        deferred = [32] if with_ahead else []
        logp = grouped_logprobs(run, params, x["tokens"], [t] * micro.count, micro, graphdef=graphdef,
                                deferred=deferred)
        batch = stages.ExperienceBatch(x["tokens"], x["loss_mask"], logp, logp, jnp.ones((n, t), jnp.float32))
        kw = dict(graphdef=graphdef, loss="policy", loss_cfg=LossConfig(), optimizer=opt, token_weighted=True)
        with count_compiles() as first:
            params, state, _ = grouped_update(run, params, opt.init(params), batch, [t] * micro.count, micro,
                                              deferred=deferred, **kw)
        # the optimizer update compiled beside the gradient program, and the real call used it
        assert ("jit(train_policy_apply)" in first.seconds_by_name) != with_ahead, first.seconds_by_name
        if with_ahead:
            shapes.stage_queue.drain()
            assert shapes.stage_queue.submitted == 6 and not shapes.stage_queue.failed, shapes.stage_queue.failed
        with count_compiles() as c:  # the deferred width now
            logp2 = grouped_logprobs(run, params, x["tokens"], [32] * micro.count, micro, graphdef=graphdef)
            params, _, m = grouped_update(run, params, state, batch, [32] * micro.count, micro, **kw)
            jax.block_until_ready(m)
        model_programs = {k for k in c.seconds_by_name if k in ("jit(train_logprobs)", "jit(train_policy_grad)")}
        assert (not model_programs) if with_ahead else model_programs == {"jit(train_logprobs)",
                                                                          "jit(train_policy_grad)"}, model_programs
        # the programs that cut micro-batches at the new width and write their log-probs back: ahead as well
        cut = {"jit(train_micro_tokens)", "jit(train_put_logprobs)", "jit(train_micro_batch)"}
        assert (not cut & set(c.seconds_by_name)) if with_ahead else cut <= set(c.seconds_by_name), c.seconds_by_name
        results.append((np.asarray(logp2), [np.asarray(p) for p in jax.tree.leaves(params)], float(m["loss"])))
    (a_logp, a_params, a_loss), (b_logp, b_params, b_loss) = results
    np.testing.assert_array_equal(a_logp, b_logp)
    assert a_loss == b_loss
    for a, b in zip(a_params, b_params):
        np.testing.assert_array_equal(a, b)


def test_compaction_programs_are_compiled_ahead_from_a_rollout_that_did_not_compact():
    """A rollout that kept finished rows (the first on accelerators) tells where a compacting one will shrink the
    batch: after `DecodeShapes.compaction_ahead`, the compacted rollout's take / generate / extend / grow find their
    programs compiled; a batch that never fell to a quarter submits nothing for the smaller sizes."""
    model = Qwen2(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32)
    graphdef, params = nnx.split(jax.device_put(model, jax.devices()[0]))
    sampler = _watched(Sampler(graphdef, CFG, cache_buckets=(32, 64, 128)), ahead=False)

    def opening():
        state = sampler.init_state(B, 32)
        return sampler.extend(params, state, np.ones((B, 10), np.int32), np.full(B, 10))

    state = opening()  # without compaction: all B rows to the end, a quarter of them still playing at turn 1
    state, _ = _turns(sampler, params, state, 0, 1)
    state, _ = _turns(sampler, params, state, 1, 3, active=B // 4)  # turn 2 grows the cache to 64
    sampler.shapes.start()
    submitted = sampler.shapes.compaction_ahead(params, COMPACT_FACTOR, COMPACT_LEVELS)
    sampler.shapes.ahead.drain()
    assert not sampler.shapes.ahead.failed, sampler.shapes.ahead.failed
    keys = set(sampler.shapes.ahead._futures)
    assert {("take", B, 32, B // 4), ("take", B, 64, B // 4), ("grow", B // 4, 32, 64)} <= keys, keys
    assert not any(k[0] == "take" and k[3] == B // 16 for k in keys)  # never down to a sixteenth
    assert submitted == len(keys)

    state = opening()  # the same games, compacting after turn 1
    state, _ = _turns(sampler, params, state, 0, 1)
    with count_compiles() as c:
        state = sampler.take_rows(state, np.arange(B // 4), B // 4)
        state, _ = _turns(sampler, params, state, 1, 3)
        jax.block_until_ready(state)
    assert state.batch_size == B // 4 and state.max_len == 64
    programs = {name for name in c.seconds_by_name if "_impl" in name}
    assert not programs, programs
    assert {("take", B, 32, B // 4), ("grow", B // 4, 32, 64)} <= sampler.shapes.ahead.used


def test_the_trainer_compiles_compaction_ahead_when_the_next_rollout_compacts(tmp_path, monkeypatch):
    """The accelerators' rules on the CPU (compaction and compiling ahead from the second rollout on): not an
    evaluation, but the first training rollout, which kept finished rows, submits the compacted batches' programs;
    the second, which compacts, does not submit them again and uses them (the sampler test above shows that they are
    found compiled)."""
    monkeypatch.setattr(ProgramShapes, "compact_now", lambda self: self.rollouts_done > 0)
    monkeypatch.setattr(ProgramShapes, "decode_ahead_now", lambda self: self.rollouts_done > 0)
    calls = []
    real = DecodeShapes.compaction_ahead
    monkeypatch.setattr(DecodeShapes, "compaction_ahead", lambda self, *a: calls.append(real(self, *a)))
    cfg = job(groups=2, group_size=8, run__steps=2, sft__steps=0, devices=1, eval__games=8, eval__every=0,
              checkpoint_every=0, max_context=512, constrain_moves=False, prompt_style="compact", run_dir=str(tmp_path))
    trainer = Trainer(cfg, log=False)
    trainer.evaluate()  # an evaluation's rollout (its own batch) predicts nothing
    assert calls == []
    trainer.iteration()
    (sampler,) = trainer.rollout.samplers.values()
    ahead = {k for k in sampler.shapes.ahead._futures if k[0] == "take"}
    assert len(calls) == 1 and calls[0] > 0 and ahead, (calls, ahead)
    sampler.shapes.ahead.drain()
    asked = []
    wait = sampler.shapes.wait
    monkeypatch.setattr(sampler.shapes, "wait", lambda key: (asked.append(key), wait(key)))
    second = trainer.iteration()
    takes = {k for k in asked if k[0] == "take"}
    assert len(calls) == 1 and second["compile/ahead_failed"] == 0
    # these seeds' second rollout compacts where the first foretold (a deeper level it reached is its own look-ahead's)
    assert takes & ahead and not any(k in sampler.shapes.ahead.failed for k in takes), (takes, ahead)
