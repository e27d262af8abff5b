"""Drafts from history (`--rollout.drafts K`): acceptance and decode time of a rollout with and without them.

A policy that repeats itself: the tiny model (or `--model`'s shape) after a shipped task preset's SFT stage on the
task's expert episodes (`experiments/train.py --preset P`: `tiny-cpu`, guess-the-number by binary search, answers of
2-3 tokens; `arithmetic`, a calculator call `[calc 417*83]` then the product, answers of 6-14 tokens), `--sft-steps`
steps. Its rollout of iteration 0 fills the draft index (as a job's previous iteration does); then the same trained
policy plays a rollout with and without drafts, `--rounds` times each, alternating, after one of each that compiles:

- `next`: later iterations' problems (other seeds; round r plays iteration r + 1's), drafts from iteration 0's answers:
  what a job sees;
- `repeat`: iteration 0's problems again with other keys (an epoch over a fixed set of prompts, RhymeRL's setting).

Within a round both modes play the same problems with the same key; the rounds' samples differ, so the success rates
(the same distribution with and without drafts) are means over `--rounds` x the episodes.

Reported per case and mode: the rollout's median wall time, the median time its host waited for the decode programs
(`rollout/wait_frac`'s numerator), answer tokens per second, the mean success rate and answer
tokens, draft tokens proposed and accepted. Timings are a ratio within one run on one
device; on a shared CPU they are only that.

    python experiments/benchmarks/bench_drafts.py                          # guess-the-number, 64 episodes, K = 4
    python experiments/benchmarks/bench_drafts.py --preset arithmetic --drafts 16 --sft-steps 300
    python experiments/benchmarks/bench_drafts.py --preset arithmetic --drafts 16 --model qwen2.5-1.5b   # a GPU

Writes experiments/results/bench_drafts_<preset>_k<K>_n<context>_<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a clone: no install needed
CONFIGS = ROOT / "experiments" / "configs" / "train"
RESULTS = ROOT / "experiments" / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-cpu", choices=["tiny-cpu", "arithmetic"])
    p.add_argument("--model", default="", help="a model shape (--model.name), e.g. qwen2.5-1.5b; default the preset's")
    p.add_argument("--sft-steps", type=int, default=200, help="SFT steps on the task's expert episodes")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--drafts", type=int, default=4, help="K, the draft tokens a decode step verifies")
    p.add_argument("--context", type=int, default=8, help="the index's key: the context's last N tokens")
    p.add_argument("--rounds", type=int, default=5, help="measured rollouts per case and mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flags", default="", help="more job flags, e.g. \"--sft.learning-rate 3e-4\"")
    p.add_argument("--out", type=Path)
    a = p.parse_args()

    import jax

    from earl_jax.parallel.profile import device_slug
    from earl_jax.rl.job.entry import parse_job
    from earl_jax.rl.loop.trainer import Trainer
    from earl_jax.rl.matchups.game_seeds import rollout_inputs
    from earl_jax.rollout.drafts import DraftIndex

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = parse_job(["--preset", a.preset, "--run.run-dir", run_dir, "--sft.steps", str(a.sft_steps),
                         "--rollout.groups", str(a.groups), "--rollout.group-size", str(a.group_size),
                         "--rollout.drafts", str(a.drafts),
                         "--run.seed", str(a.seed), "--eval.every", "0", "--run.checkpoint-every", "0",
                         "--run.progress", "false", "--run.wandb-mode", "disabled"]
                        + (["--model.name", a.model] if a.model else []) + shlex.split(a.flags), CONFIGS).config
        trainer = Trainer(cfg, log=False)
        sft = trainer.format_warmup()
        stage = trainer.rollout
        print(f"SFT: {a.sft_steps} steps, {sft}", flush=True)

        def play(step: int, drafts, key: int = 0):
            stage.drafts = drafts
            seeds, group_ids, rng = rollout_inputs(cfg.rollout, cfg.run.seed, step, cfg.env.agent_player is None)
            rng = jax.random.fold_in(rng, key) if key else rng
            traj, _ = trainer.play(trainer.matchmaker.train_env(step), seeds, group_ids, rng, trainer.sampling)
            return traj.stats

        index = DraftIndex(max(cfg.rollout.max_turn_tokens, a.drafts), n=a.context)  # whole answers, as a job's
        play(0, index)  # iteration 0's answers fill the index
        previous = copy.deepcopy(index)
        cases = {"next": lambda r: (r + 1, 0), "repeat": lambda r: (0, r + 1)}  # round -> (iteration, key)
        for at in cases.values():  # one of each compiles
            step, key = at(a.rounds)
            play(step, None, key)
            play(step, copy.deepcopy(previous), key)
        runs: dict[str, dict[str, list]] = {c: {"plain": [], "drafts": []} for c in cases}
        for r in range(a.rounds):
            for case, at in cases.items():
                step, key = at(r)
                for mode in (("plain", "drafts") if r % 2 == 0 else ("drafts", "plain")):
                    s = play(step, None if mode == "plain" else copy.deepcopy(previous), key)
                    runs[case][mode].append(s)
    rows = []
    for case, modes in runs.items():
        row = {"case": case}
        for mode, stats in modes.items():
            med = lambda f: statistics.median(f(s) for s in stats)  # noqa: E731
            mean = lambda f: statistics.fmean(f(s) for s in stats)  # noqa: E731
            row[mode] = {"rollout_s": med(lambda s: s.rollout_s), "wait_s": med(lambda s: s.wait_s),
                         "rollout_s_each": [round(s.rollout_s, 4) for s in stats],
                         "wait_s_each": [round(s.wait_s, 4) for s in stats],
                         "answer_tokens_per_s": med(lambda s: s.answer_tokens / s.rollout_s),
                         "answer_tokens": mean(lambda s: s.answer_tokens), "success_rate": mean(lambda s: s.win_rate),
                         "turns_mean": mean(lambda s: s.turns_mean)}
            if mode == "drafts":
                proposed, accepted = sum(s.draft_proposed for s in stats), sum(s.draft_accepted for s in stats)
                row[mode] |= {"draft_proposed": proposed / len(stats), "draft_accepted": accepted / len(stats),
                              "draft_acceptance": accepted / max(proposed, 1)}
        row["rollout_speedup"] = row["plain"]["rollout_s"] / row["drafts"]["rollout_s"]
        row["decode_speedup"] = row["plain"]["wait_s"] / row["drafts"]["wait_s"]
        rows.append(row)
        print(f"{case}: acceptance {row['drafts']['draft_acceptance']:.3f} "
              f"({row['drafts']['draft_accepted']:.0f} of {row['drafts']['draft_proposed']:.0f} draft tokens), "
              f"rollout {row['plain']['rollout_s']:.3f} -> {row['drafts']['rollout_s']:.3f} s "
              f"(x{row['rollout_speedup']:.2f}), decode wait {row['plain']['wait_s']:.3f} -> "
              f"{row['drafts']['wait_s']:.3f} s (x{row['decode_speedup']:.2f}), success "
              f"{row['plain']['success_rate']:.3f} / {row['drafts']['success_rate']:.3f}", flush=True)
    device = jax.devices()[0].device_kind
    result = {"script": "experiments/benchmarks/bench_drafts.py", "argv": sys.argv[1:], "preset": a.preset,
              "model": cfg.model.name, "device": device,
              "backend": jax.default_backend(), "jax": jax.__version__, "task": cfg.env.task,
              "task_args": cfg.env.task_args, "episodes": a.groups * a.group_size, "drafts": a.drafts,
              "context": a.context,
              "answer_budget": cfg.rollout.max_turn_tokens, "sft_steps": a.sft_steps, "rounds": a.rounds,
              "sft": {k: float(v) for k, v in sft.items()}, "rows": rows}
    shape = f"_{a.model}" if a.model else ""
    out = a.out or RESULTS / f"bench_drafts_{a.preset}{shape}_k{a.drafts}_n{a.context}_{device_slug(device)}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
