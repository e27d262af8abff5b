"""docs/examples/score_stage.py, the stage docs/fork.md adds: registered in its own module and nowhere else, planned on
the 8 fake devices, run under its plan (mesh, micro-batch and chunk reach its programs), right, and logged."""

from __future__ import annotations

import importlib
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from earl_jax.parallel.selector_config import SelectorConfig
from earl_jax.rl.algorithm import micro_steps as stages
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.sharding.mesh import INFERENCE_RULES, TRAIN_RULES
from earl_jax.sharding.stage_registry import StageSpec, register_stage, stage_names, stage_spec
from jobs import job

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_the_guide_s_stage_runs_under_its_plan_and_is_logged(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    score_stage = importlib.import_module("score_stage")  # registers "score"
    assert "score" in stage_names("when_run") and stage_spec("score").rules == INFERENCE_RULES
    # micro-batches of 2 rows per shard at the 64-token width, chunks of 32 positions: what the selector must pick
    trainer = Trainer(job(groups=8, group_size=2, run__steps=2, eval__every=0, sft__steps=0, devices=8, max_turns=2,
                          max_context=128, planner__micro_batch_tokens=128, planner__logprob_chunk=32,
                          run_dir=str(tmp_path)), log=False)
    received, traced = [], []
    run, logprobs = trainer.policy.planner.run, stages.token_logprobs

    def spy_run(stage, fn, **kw):
        return run(stage, lambda r: (received.append((stage, r.layout, dict(r.mesh.shape))), fn(r))[1], **kw)

    def spy_logprobs(model, tokens, *, chunk, **kw):  # traced once per program: its rows and chunk
        traced.append((tokens.shape[0], chunk))
        return logprobs(model, tokens, chunk=chunk, **kw)

    monkeypatch.setattr(trainer.policy.planner, "run", spy_run)
    monkeypatch.setattr(stages, "token_logprobs", spy_logprobs)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, trainer.policy.model_cfg.vocab_size, (32, 64)).astype(np.int32)
    mask = rng.random((32, 64)) < 0.5
    mask[:, 0] = False  # the first token has no prediction
    params = jax.device_get(trainer.state.params)

    scores = score_stage.score_rows(trainer, tokens, mask)

    layout = trainer.policy.planner.current["score"]
    assert layout == trainer.policy.planner.selector.choices["score"].layout  # what the selector decided ...
    assert received == [("score", layout, {"data": layout.mesh.data, "fsdp": 1, "tensor": layout.mesh.tensor})]
    assert (layout.micro_batch, layout.logprob_chunk) == (2, 32)
    shards = layout.mesh.data  # ... is what its programs received: the plan's micro-batch rows and chunk
    assert traced == [(layout.micro_batch * shards, layout.logprob_chunk)]
    # the policy's mean log-prob of the masked tokens, as one device computes it without the stage
    logits, _ = nnx.merge(trainer.policy.graphdef, params)(jax.numpy.asarray(tokens))
    logp = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits[:, :-1])), tokens[:, 1:, None], -1)[..., 0]
    want = (logp * mask[:, 1:]).sum(1) / mask[:, 1:].sum(1)
    np.testing.assert_allclose(scores, want, rtol=1e-4, atol=1e-5)

    record = trainer.iteration()  # the next metrics record names the layout the stage ran on, once
    assert record["parallel/score_mesh"] == str(layout.mesh)
    assert record["parallel/score_micro_batch"] == 2 and record["parallel/score_logprob_chunk"] == 32
    assert "parallel/score_why" in record and "parallel/score_mesh" not in trainer.iteration()


def test_the_layout_panel_plots_every_stage_the_records_name():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from earl_jax.rl.job.plots import _layouts

    rows = [{"step": 1, "parallel/rollout_mesh": "d8f1t1", "parallel/train_mesh": "d1f8t1"},
            {"step": 2, "parallel/rollout_mesh": "d8f1t1", "parallel/train_mesh": "d2f4t1",
             "parallel/score_mesh": "d4f1t2", "parallel/critic_mesh": "d2f1t4"}]  # critic: registered nowhere here
    fig, ax = plt.subplots()
    _layouts(ax, rows)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:2] == ["rollout", "train"] and set(labels) == {"rollout", "train", "score", "critic"}
    assert [t.get_text() for t in ax.get_yticklabels()] == ["d1f8t1", "d2f1t4", "d2f4t1", "d4f1t2", "d8f1t1"]
    plt.close(fig)


def test_a_registration_is_checked_and_a_name_taken_once():
    with pytest.raises(ValueError, match="updates_weights=True goes with memory='update'"):
        StageSpec("critic", TRAIN_RULES, memory="score", updates_weights=True)
    with pytest.raises(ValueError, match="memory must be one of decode, score, update, got 'train'"):
        StageSpec("critic", TRAIN_RULES, memory="train", updates_weights=True)
    with pytest.raises(ValueError, match="must map 'batch'"):
        StageSpec("critic", {"embed": None}, memory="score")
    with pytest.raises(ValueError, match="stage 'rollout' is registered already"):
        register_stage(StageSpec("rollout", INFERENCE_RULES, memory="score"))
    assert register_stage(stage_spec("train")) == stage_spec("train")  # the same spec again: a module imported twice
    with pytest.raises(ValueError, match="unknown stage 'critic'; registered: rollout, experience, train, sft"):
        SelectorConfig(stages=("critic",))
