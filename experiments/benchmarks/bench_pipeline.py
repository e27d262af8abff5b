"""Host work overlapping decode: a task rollout with --rollout.pipeline-groups 1, 2, 4 and --env.step-workers 1, N.

The job's own rollout stage (Trainer.play) on the calculator task, every answer read as a tool call (random weights
rarely write one), the tiny model with a float32 cache (so the games can be compared): each setting
plays the same seeds `--rounds` times after a warm-up rollout (its compiles), the median rollout seconds and the
host's share (rollout/env_frac) are reported, and each setting's games are checked equal to the first's.
`--tool-ms` adds that many milliseconds of host time to every tool call (a slow tool: a search, a sandbox).

    python experiments/benchmarks/bench_pipeline.py --games 512 --tool-ms 0 1 --workers 1 16 \
        --out experiments/results/X.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import numpy as np


def make_slow_arithmetic(tool_ms: float = 0.0, **kw):
    """The shipped calculator task whose tool also sleeps `tool_ms` (the job imports this module by name: an
    argument, not a global of __main__)."""
    from earl_jax.tasks.arithmetic import Arithmetic, calculator
    from earl_jax.tasks.tools import CALL_PARSERS, Tool, ToolCall, ToolUse, register_call_parser

    if "bench_every_answer" not in CALL_PARSERS:  # random weights rarely write a call: here every answer is one
        register_call_parser("bench_every_answer")(lambda answer: ToolCall("calc", answer))

    def slow(args: str) -> str:
        time.sleep(tool_ms / 1000)
        return calculator(args)

    return ToolUse(Arithmetic(**kw), [Tool("calc", slow, "integer + - * / // % ( )")], parser="bench_every_answer",
                   max_calls=3)


def rollout(k: int, games: int, rounds: int, run_dir: Path, workers: int = 1, tool_ms: float = 0.0):
    from earl_jax.rl.loop.trainer import Trainer
    from jobs import job

    cfg = job(env__task="bench_pipeline:make_slow_arithmetic",
              env__task_args=json.dumps({"digits": 3, "tool_ms": tool_ms}), sft__steps=0,
              rollout__groups=games // 8, rollout__group_size=8, rollout__max_turn_tokens=16, rollout__max_turns=4,
              rollout__max_context=256, rollout__pipeline_groups=k, env__step_workers=workers,
              rollout__cache_dtype="float32", run__run_dir=str(run_dir), run__steps=1,
              eval__games=8, run__checkpoint_every=0, run__progress=False, run__wandb_mode="disabled")
    trainer = Trainer(cfg, log=False)
    seeds, group_ids, rng = trainer.rollout_inputs()
    times, host, traj = [], [], None
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        traj, _ = trainer.play(trainer.matchmaker.train_env(0), seeds, group_ids, rng, trainer.sampling)
        if r:  # round 0 compiles
            times.append(time.perf_counter() - t0)
            host.append(traj.stats.env_s / max(traj.stats.rollout_s, 1e-9))
    assert trainer.rollout.pipeline_groups == k, trainer.rollout.pipeline_groups
    return statistics.median(times), statistics.median(host), traj


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--games", type=int, default=128)
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4], help="--rollout.pipeline-groups settings")
    p.add_argument("--workers", type=int, nargs="+", default=[1], help="--env.step-workers settings")
    p.add_argument("--tool-ms", type=float, nargs="+", default=[0.0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # tests/jobs.py: JobConfigs by field
    import tempfile

    rows = []
    for ms in a.tool_ms:
        first = None
        for k, w in [(k, w) for w in a.workers for k in a.groups]:
            with tempfile.TemporaryDirectory() as d:
                secs, host, traj = rollout(k, a.games, a.rounds, Path(d), w, ms)
            if first is None:
                first = traj
            same = bool(np.array_equal(first.tokens, traj.tokens) and np.array_equal(first.loss_mask, traj.loss_mask))
            rows.append({"tool_ms": ms, "pipeline_groups": k, "step_workers": w, "rollout_s": secs, "host_frac": host,
                         "same_games": same})
            print(f"tool {ms:4.1f} ms, pipeline groups {k}, step workers {w}: rollout {secs:.3f} s, host {host:.2f}, "
                  f"same games {same}", flush=True)
        one = next(r["rollout_s"] for r in rows if r["tool_ms"] == ms)  # the first setting of this tool time
        for r in rows:
            if r["tool_ms"] == ms:
                r["speedup_vs_first"] = one / r["rollout_s"]
    result = {"script": "experiments/benchmarks/bench_pipeline.py", "device": str(jax.devices()[0].device_kind),
              "backend": jax.default_backend(), "games": a.games, "rounds": a.rounds, "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
