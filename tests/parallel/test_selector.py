"""Parallelism Selector: buckets with hysteresis, thresholds, profile tables, OOM fallback, Figure 3 smoke test."""

import importlib.util
import json
from pathlib import Path

import jax
import pytest
from hypothesis import given, settings, strategies as st

from earl_jax import distributed
from earl_jax.models.model_config import get_config
from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel, candidate_meshes
from earl_jax.parallel.plan import ContextStats, StageLayout, StagePlan
from earl_jax.parallel.planner import OtherProcessFailedError, OtherProcessOOMError, run_with_oom_fallback
from earl_jax.parallel.profile import (
    INFEASIBLE,
    OK,
    OOM,
    ProfileTable,
    ProfileTableMismatch,
    SyntheticThroughput,
    is_oom_error,
    run_profile,
)
from earl_jax.parallel.selector import NoFeasibleLayoutError, ParallelismSelector
from earl_jax.parallel.selector_config import SMALL_BUCKET_EDGES, HysteresisLevel, SelectorConfig
from earl_jax.sharding.mesh import TRAIN_RULES, MeshShape, make_mesh
from earl_jax.sharding.stage_registry import StageSpec, stage_names

STAGES = stage_names("each_iteration")  # the stages plan() plans

H100 = 80 * GiB
ROOT = Path(__file__).resolve().parents[2]


def tiny_selector(**kw):
    cfg = get_config("tiny")
    conf = kw.pop("config", SelectorConfig(bucket_edges=SMALL_BUCKET_EDGES, smoothing="none"))
    return ParallelismSelector(cfg, 8, memory=MemoryConfig(budget_bytes=4 * GiB), config=conf, **kw)


def stats(ctx, n=16, mx=None):
    return ContextStats(ctx, int(mx if mx is not None else ctx), n)


def oom():
    err = getattr(jax.errors, "JaxRuntimeError", RuntimeError)  # XlaRuntimeError's public name
    return err("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")


# ---- buckets, hysteresis, smoothing -------------------------------------------------------------

def test_bucket_of_and_first_plan():
    sel = ParallelismSelector(get_config("tiny"), 8, memory=MemoryConfig(budget_bytes=4 * GiB))
    assert sel.bucket_edges == (1024, 2048, 4096, 8192, 16384, 32768)
    assert [sel.bucket_of(x) for x in (1, 1024, 1025, 5000, 99999)] == [1024, 1024, 2048, 8192, 32768]
    plan = sel.plan(stats(1500))
    assert plan.context_bucket == 2048
    for s in STAGES:
        assert plan[s].mesh.size == 8


def test_hysteresis_oscillation_does_not_flap():
    sel = tiny_selector(config=SelectorConfig(bucket_edges=(128, 256, 512), margin=0.10, smoothing="none"))
    assert sel.plan(stats(100)).context_bucket == 128
    buckets = [sel.plan(stats(x)).context_bucket for x in [120, 135, 125, 139, 130, 118, 136] * 3]
    assert set(buckets) == {128}  # 128 +- 9 %: stays
    assert sel.plan(stats(142)).context_bucket == 256  # passed 128 by > 10 %
    buckets = [sel.plan(stats(x)).context_bucket for x in [125, 135, 119, 140, 124] * 3]
    assert set(buckets) == {256}  # back around the edge: stays up
    assert sel.plan(stats(114)).context_bucket == 128  # below 128 by > 10 %
    assert sel.plan(stats(1000)).context_bucket == 512  # jumps several buckets at once
    assert sel.plan(stats(50)).context_bucket == 128


@settings(max_examples=60, deadline=None)
@given(xs=st.lists(st.floats(0.91, 1.09), min_size=1, max_size=40), start=st.sampled_from([0.5, 1.5]))
def test_hysteresis_property_no_switch_within_margin(xs, start):
    edge = 1000.0
    lvl = HysteresisLevel([0, edge, 4000], margin=0.10, inclusive=False)
    first = lvl.update(start * edge)
    assert all(lvl.update(x * edge) == first for x in xs)


