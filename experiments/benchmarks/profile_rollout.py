"""Where a rollout's time goes: the host's Python profile, and each sampler call timed to completion.

Builds the main job's trainer (connect4.py's default plus the flags given), runs a few iterations so every
program is compiled, then rolls out one more batch twice:
  1. under cProfile, as it runs (the host's view: env work, launches that block, waits for answers);
  2. with every Sampler call (extend, generate, take_rows, grow) made synchronous and timed, so the device
     time of each kind of call, and its count per rollout, are known.

    python experiments/benchmarks/profile_rollout.py -- --rollout.groups 256 --rollout.group-size 8 \
        --env.prompt-style compact --rollout.constrain-moves false

Writes experiments/results/profile_rollout_<device>.json (and prints the tables).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a clone: no install needed


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warm-iterations", type=int, default=4)
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results")
    p.add_argument("flags", nargs="*", help="connect4.py flags (after --)")
    args = p.parse_args(argv)

    import jax

    from earl_jax.compile_cache import enable_compile_cache
    from earl_jax.parallel.profile import device_slug
    from earl_jax.rl.job.entry import parse_job
    from earl_jax.rl.loop.trainer import Trainer
    from earl_jax.rollout.sampler import Sampler

    flags = ["--sft.steps", "0", "--eval.every", "0", "--run.checkpoint-every", "0", "--run.wandb-mode", "disabled",
             "--run.progress", "false", "--run-dir", tempfile.mkdtemp(), *args.flags]
    cfg = parse_job(flags, ROOT / "experiments" / "configs" / "connect4").config
    enable_compile_cache(cfg.run.compile_cache or None)
    trainer = Trainer(cfg, log=False)
    for i in range(args.warm_iterations):
        r = trainer.iteration()
        print(f"warm iteration {i + 1}: rollout {r['time/rollout_s']:.3f} s, programs {r['compile/programs']}",
              flush=True)

    def rollout():
        seeds, group_ids, rng = trainer.rollout_inputs()
        t0 = time.perf_counter()
        traj, _ = trainer.play(trainer.env, seeds, group_ids, rng, trainer.sampling)
        return traj, time.perf_counter() - t0

    rollout()  # one more unprofiled, as a check that nothing compiles below
    prof = cProfile.Profile()
    prof.enable()
    traj, wall = rollout()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(25)
    top = [{"function": f"{Path(f).name}:{line}({name})", "calls": nc, "tottime_s": tt, "cumtime_s": ct}
           for (f, line, name), (cc, nc, tt, ct, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]]
    print(buf.getvalue())
    s = traj.stats
    host = {"rollout_s": wall, "env_s": s.env_s, "wait_s": s.wait_s, "turns_mean": s.turns_mean,
            "decode_rows": s.decode_rows, "generated_tokens": s.generated_tokens}
    print("profiled rollout:", host)

    # Every sampler call synchronous and timed: device time per kind of call.
    timed = collections.defaultdict(lambda: [0, 0.0])
    originals = {}
    for name in ("extend", "generate", "take_rows", "ensure_capacity", "init_state"):
        originals[name] = getattr(Sampler, name)

        def wrapped(self, *a, _name=name, **kw):
            t0 = time.perf_counter()
            out = jax.block_until_ready(originals[_name](self, *a, **kw))
            timed[_name][0] += 1
            timed[_name][1] += time.perf_counter() - t0
            return out
        setattr(Sampler, name, wrapped)
    traj, wall_sync = rollout()
    for name, fn in originals.items():
        setattr(Sampler, name, fn)
    calls = {k: {"calls": n, "seconds": t, "ms_per_call": 1e3 * t / max(n, 1)} for k, (n, t) in timed.items()}
    for k, v in calls.items():
        print(f"{k:16s} {v['calls']:4d} calls {v['seconds']:.3f} s  {v['ms_per_call']:.2f} ms/call")
    print(f"synchronous rollout: {wall_sync:.3f} s (env {traj.stats.env_s:.3f} s)")

    kind = jax.devices()[0].device_kind
    result = {"what": "one rollout after warm-up: cProfile of the host, then every Sampler call timed to completion",
              "device": kind, "devices": jax.device_count(), "flags": args.flags, "host": host,
              "top_tottime": top, "sampler_calls": calls, "synchronous_rollout_s": wall_sync}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile_rollout_{device_slug(kind)}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
