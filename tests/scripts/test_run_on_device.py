"""experiments/benchmarks/run_on_device.sh, the one device runner: its subcommands launch what docs/results.md says,
checked with stand-ins for python3 and nvidia-smi that record each command instead of running it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "experiments" / "benchmarks" / "run_on_device.sh"

STUB_PYTHON = """#!/bin/bash
[ "$1" = "-" ] && exec "$REAL_PYTHON" "$@"  # the runner's own helpers (flag check, metrics lines) run for real
echo "[$CUDA_VISIBLE_DEVICES] $*" >> "$CALLS"
for ((i = 1; i <= $#; i++)); do  # a training job: make the run folder it would leave
  if [ "${!i}" = "--run-dir" ]; then j=$((i + 1)); d=${!j}
    mkdir -p "$d/checkpoints/10" "$d/checkpoints/20"; echo '{}' > "$d/metrics.jsonl"; echo '{}' > "$d/evaluation.json"
  fi
done
"""


def _run(tmp_path, *args, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(STUB_PYTHON)
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho 'NVIDIA H200, 143771 MiB'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    work = tmp_path / "repo"
    work.mkdir(exist_ok=True)
    calls = tmp_path / "calls.log"
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
                "CALLS": str(calls), "REAL_PYTHON": sys.executable, **env}
    proc = subprocess.run(["bash", str(RUNNER), *args], cwd=work, env=full_env, capture_output=True, text=True,
                          timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc, [ln for ln in lines if " -m pip " not in ln]


def test_every_subcommand_in_the_usage_is_dispatched():
    text = RUNNER.read_text()
    usage = set(re.findall(r"^#   ([a-z0-9-]+)(?= {2,}| \[| MINUTES)", text, re.M))
    dispatched = {f"{m}" for line in re.findall(r"^  ([a-z0-9|-]+)\) device;", text, re.M) for m in line.split("|")}
    assert usage == dispatched and {"fig1", "fig3", "fig4", "e2e", "train", "connect4", "sweep"} <= usage
    for name in dispatched:
        assert f"cmd_{name.replace('-', '_')}()" in text, name


def test_an_unknown_subcommand_prints_the_usage_and_fails(tmp_path):
    proc, calls = _run(tmp_path, "fig5")
    assert proc.returncode == 2 and "unknown subcommand 'fig5'" in proc.stderr and "connect4 MINUTES" in proc.stderr
    assert calls == []


def test_connect4_runs_each_setting_on_its_own_gpu_then_evaluates(tmp_path):
    proc, calls = _run(tmp_path, "connect4", "7", A="--optim.ppo-mini-batches 4", B="")
    assert proc.returncode == 0, proc.stderr
    train = sorted(c for c in calls if "experiments/connect4.py" in c)
    assert len(train) == 2 and train[0].startswith("[0]") and train[1].startswith("[1]")
    assert "--preset gpu --run.max-minutes 7 --run.wandb-mode disabled" in train[0]
    assert train[0].endswith("--run-dir runs/connect4-gpu-a --optim.ppo-mini-batches 4")
    assert train[1].endswith("--run-dir runs/connect4-gpu-b")
    evals = [c for c in calls if "experiments/evaluate_run.py" in c]
    assert len(evals) == 2 and all("random,alphabeta:1,alphabeta:2,alphabeta:3,mcts:100" in c for c in evals)
    for name in "ab":
        assert (tmp_path / "out" / name / "evaluation.json").exists()


def test_connect4_in_parts_saves_the_newest_checkpoint_then_resumes_it(tmp_path):
    proc, calls = _run(tmp_path, "connect4", "7.5", SAVE="1", ONLY_A="1", A="")
    assert proc.returncode == 0, proc.stderr
    assert not any("evaluate_run.py" in c for c in calls)  # a part: the evaluation comes after the last one
    subprocess.run(["tar", "xzf", "out/runs.tgz"], cwd=tmp_path, check=True)
    state = tmp_path / "a" / "state.tgz"
    listed = subprocess.run(["tar", "tzf", str(state)], capture_output=True, text=True, check=True).stdout
    assert "checkpoints/20/" in listed and "checkpoints/10/" not in listed
    (tmp_path / "calls.log").unlink()
    proc, calls = _run(tmp_path, "connect4", "7", STATE=str(state), ONLY_A="1", A="")
    assert proc.returncode == 0, proc.stderr
    assert any("--resume" in c and "connect4.py" in c for c in calls) and any("evaluate_run.py" in c for c in calls)


@pytest.mark.parametrize("sub, env, expect", [
    ("pod-first-iteration", {"RUNS": "nocompact:150:--rollout.compact-finished=false base:150"},
     ["--preset pod --model qwen2.5-1.5b --steps 2 --eval.games 64 --sft.steps 0",
      "--rollout.compact-finished=false --run-dir /tmp/pod_nocompact",
      "--run.keep-checkpoints 0 --run-dir /tmp/pod_base"]),
    ("steady", {"A_FLAGS": "--rollout.compile-ahead false", "B_FLAGS": "--rollout.compile-ahead true"},
     ["--rollout.compile-ahead false --run-dir /tmp/steady_a", "--rollout.compile-ahead true --run-dir /tmp/steady_b"]),
    ("e2e", {"RUNS": "static_d4f1t1,auto", "MODEL": "qwen2.5-3b", "E2E_STATE": "state", "EARL_COMPILE_CACHE": "cc"},
     ["fig_e2e_adaptivity.py --gpu4 --model qwen2.5-3b", "--runs static_d4f1t1,auto --budget-s 280"]),
])
def test_subcommands_pass_their_settings_to_the_scripts(tmp_path, sub, env, expect):
    proc, calls = _run(tmp_path, sub, **env)
    assert proc.returncode == 0, proc.stderr
    for piece in expect:
        assert any(piece in c for c in calls), (piece, calls)


@pytest.mark.parametrize("sub, env, flag", [
    ("connect4", {"A": "--no-such-flag 1", "ONLY_A": "1"}, "--no-such-flag"),
    ("steady", {"A_FLAGS": "--compile-ahead false"}, "--compile-ahead"),  # a flag's name before the components
    ("pod-first-iteration", {"RUNS": "x:150:--eval-games,8"}, "--eval-games"),
])
def test_a_flag_the_job_does_not_know_starts_no_run(tmp_path, sub, env, flag):
    """A typo in a run's flags must not start a run with the defaults in its place (a lost device call)."""
    proc, calls = _run(tmp_path, sub, "7", **env)
    assert f"connect4.py takes no {flag} (--help lists its flags)" in proc.stderr
    assert not any("experiments/connect4.py" in c for c in calls)