def test_smoothing_ema_and_window():
    cfg = get_config("tiny")
    ema = ParallelismSelector(cfg, 8, memory=MemoryConfig(budget_bytes=4 * GiB),
                              config=SelectorConfig(bucket_edges=SMALL_BUCKET_EDGES, smoothing="ema", ema_alpha=0.5))
    assert [ema.plan(stats(x)).smoothed_context_len for x in (100, 200, 200)] == [100, 150, 175]
    win = ParallelismSelector(cfg, 8, memory=MemoryConfig(budget_bytes=4 * GiB),
                              config=SelectorConfig(bucket_edges=SMALL_BUCKET_EDGES, smoothing="window", window=2))
    assert [win.plan(stats(x)).smoothed_context_len for x in (100, 200, 400)] == [100, 150, 300]
    with pytest.raises(ValueError):
        SelectorConfig(bucket_edges=(64, 32))
    with pytest.raises(ValueError):
        SelectorConfig(margin=1.5)


# ---- the three ways of choosing -----------------------------------------------------------------

def test_heuristic_without_table_prefers_smallest_tensor_that_fits():
    cfg = get_config("qwen2.5-72b")
    sel = ParallelismSelector(cfg, 8, memory=MemoryConfig(budget_bytes=H100),
                              config=SelectorConfig(stages=("rollout",), smoothing="none"))
    tensors = [sel.plan(stats(ctx, 24)).rollout.mesh.tensor for ctx in (900, 4000, 16000, 30000)]
    assert tensors == sorted(tensors) and tensors[-1] == 8 and tensors[0] < 8
    plan = sel.plan(stats(30000, 24))
    assert plan.train is None and plan.experience is None and str(plan) == "rollout=d1f1t8"
    for m in candidate_meshes(cfg, 8, "rollout"):
        if m.tensor < plan.rollout.mesh.tensor:
            assert not sel.memory.feasible("rollout", m, 32768, 24)


def test_72b_on_64_devices_all_stages_configs_only():
    sel = ParallelismSelector(get_config("qwen2.5-72b"), 64, memory=MemoryConfig(budget_bytes=H100))
    plan = sel.plan(stats(3000, 64, mx=4096))
    assert all(plan[s].mesh.size == 64 for s in STAGES)
    assert plan.train.micro_batch >= 1 and plan.experience.logprob_chunk >= 128


def test_thresholds_given_directly_no_profiling():
    th = {"rollout": [(0, "d4f1t2"), (256, MeshShape(2, 1, 4))], "train": [(0, MeshShape(1, 8, 1))]}
    sel = tiny_selector(config=SelectorConfig(bucket_edges=SMALL_BUCKET_EDGES, smoothing="none", thresholds=th))
    p = sel.plan(stats(100))
    assert str(p.rollout) == "d4f1t2" and str(p.train) == "d1f8t1"
    assert str(sel.plan(stats(270)).rollout) == "d4f1t2"  # within the 10 % margin of 256
    assert str(sel.plan(stats(300)).rollout) == "d2f1t4"
    assert str(sel.plan(stats(240)).rollout) == "d2f1t4"  # hysteresis on the way down too
    assert str(sel.plan(stats(200)).rollout) == "d4f1t2"
    assert p.experience.mesh.tensor == 1  # not in thresholds -> heuristic (smallest tensor)


def test_plan_str_and_log_dict():
    plan = tiny_selector().plan(stats(100))
    assert str(plan) == "rollout=d8f1t1 experience=d8f1t1 train=d8f1t1"
    d = plan.log_dict()
    assert d["parallel/rollout_mesh"] == "d8f1t1" and d["parallel/context_bucket"] == 128
    assert {"parallel/train_micro_batch", "parallel/experience_logprob_chunk"} <= set(d)
    assert str(StageLayout(MeshShape(4, 1, 2), 8, 512)) == "d4f1t2"
    mesh = make_mesh(plan.train.mesh)  # the plan's shapes are real meshes over the 8 devices
    assert mesh.devices.size == 8


# ---- profile table ------------------------------------------------------------------------------

def small_profile(oom_if=None, **kw):
    cfg = get_config("tiny")
    mm = MemoryModel(cfg, MemoryConfig(budget_bytes=4 * GiB))
    return mm, run_profile(mm, SyntheticThroughput(mm, oom_if=oom_if), num_devices=8, context_lens=[64, 256],
                           response_counts=[8, 32], device_kind="cpu", progress=False, **kw)


