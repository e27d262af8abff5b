"""Figure 1 of EARL (arXiv 2510.05943) as two real training runs: the context grows until a static
configuration runs out of memory, while the selector's run goes on.

Both runs are `experiments/connect4.py` with the same configuration and seed, each in its own process
(an out-of-memory error ends that process only, and frees its device memory):

* static   - `--planner.mode static`: the first iteration's layouts (mesh, micro-batch, log-prob chunk)
             for the whole run and no fallback, as a fixed configuration would run;
* selector - `--planner.mode auto`: experience and train are planned for each batch's context from the
             memory model; an OOM halves the micro-batch, then gives up the mesh.

What makes the context grow, stated plainly: a per-turn token-budget curriculum (`--rollout.turn-tokens-schedule`,
a length curriculum like DeepScaleR's 8K -> 16K -> 24K) with fixed-length answers (`--rollout.stop-at-eos false`:
every answer uses its whole budget, the move is the first number in it), so every game's context grows
with the schedule. It is not a policy that learned to think longer; the memory story (activations grow
with context, a static micro-batch does not shrink) is the same.

    # one GPU: the tiny model, random init, each run's device memory capped at --mem-gib (5 GiB) so that a
    # short run reaches the cap (a 0.5B model needs the same story at ~10x the tokens: too slow for one call)
    python experiments/fig1_context_growth.py --gpu
    # CPU smoke test (the nano test model; nothing runs out of memory on the host, the figure says so)
    python experiments/fig1_context_growth.py --small

Writes experiments/results/<name>.{json,png} (each run's per-iteration trace is in the JSON; the run folders
go to a temporary folder, or to --keep-runs DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone: no install needed

from earl_jax.parallel.profile import device_slug  # noqa: E402
from earl_jax.rl.loop.metrics import read_metrics  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")

COMMON = ["--game", "connect_four", "--sft.steps", "0", "--eval.every", "0", "--run.checkpoint-every", "0",
          "--run.keep-checkpoints", "1", "--run.wandb-mode", "disabled", "--run.progress", "false",
          # only the selector sizes micro-batches (the static run keeps its first)
          "--planner.micro-batch-tokens", str(1 << 30)]
SETTINGS = {
    # learning rate 1e-6: the policy stays near its initialization, so both runs play (almost) the same games
    # and their contexts match: a paired comparison of the two layouts, not of two learning curves.
    "gpu": ["--model", "tiny", "--rollout.groups", "8", "--rollout.group-size", "4", "--steps", "6",
            "--eval.games", "8", "--rollout.turn-tokens-schedule", "0:64,2:1024,4:3072",
            "--rollout.max-context", "32768", "--rollout.max-turns", "32", "--learning-rate", "1e-6",
            "--rollout.stop-at-eos", "false", "--rollout.constrain-moves", "false"],
    "small": ["--model", "nano", "--rollout.groups", "2", "--rollout.group-size", "4", "--steps", "4",
              "--eval.games", "4", "--rollout.stop-at-eos", "false", "--rollout.constrain-moves", "false",
              "--rollout.turn-tokens-schedule", "0:8,2:48", "--rollout.max-context", "1024",
              "--rollout.max-turns", "32"],
}


def error_line(lines: list[str]) -> str | None:
    """The trainer's message naming the stage and layout that ran out of memory, else the last OOM line."""
    named = [ln.strip() for ln in lines if ln.startswith("RuntimeError:") and "static layout" in ln]
    return named[-1] if named else next((ln.strip() for ln in reversed(lines) if any(m in ln for m in OOM_MARKERS)),
                                        None)


