"""The StagePlan is what runs: every layout field reaches its stage, and micro-batching changes no numbers.

8 fake CPU devices. The trainer-level tests force a plan (static mode keeps it) and spy on what the stages the
trainer runs (rl/stages/experience_stage.py, rl/stages/train_stage.py) and their programs receive: the layout, the mesh
and row sharding of the
programs' inputs, the rows of each micro-batch and the log-prob chunk seen when `token_logprobs` is traced.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from earl_jax.models.init import init_sharded
from earl_jax.models.model_config import ModelConfig
from earl_jax.parallel.dispatch import Dispatcher
from earl_jax.parallel.plan import StageLayout, StagePlan
from earl_jax.parallel.planner import ProgramCache, StagePlanner, StageRun
from earl_jax.rl.algorithm import micro_steps as stages
from earl_jax.rl.algorithm.losses import LossConfig
from earl_jax.rl.algorithm.packing import scored_spans
from earl_jax.rl.loop import trainer as trainer_mod
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rl.stages.experience_stage import ExperienceResult, RolloutBatch, experience_stage
from earl_jax.rl.stages.train_stage import train_stage
from earl_jax.sharding.mesh import MeshShape, make_mesh, state_shardings
from earl_jax.sharding.stage_registry import STAGE_RULES, stage_names, stage_spec
from jobs import job, with_fields

M = MeshShape.parse
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"

# What each stage must receive from each field of its layout; a new field needs a probe here (and a stage
# that reads it), or test_every_layout_field_is_read_by_a_stage fails.
PROBES = {
    "mesh": "the mesh of the stage program's inputs (rollout: of the sampler and its weights)",
    "micro_batch": "rows per micro-batch seen by token_logprobs: micro_batch x batch shards",
    "logprob_chunk": "the chunk token_logprobs is called with",
}


def test_every_layout_field_is_read_by_a_stage():
    assert {f.name for f in dataclasses.fields(StageLayout)} == set(PROBES)


class Spy:
    """Records what the stage programs receive."""

    def __init__(self, monkeypatch):
        self.traced: list[tuple[str, int, int]] = []  # (stage, rows, chunk) per token_logprobs trace
        self.inputs: list[tuple[str, dict, NamedSharding]] = []  # (stage, program's mesh, tokens' sharding)
        self.layouts: list[tuple[str, StageLayout]] = []  # (stage, layout) per call of the trainer's stage functions
        self._stage = None
        real_logprobs, real_jit = stages.token_logprobs, StageRun.jit
        spy = self

        def stage_fn(real):
            def call(run, *args, **kw):
                spy.layouts.append((run.stage, run.layout))
                return real(run, *args, **kw)
            return call

        def token_logprobs(model, tokens, *, chunk, **kw):
            spy.traced.append((spy._stage, tokens.shape[0], chunk))
            return real_logprobs(model, tokens, chunk=chunk, **kw)

        def jit(run, name, fn, **kw):
            program = real_jit(run, name, fn, **kw)

            def call(*args):
                # the programs that compute a micro-batch's log-probs (not e.g. the accumulator's shapes)
                spy._stage = run.stage if name in ("logprobs", "policy_grad") else None
                # a micro-batch's tokens: micro_logprobs(params, tok, ch), micro_grad(params, acc, mb, w)
                tokens = args[1] if name == "logprobs" else args[2].tokens if name.endswith("_grad") else None
                if tokens is not None:
                    spy.inputs.append((run.stage, dict(run.mesh.shape), tokens.sharding))
                return program(*args)
            return call

        monkeypatch.setattr(stages, "token_logprobs", token_logprobs)
        monkeypatch.setattr(StageRun, "jit", jit)
        monkeypatch.setattr(trainer_mod, "experience_stage", stage_fn(trainer_mod.experience_stage))
        monkeypatch.setattr(trainer_mod, "train_stage", stage_fn(trainer_mod.train_stage))


SMALL = job(groups=8, group_size=2, run__steps=1, eval__every=0, sft__steps=0, devices=8, max_turns=2,
            max_context=128, planner__mode="static", micro_batch_tokens=1 << 20, kl_coef=0.0)

# (rollout, experience, train) layouts: meshes 8x1, 4x2, 2x4 (and fsdp in training), micro-batches 1, 2, all
# (all = 16 rows / batch shards), several chunks.
PLANS = [
    (StageLayout(M("d8f1t1")), StageLayout(M("d8f1t1"), 1, 16), StageLayout(M("d1f8t1"), 2, 32)),
    (StageLayout(M("d4f1t2")), StageLayout(M("d4f1t2"), 2, 64), StageLayout(M("d2f2t2"), 1, 16)),
    (StageLayout(M("d2f1t4")), StageLayout(M("d2f1t4"), 8, 32), StageLayout(M("d8f1t1"), 2, 64)),
    (StageLayout(M("d8f1t1")), StageLayout(M("d2f1t4"), 1, 64), StageLayout(M("d2f1t4"), 8, 16)),
]


@pytest.mark.slow
def test_each_stage_receives_what_the_plan_says(tmp_path, monkeypatch):
    trainer = Trainer(with_fields(SMALL, run_dir=str(tmp_path / "run")), log=False)
    spy = Spy(monkeypatch)
    n = SMALL.batch_size
    for rollout, experience, train in PLANS:
        trainer.policy.planner.current = StagePlan(rollout=rollout, experience=experience, train=train,
                                                   context_bucket=128)
        spy.traced.clear()
        spy.inputs.clear()
        spy.layouts.clear()
        record = trainer.iteration()
        # the stage functions the trainer runs receive the plan's layouts
        assert spy.layouts == [("experience", experience), ("train", train)]
        assert record["parallel/rollout_mesh"] == str(rollout.mesh)  # the record names what ran
        assert record["parallel/experience_micro_batch"] == experience.micro_batch
        # rollout: the sampler and the weights it decodes with live on the planned mesh
        sampler = trainer.rollout.samplers[rollout.mesh]
        assert dict(sampler.mesh.shape) == {"data": rollout.mesh.data, "fsdp": 1, "tensor": rollout.mesh.tensor}
        for layout in (experience, train):
            stage = "experience" if layout is experience else "train"
            mesh = make_mesh(layout.mesh, jax.devices())
            shards = layout.mesh.data * layout.mesh.fsdp
            inputs = [(m, s) for st, m, s in spy.inputs if st == stage]
            assert inputs, stage
            for program_mesh, sharding in inputs:  # the program's mesh, and rows over the rules' batch axes
                assert program_mesh == dict(mesh.shape), (stage, layout)
                # equivalent (same rows on the same devices), possibly on another Mesh object: the dispatcher
                # leaves an array alone when its layout already is the target's
                batch = STAGE_RULES[stage]["batch"]
                assert sharding.is_equivalent_to(NamedSharding(mesh, P(batch)), 2), (stage, sharding)
            traced = [(rows, chunk) for st, rows, chunk in spy.traced if st == stage]
            if traced:  # traced once per new program; a program reused from an earlier plan is not retraced
                per_shard = n // shards
                count = next(k for k in range(-(-per_shard // layout.micro_batch), per_shard + 1) if per_shard % k == 0)
                # the plan's split, or a finer length-grouped one (packing.length_split): never more rows
                allowed = {(n // k, layout.logprob_chunk) for k in range(count, per_shard + 1) if per_shard % k == 0}
                assert set(traced) <= allowed, (stage, layout, traced)
                assert max(rows for rows, _ in traced) <= layout.micro_batch * shards
        # the weights the train stage wrote are in the train layout's shardings
        targets = state_shardings(trainer.state.params, make_mesh(train.mesh, jax.devices()), STAGE_RULES["train"])
        for x, target in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(targets)):
            assert x.sharding.is_equivalent_to(target, x.ndim), (train, x.shape)


@pytest.fixture(scope="session")
def with_guide_stage():
    """The registered stages, the fork guide's (docs/examples/score_stage.py) among them."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        importlib.import_module("score_stage")
    finally:
        sys.path.remove(str(EXAMPLES))
    return stage_names()