def test_profile_and_table_driven_selection():
    mm, table = small_profile()
    assert len(table) == 2 * 2 * (3 + 3 + 9)  # contexts x responses x (rollout + experience + train candidates)
    assert all(e.status == OK and e.tgs > 0 for e in table.entries.values())
    sel = ParallelismSelector(mm.cfg, 8, memory=mm, table=table, device_kind="cpu",
                              config=SelectorConfig(bucket_edges=(64, 256), smoothing="none"))
    plan = sel.plan(stats(200, 30))
    for s in STAGES:  # argmax of the table at bucket 256, nearest response count 32
        best = max(table.meshes(s), key=lambda m: table.tgs(s, m, 256, 32))
        assert plan[s].mesh == best


def test_profile_records_oom_and_infeasible_and_skips_them():
    cfg = get_config("qwen2.5-72b")
    mm = MemoryModel(cfg, MemoryConfig(budget_bytes=H100))
    calls = []

    def measure(stage, mesh, ctx, n, layout=None):
        calls.append((stage, mesh, ctx, n))
        assert layout is not None and layout.mesh == mesh
        if mesh.tensor == 4 and ctx == 16384:
            raise oom()
        return 100.0 * mesh.tensor

    table = run_profile(mm, measure, num_devices=8, context_lens=[1024, 16384], response_counts=[24],
                        stages=["rollout"], device_kind="NVIDIA H100 80GB HBM3", progress=True)
    assert table.get("rollout", MeshShape(8, 1, 1), 1024, 24).status == INFEASIBLE  # 145 GB of weights
    assert ("rollout", MeshShape(8, 1, 1), 1024, 24) not in calls  # skipped, never measured
    assert table.get("rollout", MeshShape(2, 1, 4), 16384, 24).status == OOM
    assert table.tgs("rollout", MeshShape(1, 1, 8), 16384, 24) == 800.0
    sel = ParallelismSelector(cfg, 8, memory=mm, table=table,
                              config=SelectorConfig(stages=("rollout",), smoothing="none"))
    assert sel.plan(stats(12000, 24)).rollout.mesh == MeshShape(1, 1, 8)  # measured OOM is excluded

    def broken(stage, mesh, ctx, n):
        raise ValueError("a bug, not an OOM")

    with pytest.raises(ValueError, match="a bug"):
        run_profile(mm, broken, num_devices=8, context_lens=[1024], response_counts=[8], stages=["rollout"],
                    device_kind="x", progress=False)


def test_table_save_load_roundtrip_and_mismatch(tmp_path):
    mm, table = small_profile(oom_if=lambda s, m, c, n: m.tensor == 4 and c == 256)
    path = table.save(tmp_path / "profile.json")
    raw = json.loads(path.read_text())
    assert raw["schema_version"] == 1 and raw["device_kind"] == "cpu" and raw["device_count"] == 8
    assert raw["model_name"] == "tiny"
    back = ProfileTable.load(path, device_kind="cpu", device_count=8, model_name="tiny")
    assert back.entries == table.entries and any(e.status == OOM for e in back.entries.values())
    with pytest.raises(ProfileTableMismatch, match="device kind 'cpu'"):
        ProfileTable.load(path, device_kind="NVIDIA H100 80GB HBM3")
    with pytest.raises(ProfileTableMismatch, match="device count 8"):
        ProfileTable.load(path, device_count=16)
    with pytest.raises(ProfileTableMismatch, match="model 'tiny'"):
        ProfileTable.load(path, model_name="qwen2.5-0.5b")
    with pytest.raises(ProfileTableMismatch, match="device count"):
        ParallelismSelector(get_config("tiny"), 4, memory=mm, table=back)
    raw["schema_version"] = 99
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileTableMismatch, match="schema_version"):
        ProfileTable.load(path)
    # a resumed profile measures only what is missing
    _, partial = small_profile()
    n = len(partial)
    calls = []
    run_profile(mm, lambda *a: calls.append(a) or 1.0, num_devices=8, context_lens=[64, 256, 1024],
                response_counts=[8, 32], device_kind="cpu", table=partial, progress=False)
    assert len(partial) == n * 3 // 2 and all(c[2] == 1024 for c in calls)


