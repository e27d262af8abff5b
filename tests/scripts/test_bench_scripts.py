"""Benchmark / figure scripts run end to end at tiny sizes on CPU (the GPU runs use the same code paths)."""

import importlib.util
import json
import statistics
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.rl.algorithm.logprobs import token_logprobs
from earl_jax.sharding.mesh import MeshShape

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    """A script from experiments/ (the paper's figures), experiments/benchmarks/ or experiments/lab/ (probes)."""
    path = next(p for d in ("", "benchmarks", "lab") if (p := ROOT / "experiments" / d / f"{name}.py").exists())
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_policies_match_plain_gradients(remat):
    cfg = ModelConfig.tiny(vocab_size=97).replace(num_hidden_layers=2)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 97)
    grads = []
    for r in (False, remat):
        graphdef, params = nnx.split(Qwen2(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, remat=r))
        f = lambda p: token_logprobs(nnx.merge(graphdef, p), tokens, chunk=8)[0].sum()  # noqa: B023,E731
        grads.append(jax.jit(jax.grad(f))(params))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        Qwen2(cfg, rngs=nnx.Rngs(0), remat="no_such_policy")


@pytest.mark.slow
def test_bench_train_tiny(tmp_path):
    bench = _load("bench_train")
    out = bench.main(["--tiny", "--out", str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("bench_train_*.json")).read_text())
    assert saved["device"] == out["device"]
    kinds = {(r["kind"], r["B"], r["T"]) for r in saved["results"]}
    assert kinds == {(k, b, t) for k in ("train", "experience") for b, t in ((2, 128), (4, 64))}
    for r in saved["results"]:
        assert r["status"] == "ok" and r["finite"] and r["tok_s"] > 0, r
        if r["kind"] == "train":
            assert r["skipped"] == 0.0
    # MFU formula: 6 N per token plus causal attention
    cfg = ModelConfig.qwen2p5_0p5b()
    assert bench.model_flops(cfg, 8, 4096, True) == pytest.approx(
        6 * cfg.num_params() * 8 * 4096 + 12 * 24 * 14 * 64 * 4096 * 8 * 4096 / 2)  # peer_train.py
    assert bench.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and bench.peak_flops("NVIDIA H200") == 989e12


@pytest.mark.slow
def test_fig3_small_real_measure_and_profile_table(tmp_path):
    fig3 = _load("fig3_selector_heatmap")
    first = fig3.main(["--small", "--contexts", "64", "--responses", "8,16", "--no-progress", "--out", str(tmp_path),
                       "--save-table", str(tmp_path / "first.json")])
    assert {c["context_len"] for c in first["cells"]} == {64}
    # a second call (the GPU runs split over device calls) measures only the rows the saved table lacks
    res = fig3.main(["--small", "--contexts", "64,128", "--responses", "8,16", "--no-progress", "--out", str(tmp_path),
                     "--continue-table", str(tmp_path / "first.json"), "--save-table", str(tmp_path / "table.json")])
    entries = json.loads((tmp_path / "first.json").read_text())["entries"]
    before = {(e["mesh"], e["num_responses"]): e["tgs"] for e in entries}
    entries = json.loads((tmp_path / "table.json").read_text())["entries"]
    after = {(e["mesh"], e["num_responses"]): e["tgs"] for e in entries if e["context_len"] == 64}
    assert after == before  # the 64 row was kept, not remeasured
    assert (tmp_path / "fig3_tiny_rollout_tp1_tp2_cpu.png").stat().st_size > 0
    assert {(c["context_len"], c["num_responses"]) for c in res["cells"]} == {(64, 8), (64, 16), (128, 8), (128, 16)}
    for c in res["cells"]:
        assert c["tgs_a"] > 0 and c["tgs_b"] > 0 and c["mesh_a"] == "d8f1t1" and c["mesh_b"] == "d4f1t2"
        assert c["selector_mesh"] in ("d8f1t1", "d4f1t2")
    from earl_jax.parallel.profile import ProfileTable
    table = ProfileTable.load(tmp_path / "table.json", device_count=8, model_name="tiny")
    assert table.meta["measure"] == "RealMeasure" and len(table) == 8

    # --retry-hung: a cell the table records hung is measured again, the others kept
    d = json.loads((tmp_path / "table.json").read_text())
    hung = next(e for e in d["entries"] if e["context_len"] == 64 and e["num_responses"] == 8)
    hung.update(tgs=None, status="hung")
    (tmp_path / "hung.json").write_text(json.dumps(d))
    fig3.main(["--small", "--contexts", "64", "--responses", "8", "--no-progress", "--out", str(tmp_path / "retry"),
               "--continue-table", str(tmp_path / "hung.json"), "--retry-hung",
               "--save-table", str(tmp_path / "r.json")])
    retried = ProfileTable.load(tmp_path / "r.json")
    assert retried.get("rollout", MeshShape.parse(hung["mesh"]), 64, 8).status == "ok" and len(retried) == 8


