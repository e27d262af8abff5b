"""Command to first finished RL iteration with an empty compile cache (`--compile-cache off`), for each value of one
connect4.py flag (default --new-widths-per-iteration 0 / 1), interleaved `--repeats` times.

    python experiments/first_iteration.py [--values 0 1] [--repeats 2]  # the README's main job on this machine
    python experiments/first_iteration.py --gpu                          # 512 compact free-text games (issue 13's
                                                                         # job), the settings side by side, one GPU each
    python experiments/first_iteration.py --gpu --flag compile-ahead --values false true

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

ROOT = Path(__file__).resolve().parents[1]
GPU_JOB = ["--groups", "64", "--group-size", "8", "--prompt-style", "compact", "--constrain-moves", "false",
           "--format-warmup-steps", "0", "--eval-every", "0", "--eval-games", "8", "--checkpoint-every", "0"]
LINE = re.compile(r"first RL iteration finished ([\d.]+) s after the command.*")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flag", default="new-widths-per-iteration", help="the connect4.py flag compared")
    ap.add_argument("--values", nargs="+", default=["0", "1"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out_path = args.out or ROOT / "experiments" / "results" / f"first_iteration_{'gpu' if args.gpu else 'cpu'}.json"
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            jobs = []
            for i, k in enumerate(args.values):
                cmd = [sys.executable, str(ROOT / "experiments" / "connect4.py"), "--steps", "1", "--compile-cache", "off",
                       "--wandb-mode", "disabled", "--progress", "false", f"--{args.flag}", k,
                       "--run-dir", f"{tmp}/run_{r}_{k}", *(GPU_JOB if args.gpu else [])]
                env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": str(i)} if args.gpu else {})}
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                jobs.append((k, cmd, proc))
                if not args.gpu:  # one at a time on the CPU: they would share its cores
                    proc.wait(timeout=900)
            for k, cmd, proc in jobs:
                text = proc.communicate(timeout=900)[0]
                m = LINE.search(text)
                if proc.returncode or not m:
                    raise SystemExit(f"{cmd} failed:\n{text[-3000:]}")
                runs.append({args.flag.replace("-", "_"): k, "repeat": r, "seconds": float(m.group(1)), "line": m.group(0)})
                print(runs[-1]["line"], f"(--{args.flag} {k})", flush=True)
    result = {"what": "connect4.py --steps 1 --compile-cache off: command to first finished RL iteration"
                      + (f" ({' '.join(GPU_JOB)}, one GPU each, side by side)" if args.gpu else ""),
              "machine": f"{os.cpu_count()} CPU cores ({os.uname().nodename})", "load_average_at_end": os.getloadavg(),
              "runs": runs}
    if args.gpu:
        import jax
        result["device"] = jax.devices()[0].device_kind
    out_path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