@pytest.mark.parametrize("stage", list(dict.fromkeys([*stage_names(), "score"])))
def test_every_registered_stage_receives_the_layout_the_selector_decided(stage, with_guide_stage):
    spec = stage_spec(stage)
    planner = StagePlanner.from_config(SMALL.planner, CFG, SMALL.batch_size)
    layout = planner.plan()[stage] if spec.planned == "each_iteration" else planner.plan_stage(stage)
    received = planner.run(stage, lambda run: run)
    assert received.layout == layout == planner.selector.choices[stage].layout == planner.ran[stage]
    assert dict(received.mesh.shape) == dict(zip(("data", "fsdp", "tensor"), layout.mesh.shape))
    assert received.rules == spec.rules
    # the selector fills the fields a stage of this memory kind reads (PROBES), and no other
    assert (layout.micro_batch is None, layout.logprob_chunk is None) == ((spec.memory == "decode",) * 2)
    assert any(m.fsdp > 1 for m in planner.selector.candidates_of(stage)) == spec.updates_weights
    logged = planner.ran_log_dict()  # the metrics record names the layout that ran
    assert logged[f"parallel/{stage}_mesh"] == str(layout.mesh)
    assert logged.get(f"parallel/{stage}_micro_batch") == layout.micro_batch


def test_micro_batch_split_is_the_one_conversion():
    programs = ProgramCache()
    for mesh, mb, rows, want in [("d8f1t1", 1, 16, (2, 8)), ("d8f1t1", 2, 16, (1, 16)), ("d2f4t1", 1, 16, (2, 8)),
                                 ("d2f1t4", 3, 16, (4, 4)), ("d2f1t4", 8, 16, (1, 16)), ("d1f8t1", 5, 64, (2, 32))]:
        stage = "train" if M(mesh).fsdp > 1 else "experience"
        run = StageRun(stage, StageLayout(M(mesh), mb, 64), make_mesh(M(mesh)), STAGE_RULES[stage], programs)
        micro = run.micro_batches(rows)
        assert (micro.count, micro.rows) == want, (mesh, mb, rows)
        assert micro.rows_per_shard <= mb and micro.shards == run.batch_shards
    with pytest.raises(ValueError, match="do not split"):
        run.micro_batches(12)  # 12 rows over 8 shards