def test_is_oom_error():
    assert is_oom_error(oom())
    assert is_oom_error(RuntimeError("CUDA out of memory"))
    assert is_oom_error(MemoryError())
    # what XLA GPU raised when NCCL's scratch did not fit outside the pool (4 x H100, 32K context)
    assert is_oom_error(RuntimeError("INTERNAL: Failed to allocate Scratch 1 for all-reduce. "
                                     "[executable_name='jit_broadcast_in_dim']"))
    assert not is_oom_error(RuntimeError("INTERNAL: Failed to launch kernel"))
    assert not is_oom_error(RuntimeError("INVALID_ARGUMENT: shapes"))
    assert not is_oom_error(ValueError("RESOURCE_EXHAUSTED"))


# ---- OOM handling -------------------------------------------------------------------------------

def test_mark_oom_moves_to_next_best():
    sel = tiny_selector()
    p1 = sel.plan(stats(100))
    assert p1.rollout.mesh == MeshShape(8, 1, 1)
    sel.mark_oom("rollout", p1.rollout.mesh)  # current bucket
    p2 = sel.plan(stats(100))
    assert p2.rollout.mesh == MeshShape(4, 1, 2) and p2.train == p1.train
    sel.plan(stats(900))  # other bucket: the mark does not apply
    assert sel.plan(stats(900)).rollout.mesh == MeshShape(8, 1, 1)
    state = sel.state_dict()
    fresh = tiny_selector()
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.oom_marks == sel.oom_marks and fresh.current_bucket == sel.current_bucket


def test_run_with_oom_fallback_reruns_same_batch_on_next_candidate():
    sel = tiny_selector()
    plan = sel.plan(stats(100))
    batch = {"tokens": object()}
    seen = []

    def step(layout):
        seen.append((layout.mesh, batch))
        if layout.mesh.tensor == 1:
            raise oom()
        return f"ok on {layout}"

    result, new_plan = run_with_oom_fallback("train", step, plan, sel)
    assert [m for m, _ in seen] == [MeshShape(8, 1, 1), MeshShape(4, 2, 1), MeshShape(2, 4, 1),
                                    MeshShape(1, 8, 1), MeshShape(4, 1, 2)]
    assert all(b is batch for _, b in seen)  # the same inputs every time: the batch is not lost
    assert result == "ok on d4f1t2" and new_plan.train.mesh == MeshShape(4, 1, 2)
    assert new_plan.rollout == plan.rollout
    assert sel.plan(stats(100)).train.mesh == MeshShape(4, 1, 2)  # the marks persist

    with pytest.raises(ValueError, match="not an OOM"):
        run_with_oom_fallback("rollout", lambda lay: (_ for _ in ()).throw(ValueError("not an OOM")), plan, sel)

    def always_oom(layout):
        raise oom()

    with pytest.raises(NoFeasibleLayoutError, match="nothing else fits") as ei:
        run_with_oom_fallback("experience", always_oom, plan, sel)
    assert is_oom_error(ei.value.__cause__)


def test_a_stage_registered_each_iteration_is_planned_with_the_others(monkeypatch):
    from earl_jax.sharding import stage_registry as registry

    critic = StageSpec("critic", TRAIN_RULES, memory="update", updates_weights=True, planned="each_iteration")
    monkeypatch.setitem(registry._REGISTRY, "critic", critic)  # registered for this test only
    sel = tiny_selector()
    plan = sel.plan(stats(100))
    assert list(plan.layouts) == ["rollout", "experience", "train", "critic"] and plan.critic.micro_batch >= 1
    # both states that update weights stay resident beside the rollout and experience
    assert sel.memory.resident_bytes == (sel.memory.train_resident_bytes(plan.train.mesh)
                                         + sel.memory.train_resident_bytes(plan.critic.mesh, "critic"))
    assert plan.log_dict()["parallel/critic_mesh"] == str(plan.critic.mesh)