def run_one(mode: str, flags: list[str], run_dir: Path, timeout: float, env: dict[str, str]) -> dict:
    """One training run in a subprocess; how it ended (finished / out of memory / other error / timeout)."""
    cmd = [sys.executable, str(ROOT / "experiments" / "connect4.py"),
           *flags, "--run-dir", str(run_dir), "--planner.mode", mode]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = None, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    status = ("finished" if rc == 0 else "timeout" if rc is None
              else "out_of_memory" if any(m in out for m in OOM_MARKERS) else "error")
    (run_dir / "output.log").write_text(out)
    metrics = list(read_metrics(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else []
    rows = [r for r in metrics if r.get("step", 0) >= 1 and "rollout/context_len_max" in r]
    err = error_line(out.splitlines())
    return {"mode": mode, "status": status, "returncode": rc, "seconds": round(time.perf_counter() - t0, 1),
            "iterations": len(rows), "error_line": err[:400] if err else None,
            "tail": out.splitlines()[-40:] if status != "finished" else [], "trace": [
                {k: r.get(k) for k in ("step", "rollout/context_len_mean", "rollout/context_len_max",
                                       "rollout/turn_tokens", "parallel/rollout_mesh", "parallel/experience_mesh",
                                       "parallel/experience_micro_batch", "parallel/experience_logprob_chunk",
                                       "parallel/train_mesh", "parallel/train_micro_batch",
                                       "parallel/train_logprob_chunk", "memory/peak_gib", "memory/limit_gib",
                                       "time/rollout_s", "time/experience_s", "time/train_s")}
                for r in rows]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    colors = {"static": "tab:red", "selector": "tab:blue"}
    # selector first, static on top with hollow squares: both stay visible where they coincide
    style = {"selector": dict(marker="o", ms=5), "static": dict(marker="s", ms=10, mfc="none", lw=2.5, alpha=0.8)}
    for name in ("selector", "static"):
        run = result["runs"][name]
        tr = run["trace"]
        steps = [e["step"] for e in tr]
        c, st = colors[name], style[name]
        axes[0].plot(steps, [e["rollout/context_len_max"] for e in tr], color=c, label=f"{name}: max context", **st)
        axes[0].plot(steps, [e["rollout/context_len_mean"] for e in tr], ":", color=c, label=f"{name}: mean context")
        axes[1].plot(steps, [e["parallel/train_micro_batch"] for e in tr], color=c, label=name, **st)
        if any(e.get("memory/peak_gib") is not None for e in tr):
            axes[2].plot(steps, [e.get("memory/peak_gib") for e in tr], color=c, label=f"{name}: peak", **st)
        if run["status"] != "finished":
            x = (steps[-1] if steps else 0) + 1  # the iteration that did not finish
            for ax in axes:
                ax.axvline(x, color=c, ls="--", alpha=0.6)
            axes[0].annotate(f"{name}: {run['status'].replace('_', ' ')}\nat iteration {x}", (x, 0),
                             xycoords=("data", "axes fraction"), xytext=(4, 8), textcoords="offset points",
                             color=c, fontsize=9)
    limit = next((e.get("memory/limit_gib") for r in result["runs"].values() for e in r["trace"]
                  if e.get("memory/limit_gib")), None)
    if limit:
        axes[2].axhline(limit, color="gray", ls="--", label="device memory limit")
    axes[0].set(ylabel="tokens per game", title=f"{result['model']} on {result['device']}: context growth")
    axes[1].set(ylabel="train micro-batch (rows)")
    axes[2].set(ylabel="peak device GiB", xlabel="iteration")
    if not limit:
        axes[2].text(0.5, 0.5, "no device memory statistics on this backend", ha="center", transform=axes[2].transAxes)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:  # the memory panel is empty on CPU
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--gpu", action="store_true", help="one GPU, tiny model, capped device memory")
    which.add_argument("--small", action="store_true", help="CPU smoke test, the nano test model")
    p.add_argument("--mem-gib", type=float, default=5.0,
                   help="GPU: device memory of each run (XLA_PYTHON_CLIENT_MEM_FRACTION of the card; both run at once)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds per run")
    p.add_argument("--sequential", action="store_true", help="run the two one after the other (default: at once)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default=None)
    p.add_argument("--keep-runs", type=Path, default=None,
                   help="keep the two run folders here (default: a temp folder)")
    p.add_argument("--replot", type=Path, default=None, help="only redraw the PNG of a saved result JSON")
    p.add_argument("extra", nargs="*", help="more connect4.py flags for both runs (after --)")
    if argv is not None and "--replot" in argv:  # no run: --gpu/--small not needed
        path = Path(argv[argv.index("--replot") + 1])
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return {}
    args = p.parse_args(argv)

    setting = "gpu" if args.gpu else "small"
    gpu_name = None
    if args.gpu:
        gpu_name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                  text=True, check=True).stdout.splitlines()[0].strip()
    name = args.name or f"fig1_context_growth_{device_slug(gpu_name) if gpu_name else 'cpu'}"
    if (args.out / f"{name}.json").exists():
        raise SystemExit(f"{args.out / name}.json exists: remove it or pass --name (results are never overwritten)")
    runs_dir = args.keep_runs or Path(tempfile.mkdtemp(prefix=f"{name}_"))
    flags = [*COMMON, *SETTINGS[setting], *args.extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    mem_fraction = None
    if args.gpu:  # each run sees a capped pool: the memory model reads the same cap (bytes_limit)
        total_mib = float(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                         capture_output=True, text=True, check=True).stdout.split()[0])
        mem_fraction = round(args.mem_gib * 1024 / total_mib, 5)
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(mem_fraction)
    else:
        env["JAX_PLATFORMS"] = "cpu"
    for mode in ("static", "selector"):
        d = runs_dir / mode
        if d.exists():
            raise SystemExit(f"{d} exists: remove it or pass --name (runs are never overwritten)")
        d.parent.mkdir(parents=True, exist_ok=True)

    modes = {"static": "static", "selector": "auto"}
    if args.sequential:
        results = {n: run_one(m, flags, runs_dir / n, args.timeout, env) for n, m in modes.items()}
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            futures = {n: pool.submit(run_one, m, flags, runs_dir / n, args.timeout, env) for n, m in modes.items()}
            results = {n: f.result() for n, f in futures.items()}

    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process only reads the device's name
    import jax  # after the runs: this process never holds device memory while they run

    device = "CPU (host)" if args.small else f"1 x {jax.devices()[0].device_kind}"
    model = SETTINGS[setting][SETTINGS[setting].index("--model") + 1]
    result = {"what": "two real training runs (static layouts vs the Parallelism Selector); the context grows "
                      "through a per-turn token-budget curriculum", "device": device, "model": model,
              "flags": flags, "mem_gib": args.mem_gib if args.gpu else None, "mem_fraction": mem_fraction,
              "runs": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{name}.png")
    for n, r in results.items():
        last = r["trace"][-1] if r["trace"] else {}
        print(f"{n}: {r['status']} after {r['iterations']} iterations ({r['seconds']} s); last max context "
              f"{last.get('rollout/context_len_max')}, train micro-batch {last.get('parallel/train_micro_batch')}"
              + (f"; {r['error_line']}" if r["error_line"] else ""))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