CFG = ModelConfig.tiny(vocab_size=32).replace(num_hidden_layers=2, hidden_size=64, intermediate_size=128)


def _run(stage: str, mesh: str, mb: int, chunk: int, programs: ProgramCache, params_host):
    shape = M(mesh)
    jmesh = make_mesh(shape)
    run = StageRun(stage, StageLayout(shape, mb, chunk), jmesh, STAGE_RULES[stage], programs)
    return run, jax.device_put(params_host, run.shardings(params_host))


@pytest.mark.parametrize("stage, mesh", [("experience", "d8f1t1"), ("experience", "d4f1t2"), ("experience", "d2f1t4"),
                                         ("train", "d8f1t1"), ("train", "d1f8t1"), ("train", "d2f2t2"),
                                         ("train", "d2f1t4")])
def test_micro_batched_stages_equal_one_batch_on_every_mesh(stage, mesh):
    """rl/stages/experience_stage.py and rl/stages/train_stage.py (what the trainer runs) at the plan's split: one
    micro-batch, then the most."""
    model = init_sharded(CFG, make_mesh(M("d8f1t1")), STAGE_RULES["train"], seed=0, dtype=jnp.float32)
    graphdef, params = nnx.split(model)
    params = jax.device_get(params)
    rng = np.random.default_rng(0)
    n, t = 16, 24
    tokens = rng.integers(1, CFG.vocab_size, (n, t)).astype(np.int32)
    mask = np.zeros((n, t), bool)
    mask[:, t // 2:] = True
    rewards = np.zeros((n, t), np.float32)
    rewards[:, -1] = rng.choice([-1.0, 1.0], n)
    groups = np.repeat(np.arange(n // 2), 2).astype(np.int32)
    old_logp = rng.normal(-3, 0.1, (n, t)).astype(np.float32)
    spans = scored_spans(mask)
    programs = ProgramCache()
    per_shard = n // (M(mesh).data * M(mesh).fsdp)
    outs = []
    for mb, chunk in ((per_shard, 64), (1, 8)):  # one micro-batch, then the most micro-batches, another chunk
        run, p = _run(stage, mesh, mb, chunk, programs, params)
        micro = run.micro_batches(n)
        assert micro.count == (1 if mb == per_shard else per_shard)
        # ProgramCache's default program service: the plan's split as it is (no finer length split)
        if stage == "experience":
            out = experience_stage(run, p, None, RolloutBatch(tokens, mask, rewards, groups), spans,
                                   graphdef=graphdef, loss=LossConfig(filter_constant_groups=False), num_groups=n // 2)
            batch, back = out.batch, np.argsort(out.arranged)  # rows in their original order
            outs.append((np.asarray(batch.old_logp)[back], np.asarray(batch.advantages)[back]))
        else:
            opt = optax.sgd(0.1)  # linear in the gradient: compares the accumulated gradient itself
            batch = stages.ExperienceBatch(*run.put_rows({"tokens": tokens, "mask": mask, "a": old_logp, "b": old_logp,
                                                          "adv": rewards.sum(1, keepdims=True) * mask}).values())
            experience = ExperienceResult(batch, {}, np.arange(n), spans)  # rows in their own order
            new, _, metrics = train_stage(run, p, opt.init(p), experience, Dispatcher(), graphdef=graphdef,
                                          loss=LossConfig(), optimizer=opt, epochs=1, mini_batches=1)
            outs.append(([np.asarray(v) for v in jax.tree.leaves(new)], metrics["loss"]))
    if stage == "experience":
        np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-6)
        # and both equal the plain forward on one device
        logits, _ = nnx.merge(graphdef, params)(jnp.asarray(tokens))
        ref = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), jnp.asarray(tokens)[:, 1:, None], -1)[..., 0]
        np.testing.assert_allclose(outs[0][0][:, 1:], ref, rtol=1e-4, atol=1e-4)
    else:
        assert outs[1][1] == pytest.approx(outs[0][1], rel=1e-5, abs=1e-6)
        moved = False
        for a, b, before in zip(outs[1][0], outs[0][0], jax.tree.leaves(params)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            moved |= not np.allclose(a, before)
        assert moved, "a step with non-zero advantages must move the weights"


def test_stage_programs_compile_with_the_planner_s_xla_options(monkeypatch):
    """Experience and train on a multi-device GPU mesh compile without the latency-hiding scheduler (it tripled
    a data-parallel grad step's temp memory on H100s); the rollout, one device and CPUs keep XLA's defaults."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from earl_jax.parallel import planner

    cpu2 = Mesh(np.array(jax.devices()[:2]), ("data",))
    cpu1 = Mesh(np.array(jax.devices()[:1]), ("data",))
    assert planner.stage_compiler_options("train", cpu2) is None  # CPU: the scheduler is a GPU pass

    class FakeGpu:
        platform = "gpu"

    class FakeMesh:
        def __init__(self, n):
            self.devices = np.array([FakeGpu()] * n)

    assert planner.stage_compiler_options("train", FakeMesh(4)) == planner.NO_LATENCY_HIDING
    assert planner.stage_compiler_options("experience", FakeMesh(2)) == planner.NO_LATENCY_HIDING
    assert planner.stage_compiler_options("rollout", FakeMesh(4)) is None
    assert planner.stage_compiler_options("train", FakeMesh(1)) is None
    monkeypatch.setenv("EARL_XLA_LHS", "1")
    assert planner.stage_compiler_options("train", FakeMesh(4)) is None
    assert planner.stage_compiler_options("train", cpu1) is None
