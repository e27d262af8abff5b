"""The rollout stage and the whole iteration, before / after the batched agent loop, same device.

Each case is a real training job (`experiments/connect4.py`, a few iterations, no warm-up) in its own process, run
with this checkout ("current") and shown beside the "baseline" the device's result file recorded for the case (commit
4fdd9ec, the code before the batched agent loop; `--against` names another file). From the iterations from the third
on that compiled nothing (`steady`) it takes the medians of: the rollout's wall time, games and generated tokens per
second, the host's share of the rollout (env stepping, parsing, tokenizing), and the experience and train times. A
reference for how fast batched game rules can go: pgx's Connect Four (pure JAX, `pip install pgx`) stepping uniformly
random legal moves for the same number of games on the same device.

    python experiments/benchmarks/bench_agent_loop.py --cpu          # the CPU default (64 games, minimal prompts)
    python experiments/benchmarks/bench_agent_loop.py --gpu          # one GPU: 512 and 2048 compact games, tiny model

Writes experiments/results/bench_agent_loop_<device>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a clone: no install needed
RESULTS = ROOT / "experiments" / "results"

from experiments.sweep import steady_iterations  # noqa: E402

# The free-text decode loop, what the baseline's numbers measure (its code had no other).
COMMON = ["--sft.steps", "0", "--eval.every", "0", "--eval.games", "8", "--run.checkpoint-every", "0",
          "--run.wandb-mode", "disabled", "--run.progress", "false", "--learning-rate", "1e-6",
          "--rollout.constrain-moves", "false"]
CASES = {
    "cpu": {"cpu64": ["--rollout.groups", "16", "--rollout.group-size", "4", "--steps", "8"]},
    "gpu": {"gpu512": ["--rollout.groups", "64", "--rollout.group-size", "8", "--steps", "10",
                       "--env.prompt-style", "compact"],
            "gpu2048": ["--rollout.groups", "256", "--rollout.group-size", "8", "--steps", "8",
                        "--env.prompt-style", "compact"]},
}
# The default of connect4.py since constrained moves (one move token a turn, no decode loop): what users run now.
for _name in ("gpu512", "gpu2048"):
    CASES["gpu"][f"{_name}_constrained"] = CASES["gpu"][_name] + ["--rollout.constrain-moves", "true"]
# Variants with no baseline: on four GPUs as four processes of one job (launch/local.py, one GPU each): the
# rollout split by process (each plays its 512 games: rollout/process_split.py), or one SPMD rollout in which every
# process steps all 2048.
# 14 iterations: each process compiles the decode programs of its own games' shapes, some iterations later than others
FOUR_PROC = CASES["gpu"]["gpu2048"][:-4] + ["--steps", "14", "--env.prompt-style", "compact"]
CASES["gpu"]["gpu2048_4proc"] = FOUR_PROC + ["--rollout.split-processes", "true"]
CASES["gpu"]["gpu2048_4proc_nosplit"] = FOUR_PROC + ["--rollout.split-processes", "false"]
CASES["gpu"]["gpu2048_constrained_4proc"] = CASES["gpu"]["gpu2048_4proc"] + ["--rollout.constrain-moves", "true"]
# ... and 2048 games a GPU (weak scaling): does a data-parallel rollout scale once each GPU has one GPU's load? At 2048
# games in all each process has 512, which one GPU plays in 0.18-0.21 s against 0.33 s for 2048: latency bound.
CASES["gpu"]["gpu8192"] = ["--rollout.groups", "1024", "--rollout.group-size", "8", "--steps", "8",
                           "--env.prompt-style", "compact"]
CASES["gpu"]["gpu8192_4proc"] = (CASES["gpu"]["gpu8192"][:-4] + ["--steps", "14", "--env.prompt-style", "compact"]
                                 + ["--rollout.split-processes", "true"])
# ... and split with the collector run on a schedule (earl_jax/rl/loop/gc_control.py): do the stragglers go away?
CASES["gpu"]["gpu2048_4proc_gc"] = CASES["gpu"]["gpu2048_4proc"] + ["--run.gc-every", "1"]
LAUNCH = {name: ["-n", "4", "--devices-per-process", "1"]
          for name in ("gpu2048_4proc", "gpu2048_4proc_nosplit", "gpu2048_4proc_gc", "gpu8192_4proc",
                             "gpu2048_constrained_4proc")}
TIMES = ("time/rollout_s", "time/experience_s", "time/train_s", "time/dispatch_s")


def run_case(flags: list[str], timeout: float, env: dict, launch: list[str] | None = None) -> dict:
    """One training job of this checkout (as the processes of one job with `launch`: launch/local.py's flags);
    medians over its compile-free iterations from the third on."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "experiments" / "connect4.py"), *COMMON, *flags, "--run-dir", f"{tmp}/run"]
        if launch:
            cmd = [sys.executable, str(ROOT / "launch" / "local.py"), *launch, "--timeout", str(timeout - 5), "--",
                   *cmd]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = None, str(e.stderr or "")[-2000:]
        wall = time.perf_counter() - t0
        path = Path(tmp) / "run" / "metrics.jsonl"
        recs = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
    all_recs = recs
    settled = steady(recs)
    compiling = not settled  # every measured iteration still compiled: say so rather than drop the job
    recs = settled or [r for r in recs if r.get("step", 0) >= 3]
    # a job cut by the timeout keeps the iterations it finished (metrics.jsonl is written as it goes): this process's
    # timeout (rc None) or launch/local.py's (rc 124, which can fire after a job's last iteration)
    if rc == 124 and launch:
        rc = None
    if (rc is not None and rc != 0) or not recs:
        return {"code": "current", "status": "error" if rc is not None else "timeout", "tail": out[-3000:],
                "wall_s": wall}

    def med(k: str) -> float | None:  # None: a metric the job did not log
        vals = [r[k] for r in recs if r.get(k) is not None]
        return statistics.median(vals) if vals else None

    games = int(flags[flags.index("--rollout.groups") + 1]) * int(flags[flags.index("--rollout.group-size") + 1])
    out_ = {"code": "current", "status": "ok" if rc == 0 else "cut by the timeout", "iterations": len(recs),
            "still_compiling": compiling, "wall_s": wall, "games": games,
            **{k.split("/")[1]: med(k) for k in TIMES},
            "env_frac": med("rollout/env_frac"), "wait_frac": med("rollout/wait_frac"),
            "gather_frac": med("rollout/gather_frac"), "gather_wait_frac": med("rollout/gather_wait_frac"),
            "process_min_s": med("rollout/process_min_s"), "process_max_s": med("rollout/process_max_s"),
            "gc_pause_s": med("time/gc_pause_s"), "gc_s": med("time/gc_s"),
            "groups": med("rollout/groups") or 1,
            "generated_tokens": med("rollout/generated_tokens"),
            "tokens": med("rollout/tokens"), "turns_mean": med("episode/turns_mean")}
    out_["rollouts"] = [[r["step"], round(r["time/rollout_s"], 4), round(r.get("rollout/process_max_s", 0.0), 4),
                         round(r.get("time/gc_pause_s", 0.0), 4), round(r.get("time/compile_s", 0.0), 4)]
                        for r in recs]  # step, rollout, slowest process's own games (split), longest GC pause, compiles
    # every iteration from the third on, compiled or not: [step, rollout, slowest process, XLA compile s, programs
    # traced, process 0's slowest compiles]
    out_["all_iterations"] = [[r["step"], round(r["time/rollout_s"], 4), round(r.get("rollout/process_max_s", 0.0), 4),
                               round(r.get("time/compile_s", 0.0), 4), r.get("compile/lowered"),
                               r.get("compile/slowest")]
                              for r in all_recs if r.get("step", 0) >= 3]
    out_["iteration_s"] = out_["rollout_s"] + out_["experience_s"] + out_["train_s"]
    out_["games_per_s"] = games / out_["rollout_s"]
    out_["generated_tok_per_s"] = out_["generated_tokens"] / out_["rollout_s"]
    return out_


def steady(recs: list[dict]) -> list[dict]:
    """The iterations that compiled nothing (`sweep.steady_iterations`), from the third on: jobs that do not log
    `compile/programs` (the baseline commit) keep iterations 3+ (1-2 compile)."""
    return [r for r in steady_iterations(recs) if r.get("step", 0) >= 3]


def pgx_reference(games: int, steps: int = 200) -> dict:
    """pgx Connect Four, `games` in lock-step, uniformly random legal moves, finished games reset in place."""
    try:
        import jax
        import jax.numpy as jnp
        import pgx
    except ImportError as e:
        return {"status": f"not installed ({e})"}
    env = pgx.make("connect_four")
    init, step = jax.vmap(env.init), jax.vmap(env.step)

    @jax.jit
    def turn(state, key):
        k_act, k_init = jax.random.split(key)
        logits = jnp.where(state.legal_action_mask, 0.0, -jnp.inf)
        actions = jax.random.categorical(k_act, logits, axis=-1)
        state = step(state, actions)
        fresh = init(jax.random.split(k_init, games))
        done = state.terminated | state.truncated
        return jax.tree.map(lambda a, b: jnp.where(done.reshape(done.shape + (1,) * (a.ndim - 1)), b, a), state,
                            fresh), done

    state = jax.jit(init)(jax.random.split(jax.random.key(0), games))
    state, done = turn(state, jax.random.key(1))
    jax.block_until_ready(state)
    finished = 0
    t0 = time.perf_counter()
    for i in range(steps):
        state, done = turn(state, jax.random.key(i + 2))
        finished += done  # device-side sum: no host sync per step
    finished = int(jax.device_get(finished).sum())
    secs = time.perf_counter() - t0
    return {"status": "ok", "games": games, "ms_per_lockstep_turn": secs / steps * 1e3,
            "moves_per_s": games * steps / secs, "games_per_s": finished / secs, "device": jax.devices()[0].device_kind}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(result["cases"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for k, code in enumerate(("baseline", "current")):
        runs = [result["cases"][c].get(code, {}) for c in cases]
        xs = [i + (k - 0.5) * width for i in range(len(cases))]
        bottoms = [0.0] * len(cases)
        for stage, color in (("rollout_s", "tab:blue"), ("experience_s", "tab:orange"), ("train_s", "tab:green")):
            vals = [r.get(stage, 0.0) for r in runs]
            axes[0].bar(xs, vals, width, bottom=bottoms, color=color, alpha=0.5 + 0.5 * k,
                        label=f"{code}: {stage[:-2]}")
            bottoms = [b + v for b, v in zip(bottoms, vals)]
        axes[1].bar(xs, [r.get("games_per_s", 0.0) for r in runs], width, alpha=0.5 + 0.5 * k, label=code)
    for ax, title in zip(axes, ("seconds per iteration (median)", "rollout games per second")):
        ax.set_xticks(range(len(cases)), cases)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"agent loop before / after, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def collect(folders: list[Path]) -> dict:
    """One result from the JSONs of several jobs of one device call (run_on_device.sh agent-loop-4gpu runs each job
    into its own folder, side by side on the GPUs)."""
    parts = [json.loads(f.read_text()) for d in folders for f in sorted(Path(d).glob("bench_agent_loop_*.json"))]
    if not parts:
        raise SystemExit(f"no bench_agent_loop_*.json in {', '.join(map(str, folders))}")
    result = {k: v for k, v in parts[0].items() if k not in ("cases", "pgx")}
    result["cases"], result["pgx"] = {}, {}
    for part in parts:
        for name, runs in part["cases"].items():
            result["cases"].setdefault(name, {}).update(runs)
        result["pgx"].update(part.get("pgx", {}))
    _speedups(result)
    return result


def with_repeats(folders: list[Path]) -> dict:
    """The first folder's result, plus every folder's baseline / current pair of each case (the same cases run again,
    in one device call or several, each pair from one call) and their medians: one pair is within the host's noise.
    A code whose job did not finish (no rollout_s: a timeout) is left out of its pair."""
    runs = [json.loads(next(Path(d).glob("bench_agent_loop_*.json")).read_text()) for d in folders]
    result = runs[0]
    keys = ("rollout_s", "env_frac", "iteration_s", "games_per_s")
    result["repeats"] = {}
    for name in result["cases"]:
        pairs = [{code: {k: r["cases"][name][code][k] for k in keys} for code in ("baseline", "current")
                  if "rollout_s" in r["cases"][name].get(code, {})} for r in runs if name in r["cases"]]  # ran
        medians = {code: {k: statistics.median(p[code][k] for p in pairs if code in p) for k in keys}
                   for code in ("baseline", "current")}
        result["repeats"][name] = {"folders": [str(d) for d in folders], "pairs": pairs, "median": medians}
        print(name, "medians over", len(pairs), "pairs:", medians)
    return result


def _speedups(result: dict) -> None:
    for c in result["cases"].values():
        b, cur = c.get("baseline", {}), c.get("current", {})
        if "rollout_s" in b and "rollout_s" in cur:
            c["speedup"] = {"rollout": b["rollout_s"] / cur["rollout_s"],
                            "iteration": b["iteration_s"] / cur["iteration_s"],
                            "experience": b["experience_s"] / cur["experience_s"],
                            "train": b["train_s"] / cur["train_s"]}
            print("speedup", c["speedup"])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--cpu", action="store_true")
    which.add_argument("--gpu", action="store_true")
    p.add_argument("--cases", default=None, help="comma list of case names (default: all of the setting)")
    p.add_argument("--against", type=Path, default=None,
                   help="the result file with each case's baseline (default: the device's in experiments/results)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per job")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--collect", type=Path, nargs="+", default=None,
                   help="run nothing: merge the results in these folders (jobs of one device call) into one")
    p.add_argument("--repeats", type=Path, nargs="+", default=None,
                   help="run nothing: the first folder's result with every folder's pairs and their medians")
    p.add_argument("extra", nargs="*", help="more connect4.py flags for every job (after --)")
    args = p.parse_args(argv)
    if args.collect:
        return _write(collect(args.collect), args.out)
    if args.repeats:
        return _write(with_repeats(args.repeats), args.out)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process (pgx) must leave the jobs their memory
    setting = "gpu" if args.gpu else "cpu"
    cases = {k: v + args.extra for k, v in CASES[setting].items() if args.cases is None or k in args.cases.split(",")}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.cpu:
        env["JAX_PLATFORMS"] = "cpu"
    result = {"what": "experiments/connect4.py jobs, medians of iterations 3+ that compiled nothing", "cases": {},
              "pgx": {}}
    for name, flags in cases.items():
        r = run_case(flags, args.timeout, env, LAUNCH.get(name))
        result["cases"][name] = {"current": r}
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "tail"}, flush=True)
        if "tail" in r:
            print(r["tail"], flush=True)
        if name in LAUNCH:  # a variant: its base case has the pgx reference
            continue
        games = int(flags[flags.index("--rollout.groups") + 1]) * int(flags[flags.index("--rollout.group-size") + 1])
        result["pgx"][name] = pgx_reference(games)
        print(name, "pgx", result["pgx"][name], flush=True)
    import jax

    result["device"] = jax.devices()[0].device_kind
    with_baselines(result, args.against)
    return _write(result, args.out)


def with_baselines(result: dict, against: Path | None) -> None:
    """Each case's recorded baseline from `against` (default: the device's result file), and the speedups."""
    from earl_jax.parallel.profile import device_slug

    path = against or RESULTS / f"bench_agent_loop_{device_slug(result['device'])}.json"
    recorded = json.loads(path.read_text())["cases"] if path.is_file() else {}
    for name, runs in result["cases"].items():
        if "baseline" in recorded.get(name, {}):
            runs["baseline"] = recorded[name]["baseline"]
    result["baseline_from"] = str(path) if recorded else None
    _speedups(result)


def _write(result: dict, out: Path) -> dict:
    from earl_jax.parallel.profile import device_slug

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_agent_loop_{device_slug(result['device'])}.json"
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
