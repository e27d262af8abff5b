"""End-to-end adaptivity: one Connect Four training job whose context grows from ~1K to >= 32K tokens, run
with the Parallelism Selector (`auto`) and with one static plan per rollout layout, on the same devices.

Runs, each a real `experiments/connect4.py` training job in its own process, one after another (an
out-of-memory error ends that process only and frees its devices), each capped by a wall-time budget:

* static_<mesh>  one per rollout layout of the model on the devices (4 GPUs: d4f1t1, d2f1t2, d1f1t4), via
                 `--planner.rollout-thresholds 0:<mesh> --planner.mode static`: the first plan for the whole run, so
                 experience / train keep the layouts the selector plans before any batch, for the first
                 context bucket (up to 1K tokens on GPU), with no OOM fallback;
* auto           `--planner.mode auto`: every stage planned for the context, OOM fallback. Its rollout
                 ranks layouts by a profile table (`--auto-table`): by default the rollout throughput the static
                 runs measured per phase (EARL's start-up profile, paid here by the static runs and not
                 charged to auto), or `none` (the memory model's heuristic), or a table from
                 benchmarks/profile_selector.py.

The context grows through the turn-token schedule (`--rollout.turn-tokens-schedule`, fixed-length
answers `--rollout.stop-at-eos false`: every answer uses its whole budget), not through a policy that learned to think
longer; the learning rate is 1e-6 so every run plays (nearly) the same games: a paired comparison of layouts.
Two agent turns per game: each phase's games touch two KV-cache sizes, so each run compiles ~4 rollout
programs per phase (four turns would need ~8; compiles, not decoding, dominate a short run).

Per iteration the JSON keeps each run's tokens per GPU per second of every stage and the whole iteration
(throughput/*_tgs), the dispatch share, peak memory per GPU, the meshes in use and how the run ended (the
trainer names the stage that ran out of memory); the summary (adaptivity_summary.py) compares auto with the
best static run per phase and over the whole run, against the issue's targets. The PNG shows iteration
throughput per run with the context length, auto's mesh and micro-batch switches and every OOM.

    # CPU (the nano test model, 4 of the fake devices, 4 iterations per run)
    python experiments/fig_e2e_adaptivity.py --small
    # 4 GPUs, Qwen2.5-3B shape (random init, game tokenizer), 8 games, 480 -> 3968 -> 16000 tokens a turn
    # (contexts ~1.1K, ~8.1K, ~32.2K; 2 + 2 + 1 iterations), one run per device call, all merging into one JSON:
    EARL_COMPILE_CACHE=$PWD/runs/jax_cache python experiments/fig_e2e_adaptivity.py --gpu4 --runs static_d4f1t1
    ...  --runs static_d2f1t2,   then --runs static_d1f1t4,   then --runs auto      (the same command otherwise)
    python experiments/fig_e2e_adaptivity.py --replot experiments/results/<name>.json

Measured (4 x H100, `run_on_device.sh e2e`, the 1.5B trim, mem fraction 0.92; docs/results.md, "End-to-end
adaptivity"): a cold run spends ~95 s to its first iteration and ~100 s on the 8K phase's
compiles; with compiles cached (the auto run) 1K + 8K phases take ~80 s and the 32K iteration 161 s. A run of
all three phases therefore needs ~420 s cold: two runs per 10-minute device call do not reach 32K at 270 s each.

Cost of `--gpu4` (the estimate written before any GPU run): about 8 minutes of device time per run, cold: ~30 s to
start and initialize 3B; ~13 rollout programs at ~8 s each (0.5B's extend + generate compiled in 10-14 s on
one H100, bench_rollout) plus experience and train at three widths; decoding ~4.5 ms a step (Fig. 3's 0.5B
steps scaled to 3B's weight reads), i.e. ~9 s, ~70 s and ~160 s for a 1K, 8K and 32K iteration. So the four
runs take four device calls of up to 10 minutes, not one (`--budget-s` 540 stops a run before the call's
limit; a run cut there keeps its finished iterations, marked "budget"); runs after the first load the
experience and train programs from the compile cache if the machine stays warm. The lead may trim:
`--steps 4` (the 1K and 8K phases only, ~4 min a run: `--runs static_d4f1t1,static_d2f1t2 --budget-s 280`, then
the other two), or `--model qwen2.5-1.5b` (about half the decoding); a trimmed figure gets its own JSON
(`..._custom`), since the runs of one figure must share their settings (a mismatch is refused).
Memory, by the memory model at --mem-fraction 0.92 (72.8 GiB of an 80 GB card): the static plans keep train
on d4f1t1 with 2 rows per shard (planned for the first bucket), 66.5 GiB at 32K, above the 65.5 GiB the model
allows itself: they may run out of memory in their 32K iteration; auto plans 1 row there.

Writes experiments/results/<name>.{json,png}; run folders go to a temporary folder (or --keep-runs DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone: no install needed
sys.path.insert(0, str(ROOT / "experiments"))

import adaptivity_summary  # noqa: E402
from earl_jax.parallel.profile import SCRATCH_OOM  # noqa: E402
from earl_jax.rollout.rollout_config import parse_schedule  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")  # and SCRATCH_OOM (run_one)

COMMON = ["--game", "connect_four", "--sft.steps", "0", "--eval.opponents=", "--eval.every", "0",
          "--run.checkpoint-every", "0", "--run.keep-checkpoints", "0", "--run.wandb-mode", "disabled",
          "--run.progress", "false", "--rollout.stop-at-eos", "false", "--rollout.constrain-moves", "false",
          "--env.prompt-style", "compact", "--rollout.max-turns", "2", "--learning-rate", "1e-6", "--seed", "0"]
SETTINGS = {
    # 4 games: one per data shard of d4f1t1; budgets 16 -> 96 tokens a turn (contexts ~190 -> ~350)
    "small": dict(model="nano", devices=4, schedule="0:16,2:96", steps=4, budget_s=240.0, mem_fraction=None,
                  flags=["--rollout.groups", "2", "--rollout.group-size", "2", "--rollout.max-context", "512"]),
    # 8 games (2 per data shard of d4f1t1); two turns of 480 / 3968 / 16000 tokens: contexts ~1.1K, ~8.1K, ~32.2K
    # mem fraction 0.85, not 0.92: at 0.92 a TP4 run could not get NCCL's all-reduce scratch outside XLA's pool
    # at its 32K iteration (4 x H100, 1.5B, with 26 of 73 GiB of the pool in use)
    "gpu4": dict(model="qwen2.5-3b", devices=4, schedule="0:480,2:3968,4:16000", steps=5, budget_s=540.0,
                 mem_fraction=0.85, flags=["--rollout.groups", "4", "--rollout.group-size", "2",
                                           "--rollout.max-context", "32768", "--model.dtype", "bfloat16"]),
}
TRACE_KEYS = ("step", "rollout/turn_tokens", "rollout/context_len_mean", "rollout/context_len_max",
              "rollout/turn_context_len_mean", "rollout/tokens", "rollout/generated_tokens",
              "throughput/rollout_tgs", "throughput/experience_tgs", "throughput/train_tgs", "throughput/iteration_tgs",
              "time/rollout_s", "time/experience_s", "time/train_s", "time/dispatch_s", "time/iteration_s",
              "time/elapsed_s", "time/dispatch_share", "time/trace_s", "time/lower_s", "time/compile_s",
              "dispatch/bytes", "memory/peak_gib", "memory/limit_gib",
              "compile/programs", "parallel/context_bucket", "parallel/rollout_mesh", "parallel/experience_mesh",
              "parallel/experience_micro_batch", "parallel/experience_logprob_chunk", "parallel/train_mesh",
              "parallel/train_micro_batch", "parallel/train_logprob_chunk")


# ---------------------------------------------------------------- the machine and the runs
def probe_devices(env: dict[str, str], count: int) -> dict:
    """The devices a run will see (kind, count, memory), from a short process of its own: this one never
    initializes a backend, so it holds no device memory while the runs use it."""
    code = ("import json, jax; d = jax.devices()[:%d]; s = d[0].memory_stats() or {}; "
            "print(json.dumps({'kind': d[0].device_kind, 'count': len(d), 'platform': d[0].platform, "
            "'bytes_limit': s.get('bytes_limit')}))" % count)
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false"),
                         capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise SystemExit(f"device probe failed:\n{out.stderr[-2000:]}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    if info["count"] < count:
        raise SystemExit(f"this setting needs {count} devices; the machine has {info['count']} {info['kind']}")
    return info


def rollout_meshes(model: str, num_devices: int, batch: int) -> list[str]:
    """Every rollout layout of the model over the devices (fsdp 1) whose data axis divides the batch."""
    from earl_jax.models.model_config import get_config
    from earl_jax.models.tokenizer import game_tokenizer
    from earl_jax.parallel.memory import candidate_meshes

    cfg = get_config(model, vocab_size=game_tokenizer().get_vocab_size())
    return [str(m) for m in candidate_meshes(cfg, num_devices, "rollout") if batch % m.data == 0]


def oom_stage(output: str) -> str | None:
    """The stage the trainer named when it ran out of memory (static: no fallback; auto: nothing left)."""
    m = re.findall(r"\b(rollout|experience|train) stage ran out of memory", output)
    m = m or re.findall(r"NoFeasibleLayoutError: (rollout|experience|train): out of memory", output)
    if not m and SCRATCH_OOM.search(output):
        return "collective scratch"  # NCCL's buffers, outside XLA's pool: not a stage's planned memory
    return m[-1] if m else None


def error_line(output: str) -> str | None:
    lines = output.splitlines()
    named = [ln.strip() for ln in lines if "ran out of memory" in ln or "NoFeasibleLayoutError" in ln]
    last = next((ln.strip() for ln in reversed(lines) if re.match(r"^\w+(\.\w+)*(Error|Exception)\b", ln)), None)
    return (named or [last])[-1] if (named or last) else None


def run_one(name: str, flags: list[str], run_dir: Path, budget_s: float, env: dict[str, str],
            schedule: list[tuple[int, int]]) -> dict:
    """One training run in a subprocess, stopped after `budget_s`; how it ended and its per-iteration trace."""
    from earl_jax.rl.loop.metrics import read_metrics

    cmd = [sys.executable, str(ROOT / "experiments" / "connect4.py"),
           *flags, "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget_s)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = None, "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                                for x in (e.stdout, e.stderr))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "output.log").write_text(out)
    metrics = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    trace = [{k: r.get(k) for k in TRACE_KEYS} for r in metrics if r.get("step", 0) >= 1 and "rollout/tokens" in r]
    status = ("finished" if rc == 0 else "budget" if rc is None
              else "out_of_memory" if any(m in out for m in OOM_MARKERS) or SCRATCH_OOM.search(out) else "error")
    failed = len(trace) + 1 if status in adaptivity_summary.DIED else None
    budgets = [t for s, t in schedule if failed is not None and s <= failed - 1]
    err = error_line(out) if status != "finished" else None
    return {"status": status, "returncode": rc, "seconds": round(time.perf_counter() - t0, 1), "command": cmd[1:],
            "iterations": len(trace), "failed_iteration": failed,
            "failed_turn_tokens": budgets[-1] if budgets else None,
            "oom_stage": oom_stage(out) if status == "out_of_memory" else None,
            "error_line": err[:400] if err else None,
            "tail": out.splitlines()[-40:] if status in adaptivity_summary.DIED else [], "trace": trace}


def auto_table(result: dict, path: Path) -> Path:
    """The static runs' rollout throughput per phase as a ProfileTable for the auto run (`--planner.table`)."""
    from earl_jax.models.model_config import get_config
    from earl_jax.parallel.profile import ProfileEntry, ProfileTable
    from earl_jax.parallel.selector_config import default_bucket_edges
    from earl_jax.sharding.mesh import MeshShape

    # the trainer's edges (StagePlanner.from_config): --planner.edges, else the selector's default for the model
    flags = result["flags"]
    edges = (tuple(int(v) for v in flags[flags.index("--planner.edges") + 1].split(","))
             if "--planner.edges" in flags else default_bucket_edges(get_config(result["model"])))
    rows = adaptivity_summary.auto_profile_rows(result, edges)
    if not rows:
        raise SystemExit("the auto run's table comes from the static runs' rollouts, and none has a finished "
                         "iteration here: run them first (--runs static_...), or pass --auto-table none")
    table = ProfileTable(result["device_kind"], result["num_devices"], get_config(result["model"]).name,
                         meta={"measure": "fig_e2e_adaptivity static runs", "stage": "rollout"})
    for r in rows:
        table.add(ProfileEntry("rollout", MeshShape.parse(r["mesh"]), r["context_len"], result["batch_size"],
                               r["tgs"], r["status"]))
    result["auto_table"] = rows
    return table.save(path)


