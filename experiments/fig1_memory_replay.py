"""Figure 1 of EARL (arXiv 2510.05943), replayed through the memory model: as training goes on the
context grows; a static rollout layout runs out of memory (or must truncate), the selector's run goes on.

What is measured and what is modelled, plainly:
- the context-length trace per iteration comes from a real training run's metrics.jsonl
  (`rollout/context_len_mean` and `_max`), scaled so its largest value reaches --max-context
  (the tiny CPU run grows to ~10^2 tokens; the paper's runs to 8K-32K);
- memory per device is the project's memory model (earl_jax/parallel/memory.py) for --model on
  --devices devices of --device-gib each, with --responses responses: no accelerator runs here, so
  "out of memory" means the memory model's verdict, not a crash;
- each iteration, the static layouts (every rollout tensor degree) are checked at that iteration's max
  context, and the ParallelismSelector, fed the same statistics, picks its layout (with hysteresis).

    python experiments/fig1_memory_replay.py --metrics runs/connect4/metrics.jsonl

Writes experiments/results/fig1_memory_replay.{json,png}. The real-run figure is fig1_context_growth.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed

from earl_jax.models.model_config import get_config
from earl_jax.parallel.memory import MemoryConfig, MemoryModel, candidate_meshes
from earl_jax.parallel.plan import ContextStats
from earl_jax.parallel.selector import NoFeasibleLayoutError, ParallelismSelector
from earl_jax.parallel.selector_config import SelectorConfig
from earl_jax.rl.loop.metrics import read_metrics

GiB = 2**30


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", required=True, help="metrics.jsonl of a training run (the context trace)")
    p.add_argument("--model", default="qwen2.5-72b")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--device-gib", type=float, default=80.0, help="per-device memory (H100: 80)")
    p.add_argument("--responses", type=int, default=32)
    p.add_argument("--max-context", type=int, default=32768, help="the scaled trace's largest context")
    p.add_argument("--out", default="experiments/results/fig1_memory_replay")
    args = p.parse_args(argv)

    rows = [r for r in read_metrics(args.metrics) if r.get("step", 0) >= 1 and r.get("rollout/context_len_max")]
    if not rows:
        raise SystemExit(f"{args.metrics}: no iterations with rollout/context_len_max")
    scale = args.max_context / max(r["rollout/context_len_max"] for r in rows)
    cfg = get_config(args.model)
    mem = MemoryConfig(budget_bytes=int(args.device_gib * GiB))
    model = MemoryModel(cfg, mem)
    statics = candidate_meshes(cfg, args.devices, "rollout")
    selector = ParallelismSelector(cfg, args.devices, memory=model, config=SelectorConfig(stages=("rollout",)))

    trace = []
    for r in rows:
        mean, mx = r["rollout/context_len_mean"] * scale, int(r["rollout/context_len_max"] * scale)
        entry = {"step": r["step"], "context_mean": mean, "context_max": mx,
                 "static_fits": {str(m): model.fits(model.estimate("rollout", m, mx, args.responses)) for m in statics},
                 "static_gib": {str(m): model.estimate("rollout", m, mx, args.responses).total / GiB for m in statics}}
        try:
            plan = selector.plan(ContextStats(mean, mx, args.responses))
            entry["selector"] = str(plan.rollout.mesh)
        except NoFeasibleLayoutError:
            entry["selector"] = None
        trace.append(entry)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    first_oom = {s: next((e["step"] for e in trace if not e["static_fits"][s]), None) for s in map(str, statics)}
    result = {"what": "memory-model replay of a measured context trace (not an accelerator run)",
              "metrics": str(args.metrics), "scale": scale, "model": args.model, "devices": args.devices,
              "device_gib": args.device_gib, "responses": args.responses, "first_oom_step": first_oom,
              "selector_ran_out": [e["step"] for e in trace if e["selector"] is None], "trace": trace}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    steps = [e["step"] for e in trace]
    ax1.plot(steps, [e["context_max"] for e in trace], label="max context (scaled)")
    ax1.plot(steps, [e["context_mean"] for e in trace], label="mean context (scaled)")
    ax1.set(ylabel="tokens", title=f"{args.model}, {args.devices} x {args.device_gib:.0f} GiB, "
                                   f"{args.responses} responses (memory-model replay)")
    ax1.legend()
    for s in map(str, statics):
        ax2.plot(steps, [e["static_gib"][s] for e in trace], label=f"static {s}")
        if first_oom[s] is not None:
            ax2.axvline(first_oom[s], ls=":", color="gray")
    ax2.axhline(model.usable_bytes / GiB, color="red", ls="--", label="usable memory")
    chosen = [next((e["static_gib"][e["selector"]] for _ in [0]), None) if e["selector"] else None for e in trace]
    ax2.plot(steps, chosen, "k.", label="selector's choice")
    ax2.set(xlabel="iteration", ylabel="GiB per device (rollout)", yscale="log")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(json.dumps({"first_oom_step": first_oom, "selector_ran_out": result["selector_ran_out"]}))


if __name__ == "__main__":
    main()