def test_fig1_small_runs_static_and_selector(tmp_path):
    fig1 = _load("fig1_context_growth")
    # one iteration of short games (at most 6 agent turns) per job: the figure's whole path, fewer programs to compile
    res = fig1.main(["--small", "--out", str(tmp_path), "--", "--steps", "1", "--rollout.max-turns", "6"])
    assert set(res["runs"]) == {"static", "selector"}
    for name, run in res["runs"].items():
        assert run["status"] == "finished" and run["iterations"] == 1, (name, run["tail"])
        assert [e["rollout/turn_tokens"] for e in run["trace"]] == [8]
    assert (tmp_path / "fig1_context_growth_cpu.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="exists"):  # results are never overwritten
        fig1.main(["--small", "--out", str(tmp_path)])


def test_agent_loop_bench_keeps_a_launched_jobs_iterations_when_its_launcher_times_out(monkeypatch):
    """launch/local.py exits 124 when its own timeout fires, e.g. after the job's last iteration: the
    iterations in metrics.jsonl are kept, as for a job this process timed out; a plain job's failure is an error."""
    bench = _load("bench_agent_loop")

    def fake_run(cmd, **kw):
        run_dir = Path(cmd[cmd.index("--run-dir") + 1])
        run_dir.mkdir(parents=True)
        recs = [{"step": i, "time/rollout_s": 0.5, "time/experience_s": 0.3, "time/train_s": 0.8,
                 "time/dispatch_s": 0.01, "rollout/generated_tokens": 1000, "compile/programs": 7} for i in range(1, 6)]
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
        return types.SimpleNamespace(returncode=124, stdout="", stderr="launch/local.py: timed out after 195s")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    flags = bench.CASES["gpu"]["gpu8192_4proc"]
    kept = bench.run_case(flags, 60, {}, bench.LAUNCH["gpu8192_4proc"])
    assert kept["status"] == "cut by the timeout" and kept["iterations"] == 3 and kept["games"] == 8192
    assert kept["games_per_s"] == pytest.approx(8192 / 0.5)
    assert bench.run_case(flags, 60, {}, None)["status"] == "error"  # not launched: 124 is the job's own


def test_agent_loop_bench_collects_one_calls_jobs_and_steady_iterations(tmp_path):
    bench = _load("bench_agent_loop")
    job = {"rollout_s": 2.0, "experience_s": 0.5, "train_s": 0.5, "iteration_s": 3.0}
    for name, code, scale in (("a", "baseline", 1.0), ("b", "current", 0.25)):
        (tmp_path / name).mkdir()
        part = {"what": "x", "device": "NVIDIA H100 80GB HBM3",
                "pgx": {"gpu512": {"games": 512}} if name == "a" else {},
                "cases": {"gpu512": {code: {k: v * scale for k, v in job.items()}}}}
        (tmp_path / name / "bench_agent_loop_nvidia_h100.json").write_text(json.dumps(part))
    merged = bench.collect([tmp_path / "a", tmp_path / "b"])
    assert set(merged["cases"]["gpu512"]) == {"baseline", "current", "speedup"}
    assert merged["pgx"] == {"gpu512": {"games": 512}}
    assert merged["cases"]["gpu512"]["speedup"]["rollout"] == pytest.approx(4.0)
    with pytest.raises(SystemExit, match="no bench_agent_loop"):
        bench.collect([tmp_path / "empty"])
    # compile-free: the stages' program count did not grow and nothing new was traced (an eager op's program too)
    recs = [{"step": s, "compile/programs": p, "compile/lowered": n} for s, p, n in
            ((2, 5, 0), (3, 5, 0), (4, 5, 2), (5, 6, 0), (6, 6, 0))]
    assert [r["step"] for r in bench.steady(recs)] == [3, 6]
    # the four-process cases launch through launch/local.py
    assert {"gpu2048_4proc", "gpu2048_4proc_gc"} <= set(bench.LAUNCH)


def test_agent_loop_bench_takes_each_cases_baseline_from_the_recorded_result(tmp_path):
    """This checkout's runs beside the baselines a result file recorded (the code before the batched agent loop),
    with the speedups; a case the file has no baseline for stands alone."""
    bench = _load("bench_agent_loop")
    job = {"rollout_s": 2.0, "experience_s": 0.5, "train_s": 0.5, "iteration_s": 3.0}
    recorded = tmp_path / "recorded.json"
    recorded.write_text(json.dumps({"cases": {"gpu512": {"baseline": job, "current": {}}}}))
    result = {"device": "NVIDIA H100 80GB HBM3", "cases": {"gpu512": {"current": {k: v / 4 for k, v in job.items()}},
                                                           "gpu2048_4proc": {"current": job}}}
    bench.with_baselines(result, recorded)
    assert result["cases"]["gpu512"]["baseline"] == job and result["baseline_from"] == str(recorded)
    assert result["cases"]["gpu512"]["speedup"]["rollout"] == pytest.approx(4.0)
    assert set(result["cases"]["gpu2048_4proc"]) == {"current"}


def test_agent_loop_bench_merges_repeated_pairs_with_medians(tmp_path):
    bench = _load("bench_agent_loop")
    keys = ("rollout_s", "env_frac", "iteration_s", "games_per_s")
    fracs = {"r1": (0.14, 0.12), "r2": (0.13, 0.08), "r3": (0.15, 0.10)}  # (baseline, current)
    for run, (b, c) in fracs.items():
        (tmp_path / run).mkdir()
        cases = {"gpu512": {"baseline": dict.fromkeys(keys, 1.0) | {"env_frac": b},
                            "current": dict.fromkeys(keys, 1.0) | {"env_frac": c}}}
        if run == "r1":  # a case only the first run has: its own medians, over one pair
            cases["gpu2048"] = {"baseline": dict.fromkeys(keys, 2.0), "current": dict.fromkeys(keys, 3.0)}
        part = {"what": "x", "device": "NVIDIA H200", "pgx": {}, "cases": cases}
        (tmp_path / run / "bench_agent_loop_nvidia_h200.json").write_text(json.dumps(part))
    merged = bench.with_repeats([tmp_path / r for r in fracs])
    assert merged["cases"]["gpu512"]["current"]["env_frac"] == 0.12  # the first run's result stays the main one
    rep = merged["repeats"]["gpu512"]
    assert len(rep["pairs"]) == 3 and rep["pairs"][1]["current"]["env_frac"] == 0.08
    assert rep["median"]["baseline"]["env_frac"] == 0.14 and rep["median"]["current"]["env_frac"] == 0.10
    assert len(merged["repeats"]["gpu2048"]["pairs"]) == 1
    assert merged["repeats"]["gpu2048"]["median"]["current"]["rollout_s"] == 3.0


def test_trace_time_compares_nested_and_plain_layers_and_restores_the_model(tmp_path):
    from earl_jax.models import qwen2

    nested = qwen2._apply_layer
    out = tmp_path / "trace.json"
    result = _load("trace_time").main(["--model", "tiny", "--rows", "2", "--width", "64", "--repeats", "1",
                                       "--out", str(out)])
    assert qwen2._apply_layer is nested  # the plain loop is put back
    assert json.loads(out.read_text())["runs"] == [result]
    assert result["nested"]["trace_s_median"] > 0 and result["plain"]["trace_s_median"] > 0


def test_bench_rollout_long_rows_start_decoding_at_the_prompt_length():
    """The long rows time decode from a cache of random keys/values at the prompt's length (not a prefill)."""
    mod = _load("bench_rollout")
    from earl_jax.rollout.sampler import Sampler
    cfg = ModelConfig.tiny(vocab_size=64).replace(num_hidden_layers=2)
    graphdef, params = nnx.split(Qwen2(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32))
    sampler = Sampler(graphdef, cfg, cache_dtype=jnp.float32)
    state = mod.random_state(sampler, cfg, 2, 200, 208, seed=0)
    assert state.max_len == 256 and np.asarray(state.lengths).tolist() == [200, 200]
    assert float(jnp.abs(state.cache.layers[1].v).mean()) > 0.5  # filled, not zeros
    state, g = sampler.generate(params, state, jax.random.key(0), max_new_tokens=8, budget=8)
    assert np.asarray(state.lengths).tolist() == [208, 208]


def test_bench_rollout_plot_redraws_the_png_from_its_json(tmp_path, monkeypatch):
    mod = _load("bench_rollout")
    bw = {"jax": 3500.0, "torch": 4200.0, "best": 4200.0}
    row = lambda name, tunix: {"row": name, "roofline_tok_s": 1e5, "copy_GBps": bw, "tunix": tunix,
                               "impls": {"xla": {"tok_s": 2e4}, "auto": {"tok_s": 3e4}}}
    path = tmp_path / "bench_rollout_x.json"
    path.write_text(json.dumps({"device": "X", "copy_GBps": bw, "rows": [
        row("short-0.5b-b32", {"tok_s": 1.9e4}), row("long-1.5b-b32", {"error": "not run: asks 771 GiB"})]}))
    monkeypatch.setattr("sys.argv", ["bench_rollout.py", "--plot", str(path)])
    mod.main()
    assert path.with_suffix(".png").stat().st_size > 10_000


def test_bench_search_workers_plays_the_same_games_in_workers(tmp_path, monkeypatch):
    out = tmp_path / "sw.json"
    monkeypatch.setattr("sys.argv", ["bench_search_workers.py", "--opponent", "mcts:4", "--games", "6",
                                     "--workers", "0", "2", "--out", str(out)])
    _load("bench_search_workers").main()  # exits non-zero if the workers' games differ
    rows = json.loads(out.read_text())["rows"]
    assert [r["workers"] for r in rows] == [0, 2] and all(r["seconds"] > 0 for r in rows)


def test_bench_pool_plays_the_same_episodes_each_way(tmp_path, monkeypatch):
    out = tmp_path / "pool.json"
    monkeypatch.setattr("sys.argv", ["bench_pool.py", "--episodes", "32", "--slots", "8", "--rounds", "1",
                                     "--model", "nano", "--turn-tokens", "2", "--out", str(out)])
    _load("bench_pool").main()
    assert out.with_suffix(".png").stat().st_size
    modes = json.loads(out.read_text())["modes"]
    assert modes["pool"]["turns_mean"] == modes["waves"]["turns_mean"] == modes["all"]["turns_mean"]  # same episodes
    assert modes["pool"]["pool_occupancy"] == 1.0
    assert modes["waves"]["pool_occupancy"] is None and modes["all"]["pool_occupancy"] is None  # lock-step, no pool


def test_bench_overlap_compares_each_mode_with_the_synchronous_loop(tmp_path, monkeypatch):
    out = tmp_path / "overlap.json"
    small = ("--rollout.groups 4 --rollout.max-turns 2 --sft.steps 0 --optim.ppo-mini-batches 1 --model.name nano "
             "--planner.devices 2")
    monkeypatch.setattr("sys.argv", ["bench_overlap.py", "--steps", "3", "--skip", "1", "--out", str(out),
                                     "--flags", small])
    _load("bench_overlap").main()
    assert out.with_suffix(".png").stat().st_size
    modes = json.loads(out.read_text())["modes"]
    assert modes["stale1"]["staleness_max"] == 1 and modes["sync"]["staleness_max"] == 0  # the batches ahead ran
    answers = statistics.median(r["rollout/generated_tokens"] for r in modes["sync"]["per_iteration"])
    budget = ["--rollout.token-budget", str(round(0.75 * answers))]
    assert modes["partial"]["flags"][-2:] == modes["both"]["flags"][-2:] == budget
    assert "--rollout.max-staleness" in modes["both"]["flags"] and modes["both"]["staleness_max"] >= 1
    for m in ("stale1", "partial", "both"):
        assert modes[m]["vs_sync"] == modes[m]["trained_tokens_per_s"] / modes["sync"]["trained_tokens_per_s"]
        assert len(modes[m]["per_iteration"]) == 3


def test_bench_mcts_scores_the_two_bots_and_times_the_env(tmp_path):
    bench = _load("bench_mcts")
    row = bench.main(["--game", "tic_tac_toe", "--simulations", "4", "--games", "4", "--out", str(tmp_path / "t.json")])
    assert 0 <= row["cpp_score"] <= 1 and row["cpp_ms_per_move"] > 0 and row["python_ms_per_move"] > 0
    row = bench.main(["--simulations", "4", "--games", "2", "--env-games", "16", "--env-simulations", "4",
                      "--out", str(tmp_path / "c.json")])
    saved = json.loads((tmp_path / "c.json").read_text())
    runs = ("python_bot", "cpp_bot", "cpp_bot_2_workers")
    assert saved["env"]["games"] == 16 and all(saved["env"][k] > 0 for k in runs)