def keep_replaced(result: dict, name: str) -> None:
    """A --rerun keeps the run it replaces (e.g. a cold-cache run before the warm one), out of the summary."""
    if name in result["runs"]:
        result.setdefault("replaced_runs", {}).setdefault(name, []).append(result["runs"][name])


# ---------------------------------------------------------------- the figure
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = result["runs"]
    palette = ("tab:red", "tab:green", "tab:purple", "tab:olive", "tab:brown", "tab:pink")
    colors = {**dict(zip(sorted(n for n in runs if n != "auto"), palette)), "auto": "tab:blue"}
    fig, axes = plt.subplots(3, 1, figsize=(9, 10.5), sharex=True)
    for name in sorted(runs, key=lambda n: n == "auto"):  # auto drawn last, on top
        run, c = runs[name], colors.get(name, "gray")
        tr = run["trace"]
        steps = [e["step"] for e in tr]
        style = dict(marker="o", lw=2.5, ms=6) if name == "auto" else dict(marker="s", lw=1.2, ms=5, mfc="none")
        for ax, key in ((axes[0], "throughput/iteration_tgs"), (axes[1], "throughput/rollout_tgs")):
            ax.plot(steps, [e[key] for e in tr], color=c, label=name, **style)
            compiled = [(e["step"], e[key]) for e, k in zip(tr, adaptivity_summary.mark_compiles(tr)) if k]
            if compiled:  # iterations whose time includes compiling (or loading) programs
                ax.plot(*zip(*compiled), ls="none", marker="x", ms=9, color=c)
        if run["status"] != "finished":
            x = (steps[-1] if steps else 0) + 1
            what = (f"OOM ({run.get('oom_stage') or 'stage unknown'})" if run["status"] == "out_of_memory"
                    else run["status"])
            y = tr[-1]["throughput/iteration_tgs"] if tr else 0
            axes[0].plot([x], [y], marker="X", ms=14, color=c, ls="none", mec="black")
            axes[0].annotate(f"{name}: {what} at {x}", (x, y), xytext=(6, -12), textcoords="offset points", color=c,
                             fontsize=8)
    auto = runs.get("auto", {}).get("trace", [])
    for prev, cur in zip(auto, auto[1:]):  # the auto run's mesh switches, any stage
        changed = [f"{s} {cur[f'parallel/{s}_mesh']}" for s in ("rollout", "experience", "train")
                   if cur.get(f"parallel/{s}_mesh") != prev.get(f"parallel/{s}_mesh")]
        changed += [f"{s} micro-batch {prev[k]}->{cur[k]}" for s in ("experience", "train")  # same mesh, new programs
                    if (k := f"parallel/{s}_micro_batch") in cur and prev.get(k) != cur[k]
                    and cur.get(f"parallel/{s}_mesh") == prev.get(f"parallel/{s}_mesh")]
        if changed:
            for ax in axes:
                ax.axvline(cur["step"], color="tab:blue", ls=":", alpha=0.7)
            axes[0].annotate("auto: " + ", ".join(changed), (cur["step"], 0.98), xycoords=("data", "axes fraction"),
                             xytext=(3, 0), textcoords="offset points", fontsize=7, color="tab:blue", rotation=90,
                             va="top")
    if auto:
        steps = [e["step"] for e in auto]
        axes[2].plot(steps, [e["rollout/context_len_max"] for e in auto], "o-", color="tab:blue", label="max context")
        axes[2].plot(steps, [e["rollout/turn_context_len_mean"] for e in auto], "o--", color="tab:cyan",
                     label="mean context at a turn's start (the selector's input)")
        for e in auto:
            axes[2].annotate(e["parallel/rollout_mesh"], (e["step"], e["rollout/context_len_max"]), fontsize=7,
                             xytext=(3, 4), textcoords="offset points", color="tab:blue")
    axes[2].set_yscale("log")
    for start, tokens in result["schedule"]:
        for ax in axes:
            ax.axvline(start + 0.5, color="gray", ls="--", lw=0.8)
        axes[2].annotate(f"{tokens} tok/turn", (start + 0.55, 0.03), xycoords=("data", "axes fraction"), fontsize=8,
                         color="gray")
    axes[0].set(ylabel="iteration tokens / GPU / s",
                title=f"{result['model']} on {result['device']}: Connect Four, context {result['context_range']}\n"
                      "x: iteration that compiled (or loaded) programs")
    axes[1].set(ylabel="rollout tokens / GPU / s")
    axes[2].set(ylabel="auto run: context (tokens)", xlabel="iteration", xlim=(0.4, result["steps"] + 0.8))
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=7, loc="upper left")
    if auto:
        axes[2].legend(fontsize=7, loc="lower right")
    fig.text(0.01, 0.005, summary_line(result.get("summary", {})), fontsize=7, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_line(s: dict) -> str:
    """One line of the summary for the figure's foot."""
    if not s:
        return ""
    def phase_gain(r: dict) -> str:
        net = r.get("auto_vs_best_static_net_pct")
        return (f"{r['turn_tokens']}:{r['auto_vs_best_static_pct']:+.1f}%"
                + ("" if net is None else f" (net {net:+.1f}%)"))

    phases = " ".join(phase_gain(r) for r in s.get("phases", []) if r.get("auto_vs_best_static_pct") is not None)
    w = s.get("whole_run", {})
    gain = w.get("auto_gain_vs_best_static_compile_free_pct")
    net = w.get("auto_gain_vs_best_static_net_pct")
    share = s.get("dispatch", {}).get("share")
    oom = sorted(s.get("oom", {}).get("out_of_memory", {})) or "none"
    return (f"auto vs best static per phase (tok/turn:gain) {phases or '-'}\nwhole run (compile-free) "
            f"{'-' if gain is None else f'{gain:+.1f}%'} vs {w.get('best_static_compile_free')}, compile-excluded "
            f"{'-' if net is None else f'{net:+.1f}%'} vs {w.get('best_static_net')}; dispatch share "
            f"{'-' if share is None else f'{share:.2%}'}; OOM: {oom}")


def write(result: dict, json_path: Path) -> None:
    ctx = [e["rollout/context_len_max"] for r in result["runs"].values() for e in r["trace"]]
    result["context_range"] = f"{min(ctx)}-{max(ctx)} tokens" if ctx else "none yet"
    result["summary"] = adaptivity_summary.summarize(result)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(json_path)
    plot(result, json_path.with_suffix(".png"))


def print_summary(result: dict) -> None:
    s = result["summary"]
    for row in s["phases"]:
        tgs = ", ".join(f"{n} {v['iteration_tgs']:.0f}" + ("" if v["compile_free"] else "*")
                        for n, v in row["runs"].items() if v["iteration_tgs"])
        print(f"phase {row['phase']} ({row['turn_tokens']} tok/turn): {tgs}; auto vs best static "
              f"({row.get('best_static')}): {row.get('auto_vs_best_static_pct')}%; compile-excluded "
              f"({row.get('best_static_net')}): {row.get('auto_vs_best_static_net_pct')}%")
    w = s["whole_run"]
    for label in ("compile_free", "all", "net"):
        print(f"whole run ({label.replace('_', '-')} iterations): best static {w.get(f'best_static_{label}')}, "
              f"auto gain "
              f"{w.get(f'auto_gain_vs_best_static_{label}_pct')}%")
    print(f"dispatch share (auto): {s['dispatch'].get('share')}; out of memory: {s['oom']['out_of_memory']}")
    for name, run in result["runs"].items():
        print(f"{name}: {run['status']} after {run['iterations']} iterations ({run['seconds']} s)"
              + (f"; {run['error_line']}" if run["error_line"] else ""))


# ---------------------------------------------------------------- command line
def run_env(setting: dict, mem_fraction: float | None, cpu: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cpu:  # --small: fake devices, at least the setting's count (--devices takes the first)
        env["JAX_PLATFORMS"] = "cpu"
        flags = env.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={setting['devices']}".strip()
    elif mem_fraction:  # the memory model reads the same cap (bytes_limit)
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(mem_fraction)
    # EARL_COMPILE_CACHE passes through to the runs; where connect4.py does not read it yet, point JAX at it
    cache = env.get("EARL_COMPILE_CACHE", "")
    if cache and cache.lower() != "off" and not (ROOT / "earl_jax" / "compile_cache.py").exists():
        env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.abspath(cache))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # every program, however quick
    return env


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--small", action="store_true", help="CPU: the nano test model on 4 fake devices")
    which.add_argument("--gpu4", action="store_true", help="4 GPUs: Qwen2.5-3B shape, contexts ~1K -> ~32K")
    which.add_argument("--replot", type=Path, default=None, help="only redraw (and re-summarize) a saved JSON")
    p.add_argument("--runs", default=None, help="comma list of runs to do now (default: all); others already in "
                                               "the JSON are kept, so two or more calls build one figure")
    p.add_argument("--auto-table", default="from-static",
                   help="the auto run's rollout profile: from-static, none (memory-model heuristic), or a JSON path")
    p.add_argument("--budget-s", type=float, default=None, help="wall-time budget per run (default: the setting's)")
    p.add_argument("--schedule", default=None,
                   help="turn-token schedule ITER:TOKENS,... (trim; default: the setting's)")
    p.add_argument("--steps", type=int, default=None, help="iterations per run (trim)")
    p.add_argument("--model", default=None, help="model preset (trim, e.g. qwen2.5-1.5b)")
    p.add_argument("--mem-fraction", type=float, default=None, help="GPU: XLA_PYTHON_CLIENT_MEM_FRACTION of each run")
    p.add_argument("--rerun", action="store_true", help="run the named runs again even if the JSON has them")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default=None)
    p.add_argument("--keep-runs", type=Path, default=None, help="keep the run folders here (default: a temp folder)")
    p.add_argument("extra", nargs="*", help="more connect4.py flags for every run (after --)")
    args = p.parse_args(argv)
    if not (args.small or args.gpu4 or args.replot):
        p.error("choose --small, --gpu4 or --replot")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:
        result = json.loads(args.replot.read_text())
        write(result, args.replot)
        print_summary(result)
        return result
    setting = dict(SETTINGS["small" if args.small else "gpu4"])
    for key in ("schedule", "steps", "model"):
        if getattr(args, key) is not None:
            setting[key] = getattr(args, key)
    mem_fraction = args.mem_fraction or setting["mem_fraction"]
    schedule = parse_schedule(setting["schedule"])
    n_dev = setting["devices"]
    flags = [*COMMON, *setting["flags"], "--model", setting["model"], "--devices", str(n_dev), "--steps",
             str(setting["steps"]), "--rollout.turn-tokens-schedule", setting["schedule"], *args.extra]
    groups, size = (int(flags[flags.index(f) + 1]) for f in ("--rollout.groups", "--rollout.group-size"))
    static = {f"static_{m}": m for m in rollout_meshes(setting["model"], n_dev, groups * size)}
    names = [*static, "auto"]
    wanted = names if args.runs is None else [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = set(wanted) - set(names)
    if unknown:
        raise SystemExit(f"--runs: unknown {sorted(unknown)}; this setting has {names}")

    env = run_env(setting, mem_fraction, cpu=args.small)
    # CPU: jax names every host device "cpu" (no probe process needed); accelerators: ask them
    info = {"kind": "cpu", "bytes_limit": None} if args.small else probe_devices(env, n_dev)
    from earl_jax.parallel.profile import device_slug

    custom = "_custom" if any(getattr(args, k) is not None for k in ("schedule", "steps", "model")) else ""
    name = args.name or f"fig_e2e_adaptivity_{setting['model']}_{device_slug(info['kind'], n_dev)}{custom}"
    json_path = args.out / f"{name}.json"
    result = {"what": "one Connect Four job, context grown by a turn-token schedule, run with the selector (auto) "
                      "and with a static plan per rollout layout", "setting": "small" if args.small else "gpu4",
              "device": f"{n_dev} x {info['kind']}", "device_kind": info["kind"], "num_devices": n_dev,
              "bytes_limit": info["bytes_limit"], "model": setting["model"], "schedule": schedule,
              "steps": setting["steps"], "batch_size": groups * size, "flags": flags, "mem_fraction": mem_fraction,
              "auto_table_source": args.auto_table, "static_runs": static, "runs": {}}
    if json_path.exists():  # continue the figure: same settings, more runs
        old = json.loads(json_path.read_text())
        differ = [k for k in ("flags", "device", "mem_fraction") if old.get(k) != result[k]]
        if differ:
            raise SystemExit(f"{json_path} exists with other {differ}: pass --name for a new figure "
                             "(runs of one figure must share their settings)")
        result["runs"], result["auto_table"] = old["runs"], old.get("auto_table")
        result["replaced_runs"] = old.get("replaced_runs", {})
    runs_dir = args.keep_runs or Path(tempfile.mkdtemp(prefix=f"{name}_"))
    for run_name in wanted:
        if run_name in result["runs"] and not args.rerun:
            print(f"{run_name}: in {json_path} already ({result['runs'][run_name]['status']}); skipped")
            continue
        run_flags = list(flags)
        if run_name == "auto":
            run_flags += ["--planner.mode", "auto"]
            if args.auto_table == "from-static":
                run_flags += ["--planner.table", str(auto_table(result, runs_dir / "auto_table.json"))]
            elif args.auto_table != "none":
                run_flags += ["--planner.table", args.auto_table]
        else:
            run_flags += ["--planner.mode", "static", "--planner.rollout-thresholds", f"0:{static[run_name]}"]
        run_dir = runs_dir / run_name
        if run_dir.exists():
            raise SystemExit(f"{run_dir} exists: remove it or pass another --keep-runs (runs are never overwritten)")
        print(f"{run_name}: running (budget {args.budget_s or setting['budget_s']:.0f} s)", flush=True)
        run = run_one(run_name, run_flags, run_dir, args.budget_s or setting["budget_s"], env, schedule)
        run["rollout_mesh"] = static.get(run_name)
        keep_replaced(result, run_name)
        result["runs"][run_name] = run
        write(result, json_path)  # after every run: a call cut short keeps what finished
    write(result, json_path)
    print_summary(result)
    print(f"wrote {json_path} and {json_path.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
