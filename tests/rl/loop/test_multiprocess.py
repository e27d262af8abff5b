"""Multi-host paths on one machine: two CPU processes x 4 fake devices joined by jax.distributed (gloo).

(a) the Data Dispatcher over a global 8-device mesh: weights train -> rollout layout, a batch
    experience -> train layout, and moves whose blocks must cross processes (two_step_global,
    reorder, host_gather): every value arrives, each move names its route;
(b) Connect Four end to end, two iterations: 2 processes x 4 devices reach the same metrics and
    parameters as 1 process x 8 devices running the same command (each process playing its half of the
    games: the rollout is split by process);
(c) the selector's OOM fallback when only one process fails: both agree on every retry.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from earl_jax import distributed

ROOT = Path(__file__).resolve().parents[3]
LAUNCH = [sys.executable, str(ROOT / "launch" / "local.py")]
_spec = importlib.util.spec_from_file_location("launch_local", ROOT / "launch" / "local.py")
launch_local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch_local)


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EARL_", "SLURM_"))}
    # conftest.py's quick-compile XLA flags too (the jobs are mostly compiles), with this job's device count
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=launch_local.cpu_xla_flags(env.get("XLA_FLAGS", ""), devices),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), WANDB_MODE="disabled",
               EARL_COMPILE_CACHE="off")  # the jobs would otherwise cache programs in the user's home
    return env


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(l for l in p.read_text().splitlines()[-40:] if "[Gloo]" not in l)
                     for p in sorted(folder.glob("*.log")))


def _two_processes(command: list[str], logs: Path, timeout: int) -> subprocess.Popen:
    return subprocess.Popen(LAUNCH + ["-n", "2", "--cpu-devices", "4", "--log-dir", str(logs), "--quiet-main",
                                      "--timeout", str(timeout), "--"] + command,
                            cwd=ROOT, env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: int, what: str, logs: Path | None = None) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a hang fails the test instead of blocking CI
        proc.terminate()  # launch/local.py stops its processes on SIGTERM
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{what} timed out after {timeout}s\n{out[-3000:]}\n{_logs(logs) if logs else ''}")
    assert proc.returncode == 0, f"{what} failed ({proc.returncode})\n{out[-3000:]}\n{_logs(logs) if logs else ''}"
    return out


def test_resolve_launch_from_flags_env_and_slurm():
    assert distributed.resolve(env={}) is None  # one process: nothing to join
    got = distributed.resolve(env={"EARL_COORDINATOR": "10.0.0.1:9999", "EARL_NUM_PROCESSES": "4",
                                   "EARL_PROCESS_ID": "2"})
    assert (got.coordinator, got.num_processes, got.process_id, got.source) == ("10.0.0.1:9999", 4, 2, "env")
    # flags win over the environment, field by field
    got = distributed.resolve(process_id=1, env={"EARL_COORDINATOR": "h", "EARL_NUM_PROCESSES": "2",
                                                 "EARL_PROCESS_ID": "0"})
    assert (got.coordinator, got.process_id, got.source) == ("h:1234", 1, "flags+env")
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "3", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
             "SLURM_STEP_NODELIST": "gpu[007-009]", "SLURM_STEP_NUM_NODES": "3"}
    got = distributed.resolve(env=slurm)
    assert (got.coordinator, got.num_processes, got.process_id, got.local_device_ids) == (
        f"gpu007:{4242 % 4096 + 61440}", 3, 1, None)  # one task per node: all its GPUs
    got = distributed.resolve(env={**slurm, "SLURM_NTASKS": "6", "SLURM_LOCALID": "1"})
    assert got.local_device_ids == (1,)  # two tasks per node: one GPU each
    assert distributed.resolve(env={**slurm, "EARL_COORDINATOR": "head:5000"}).coordinator == "head:5000"
    assert distributed.resolve(env={"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert distributed.resolve(env={"EARL_DISTRIBUTED": "auto"}).auto
    assert distributed.resolve(env={"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}).auto
    with pytest.raises(ValueError, match="coordinator"):
        distributed.resolve(num_processes=2, process_id=0, env={})
    with pytest.raises(ValueError, match="outside"):
        distributed.resolve("h:1", 2, 5, env={})


def test_host_global_round_trip_on_one_process():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from earl_jax.sharding.mesh import MeshShape, make_mesh

    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    y = distributed.host_to_global(x, NamedSharding(make_mesh(MeshShape(4, 1, 2)), P("data", "tensor")))
    assert len(y.addressable_shards) == 8 and y.sharding.spec == P("data", "tensor")
    back = distributed.global_to_host({"a": y, "b": jax.numpy.ones(3)})
    np.testing.assert_array_equal(back["a"], x)
    assert isinstance(back["b"], np.ndarray)
    assert distributed.any_process(True) and not distributed.any_process(False)


@pytest.mark.slow
def test_dispatcher_across_two_processes(tmp_path):
    out = tmp_path / "dispatch.json"
    proc = _two_processes([sys.executable, str(ROOT / "tests" / "mp_worker.py"), "dispatch", str(out)],
                          tmp_path / "logs", timeout=150)
    _finish(proc, 180, "dispatch workers", tmp_path / "logs")
    r = json.loads(out.read_text())
    assert (r["processes"], r["devices"], r["local_devices"]) == (2, 8, 4)
    for case in ("weights", "batch", "cross_set", "reorder", "host_gather", "process_rows", "any_process"):
        assert r[case]["equal"] and r[case].get("on_target", True), (case, r[case])
    assert set(r["weights"]["routes"]) <= {"noop", "reshard"} and r["weights"]["routes"].get("reshard")
    assert r["batch"]["routes"] == {"reshard": 1}
    assert r["cross_set"]["routes"] == {"two_step_global": 1}
    assert r["reorder"]["routes"] == {"reorder": 1}
    assert r["host_gather"]["routes"] == {"host_gather": 1}


@pytest.fixture(scope="session")
def oom_job(tmp_path_factory) -> list[dict]:
    """Both processes' reports of the OOM fallback scenarios in tests/mp_worker.py (one job, ~5 s)."""
    tmp = tmp_path_factory.mktemp("oom")
    proc = _two_processes([sys.executable, str(ROOT / "tests" / "mp_worker.py"), "oom_fallback", str(tmp / "out")],
                          tmp / "logs", timeout=60)
    _finish(proc, 90, "oom fallback workers", tmp / "logs")  # a hang in the agreement fails here
    return [json.loads((tmp / f"out.{i}.json").read_text()) for i in range(2)]