def test_a_stage_planned_when_it_runs_falls_back_for_its_own_batch():
    """sft (or a fork's stage) is not in plan(): an out-of-memory error still moves it on, re-planned for the batch it
    was planned for, not the iteration's."""
    sel = tiny_selector()
    plan = sel.plan(stats(100, n=16))
    own = stats(100, n=64, mx=512)  # its own batch: more and longer rows than the iteration's
    plan = plan.replace(sft=sel.select("sft", plan.context_bucket, own))
    sel.plan(stats(100, n=16), update=False)  # the iteration is planned again in between
    tried = []

    def step(layout):
        tried.append(layout)
        if len(tried) < 3:
            raise oom()
        return "ok"

    result, new_plan = run_with_oom_fallback("sft", step, plan, sel, shrink_first=True)
    assert result == "ok" and new_plan.sft == tried[-1] and new_plan.train == plan.train
    # its 64 rows are 8 per shard of d8f1t1, halved on each error; the iteration's 16 rows would allow 2 at most
    assert [(str(lay.mesh), lay.micro_batch) for lay in tried] == [("d8f1t1", 8), ("d8f1t1", 4), ("d8f1t1", 2)]
    sel.mark_oom("sft", tried[-1].mesh)  # and its mesh can be given up, as a planned stage's
    assert sel.select("sft", plan.context_bucket, own).mesh != tried[-1].mesh


def test_oom_fallback_on_one_process_makes_no_collective(monkeypatch):
    from jax.experimental import multihost_utils

    monkeypatch.setattr(multihost_utils, "process_allgather", lambda *a, **k: pytest.fail("collective on 1 process"))
    sel = tiny_selector()

    def step(layout):
        if layout.mesh == MeshShape(8, 1, 1):
            raise oom()
        return str(layout)

    result, plan = run_with_oom_fallback("train", step, sel.plan(stats(100)), sel)
    assert result == "d4f2t1" and plan.train.mesh == MeshShape(4, 2, 1)


def fake_peer(monkeypatch, peer: list[int], same_layout: bool = True) -> list[int]:
    """A second process whose attempt i ends with peer[i] (0 ok, 1 out of memory, 2 other error; ok after
    the list); returns this process's outcomes as the all-gather saw them."""
    sent = []

    def gather_ints(outcome, layout_id):
        sent.append(outcome)
        other = peer[len(sent) - 1] if len(sent) <= len(peer) else 0
        return [(outcome, layout_id), (other, layout_id if same_layout else layout_id + 1)]

    monkeypatch.setattr(distributed, "gather_ints", gather_ints)
    return sent


def test_oom_on_another_process_is_an_oom_here(monkeypatch):
    sent = fake_peer(monkeypatch, [1])
    sel = tiny_selector()
    plan = sel.plan(stats(100))
    switches = []
    result, new_plan = run_with_oom_fallback("train", str, plan, sel, on_switch=lambda a, b, e: switches.append(e))
    assert sent == [0, 0]  # this process's first attempt worked, and was run again anyway
    assert result == "d4f2t1" and new_plan.train.mesh == MeshShape(4, 2, 1)
    assert sel.oom_marks == {("train", MeshShape(8, 1, 1), plan.context_bucket)}  # the mesh the peer could not fit
    assert isinstance(switches[0], OtherProcessOOMError) and is_oom_error(switches[0])
    assert "process [1]" in str(switches[0])
    sent = fake_peer(monkeypatch, [1])  # a stage that changed state when it succeeded here: no rerun
    with pytest.raises(RuntimeError, match=r"out of memory on process \[1\] after it had completed on process \[0\]"):
        run_with_oom_fallback("train", str, plan, sel, rerun_after_success=False)
    assert sent == [0]


