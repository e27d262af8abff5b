"""Profile mode of the Parallelism Selector on this machine: measure TGS (tokens per device per second) of each
stage on every candidate mesh x context length x response count with the real code (the Sampler for rollout,
the experience and train stages; `earl_jax.rl.job.measure.RealMeasure`), and save the ProfileTable JSON that
the trainer loads with `--planner.table` (PlannerConfig.table). Cells the memory model rejects are
recorded "infeasible", out-of-memory cells "oom". The table is saved after every context row, so a run cut
short by `--time-budget` (or a timeout) still leaves a usable table.

    # CPU, 8 fake devices, tiny model (~2-3 min):
    python experiments/benchmarks/profile_selector.py --small
    # 1-2 GPUs, Qwen2.5-0.5B, rollout only (~6-8 min, one device call):
    python experiments/benchmarks/profile_selector.py --gpu --out experiments/results/profile_qwen2.5-0.5b.json
    # then: python experiments/connect4.py ... --planner.table experiments/results/profile_qwen2.5-0.5b.json

The table names the device kind, the device count and the model: the selector refuses one measured for
another machine or model.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
if "--small" in sys.argv:  # 8 fake CPU devices: the flags must precede jax's start-up
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()

from earl_jax.models.model_config import get_config  # noqa: E402
from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel  # noqa: E402
from earl_jax.parallel.profile import ProfileTable  # noqa: E402
from earl_jax.rl.job.measure import RealMeasure, profile_rows  # noqa: E402

RESULTS = ROOT / "experiments" / "results"


def _ints(s: str) -> list[int]:
    """'1K,8,32' -> [1024, 8, 32]."""
    return [int(float(v.strip().lower().rstrip("k")) * (1024 if v.strip().lower().endswith("k") else 1))
            for v in s.split(",")]


def main(argv=None) -> ProfileTable:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset (default qwen2.5-0.5b; tiny with --small)")
    p.add_argument("--stages", default="rollout,experience", help="comma list of rollout, experience, train")
    p.add_argument("--contexts", type=_ints, default=None)
    p.add_argument("--responses", type=_ints, default=None)
    p.add_argument("--tensors", type=lambda s: tuple(int(v) for v in s.split(",")), default=None,
                   help="only meshes with these tensor degrees (default: every candidate)")
    p.add_argument("--devices", type=int, default=None, help="profile the first N devices (default: all)")
    p.add_argument("--memory-gib", type=float, default=None)
    p.add_argument("--safety", type=float, default=0.9)
    p.add_argument("--decode-steps", type=int, default=None)
    p.add_argument("--measure-repeats", type=int, default=2)
    p.add_argument("--time-budget", type=float, default=None, help="start no new context row after this many s")
    p.add_argument("--small", action="store_true", help="CPU: tiny model, 8 fake devices, contexts 64..256")
    p.add_argument("--gpu", action="store_true", help="Qwen2.5-0.5B, contexts 1K,32K,8K (that order), "
                   "responses 8,32,128, rollout, 420 s budget")
    p.add_argument("--out", type=Path, default=None,
                   help="table path (default experiments/results/profile_<model>_<dev>.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.small:
        args.model = args.model or "tiny"
        args.contexts = args.contexts or [64, 128, 256]
        args.responses = args.responses or [8, 16, 32]
        args.decode_steps = args.decode_steps or 8
    if args.gpu:
        args.model = args.model or "qwen2.5-0.5b"
        args.contexts = args.contexts or _ints("1K,32K,8K")
        args.responses = args.responses or [8, 32, 128]
        args.stages = "rollout" if "--stages" not in (argv if argv is not None else sys.argv) else args.stages
        args.time_budget = 420.0 if args.time_budget is None else args.time_budget
    args.model = args.model or "qwen2.5-0.5b"
    args.contexts = args.contexts or _ints("1K,2K,4K,8K,16K,32K")
    args.responses = args.responses or [8, 16, 32, 64, 128]
    args.decode_steps = args.decode_steps or 16

    import jax

    from earl_jax.parallel.memory import device_memory_budget

    cfg = get_config(args.model)
    n_dev = args.devices or jax.device_count()
    kind = jax.devices()[0].device_kind
    budget = int(args.memory_gib * GiB) if args.memory_gib else device_memory_budget()
    memory = MemoryModel(cfg, MemoryConfig(budget_bytes=budget, safety_fraction=args.safety))
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    slug = "".join(c if c.isalnum() or c in ".-" else "_" for c in f"{kind}x{n_dev}".lower())
    out = args.out or RESULTS / f"profile_{cfg.name}_{slug}.json"
    measure = RealMeasure(cfg, decode_steps=args.decode_steps, repeats=args.measure_repeats, seed=args.seed)
    table = profile_rows(memory, measure, contexts=args.contexts, responses=args.responses, stages=stages,
                         num_devices=n_dev, device_kind=kind, tensors=args.tensors, save=out,
                         time_budget=args.time_budget, progress=not args.no_progress)
    table.meta.update(budget_bytes=budget, stages=list(stages), responses=list(args.responses))
    table.save(out)
    ok = sum(e.status == "ok" for e in table.entries.values())
    print(f"wrote {out}: {len(table)} entries ({ok} measured) for {cfg.name} on {n_dev} x {kind}; "
          f"contexts cut by the time budget: {table.meta.get('contexts_cut')}")
    for (stage, mesh, ctx, n), e in sorted(table.entries.items(),
                                           key=lambda kv: (kv[0][0], kv[0][2], kv[0][3], str(kv[0][1]))):
        print(f"  {stage:10s} ctx {ctx:6d} n {n:4d} {str(mesh):10s} {e.status:10s} "
              + ("" if e.tgs is None else f"{e.tgs:12,.0f} tok/s/dev"))
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