def test_oom_on_one_process_moves_both_to_the_same_layout(oom_job):
    p0, p1 = oom_job
    for case in ("oom_on_1", "shrink_1_then_0"):
        assert p0[case] == p1[case], case  # same layouts tried, same marks and caps, same result
    one = p0["oom_on_1"]  # process 0 succeeded on d8f1t1, dropped that result and moved with process 1
    assert one["tried"] == [one["first"], one["final"]] and one["final"].startswith("d4f2t1")
    assert one["oom_marks"] == [["train", "d8f1t1", 128]] and one["micro_batch_caps"] == []
    shrink = p0["shrink_1_then_0"]  # OOMs on different processes at different attempts: two halvings
    assert [t.split()[1] for t in shrink["tried"]] == ["mb32", "mb16", "mb8"]
    assert shrink["oom_marks"] == [] and shrink["micro_batch_caps"] == [["experience", "d8f1t1", 128, 8]]
    # a stage that changed state where it succeeded (train) is not rerun: both processes stop, same error
    assert p0["no_rerun"]["error"] == p1["no_rerun"]["error"]
    assert "out of memory on process [1] after it had completed on process [0]" in p0["no_rerun"]["error"]


def test_error_on_one_process_fails_the_other_clearly(oom_job):
    p0, p1 = oom_job
    for case in ("bug_on_1", "bug_on_1_oom_on_0"):  # the failure wins over an OOM on the other process
        assert p1[case]["error"] == "ValueError: injected bug", case
        assert p0[case]["error"].startswith("OtherProcessFailedError: train: another process failed (process [1])")
        assert p0[case]["tried"] == p1[case]["tried"] == [p0[case]["first"]]  # no retry anywhere


def _restore_numpy(run_dir: Path) -> tuple[int, list[np.ndarray]]:
    import jax
    import orbax.checkpoint as ocp

    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    path = run_dir / "checkpoints" / str(steps[-1]) / "state"
    ck = ocp.PyTreeCheckpointer()
    meta = ck.metadata(path)
    tree = getattr(meta, "item_metadata", None)
    tree = getattr(tree, "tree", tree) if tree is not None else meta
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return steps[-1], [np.asarray(v) for v in jax.tree.leaves(ck.restore(path, restore_args=args))]


# Tiny model, 8 games per iteration, the default's constrained moves, and meshes that make the dispatcher
# reshard weights (train d2f2t2 -> rollout d4f1t2) across the two processes.
CONNECT4 = ["--rollout.groups", "4", "--rollout.group-size", "2", "--eval.games", "8", "--steps", "2",
            "--loss.kl-coef", "0.01", "--loss.filter-constant-groups", "false",
            "--planner.rollout-thresholds", "0:d4f1t2", "--planner.experience-thresholds", "0:d8f1t1",
            "--planner.train-thresholds", "0:d2f2t2", "--run.progress", "false", "--run.wandb-mode", "disabled",
            "--model.name", "nano"]
