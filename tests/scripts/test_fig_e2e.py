"""The end-to-end adaptivity figure: its summary on hand-made traces, and two real CPU runs merged into one JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import adaptivity_summary as summary  # noqa: E402


def _rec(step, turn_tokens, tokens, iteration_s, programs, mesh="d4f1t1", gen=None, rollout_s=None, dispatch_s=0.0,
         ctx=100.0):
    return {"step": step, "rollout/turn_tokens": turn_tokens, "rollout/tokens": tokens,
            "rollout/generated_tokens": gen if gen is not None else tokens // 2, "time/iteration_s": iteration_s,
            "time/rollout_s": rollout_s if rollout_s is not None else iteration_s / 2, "time/dispatch_s": dispatch_s,
            "time/dispatch_share": dispatch_s / iteration_s, "compile/programs": programs,
            "parallel/rollout_mesh": mesh,
            "rollout/context_len_max": int(2 * ctx), "rollout/turn_context_len_mean": ctx}


def _result():
    """Two phases (budgets 8 and 64, iterations 1-2 and 3-4), 2 devices. static_a finishes, static_b runs out of
    memory in its rollout at iteration 4, auto switches rollout layout in phase 2 (compiling at iteration 3)."""
    a = [_rec(1, 8, 400, 10.0, 5), _rec(2, 8, 400, 2.0, 5), _rec(3, 64, 2000, 20.0, 9), _rec(4, 64, 2000, 4.0, 9)]
    b = [_rec(1, 8, 400, 10.0, 5, "d1f1t2"), _rec(2, 8, 400, 1.0, 5, "d1f1t2"), _rec(3, 64, 2000, 30.0, 9, "d1f1t2")]
    auto = [_rec(1, 8, 400, 8.0, 5, "d1f1t2", dispatch_s=0.08), _rec(2, 8, 400, 1.0, 5, "d1f1t2", dispatch_s=0.01),
            _rec(3, 64, 2000, 25.0, 12, dispatch_s=0.2), _rec(4, 64, 2000, 4.0, 12, dispatch_s=0.05)]
    runs = {"static_a": {"status": "finished", "trace": a, "rollout_mesh": "d2f1t1"},
            "static_b": {"status": "out_of_memory", "oom_stage": "rollout", "failed_iteration": 4,
                         "failed_turn_tokens": 64, "trace": b, "rollout_mesh": "d1f1t2"},
            "auto": {"status": "finished", "trace": auto}}
    return {"num_devices": 2, "schedule": [[0, 8], [2, 64]], "steps": 4, "runs": runs}


def test_an_iteration_compiled_when_its_program_count_grew():
    trace = [{"compile/programs": n} for n in (5, 5, 9, 9, 9, 12)]
    assert summary.mark_compiles(trace) == [True, False, True, False, False, True]


def test_phases_compare_compile_free_iterations_with_the_best_static_run():
    rows = summary.phase_rows(_result())
    first, second = rows
    assert first["iterations"] == [1, 2] and second["iterations"] == [3, 4]
    # phase 1: compile-free iteration 2 only: a 400/2/2 = 100, b 400/1/2 = 200, auto 200
    assert first["runs"]["static_a"]["iteration_tgs"] == 100 and first["runs"]["static_b"]["iteration_tgs"] == 200
    assert first["best_static"] == "static_b" and first["auto_vs_best_static_pct"] == 0 and first["within_target"]
    # phase 2: static_b compiled in its only iteration there: all of them count, and the row says so
    assert second["runs"]["static_b"]["compile_free"] is False
    assert second["runs"]["static_b"]["iteration_tgs"] == 2000 / 30 / 2
    assert second["best_static"] == "static_a" and second["runs"]["auto"]["iteration_tgs"] == 2000 / 4 / 2
    assert second["auto_vs_best_static_pct"] == 0


def test_whole_run_skips_static_runs_that_died_and_reports_both_versions():
    w = summary.whole_run(_result())
    assert w["vs_static"]["static_b"]["eligible"] is False and w["vs_static"]["static_b"]["common_iterations"] == 3
    assert w["best_static_compile_free"] == w["best_static_all"] == "static_a"  # static_b died: not a whole-run plan
    # compile-free: auto iterations 2, 4 (2400 tokens / 5 s), static_a 2, 4 (2400 / 6 s)
    assert w["auto_gain_vs_best_static_compile_free_pct"] == 20.0 and w["target_met_compile_free"]
    # every iteration: auto 4800 / 38 s, static_a 4800 / 36 s
    assert w["auto_gain_vs_best_static_all_pct"] == round((36 / 38 - 1) * 100, 2) and not w["target_met_all"]


def test_dispatch_share_and_oom_report():
    res = _result()
    d = summary.dispatch_share(res["runs"]["auto"]["trace"])
    assert d["share"] == round(0.34 / 38, 5) and d["max_iteration_share"] == 0.0125 and d["target_met"]
    assert not summary.dispatch_share([_rec(1, 8, 1, 1.0, 1, dispatch_s=0.5)])["target_met"]
    oom = summary.oom_report(res)
    assert oom["out_of_memory"] == {"static_b": {"stage": "rollout", "iteration": 4}}
    assert oom["auto_oom"] is False and oom["a_static_died_of_oom"]


def test_the_auto_table_holds_each_static_layout_per_phase_at_one_context():
    res = _result()
    res["runs"]["static_b"]["trace"][1]["rollout/turn_context_len_mean"] = 140.0  # contexts differ a little
    res["runs"]["static_a"]["trace"][2]["rollout/turn_context_len_mean"] = 300.0  # phase 2: (300+100+100)/3
    rows = summary.auto_profile_rows(res, bucket_edges=(64, 128, 256, 512))
    by_bucket = {}
    for r in rows:
        by_bucket.setdefault(r["context_len"], []).append((r["mesh"], r["status"], r["phase_context"]))
    # phase 1: mean context 110 -> bucket 128; phase 2: 167 -> 256, where static_b's rollout ran out of memory
    assert by_bucket == {128: [("d2f1t1", "ok", 110), ("d1f1t2", "ok", 110)],
                         256: [("d2f1t1", "ok", 167), ("d1f1t2", "oom", 167)]}
    ok = {(r["mesh"], r["context_len"]): r["tgs"] for r in rows if r["status"] == "ok"}
    assert ok[("d2f1t1", 128)] == 200 / 1.0 / 2  # generated tokens / rollout s / devices, compile-free iteration 2
    one = summary.auto_profile_rows(res, bucket_edges=(1024,))  # both phases in one bucket: the later one stays
    assert ({(r["mesh"], r["status"], r["phase_context"]) for r in one}
            == {("d2f1t1", "ok", 167), ("d1f1t2", "oom", 167)})


def test_how_a_run_ended_is_read_from_its_output():
    import importlib

    fig = importlib.import_module("fig_e2e_adaptivity")
    static = ("Traceback ...\njaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating\n\n"
              "During handling ...\nRuntimeError: train stage ran out of memory on the static layout d4f1t1 mb2 "
              "chunk64 (--planner.mode static keeps the first plan; auto adapts it)\n")
    assert fig.oom_stage(static) == "train" and fig.error_line(static).startswith("RuntimeError: train stage ran out")
    auto = ("earl_jax.parallel.selector.NoFeasibleLayoutError: rollout: out of memory on d1f1t4, and nothing else "
            "fits:\nno rollout layout ...\n")
    assert fig.oom_stage(auto) == "rollout" and "NoFeasibleLayoutError: rollout" in fig.error_line(auto)
    assert fig.oom_stage("ValueError: something else\n") is None
    assert fig.error_line("x\nValueError: something else\ny\n") == "ValueError: something else"
    with pytest.raises(SystemExit, match="run them first"):  # auto's table needs a static run's iterations
        fig.auto_table({**_result(), "runs": {}, "flags": [], "model": "tiny"}, Path("unused.json"))


def test_small_figure_runs_merge_into_one_json_and_refuse_other_settings(tmp_path, monkeypatch):
    import importlib

    fig = importlib.import_module("fig_e2e_adaptivity")
    monkeypatch.setenv("EARL_COMPILE_CACHE", jax.config.jax_compilation_cache_dir or str(tmp_path / "cache"))
    trim = ["--small", "--steps", "2", "--schedule", "0:40,1:60", "--out", str(tmp_path)]
    first = fig.main([*trim, "--runs", "static_d4f1t1", "--keep-runs", str(tmp_path / "a")])
    assert list(first["runs"]) == ["static_d4f1t1"] and first["static_runs"]["static_d1f1t4"] == "d1f1t4"
    res = fig.main([*trim, "--runs", "auto,static_d4f1t1", "--keep-runs", str(tmp_path / "b")])  # a second call
    assert set(res["runs"]) == {"static_d4f1t1", "auto"}  # the static run was kept, not rerun
    for name, run in res["runs"].items():
        assert run["status"] == "finished" and run["iterations"] == 2, (name, run["tail"])
        assert [e["rollout/turn_tokens"] for e in run["trace"]] == [40, 60]
        assert all(e[k] is not None for e in run["trace"] for k in ("throughput/iteration_tgs", "time/dispatch_share",
                                                                    "compile/programs", "parallel/train_mesh",
                                                                    "time/compile_s"))
        assert all(e["parallel/rollout_mesh"] == "d4f1t1" for e in run["trace"])  # auto: the only measured layout
    assert [r["mesh"] for r in res["auto_table"]] == ["d4f1t1", "d4f1t1"]
    assert [row["turn_tokens"] for row in res["summary"]["phases"]] == [40, 60]
    assert res["summary"]["phases"][0]["best_static"] == "static_d4f1t1"
    assert res["summary"]["phases"][0]["auto_vs_best_static_net_pct"] is not None  # compile times were kept
    saved = json.loads((tmp_path / "fig_e2e_adaptivity_nano_cpu_custom.json").read_text())
    assert set(saved["runs"]) == {"static_d4f1t1", "auto"}
    assert (tmp_path / "fig_e2e_adaptivity_nano_cpu_custom.png").stat().st_size
    with pytest.raises(SystemExit, match="exists with other"):  # one figure, one setting
        fig.main(["--small", "--steps", "3", "--schedule", "0:40,1:60", "--out", str(tmp_path), "--runs", "auto"])
    with pytest.raises(SystemExit, match="unknown"):
        fig.main([*trim, "--runs", "static_d3f1t1"])


def test_a_rerun_keeps_the_run_it_replaces_and_the_plot_marks_micro_batch_switches(tmp_path, monkeypatch):
    import importlib

    fig = importlib.import_module("fig_e2e_adaptivity")
    res = _result()
    cold = res["runs"]["static_a"]
    fig.keep_replaced(res, "static_a")  # what main does before a --rerun overwrites the run
    fig.keep_replaced(res, "static_c")  # nothing to keep: not run before
    assert res["replaced_runs"] == {"static_a": [cold]}
    for i, e in enumerate(res["runs"]["auto"]["trace"]):
        e.update({f"parallel/{s}_mesh": "d2f1t1" for s in ("experience", "train")}, **{
            "parallel/train_micro_batch": 2 if i < 2 else 1, "parallel/experience_micro_batch": 2,
            "throughput/iteration_tgs": 100.0, "throughput/rollout_tgs": 50.0})
    for name in ("static_a", "static_b"):
        for e in res["runs"][name]["trace"]:
            e.update({"throughput/iteration_tgs": 90.0, "throughput/rollout_tgs": 40.0})
    import matplotlib.axes

    notes = []

    orig = matplotlib.axes.Axes.annotate
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate",
                        lambda self, text, *a, **k: notes.append(text) or orig(self, text, *a, **k))
    res.update(model="tiny", device="2 x cpu", context_range="-", summary={})
    fig.plot(res, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size
    # auto iteration 3: a new rollout mesh, and the train stage on the same mesh with a smaller micro-batch
    assert "auto: rollout d4f1t1, train micro-batch 2->1" in notes
    assert not any("experience micro-batch" in n for n in notes)


def test_compile_excluded_throughput_takes_each_iterations_foreground_compiles_off():
    res = _result()
    for name, compile_s in (("static_a", (8.0, 0.0, 10.0, 0.0)), ("auto", (6.0, 0.0, 22.0, 0.0))):
        for e, c in zip(res["runs"][name]["trace"], compile_s):
            e.update({"time/trace_s": c / 2, "time/lower_s": 0.0, "time/compile_s": c / 2})
    assert summary.net_seconds(res["runs"]["auto"]["trace"][2]) == 3.0  # 25 s, 22 of them compiling
    assert summary.net_seconds(res["runs"]["static_b"]["trace"][0]) is None  # not recorded: no net figure
    first, second = summary.phase_rows(res)
    # phase 2, every iteration: static_a 4000 tokens / (10 + 4 s) / 2 devices, auto 4000 / (3 + 4) / 2
    assert second["runs"]["static_a"]["iteration_tgs_net"] == 4000 / 14 / 2
    assert second["runs"]["auto"]["iteration_tgs_net"] == 4000 / 7 / 2
    assert second["runs"]["static_b"]["iteration_tgs_net"] is None
    assert second["best_static_net"] == "static_a" and second["auto_vs_best_static_net_pct"] == 100.0
    # phase 1: static_a (10 - 8) + 2 s, auto (8 - 6) + 1 s for 800 tokens each
    assert first["auto_vs_best_static_net_pct"] == round((4 / 3 - 1) * 100, 2)
    w = summary.whole_run(res)
    assert w["vs_static"]["static_a"]["net"]["auto_gain_pct"] == round((18 / 10 - 1) * 100, 2)
    assert w["vs_static"]["static_b"]["net"]["auto_gain_pct"] is None and w["best_static_net"] == "static_a"
