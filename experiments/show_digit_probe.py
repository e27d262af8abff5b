"""The free-text learning probe: `earl_jax/ShowDigit-v0` from random weights, no warm-up, candidates x seeds.

Each run is the stock job (`experiments/train.py`), 300 iterations of 128 one-turn episodes, no SFT stage (its
demonstrations would show the answer); runs go side by side, two CPU cores each. The summary (the mean training
return over the last 10 iterations, per run and per candidate with the spread) goes to OUT/summary.json, the curves
to OUT/curves.png; docs/learning.md "Free text from random weights" quotes them.

    python experiments/show_digit_probe.py OUT --candidates grpo,mixed --seeds 11,12 --parallel 8

With `--stop-after SECONDS` the running runs are stopped then (each saves a checkpoint) and the same command later
resumes them: a device call of at most 10 minutes runs a many-seed comparison in parts. The summary also pairs the
candidates seed by seed (`paired`: the mean difference and its standard error).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 300  # a run's length; a run with fewer is unfinished (resumed, not summarized)
BASE = ["--env.task", "earl_jax/ShowDigit-v0", "--env.task-args", "{}", "--sft.steps", "0",
        "--rollout.groups", "32", "--rollout.group-size", "4", "--rollout.max-turns", "1",
        "--run.steps", str(ITERATIONS),
        "--eval.every", "0", "--eval.games", "32", "--run.resume", "auto", "--run.wandb-mode", "disabled",
        "--run.progress", "false",
        # what the runs had: the library's rate, no KL term (train.py's default preset fine-tunes an SFT base instead)
        "--optim.learning-rate", "1e-3", "--optim.ppo-mini-batches", "1", "--loss.kl-coef", "0"]
FORMAT = ["--sft.steps", "20", "--sft.answers", "format"]
MIXED = ["--loss.between-group-weight", "1.0", "--loss.filter-constant-groups", "false"]
UNTIED = "tiny-untied"  # a model shape only this probe registers (run_one)
_UNTIED_TRAIN = (  # train.py with the tiny model's embeddings untied, registered as UNTIED
    f"import runpy, sys; sys.path.insert(0, {str(ROOT)!r}); from earl_jax.models import model_config as mc; "
    f"mc.PRESETS[{UNTIED!r}] = lambda: mc.ModelConfig.tiny().replace(tie_word_embeddings=False, name={UNTIED!r}); "
    "sys.argv[0] = sys.argv[1]; del sys.argv[1]; runpy.run_path(sys.argv[0], run_name='__main__')")
CANDIDATES = {
    "grpo": [],  # the library default: GRPO, constant groups filtered
    "grpo_nofilter": ["--loss.filter-constant-groups", "false"],
    "mixed": MIXED,  # GRPO plus the between-group term: a constant group still has a batch baseline
    "mixed_half": ["--loss.between-group-weight", "0.5", "--loss.filter-constant-groups", "false"],
    "mixed_lr5e-4": MIXED + ["--optim.learning-rate", "5e-4"],
    "mixed_lr2e-3": MIXED + ["--optim.learning-rate", "2e-3"],
    "mixed_g16x8": MIXED + ["--rollout.groups", "16", "--rollout.group-size", "8"],
    "mixed_g32x8": MIXED + ["--rollout.group-size", "8"],  # 256 episodes an iteration, 8 tries at each digit
    "mixed_g64x4": MIXED + ["--rollout.groups", "64"],  # 256 episodes an iteration
    "mixed_lr3e-3": MIXED + ["--optim.learning-rate", "3e-3"],
    "mixed_tokens2": MIXED + ["--rollout.max-turn-tokens", "2"],  # a digit and the end token
    "mixed_entropy1": MIXED + ["--loss.entropy-coef", "0.01", "--loss.entropy-floor", "1.0"],
    "dr_grpo_mixed": MIXED + ["--loss.estimator", "dr_grpo"],
    "rloo_mixed": MIXED + ["--loss.estimator", "rloo"],
    "reinforce_pp": ["--loss.estimator", "reinforce_pp"],
    "reinforce_pp_lr2e-3": ["--loss.estimator", "reinforce_pp", "--optim.learning-rate", "2e-3"],
    "mixed_kl0.05": MIXED + ["--loss.kl-coef", "0.05"],  # KL to the initial weights keeps the first token spread
    "mixed_kl0.2": MIXED + ["--loss.kl-coef", "0.2"],
    "grpo_kl0.1": ["--loss.kl-coef", "0.1"],
    "mixed_mb4": MIXED + ["--optim.ppo-mini-batches", "4"],  # four optimizer steps an iteration, each on 8 groups
    "mixed_ep2": MIXED + ["--optim.ppo-epochs", "2"],
    "format": ["--sft.steps", "20", "--sft.answers", "format"],  # 20 SFT steps on random digits, then GRPO
    "format_mixed": MIXED + ["--sft.steps", "20", "--sft.answers", "format"],
    "format50_mixed": MIXED + ["--sft.steps", "50", "--sft.games", "64", "--sft.answers", "format"],
    "mixed_entropy": MIXED + ["--loss.entropy-coef", "0.01", "--loss.entropy-floor", "2.0"],
    # the format first (uniform digits), then the step size and the number of steps the reading needs
    "format_mixed_lr2e-3": FORMAT + MIXED + ["--optim.learning-rate", "2e-3"],
    "format_mixed_lr3e-3": FORMAT + MIXED + ["--optim.learning-rate", "3e-3"],
    "format_mixed_mb4": FORMAT + MIXED + ["--optim.ppo-mini-batches", "4"],
    "format_mixed_ep2": FORMAT + MIXED + ["--optim.ppo-epochs", "2"],
    "format_mixed_entropy1": FORMAT + MIXED + ["--loss.entropy-coef", "0.01", "--loss.entropy-floor", "1.0"],
    "format_rpp": FORMAT + ["--loss.estimator", "reinforce_pp"],
    "format_rpp_mb4": FORMAT + ["--loss.estimator", "reinforce_pp", "--optim.ppo-mini-batches", "4"],
    "format_mixed_g64x4": FORMAT + MIXED + ["--rollout.groups", "64"],
    "format_mixed_mb8": FORMAT + MIXED + ["--optim.ppo-mini-batches", "8"],
    "format_mixed_mb16": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16"],
    "mixed_mb8": MIXED + ["--optim.ppo-mini-batches", "8"],
    "mixed_mb16": MIXED + ["--optim.ppo-mini-batches", "16"],
    "format_grpo_mb16": FORMAT + ["--optim.ppo-mini-batches", "16"],
    "format_mixed_mb8_ep2": FORMAT + MIXED + ["--optim.ppo-mini-batches", "8", "--optim.ppo-epochs", "2"],
    "format_mixed_mb4_ep2": FORMAT + MIXED + ["--optim.ppo-mini-batches", "4", "--optim.ppo-epochs", "2"],
    # past the preset's plateau near 0.5: twice the updates on the same episodes, or larger ones
    "format_mixed_mb16_ep2": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--optim.ppo-epochs", "2"],
    "format_mixed_mb16_lr2e-3": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--optim.learning-rate", "2e-3"],
    "format_mixed_mb32": FORMAT + MIXED + ["--optim.ppo-mini-batches", "32"],  # one group an update
    # twice the episodes an iteration in updates of the preset's size: twice the updates, each on fresh episodes
    "format_mixed_g64_mb32": FORMAT + MIXED + ["--rollout.groups", "64", "--optim.ppo-mini-batches", "32"],
    # the preset's episodes and updates in groups of 2: each update sees 4 digits instead of 2
    "format_mixed_mb16_gs2": FORMAT + MIXED + ["--rollout.groups", "64", "--rollout.group-size", "2",
                                               "--optim.ppo-mini-batches", "16"],
    # the preset with no decay of its rate: the slower seeds were still rising at 300 while the rate fell to 0.1x
    "format_mixed_mb16_constant": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--optim.schedule", "constant"],
    # the answer's budget sized to its format (a digit and the end token) instead of tiny-cpu's 6: past the format
    # warm-up the end token fades, and 5 of 6 trained tokens then carry the digit's advantage without deciding it
    "format_mixed_mb16_t2": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--rollout.max-turn-tokens", "2"],
    # the same at a lower rate: without the 4 unrewarded tokens the digit's share of each normalised step is larger
    "format_mixed_mb16_t2_lr5e-4": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--rollout.max-turn-tokens", "2",
                                                     "--optim.learning-rate", "5e-4"],
    "format_mixed_mb16_t2_lr3e-4": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--rollout.max-turn-tokens", "2",
                                                     "--optim.learning-rate", "3e-4"],
    # one token, the task's action_space (Text, max_length 1): with two, the policy wrote '0X' and read at the second
    "format_mixed_mb16_t1": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--rollout.max-turn-tokens", "1"],
    "format_mixed_mb16_t1_lr5e-4": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--rollout.max-turn-tokens", "1",
                                                     "--optim.learning-rate", "5e-4"],
    # one token and an entropy bonus up to 1 nat: a digit pooled on one confident wrong answer gets no gradient
    "format_mixed_mb16_t1_ent01": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--rollout.max-turn-tokens", "1",
                                                    "--loss.entropy-coef", "0.01", "--loss.entropy-floor", "1.0"],
    "format_mixed_mb16_t1_ent05": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--rollout.max-turn-tokens", "1",
                                                    "--loss.entropy-coef", "0.05", "--loss.entropy-floor", "1.0"],
    # the preset with the 6x larger model (~5M parameters): every answer format above plateaued near 0.5
    "format_mixed_mb16_small": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--model.name", "small"],
    "format_mixed_mb16_small_lr5e-4": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--model.name", "small",
                                                        "--optim.learning-rate", "5e-4"],
    # the preset with twice the between-group term: a pooled digit's constant groups are what it has to break
    "format_mixed2_mb16": FORMAT + ["--loss.between-group-weight", "2.0", "--loss.filter-constant-groups", "false",
                                    "--optim.ppo-mini-batches", "16"],
    # the preset sampling at temperature 1.3: a pooled digit's group answers alike; a hotter draw breaks the tie
    "format_mixed_mb16_t13": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--rollout.temperature", "1.3"],
    # the ratio clip's upper side: a rare right answer may rise more than 1.28x in an iteration of 16 updates
    "format_mixed_mb16_ch1": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--loss.clip-eps-high", "1.0"],
    "format_mixed_mb16_ch3": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--loss.clip-eps-high", "3.0"],
    "format_mixed_mb16_ch06": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--loss.clip-eps-high", "0.6"],
    "format_mixed_mb8_ch1": FORMAT + MIXED + ["--optim.ppo-mini-batches", "8", "--loss.clip-eps-high", "1.0"],
    # the preset with the 2 x 32 model (~21K parameters): the 6x larger model started reading later than the tiny one
    "format_mixed_mb16_nano": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--model.name", "nano"],
    "format_mixed_mb16_nano_lr3e-3": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--model.name", "nano",
                                                       "--optim.learning-rate", "3e-3"],
    # the entropy bonus that evened the seeds out (with one answer token), on the preset's budget, and with the wider
    # upper clip that gave seed 11 its best run: a pool stays breakable and a rare right answer may rise faster
    "format_mixed_mb16_ent01": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--loss.entropy-coef", "0.01",
                                                 "--loss.entropy-floor", "1.0"],
    "format_mixed_mb16_ch06_ent01": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--loss.clip-eps-high", "0.6",
                                                      "--loss.entropy-coef", "0.01", "--loss.entropy-floor", "1.0"],
    # the preset's episodes in larger groups: a digit pooled on one wrong answer finds the right one within its group
    # more often (8 draws at 1 in 10: 0.57, against 0.34 for 4); an update holds one group, the advantages the batch's
    "format_mixed_mb16_g16x8": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--rollout.groups", "16",
                                                 "--rollout.group-size", "8"],
    "format_mixed_mb8_g8x16": FORMAT + MIXED + ["--optim.ppo-mini-batches", "8", "--rollout.groups", "8",
                                                "--rollout.group-size", "16"],
    # the tiny model with untied input and output embeddings (no flag: run_one registers the shape for the run), so
    # the unrewarded tokens' updates cannot move the digit embeddings the reading needs
    "format_mixed_mb16_untied": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--model.name", UNTIED],
    "format_mixed_mb16_untied_ent01": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--model.name", UNTIED,
                                                        "--loss.entropy-coef", "0.01", "--loss.entropy-floor", "1.0"],
    # groups of 16 and the preset's 16 updates: twice the preset's episodes an iteration
    "format_mixed_mb16_g16x16": FORMAT + MIXED + ["--optim.ppo-mini-batches", "16", "--rollout.groups", "16",
                                                  "--rollout.group-size", "16"],
}


def run_one(out: Path, name: str, seed: int, hidden: bool, cores: str) -> subprocess.Popen:
    tag = f"{name}{'_hidden' if hidden else ''}_s{seed}"
    args = [*BASE, *CANDIDATES[name], "--run.seed", str(seed), "--run.run-dir", str(out / tag)]
    if hidden:
        args[args.index("{}")] = '{"hidden": true}'
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    log = open(out / f"{tag}.log", "w")
    launch = [sys.executable, *(["-c", _UNTIED_TRAIN] if UNTIED in args else []), str(ROOT / "experiments/train.py")]
    return subprocess.Popen(["taskset", "-c", cores, *launch, *args], stdout=log, stderr=subprocess.STDOUT, env=env)


def _cores(slot: int, per_run: int = 2) -> str:
    """`per_run` cores per run; runs share them when there are fewer cores than per_run x --parallel."""
    n = os.cpu_count() or 1
    return ",".join(sorted({str((per_run * slot + i) % n) for i in range(per_run)}))


def returns(run_dir: Path) -> list[float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["episode/return_mean"] for r in rows if "episode/return_mean" in r]


def summarize(out: Path) -> dict:
    import numpy as np

    runs = {}
    for d in sorted(p for p in out.iterdir() if p.is_dir()):
        r = returns(d)
        if r:
            runs[d.name] = {"iterations": len(r), "last10_return": float(np.mean(r[-10:])), "curve": r}
    last: dict[str, dict[str, float]] = {}  # candidate -> seed -> last-10 return
    for tag, v in runs.items():  # finished runs only: a cut one would mix an earlier iteration in
        if v["iterations"] >= ITERATIONS:
            cand, seed = tag.rsplit("_s", 1)
            last.setdefault(cand, {})[seed] = v["last10_return"]
    cands = {c: {"mean": float(np.mean(list(v.values()))), "std": float(np.std(list(v.values()))), "seeds": len(v),
                 "values": list(v.values())} for c, v in last.items()}
    return {"script": "experiments/show_digit_probe.py", "job": " ".join(BASE), "candidates": cands,
            "paired": paired(last),
            "runs": {k: {kk: vv for kk, vv in v.items() if kk != "curve"} for k, v in runs.items()},
            "curves": {k: v["curve"] for k, v in runs.items()}}


def paired(last: dict[str, dict[str, float]]) -> dict:
    """Each pair of candidates on the seeds both finished: the mean difference of their last-10 returns, seed by
    seed, and its standard error (a difference beyond two of them is what a many-seed comparison can claim)."""
    import itertools

    import numpy as np

    out = {}
    for a, b in itertools.combinations(sorted(last), 2):
        seeds = sorted(set(last[a]) & set(last[b]))
        if len(seeds) >= 2:
            d = np.array([last[a][s] - last[b][s] for s in seeds])
            out[f"{a} - {b}"] = {"seeds": len(seeds), "mean": float(d.mean()),
                                 "stderr": float(d.std(ddof=1) / np.sqrt(len(d)))}
    return out


def plot(summary: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors, finished = {}, {}
    for tag, curve in sorted(summary["curves"].items()):
        cand = tag.rsplit("_s", 1)[0]
        smooth = np.convolve(curve, np.ones(10) / 10, mode="valid")
        line, = ax.plot(smooth, color=colors.get(cand), lw=0.6, alpha=0.5)
        colors[cand] = line.get_color()
        if len(curve) >= ITERATIONS:
            finished.setdefault(cand, []).append(smooth)
    for cand, curves in finished.items():  # the candidate's mean over its finished seeds, thick
        n = min(map(len, curves))
        ax.plot(np.mean([c[:n] for c in curves], axis=0), color=colors[cand], lw=2.5,
                label=f"{cand} (mean of {len(curves)})")
    ax.axhline(0.5, color="gray", ls=":", lw=1)
    ax.set(xlabel="iteration", ylabel="training return (10-iteration mean)", title="ShowDigit, free text, random init")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--candidates", default="grpo,mixed", help=f"comma list of: {', '.join(CANDIDATES)}")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--hidden", action="store_true", help="also run each candidate with the digit hidden (the control)")
    p.add_argument("--parallel", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="runs at a time")
    p.add_argument("--cores-per-run", type=int, default=2)
    p.add_argument("--summarize-only", action="store_true")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="then stop the running runs (each checkpoints; a later call resumes them) and summarize")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    unknown = set(a.candidates.split(",")) - set(CANDIDATES)
    if unknown:
        p.error(f"--candidates: unknown {', '.join(sorted(unknown))}; known: {', '.join(CANDIDATES)}")
    # seed by seed, so that runs cut short by --stop-after leave every candidate on the same seeds
    jobs = [(c, int(s), h) for s in a.seeds.split(",") for c in a.candidates.split(",")
            for h in ((False, True) if a.hidden else (False,))]
    jobs = [j for j in jobs if len(returns(a.out / f"{j[0]}{'_hidden' if j[2] else ''}_s{j[1]}")) < ITERATIONS]
    running: dict[int, tuple] = {}
    t0 = time.time()
    while (jobs or running) and not a.summarize_only:
        if a.stop_after is not None and time.time() - t0 > a.stop_after:
            for _, proc in running.values():
                proc.terminate()  # the job saves a checkpoint on SIGTERM
            for job, proc in running.values():
                print(f"stopped {job}: exit {proc.wait()}", flush=True)
            break
        for slot in range(a.parallel):
            if slot not in running and jobs:
                job = jobs.pop(0)
                running[slot] = (job, run_one(a.out, *job, cores=_cores(slot, a.cores_per_run)))
        time.sleep(5)
        for slot, (job, proc) in list(running.items()):
            if proc.poll() is not None:
                del running[slot]
                print(f"{time.time() - t0:6.0f}s {job}: exit {proc.returncode}, "
                      f"{len(returns(a.out / (job[0] + ('_hidden' if job[2] else '') + f'_s{job[1]}')))} iterations",
                      flush=True)
    summary = summarize(a.out)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(summary, a.out / "curves.png")
    for c, v in sorted(summary["candidates"].items()):
        print(f"{c:24s} last-10 return {v['mean']:+.3f} +- {v['std']:.3f} over {v['seeds']} seeds {v['values']}")
    for pair, v in summary["paired"].items():
        print(f"{pair}: {v['mean']:+.3f} (standard error {v['stderr']:.3f}, {v['seeds']} seeds)")


if __name__ == "__main__":
    main()