def test_failure_on_another_process_raises_here_after_the_exchange(monkeypatch):
    sel = tiny_selector()
    plan = sel.plan(stats(100))
    sent = fake_peer(monkeypatch, [2])
    with pytest.raises(OtherProcessFailedError, match=r"another process failed \(process \[1\]\)"):
        run_with_oom_fallback("train", str, plan, sel)
    sent = fake_peer(monkeypatch, [2])
    with pytest.raises(OtherProcessFailedError) as ei:  # a failure elsewhere wins over an OOM here
        run_with_oom_fallback("train", lambda lay: (_ for _ in ()).throw(oom()), plan, sel)
    assert sent == [1] and is_oom_error(ei.value.__cause__) and not sel.oom_marks
    sent = fake_peer(monkeypatch, [0])
    with pytest.raises(ValueError, match="a bug"):  # its own error, raised after the peers learnt of it
        run_with_oom_fallback("train", lambda lay: (_ for _ in ()).throw(ValueError("a bug")), plan, sel)
    assert sent == [2]
    monkeypatch.setattr(distributed, "gather_ints", lambda *v: (_ for _ in ()).throw(RuntimeError("peer gone")))
    with pytest.raises(ValueError, match="a bug"):  # a broken exchange does not hide this process's own error
        run_with_oom_fallback("train", lambda lay: (_ for _ in ()).throw(ValueError("a bug")), plan, sel)
    fake_peer(monkeypatch, [0], same_layout=False)
    with pytest.raises(RuntimeError, match="different layouts"):
        run_with_oom_fallback("train", str, plan, sel)


def test_no_feasible_layout_error_is_clear():
    sel = ParallelismSelector(get_config("qwen2.5-72b"), 8, memory=MemoryConfig(budget_bytes=H100))
    with pytest.raises(NoFeasibleLayoutError, match="no train layout of qwen2.5-72b on 8 devices") as ei:
        sel.plan(stats(1000, 8))
    hint = str(ei.value).splitlines()[-1]  # what to change, by the flags that change it
    assert "--rollout.max-context" in hint and "--rollout.groups" in hint and "--planner.memory-budget-gib" in hint


def test_a_pool_of_games_plans_the_rollout_for_its_rows_only():
    """--rollout.slots S: the rollout holds S rows at once, so its memory (and the error) are for S, not every game;
    experience and train still process the whole batch."""
    big = get_config("qwen2.5-1.5b")
    memory = MemoryConfig(budget_bytes=40 * GiB)
    whole = ParallelismSelector(big, 1, memory=memory, batch_rows=1024)
    with pytest.raises(NoFeasibleLayoutError, match=r"(?s)1024 x 1024 responses.*--rollout.slots rows"):
        whole.select("rollout", 1024, stats(1000, 1024, 1024))
    pooled = ParallelismSelector(big, 1, memory=memory, batch_rows=1024, decode_rows=128)
    layout = pooled.select("rollout", 1024, stats(1000, 1024, 1024))
    ranked = pooled._ranked("rollout", 1024, stats(1000, 1024, 1024))
    assert ranked[0][0] == layout
    assert ranked[0][2] == pooled.memory.estimate("rollout", layout.mesh, 1024, 128, layout.micro_batch,
                                                  layout.logprob_chunk).total
    assert pooled.rows_of("rollout", stats(1000, 1024, 1024)) == 128
    assert pooled.rows_of("rollout", stats(1000, 64, 64)) == 64  # fewer games than slots: all of them
    assert pooled.rows_of("train", stats(1000, 1024, 1024)) == 1024


def test_the_job_s_slots_reach_the_rollout_planner():
    from earl_jax.rl.stages.policy_setup import build_policy
    from jobs import SMALL, with_fields

    policy, _ = build_policy(with_fields(SMALL, slots=4))
    assert policy.planner.selector.decode_rows == 4
    policy, _ = build_policy(SMALL)
    assert policy.planner.selector.decode_rows == 0


def test_the_job_s_drafts_reach_the_rollout_memory_model():
    from earl_jax.rl.stages.policy_setup import build_policy
    from jobs import SMALL, with_fields

    policy, _ = build_policy(with_fields(SMALL, drafts=4, constrain_moves=False))
    assert policy.planner.selector.memory.mem.draft_tokens == 4
    policy, _ = build_policy(SMALL)
    assert policy.planner.selector.memory.mem.draft_tokens == 0


def test_stage_plan_is_frozen():
    plan = tiny_selector().plan(stats(100))
    with pytest.raises(Exception):
        plan.rollout = plan.train  # type: ignore[misc]
    assert isinstance(plan, StagePlan) and plan["train"] is plan.train
    with pytest.raises(KeyError):
        plan["decode"]


