"""Rollouts ahead of training (`--rollout.max-staleness 1`), partial rollouts (`--rollout.token-budget N`) and both
together against the synchronous loop: trained tokens a second of the same job on the same device.

Each mode is one Trainer of the job (`--preset` of experiments/configs/<script>/) run by its own loop for `--steps`
iterations in this process (no evaluation or checkpoint until the end), an iteration's wall time the loop's clock
between records; the first `--skip` iterations (the warm-up, compiles, the rollout ahead's first batch) and the last
(the evaluation) are left out. Trained tokens: the
trained batch's tokens (`rollout/tokens`, a partial rollout's carried groups not counted). The token budget is
`--budget-share` of the synchronous run's median answer tokens a rollout, so the sync mode runs first. Modes run one
after another, each once: the ratio carries one run's noise. Learning is not compared here (the same iterations
differ in their samples): the last iterations' mean return is printed as a reading, not a claim.

    python experiments/benchmarks/bench_overlap.py                                      # CPU: guess-the-number
    python experiments/benchmarks/bench_overlap.py --preset gpu --steps 80 --skip 20 --flags "--sft.steps 30"
    python experiments/benchmarks/bench_overlap.py --preset gpu --load long-tail --flags "--model.name qwen2.5-1.5b"

`--load long-tail` trains on bench_pool.py's long-tailed task instead of the preset's (episodes of 2, 8 or 32 turns
at 0.75 / 0.20 / 0.05, 8 answer tokens a turn, any answer ends its turn; the reward is the episode's end, so every
group is constant and the train stage's work is the batch's tokens alone): the load whose longest episodes set the
rollout's time, where a token budget should pay. Random weights, no SFT stage.

Writes experiments/results/bench_overlap_<script>_<preset>_<device>.{json,png} (`--replot FILE.json` redraws a
saved result's PNG).
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
PER_ITERATION = ("bench/wall_s", "rollout/tokens", "rollout/generated_tokens", "time/rollout_s", "time/train_s")
LONG_TAIL = ["--env.task", "bench_pool:make_long_tail", "--env.task-args", "{}", "--sft.steps", "0",
             "--model.hf-checkpoint", "", "--loss.kl-coef", "0", "--rollout.max-turns", "32",
             "--rollout.max-turn-tokens", "8", "--rollout.max-context", "1536"]  # bench_pool.py's load
MODES = ("sync", "stale1", "partial", "both")  # both: staleness 1 and the token budget together
DECOUPLED = ["--loss.policy-loss", "decoupled_ppo"]  # both modes train tokens of older weights: AReaL's correction


def plot(result: dict, path: Path) -> None:
    """Per iteration and mode: the trained tokens and the wall seconds, the measured iterations unshaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for m, row in result["modes"].items():
        its = row["per_iteration"]
        x = range(1, len(its) + 1)
        ratio = f", {row['vs_sync']:.2f}x sync" if "vs_sync" in row else ""
        top.plot(x, [r["rollout/tokens"] for r in its], ".-", label=f"{m}{ratio}")
        bottom.plot(x, [r["bench/wall_s"] for r in its], ".-", label=m)
    for ax in (top, bottom):
        ax.axvspan(0.5, result["skip"] + 0.5, color="0.9")
        ax.axvspan(result["steps"] - 0.5, result["steps"] + 0.5, color="0.9")
    top.set_ylabel("trained tokens")
    bottom.set_ylabel("iteration wall s (log)")
    bottom.set_yscale("log")  # the first iteration holds the warm-up
    bottom.set_xlabel("iteration (shaded: left out, warm-up and compiles / the evaluation)")
    top.legend(fontsize=8)
    top.set_title(f"{result['job']} on {result['device']} ({result['backend']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", default="train", choices=("train", "connect4", "tictactoe"), help="the job's configs")
    p.add_argument("--preset", default="tiny-cpu")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--skip", type=int, default=6, help="first iterations left out (compiles)")
    p.add_argument("--budget-share", type=float, default=0.75, help="token budget / sync's answer tokens a rollout")
    p.add_argument("--modes", default="sync,stale1,partial,both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", choices=("preset", "long-tail"), default="preset",
                   help="the preset's task, or bench_pool.py's long-tailed one")
    p.add_argument("--flags", default="", help="more job flags, space-separated")
    p.add_argument("--out", type=Path)
    p.add_argument("--replot", type=Path, help="redraw this saved result's PNG and exit")
    a = p.parse_args()
    if a.replot:
        plot(json.loads(a.replot.read_text()), a.replot.with_suffix(".png"))
        return
    if not 1 <= a.skip < a.steps - 1:
        p.error(f"--skip ({a.skip}) must be in [1, --steps - 1 ({a.steps - 1})): the first iteration holds the "
                "warm-up and the last the evaluation")
    modes = a.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown {', '.join(unknown)} ({', '.join(MODES)})")
    if {"partial", "both"} & set(modes) and modes[0] != "sync":
        p.error("--modes: the token budget comes from sync's rollouts: put sync first")

    import jax

    from earl_jax.compile_cache import enable_compile_cache
    from earl_jax.parallel.profile import device_slug
    from earl_jax.rl.job.entry import parse_job
    from earl_jax.rl.loop.trainer import Trainer

    enable_compile_cache(None)  # modes after the first load the programs they share (compiles sit in --skip anyway)
    load = LONG_TAIL if a.load == "long-tail" else []
    if load:
        sys.path.insert(0, str(ROOT / "experiments" / "benchmarks"))  # the job imports bench_pool:make_long_tail

    def run(flags: list[str], run_dir: str) -> list[dict]:
        cfg = parse_job(["--preset", a.preset, "--seed", str(a.seed), "--steps", str(a.steps), "--run-dir", run_dir,
                         "--run.max-minutes", "0", "--run.progress", "false", "--run.wandb-mode", "disabled",
                         "--run.checkpoint-every", "0", "--eval.every", "0", "--eval.games", "8",
                         *load, *a.flags.split(), *flags], ROOT / "experiments" / "configs" / a.script).config
        trainer = Trainer(cfg, log=False)
        out = trainer.run()  # the job's own loop: the warm-up, then the iterations, an evaluation after the last
        elapsed = [0.0] + [r["time/elapsed_s"] for r in out]
        for i, rec in enumerate(out):
            rec["bench/wall_s"] = elapsed[i + 1] - elapsed[i]  # the first holds the warm-up, the last the evaluation
        del trainer
        gc.collect()
        return out

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        for m in modes:
            if m == "sync":
                flags = []
            else:
                flags = [*DECOUPLED]
                if m in ("stale1", "both"):
                    flags += ["--rollout.max-staleness", "1"]
                if m in ("partial", "both"):
                    answers = statistics.median(r["rollout/generated_tokens"] for r in rows["sync"]["records"])
                    flags += ["--rollout.token-budget", str(max(1, round(a.budget_share * answers)))]
            print(f"{m}: {' '.join(flags) or 'the job as configured'}", flush=True)
            recs = run(flags, f"{d}/{m}")
            kept = recs[a.skip:-1]
            tokens, wall = sum(r["rollout/tokens"] for r in kept), sum(r["bench/wall_s"] for r in kept)
            rows[m] = {"flags": flags, "records": recs, "trained_tokens_per_s": tokens / wall, "wall_s": wall,
                       "iteration_s_median": statistics.median(r["bench/wall_s"] for r in kept),
                       "rollout_s_median": statistics.median(r["time/rollout_s"] for r in kept),
                       "train_s_median": statistics.median(r["time/train_s"] for r in kept),
                       "return_last": statistics.fmean(r["episode/return_mean"] for r in recs[-min(10, len(recs)):]),
                       "staleness_max": max(r.get("rollout/staleness_max", 0) for r in kept),
                       "carried_over": sum(r.get("rollout/carried_over", 0) for r in kept)}
            print(f"{m}: {rows[m]['trained_tokens_per_s']:.0f} trained tokens/s, iteration "
                  f"{rows[m]['iteration_s_median']:.3f} s (rollout {rows[m]['rollout_s_median']:.3f}, train "
                  f"{rows[m]['train_s_median']:.3f}), return over the last iterations {rows[m]['return_last']:.3f}",
                  flush=True)
    base = rows.get("sync")
    for m, row in rows.items():
        if base and m != "sync":
            row["vs_sync"] = row["trained_tokens_per_s"] / base["trained_tokens_per_s"]
            print(f"{m} / sync: {row['vs_sync']:.2f}x trained tokens a second")
    device = jax.devices()[0].device_kind
    result = {"script": "experiments/benchmarks/bench_overlap.py", "argv": sys.argv[1:], "device": device,
              "devices": jax.device_count(), "backend": jax.default_backend(), "jax": jax.__version__,
              "job": " ".join(filter(None, [f"{a.script} --preset {a.preset}", shlex.join(load), a.flags])),
              "load": a.load, "steps": a.steps, "skip": a.skip,
              "modes": {m: {k: v for k, v in r.items() if k != "records"}
                        | {"per_iteration": [{k: rec[k] for k in PER_ITERATION} for rec in r["records"]]}
                        for m, r in rows.items()}}
    load_tag = "_long-tail" if load else ""
    out = a.out or RESULTS / f"bench_overlap_{a.script}_{a.preset}{load_tag}_{device_slug(device)}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and its .png")


if __name__ == "__main__":
    main()