EXACT_PREFIXES = ("episode/", "eval/", "rollout/context", "rollout/tokens", "rollout/generated", "parallel/",
                  "dispatch/", "step")  # compile/lowered: two processes also trace the gathers


@pytest.mark.slow
def test_connect4_two_processes_match_one(tmp_path):
    script = str(ROOT / "experiments" / "connect4.py")
    one, two = tmp_path / "one", tmp_path / "two"
    # both at once: the two-process job waits on its collectives, the reference fills the idle core
    ref = subprocess.Popen([sys.executable, script, *CONNECT4, "--run-dir", str(one)], cwd=ROOT, env=_env(8),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    multi = _two_processes([sys.executable, script, *CONNECT4, "--run-dir", str(two)], tmp_path / "logs",
                           timeout=480)  # ~2 min on 2 idle cores; generous for a busy CI machine
    _finish(ref, 540, "1 process x 8 devices")
    _finish(multi, 540, "2 processes x 4 devices", tmp_path / "logs")

    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
    assert "process 1/2" in logs["process_1.log"] and "connect4: 2 iterations" in logs["process_0.log"]
    assert "connect4: 2 iterations" not in logs["process_1.log"]  # only process 0 prints

    rows1 = [json.loads(l) for l in (one / "metrics.jsonl").read_text().splitlines()]
    rows2 = [json.loads(l) for l in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows2] == [r["step"] for r in rows1] == [0, 1, 2]  # written once, by process 0
    assert rows1[-1]["train/grad_norm"] > 0 and rows1[-1]["dispatch/bytes"] > 0  # something trained and moved
    # by default each process played its half of the games on its block of the rollout mesh (rollout/process_split.py)
    groups = [(a["rollout/groups"], b["rollout/groups"]) for a, b in zip(rows1, rows2) if "rollout/groups" in a]
    assert groups == [(1, 2)] * 2, groups
    for a, b in zip(rows1, rows2):
        assert a.keys() == b.keys()
        for k in a:
            if k.startswith(EXACT_PREFIXES):
                assert a[k] == b[k], (a["step"], k, a[k], b[k])
            elif k == "compile/programs":  # two processes arrange the experience batch on its mesh: one program more
                assert b[k] == a[k] + (a["step"] > 0), (a["step"], a[k], b[k])
            elif k.startswith(("train/", "warmup/")) and a[k] is not None:
                assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), (a["step"], k)

    step1, p1 = _restore_numpy(one)
    step2, p2 = _restore_numpy(two)
    assert step1 == step2 == 2 and len(p1) == len(p2)
    # same programs on the same mesh shapes; only the order of cross-process reductions differs (gloo)
    worst = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(p1, p2))
    assert worst < 1e-4, worst


def test_local_launcher_sets_the_job_env_and_stops_all_when_one_fails(tmp_path):
    # process i prints its job variables; process 1 then fails while process 0 would sleep for minutes. Process 1
    # first waits for process 0's line (a marker file): on a busy machine it could otherwise fail, and get process 0
    # stopped, before process 0's interpreter had started.
    ready = tmp_path / "process_0_printed"
    code = ("import os, sys, time; from pathlib import Path; e = os.environ; "
            "print(e['EARL_COORDINATOR'], e['EARL_NUM_PROCESSES'], e['EARL_PROCESS_ID'], e['XLA_FLAGS'], flush=True); "
            f"ready = Path({str(ready)!r}); "
            "(ready.touch(), time.sleep(300)) if e['EARL_PROCESS_ID'] == '0' else "
            "[time.sleep(0.05) for _ in range(1200) if not ready.exists()]; sys.exit(7)")
    proc = subprocess.run(LAUNCH + ["-n", "2", "--cpu-devices", "3", "--log-dir", str(tmp_path), "--quiet-main",
                                    "--timeout", "60", "--", sys.executable, "-c", code],
                          cwd=ROOT, env=_env(8), capture_output=True, text=True, timeout=90)
    assert proc.returncode == 7  # the failing process's code, long before process 0's sleep ends
    lines = [(tmp_path / f"process_{i}.log").read_text().split() for i in range(2)]
    assert lines[0][0] == lines[1][0] and lines[0][0].startswith("127.0.0.1:")
    assert [l[1:3] for l in lines] == [["2", "0"], ["2", "1"]]
    counts = [[f for f in l[3:] if "device_count" in f] for l in lines]  # local.py sets each process's own count
    assert counts == [["--xla_force_host_platform_device_count=3"]] * 2, counts


def test_local_launcher_refuses_a_command_it_cannot_run_before_starting_any_process(capsys):
    with pytest.raises(SystemExit) as exit_:  # the script without its interpreter: not a program
        launch_local.main(["-n", "2", "--", "experiments/no_such_job.py"])
    assert exit_.value.code == 2 and "give the command in full, e.g. -- python" in capsys.readouterr().err