# ---- Figure 3 script (synthetic, tiny) ----------------------------------------------------------

def test_fig3_synthetic_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("fig3", ROOT / "experiments" / "fig3_selector_heatmap.py")
    fig3 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fig3)
    res = fig3.main(["--synthetic", "--model", "tiny", "--memory-gib", "4", "--tp-a", "1", "--tp-b", "2",
                     "--contexts", "32,64,128", "--responses", "8,16", "--out", str(tmp_path), "--no-progress",
                     "--save-table", str(tmp_path / "table.json"), "--remeasure", "--noise", "0.02"])
    assert len(res["cells"]) == 6
    assert Path(res["paths"]["png"]).stat().st_size > 1000
    saved = json.loads(Path(res["paths"]["json"]).read_text())
    assert saved["device_count"] == 8 and "synthetic" in saved["device_kind"]
    for c in saved["cells"]:
        assert c["selector_mesh"] is not None
        assert c["speedup_pct"] == pytest.approx((c["tgs_b"] - c["tgs_a"]) / c["tgs_a"] * 100)
        assert c["gap_to_best_pct"] >= 0
    # reuse the saved table
    res2 = fig3.main(["--synthetic", "--model", "tiny", "--tp-a", "1", "--tp-b", "4", "--contexts", "32,64,128",
                      "--responses", "8,16", "--table", str(tmp_path / "table.json"), "--out", str(tmp_path),
                      "--name", "again", "--memory-gib", "4"])
    assert (tmp_path / "again.png").exists() and len(res2["cells"]) == 6
    # the figure's own JSON holds its profile table: it serves as --table too
    res3 = fig3.main(["--synthetic", "--model", "tiny", "--tp-a", "1", "--tp-b", "2", "--contexts", "32,64,128",
                      "--responses", "8,16", "--table", res["paths"]["json"], "--out", str(tmp_path),
                      "--name", "from_figure", "--memory-gib", "4"])
    assert [c["tgs_a"] for c in res3["cells"]] == [c["tgs_a"] for c in res["cells"]]


def test_shrink_micro_batch_before_switching_mesh():
    sel = tiny_selector()
    plan = sel.plan(stats(100, n=256))
    assert plan.train.mesh == MeshShape(8, 1, 1) and plan.train.micro_batch == 32
    seen = []

    def step(layout):
        seen.append(layout.describe())
        if layout.micro_batch > 8:
            raise oom()
        return layout.micro_batch

    result, new_plan = run_with_oom_fallback("train", step, plan, sel, shrink_first=True)
    assert result == 8 and new_plan.train.mesh == MeshShape(8, 1, 1)
    assert [d.split()[1] for d in seen] == ["mb32", "mb16", "mb8"]
    assert sel.plan(stats(100, n=256)).train.micro_batch == 8  # remembered for the bucket
    fresh = tiny_selector()
    fresh.load_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert fresh.plan(stats(100, n=256)).train.micro_batch == 8


def test_selector_config_from_dict_for_sweeps():
    conf = SelectorConfig.from_dict({"bucket_edges": "1K,2K,4k", "margin": 0.2, "smoothing": "window",
                                     "window": 3, "thresholds": {"rollout": [[0, "d8f1t1"], [2048, "d4f1t2"]]},
                                     "stages": "rollout,train"})
    assert conf.bucket_edges == (1024, 2048, 4096) and conf.stages == ("rollout", "train")
    assert conf.thresholds["rollout"][1] == (2048, MeshShape(4, 1, 2))
    with pytest.raises(ValueError, match="unknown selector settings"):
        SelectorConfig.from_dict({"marginn": 0.1})


def test_invalid_threshold_mesh_is_rejected_up_front():
    for bad in ("d2f2t2", "d1f1t8", "d4f1t1"):  # fsdp outside training / 8 does not divide 4 heads / 4 devices
        with pytest.raises(ValueError, match="not a valid rollout mesh"):
            tiny_selector(config=SelectorConfig(bucket_edges=SMALL_BUCKET_EDGES, thresholds={"rollout": [(0, bad)]}))
