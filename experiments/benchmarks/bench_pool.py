"""Continuous batching (`--rollout.slots S`) against lock-step waves on a long-tailed load, same episodes.

The load (fixed before any run): `LongTail`, a text task whose episode lasts 2 turns with probability 0.75, 8 turns
with 0.20 and 32 turns with 0.05, drawn from the episode's seed (mean 4.7 turns); every answer is accepted, the
last turn pays 1. Random weights answer up to `--turn-tokens` tokens a turn (the built-in tokenizer's end token is
rarely sampled), so the work is the turns: a 128-episode batch almost surely holds a 32-turn episode (1 - 0.95^128).

Three ways to play the same N episodes (their seeds equal; a wave samples with its own rows' keys, so its answers
differ from the others' by ~1% of the tokens), when memory holds S decode rows:
- `waves`: lock-step batches of S episodes one after another (today's path: finished rows compact, and each wave
  lasts as long as its longest episode);
- `pool`: one rollout with S slots over the N episodes (a finished episode's row takes the next waiting one);
- `all`: the N episodes lock-step at once, a reference for a device with room for N rows (a small model: the
  rollout's layout is the one planned for S rows);
- `paged`: a pool of `--paged-rows` rows (default 4 S) over a paged KV cache (`--rollout.kv-pages`) of the memory the
  pool's S contiguous rows hold at --max-context: more rows in the same memory, a game preempted when pages run out.

Reported per mode, medians of `--rounds` after one round that compiles: wall seconds, answer tokens per second,
decode-row occupancy (busy rows / decode rows) and, for the pool, its occupancy while episodes waited; the share of
the KV cache's positions that hold a decoding episode's context (`kv_used_frac`, summed over decodes: what a paged
cache would not allocate is 1 minus it).

    python experiments/benchmarks/bench_pool.py                                   # CPU: N 256, S 64
    python experiments/benchmarks/bench_pool.py --episodes 1024 --slots 128       # one GPU
    python experiments/benchmarks/bench_pool.py --episodes 1024 --slots 128 --model qwen2.5-1.5b
    python experiments/benchmarks/bench_pool.py --episodes 1024 --slots 128 --model qwen2.5-7b --modes waves,pool

Only the rollout stage is built (its planner, weights on its layout, its sampler), no train state, so a 7B shape
runs on one 80 GB GPU.

Writes experiments/results/bench_pool_<model>_<device>.{json,png} (`--replot FILE.json` redraws a saved result's
PNG).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import gymnasium
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]  # run from a clone; the job imports this file's task as bench_pool:...
CONFIGS = ROOT / "experiments" / "configs" / "train"
RESULTS = ROOT / "experiments" / "results"
TURNS, SHARES = (2, 8, 32), (0.75, 0.20, 0.05)


class LongTail(gymnasium.Env):
    """Episodes of 2, 8 or 32 turns (probabilities 0.75 / 0.20 / 0.05, from the reset's seed); any answer goes."""

    def __init__(self, split: str = "train"):
        self.observation_space = gymnasium.spaces.Text(max_length=16)
        self.action_space = gymnasium.spaces.Text(max_length=64)
        self.turns, self.turn = 0, 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.turns, self.turn = int(self.np_random.choice(TURNS, p=SHARES)), 0
        return "go\n> ", {}

    def step(self, answer: str):
        self.turn += 1
        done = self.turn >= self.turns
        return ("" if done else f"{self.turn}\n> "), float(done), done, False, {"success": done}


def make_long_tail(**kw) -> gymnasium.Env:
    return LongTail(**kw)


def plot(result: dict, path: Path) -> None:
    """Per mode: answer tokens a second, and the decode rows' occupancy (the pool's while episodes waited)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    rows = [result["modes"][m] for m in modes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.bar(modes, [r["tokens_per_s"] for r in rows], color="tab:blue")
    left.set_ylabel("answer tokens / s")
    right.bar(modes, [r["occupancy"] for r in rows], color="tab:green", label="whole rollout")
    waited = [r["pool_occupancy"] if r.get("pool_occupancy") is not None else 0 for r in rows]
    right.bar(modes, waited, color="none", edgecolor="black", hatch="//", label="pool, while episodes waited")
    right.set_ylim(0, 1.05)
    right.set_ylabel("busy decode rows / rows")
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{result['model']}, {result['episodes']} episodes, {result['slots']} slots, {result['device']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=256, help="N")
    p.add_argument("--slots", type=int, default=64, help="S: the decode rows memory holds")
    p.add_argument("--turn-tokens", type=int, default=8, help="answer budget a turn")
    p.add_argument("--max-context", type=int, default=512, help="a 32-turn episode needs ~32 x (budget + 4)")
    p.add_argument("--model", default="tiny", help="a model shape (--model.name), random weights")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="waves,pool,all")
    p.add_argument("--paged-rows", type=int, default=0, help="mode paged: decode rows (default 4 x --slots)")
    p.add_argument("--page-size", type=int, default=16, help="mode paged: positions a page")
    p.add_argument("--out", type=Path)
    p.add_argument("--replot", type=Path, help="redraw this saved result's PNG and exit")
    a = p.parse_args()
    if a.replot:
        plot(json.loads(a.replot.read_text()), a.replot.with_suffix(".png"))
        return
    if a.episodes % a.slots:
        p.error(f"--episodes ({a.episodes}) must be a multiple of --slots ({a.slots}): whole waves")
    modes = a.modes.split(",")
    if unknown := [m for m in modes if m not in ("waves", "pool", "all", "paged")]:
        p.error(f"--modes: unknown {', '.join(unknown)} (waves, pool, all, paged)")
    paged_rows = a.paged_rows or 4 * a.slots

    import dataclasses

    import jax

    from earl_jax.parallel.profile import device_slug
    from earl_jax.rl.job.entry import parse_job
    from earl_jax.rl.matchups.matchmaking import job_matchmaker
    from earl_jax.rl.stages.policy_setup import build_policy
    from earl_jax.rl.stages.rollout_stage import RolloutStage
    from earl_jax.rollout.buckets import DEFAULT_CACHE_BUCKETS, bucket
    from earl_jax.rollout.sampler import SamplingConfig

    def job(episodes: int, slots: int = 0):
        return parse_job(["--preset", "tiny-cpu", "--rollout.slots", str(slots),
                          "--env.task", "bench_pool:make_long_tail", "--env.task-args", "{}",
                          "--model.name", a.model, "--sft.steps", "0",
                          "--rollout.groups", str(episodes // 2), "--rollout.group-size", "2",
                          "--rollout.max-turns", str(max(TURNS)), "--rollout.max-turn-tokens", str(a.turn_tokens),
                          "--rollout.max-context", str(a.max_context), "--run.wandb-mode", "disabled"],
                         CONFIGS).config

    # the rollout stage alone, no train state: a 7B shape's weights and Adam state in float32 outgrow one GPU. Its
    # planner sizes the rollout for S rows, as a job with --rollout.slots S does.
    cfg = job(a.episodes, a.slots)
    policy, params = build_policy(cfg, stages=("rollout",))
    stage = RolloutStage(cfg.rollout, policy, cfg.rollout.max_context)
    # the paged pool: the KV memory of S contiguous rows at the longest context, as pages
    kv_pages = a.slots * bucket(a.max_context, DEFAULT_CACHE_BUCKETS) // a.page_size
    paged_stage = RolloutStage(dataclasses.replace(cfg.rollout, kv_pages=kv_pages, page_size=a.page_size), policy,
                               cfg.rollout.max_context) if "paged" in modes else None
    envs = {n: job_matchmaker(job(n), policy)[2].train_env(0) for n in {a.episodes, a.slots}}
    on_layout: dict = {}  # the weights in the compute dtype on each rollout mesh, cast once

    def rollout(env, seeds: list[int], ids: np.ndarray, slots: int, stage=stage):
        def run_stage(run):
            if run.layout.mesh not in on_layout:
                on_layout.clear()  # one copy at a time on the device
                on_layout[run.layout.mesh] = policy.weights.for_stage(run, params)
            return stage(run, on_layout[run.layout.mesh], env, seeds, ids, rng, sampling,
                         turn_tokens=cfg.rollout.turn_tokens(0)).stats
        stage.slots = slots
        return policy.planner.run("rollout", run_stage)

    sampling = SamplingConfig(temperature=1.0)
    seeds, rng = list(range(1000, 1000 + a.episodes)), jax.random.key(0)

    def play(mode: str) -> list:
        if mode == "waves":
            return [rollout(envs[a.slots], seeds[i:i + a.slots], np.arange(i, i + a.slots), 0)
                    for i in range(0, a.episodes, a.slots)]
        if mode == "paged":
            return [rollout(envs[a.episodes], seeds, np.arange(a.episodes), paged_rows, paged_stage)]
        return [rollout(envs[a.episodes], seeds, np.arange(a.episodes), a.slots if mode == "pool" else 0)]

    runs: dict[str, list] = {m: [] for m in modes}
    for m in modes:  # one round that compiles
        print(f"{m}: a first round (compiles)", flush=True)
        play(m)
    for r in range(a.rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            runs[m].append(play(m))
    if "pool" in runs and runs["pool"][0][0].pool_occupancy is None:
        sys.exit(f"bench_pool: --slots {a.slots} rounded up to whole decode batches hold all {a.episodes} episodes: "
                 "no pool was played (use more --episodes)")
    rows = {}
    for m, rounds in runs.items():
        def total(f, rounds=rounds):
            return [sum(f(s) for s in parts) for parts in rounds]
        seconds, tokens = total(lambda s: s.rollout_s), total(lambda s: s.answer_tokens)
        busy, decode_rows = total(lambda s: s.busy_rows), total(lambda s: s.decode_rows)
        kv_used, kv_allocated = total(lambda s: s.kv_used), total(lambda s: s.kv_allocated)
        rows[m] = {"rollout_s": statistics.median(seconds), "rollout_s_each": [round(x, 4) for x in seconds],
                   "answer_tokens": tokens[0],
                   "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds)),
                   "occupancy": busy[0] / max(decode_rows[0], 1), "decode_rows": decode_rows[0],
                   "turns_mean": statistics.fmean(s.turns_mean for s in rounds[0]),
                   "pool_occupancy": rounds[0][0].pool_occupancy,  # None: no pool played
                   # cache positions holding a decoding episode's context over those allocated, summed over decodes:
                   # 1 - this is what per-row contiguous caches hold beyond a paged cache's need (the schedule's, so
                   # the same on any device and model)
                   "kv_used_frac": kv_used[0] / max(kv_allocated[0], 1),
                   "preempted": sum(s.preempted for s in rounds[0])}
        print(f"{m:>6}: {rows[m]['rollout_s']:.3f} s, {rows[m]['tokens_per_s']:.0f} answer tokens/s, occupancy "
              f"{rows[m]['occupancy']:.2f}" + (f", while episodes waited {rows[m]['pool_occupancy']:.2f}"
                                               if rows[m]["pool_occupancy"] is not None else "")
              + f", KV positions used {rows[m]['kv_used_frac']:.2f}", flush=True)
    if "waves" in rows and "pool" in rows:
        speedup = rows["pool"]["tokens_per_s"] / rows["waves"]["tokens_per_s"]
        print(f"pool / waves: {speedup:.2f}x answer tokens per second")
    if "paged" in rows and "pool" in rows:
        print(f"paged ({paged_rows} rows, {kv_pages} pages of {a.page_size}) / pool ({a.slots} rows): "
              f"{rows['paged']['tokens_per_s'] / rows['pool']['tokens_per_s']:.2f}x answer tokens per second, "
              f"{rows['paged']['preempted']} episodes preempted")
    device = jax.devices()[0].device_kind
    result = {"script": "experiments/benchmarks/bench_pool.py", "argv": sys.argv[1:], "device": device,
              "backend": jax.default_backend(), "jax": jax.__version__, "model": a.model, "episodes": a.episodes,
              "slots": a.slots, "paged_rows": paged_rows, "kv_pages": kv_pages, "page_size": a.page_size,
              "turn_tokens": a.turn_tokens, "load": {"turns": TURNS, "shares": SHARES},
              "rounds": a.rounds, "modes": rows}
    out = a.out or RESULTS / f"bench_pool_{a.model}_{device_slug(device)}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and its .png")


if __name__ == "__main__":
    main()
