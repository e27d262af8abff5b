"""Command to first finished RL iteration with an empty compile cache (`--compile-cache off`), for each value of one
connect4.py flag (default --new-widths-per-iteration 0 / 1), interleaved `--repeats` times.

    python experiments/benchmarks/first_iteration.py [--values 0 1] [--repeats 2]  # the README's main job here
    python experiments/benchmarks/first_iteration.py --gpu  # 512 compact free-text games (issue 13's job), the
                                                            # settings side by side, one GPU each
    python experiments/benchmarks/first_iteration.py --gpu --flag compile-ahead --values false true
    python experiments/benchmarks/first_iteration.py --job pod-cpu --trees /tmp/old_checkout . --repeats 1 --out ...
        # the same flags in two checkouts: the pod preset's rollout shape, tiny model, 4 fake CPU devices

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
sys.path.insert(0, str(ROOT))  # run from a clone: no install needed

from experiments.job_flags import for_tree  # noqa: E402

GPU_JOB = ["--groups", "64", "--group-size", "8", "--prompt-style", "compact", "--constrain-moves", "false",
           "--format-warmup-steps", "0", "--eval-every", "0", "--eval-games", "8", "--checkpoint-every", "0"]
# the pod preset's job shape (rl/pod.py RANDOM_INIT) with the tiny model on 4 fake CPU devices, in flags that
# checkouts back to the pod preset's commit know (free text was their only mode; --constrain-moves added for later)
POD_CPU_JOB = ["--groups", "8", "--group-size", "8", "--prompt-style", "compact", "--max-turn-tokens", "8",
               "--max-context", "4096", "--rollout-cache-growth", "4", "--format-warmup-steps", "0",
               "--eval-games", "16",
               "--devices", "4", "--checkpoint-every", "0"]
LINE = re.compile(r"first RL iteration finished ([\d.]+) s after the command.*")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flag", default="new-widths-per-iteration", help="the connect4.py flag compared")
    ap.add_argument("--values", nargs="+", default=["0", "1"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--job", choices=["default", "pod-cpu"], default="default")
    ap.add_argument("--trees", type=Path, nargs="+", default=None,
                    help="checkouts to compare with the same flags (instead of --flag values)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out_path = args.out or ROOT / "experiments" / "results" / f"first_iteration_{'gpu' if args.gpu else 'cpu'}.json"
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            jobs = []
            variants = ([(tree.resolve(), str(tree)) for tree in args.trees] if args.trees
                        else [(ROOT, v) for v in args.values])
            for i, (tree, k) in enumerate(variants):
                flag = [] if args.trees else [f"--{args.flag}", k]
                job = GPU_JOB if args.gpu else POD_CPU_JOB if args.job == "pod-cpu" else []
                if args.job == "pod-cpu" and tree == ROOT:
                    job = job + ["--constrain-moves", "false"]
                cmd = [sys.executable, str(tree / "experiments" / "connect4.py"),
                       *for_tree(["--steps", "1", "--compile-cache", "off", "--wandb-mode", "disabled", "--progress",
                                  "false", *flag, "--run-dir", f"{tmp}/run_{r}_{i}", *job], tree)]
                env = {**os.environ, "PYTHONPATH": str(tree), **({"CUDA_VISIBLE_DEVICES": str(i)} if args.gpu else {}),
                       **({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"} if args.job == "pod-cpu" else {})}
                proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
                jobs.append((k, cmd, proc))
                if not args.gpu:  # one at a time on the CPU: they would share its cores
                    proc.wait(timeout=900)
            for k, cmd, proc in jobs:
                text = proc.communicate(timeout=900)[0]
                m = LINE.search(text)
                if proc.returncode or not m:
                    raise SystemExit(f"{cmd} failed:\n{text[-3000:]}")
                name = "tree" if args.trees else args.flag.replace("-", "_")
                runs.append({name: k, "repeat": r, "seconds": float(m.group(1)), "line": m.group(0),
                             "first_calls": [l for l in text.splitlines() if "first call" in l]})
                print(runs[-1]["line"], f"({name} {k})", flush=True)
    job = GPU_JOB if args.gpu else POD_CPU_JOB if args.job == "pod-cpu" else []
    result = {"what": "connect4.py --steps 1 --compile-cache off: command to first finished RL iteration"
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
