"""Command to first finished RL iteration with an empty compile cache (`--run.compile-cache off`), for each value of
one connect4.py flag (default --planner.new-widths-per-iteration 0 / 1), interleaved `--repeats` times.

    python experiments/benchmarks/first_iteration.py [--values 0 1] [--repeats 2]  # the README's main job here
    python experiments/benchmarks/first_iteration.py --gpu  # 512 compact free-text games, the settings side by side,
                                                            # one GPU each
    python experiments/benchmarks/first_iteration.py --gpu --flag rollout.compile-ahead --values false true
    python experiments/benchmarks/first_iteration.py --job pod-cpu --repeats 1 --out ...
        # the pod preset's rollout shape, tiny model, 4 fake CPU devices

Writes experiments/results/first_iteration_<cpu|gpu>.json (or --out; each run's "first RL iteration finished" line).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

GPU_JOB = ["--rollout.groups", "64", "--rollout.group-size", "8", "--env.prompt-style", "compact",
           "--rollout.constrain-moves", "false", "--sft.steps", "0", "--eval.every", "0", "--eval.games", "8",
           "--run.checkpoint-every", "0"]
# the pod preset's job shape (rl/job/pod.py RANDOM_INIT) with the tiny model on 4 fake CPU devices, free text
POD_CPU_JOB = ["--rollout.groups", "8", "--rollout.group-size", "8", "--env.prompt-style", "compact",
               "--rollout.max-turn-tokens", "8", "--rollout.max-context", "4096", "--rollout.cache-growth", "4",
               "--sft.steps", "0", "--eval.games", "16", "--devices", "4", "--run.checkpoint-every", "0",
               "--rollout.constrain-moves", "false"]
LINE = re.compile(r"first RL iteration finished ([\d.]+) s after the command.*")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flag", default="planner.new-widths-per-iteration", help="the connect4.py flag compared")
    ap.add_argument("--values", nargs="+", default=["0", "1"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--job", choices=["default", "pod-cpu"], default="default")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out_path = args.out or ROOT / "experiments" / "results" / f"first_iteration_{'gpu' if args.gpu else 'cpu'}.json"
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            jobs = []
            for i, k in enumerate(args.values):
                job = GPU_JOB if args.gpu else POD_CPU_JOB if args.job == "pod-cpu" else []
                cmd = [sys.executable, str(ROOT / "experiments" / "connect4.py"), "--steps", "1",
                       "--run.compile-cache", "off", "--run.wandb-mode", "disabled", "--run.progress", "false",
                       f"--{args.flag}", k, "--run-dir", f"{tmp}/run_{r}_{i}", *job]
                env = {**os.environ, "PYTHONPATH": str(ROOT), **({"CUDA_VISIBLE_DEVICES": str(i)} if args.gpu else {}),
                       **({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"} if args.job == "pod-cpu" else {})}
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
                jobs.append((k, cmd, proc))
                if not args.gpu:  # one at a time on the CPU: they would share its cores
                    proc.wait(timeout=900)
            for k, cmd, proc in jobs:
                text = proc.communicate(timeout=900)[0]
                m = LINE.search(text)
                if proc.returncode or not m:
                    raise SystemExit(f"{cmd} failed:\n{text[-3000:]}")
                name = args.flag.rpartition(".")[2].replace("-", "_")
                runs.append({name: k, "repeat": r, "seconds": float(m.group(1)), "line": m.group(0),
                             "first_calls": [l for l in text.splitlines() if "first call" in l]})
                print(runs[-1]["line"], f"({name} {k})", flush=True)
    job = GPU_JOB if args.gpu else POD_CPU_JOB if args.job == "pod-cpu" else []
    result = {"what": "connect4.py --steps 1 --run.compile-cache off: command to first finished RL iteration"
                      + (f" ({' '.join(job)})" if job else "") + (", one GPU each, side by side" if args.gpu else ""),
              "machine": f"{os.cpu_count()} CPU cores ({os.uname().nodename})", "load_average_at_end": os.getloadavg(),
              "runs": runs}
    if args.gpu:
        import jax
        result["device"] = jax.devices()[0].device_kind
    out_path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
