"""Figure 3 of EARL (arXiv 2510.05943): Speedup%(TP a -> TP b) of a stage's throughput over context length
(rows) x number of responses (columns), Eq. 1: (TGS(b) - TGS(a)) / TGS(a) x 100, with each cell marked by
the Parallelism Selector's choice and out-of-memory cells; plus, per cell, the selector's choice against
the best configuration measured for that cell (gap %, target <= 3%) and against the best static
configuration (one mesh for the whole grid).

    # plotting smoke test / qualitative picture from the analytic throughput model (no accelerator):
    python experiments/fig3_selector_heatmap.py --synthetic
    # from a saved profile table:
    python experiments/fig3_selector_heatmap.py --table experiments/results/profile_72b.json
    # measuring (needs default_measure wired to the real sampler):
    python experiments/fig3_selector_heatmap.py --model qwen2.5-72b --save-table profile.json

Writes experiments/results/<name>.json and <name>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from pathlib import Path

from earl_jax.models.config import get_config
from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel, candidate_meshes
from earl_jax.parallel.mesh import MeshShape
from earl_jax.parallel.profile import ProfileTable, SyntheticThroughput, run_profile
from earl_jax.parallel.selector import ContextStats, NoFeasibleLayoutError, ParallelismSelector, SelectorConfig

RESULTS = Path(__file__).resolve().parent / "results"


def default_measure(stage: str, mesh: MeshShape, context_len: int, num_responses: int) -> float:
    """Tokens per device per second of one `stage` step on `mesh` (see earl_jax/parallel/profile.py)."""
    raise NotImplementedError("wired by the sampler")


def _ints(s: str) -> list[int]:
    out = []
    for v in s.split(","):
        v = v.strip().lower()
        mult = 1024 if v.endswith("k") else 1
        out.append(int(float(v.rstrip("k")) * mult))
    return out


def _label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset name (default qwen2.5-72b)")
    p.add_argument("--stage", default="rollout", choices=("rollout", "experience", "train"))
    p.add_argument("--tp-a", type=int, default=4, help="baseline tensor degree (a in Speedup%%(a->b))")
    p.add_argument("--tp-b", type=int, default=8)
    p.add_argument("--contexts", type=_ints, default=_ints("1K,2K,4K,8K,16K,32K"))
    p.add_argument("--responses", type=_ints, default=_ints("8,16,32,64,128"))
    p.add_argument("--devices", type=int, default=None, help="device count (default: jax.device_count(); 8 synthetic)")
    p.add_argument("--device-kind", default=None, help="name in the title / table (default: the device's kind)")
    p.add_argument("--memory-gib", type=float, default=None, help="per-device budget (default: the device's; 80 synthetic)")
    p.add_argument("--safety", type=float, default=0.9)
    p.add_argument("--rollout-waves", action=argparse.BooleanOptionalAction, default=None,
                   help="rollout may decode a shard's responses in waves (default: on with --synthetic)")
    p.add_argument("--kv-replication", default="replicate", choices=("replicate", "group"))
    p.add_argument("--table", type=Path, default=None, help="use this profile table instead of measuring")
    p.add_argument("--save-table", type=Path, default=None, help="save the measured profile table here")
    p.add_argument("--synthetic", action="store_true", help="measure with the analytic throughput model")
    p.add_argument("--remeasure", action="store_true",
                   help="evaluate the selector's choices on a second, independent measurement")
    p.add_argument("--noise", type=float, default=0.0, help="synthetic: relative measurement noise (e.g. 0.02)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default=None, help="output file stem (default fig3_<model>_<stage>_tp<a>_tp<b>)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _noisy(measure, noise: float, seed: int):
    if noise <= 0:
        return measure
    rng = random.Random(seed)

    def m(stage, mesh, ctx, n):
        return measure(stage, mesh, ctx, n) * (1 + rng.uniform(-noise, noise))
    return m


def best_tgs(table: ProfileTable, stage: str, ctx: int, n: int, tensor: int | None = None) -> tuple[float | None, MeshShape | None]:
    best = (None, None)
    for m in table.meshes(stage):
        if tensor is not None and m.tensor != tensor:
            continue
        v = table.tgs(stage, m, ctx, n)
        if v is not None and (best[0] is None or v > best[0]):
            best = (v, m)
    return best


def compute_heatmap(table: ProfileTable, memory: MemoryModel, *, stage: str, tp_a: int, tp_b: int,
                    contexts: list[int], responses: list[int], eval_table: ProfileTable | None = None) -> dict:
    """Cells of the figure. `table` drives the selector; `eval_table` (default: the same) scores it."""
    ev = eval_table or table
    n_dev = table.device_count
    meshes = table.meshes(stage)
    # best static configuration: runs in the most cells, then the highest geometric-mean TGS there
    def static_score(m):
        vals = [ev.tgs(stage, m, c, n) for c in contexts for n in responses]
        ok = [v for v in vals if v is not None]
        return (len(ok), sum(math.log(v) for v in ok) / max(len(ok), 1))
    static = max(meshes, key=static_score) if meshes else None
    cells = []
    for ctx in contexts:
        for n in responses:
            a, ma = best_tgs(table, stage, ctx, n, tp_a)
            b, mb = best_tgs(table, stage, ctx, n, tp_b)
            cell = {"context_len": ctx, "num_responses": n, "tgs_a": a, "tgs_b": b,
                    "mesh_a": str(ma) if ma else None, "mesh_b": str(mb) if mb else None,
                    "oom_a": a is None, "oom_b": b is None,
                    "speedup_pct": (b - a) / a * 100 if a is not None and b is not None else None}
            sel = ParallelismSelector(memory.cfg, n_dev, memory=memory, table=table,
                                      config=SelectorConfig(bucket_edges=tuple(sorted(contexts)), margin=0.0,
                                                            smoothing="none", stages=(stage,)))
            try:
                choice = sel.plan(ContextStats(ctx, ctx, n))[stage]
                cell["selector_mesh"] = str(choice.mesh)
                cell["selector_tensor"] = choice.mesh.tensor
                cell["selector_micro_batch"] = choice.micro_batch
                chosen = ev.tgs(stage, choice.mesh, ctx, n)
            except NoFeasibleLayoutError:
                cell["selector_mesh"], cell["selector_tensor"], chosen = None, None, None
            oracle, om = best_tgs(ev, stage, ctx, n)
            st = ev.tgs(stage, static, ctx, n) if static is not None else None
            cell.update(selector_tgs=chosen, oracle_tgs=oracle, oracle_mesh=str(om) if om else None,
                        static_tgs=st,
                        gap_to_best_pct=(oracle - chosen) / oracle * 100 if chosen and oracle else None,
                        gain_vs_static_pct=(chosen - st) / st * 100 if chosen and st else None)
            cells.append(cell)
    gaps = [c["gap_to_best_pct"] for c in cells if c["gap_to_best_pct"] is not None]
    summary = {"static_mesh": str(static) if static else None,
               "max_gap_to_best_pct": max(gaps) if gaps else None,
               "mean_gap_to_best_pct": sum(gaps) / len(gaps) if gaps else None,
               "cells_within_3pct": sum(g <= 3.0 for g in gaps), "cells_scored": len(gaps),
               "cells_static_oom": sum(c["static_tgs"] is None for c in cells)}
    return {"stage": stage, "tp_a": tp_a, "tp_b": tp_b, "contexts": contexts, "responses": responses,
            "device_kind": table.device_kind, "device_count": n_dev, "model": table.model_name,
            "cells": cells, "summary": summary}


def plot_heatmap(result: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ctxs, ress = result["contexts"], result["responses"]
    rows = sorted(ctxs, reverse=True)  # longest context on top, as in the paper
    by = {(c["context_len"], c["num_responses"]): c for c in result["cells"]}
    sp = np.full((len(rows), len(ress)), np.nan)
    gap = np.full_like(sp, np.nan)
    for i, ctx in enumerate(rows):
        for j, n in enumerate(ress):
            c = by[(ctx, n)]
            if c["speedup_pct"] is not None:
                sp[i, j] = c["speedup_pct"]
            if c["gap_to_best_pct"] is not None:
                gap[i, j] = c["gap_to_best_pct"]
    a, b = result["tp_a"], result["tp_b"]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 2.4 * len(ress), 1.2 + 0.7 * len(rows)),
                             gridspec_kw={"width_ratios": [1.25, 1]})
    lim = max(1.0, float(np.nanmax(np.abs(sp)))) if np.isfinite(sp).any() else 1.0
    cmap = matplotlib.colormaps["RdBu"].with_extremes(bad="#bbbbbb")
    im = axes[0].imshow(np.ma.masked_invalid(sp), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto")
    fig.colorbar(im, ax=axes[0], label=f"Speedup% TP{a} -> TP{b}")
    for i, ctx in enumerate(rows):
        for j, n in enumerate(ress):
            c = by[(ctx, n)]
            if c["oom_a"] or c["oom_b"]:
                txt = " / ".join(f"TP{t} OOM" for t, o in ((a, c["oom_a"]), (b, c["oom_b"])) if o)
            else:
                txt = f"{c['speedup_pct']:+.1f}"
            sel = c.get("selector_tensor")
            txt += f"\nsel TP{sel}" if sel else "\nsel: none fits"
            axes[0].text(j, i, txt, ha="center", va="center", fontsize=8)
    im2 = axes[1].imshow(np.ma.masked_invalid(gap), cmap="Oranges", vmin=0, vmax=max(3.0, float(np.nanmax(gap)) if np.isfinite(gap).any() else 3.0),
                         aspect="auto")
    fig.colorbar(im2, ax=axes[1], label="selector gap to best %")
    for i, ctx in enumerate(rows):
        for j, n in enumerate(ress):
            c = by[(ctx, n)]
            g, vs = c["gap_to_best_pct"], c["gain_vs_static_pct"]
            txt = ("-" if g is None else f"gap {g:.1f}") + "\n" + (
                "static OOM" if c["static_tgs"] is None else "" if vs is None else f"vs static {vs:+.1f}")
            axes[1].text(j, i, txt, ha="center", va="center", fontsize=8)
    for ax, t in zip(axes, (f"{result['stage']}: Speedup% TP{a} -> TP{b}", f"selector: gap % to best per cell; gain % vs best static ({result['summary']['static_mesh']})")):
        ax.set_xticks(range(len(ress)), [str(n) for n in ress])
        ax.set_yticks(range(len(rows)), [_label(c) for c in rows])
        ax.set_xlabel("number of responses")
        ax.set_ylabel("context length")
        ax.set_title(t, fontsize=10)
    fig.suptitle(f"{result['model']} on {result['device_count']} x {result['device_kind']}", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = args.model or (args.table and json.loads(args.table.read_text())["model_name"]) or "qwen2.5-72b"
    cfg = get_config(model)
    synthetic = args.synthetic
    if synthetic:
        n_dev = args.devices or 8
        kind = args.device_kind or f"synthetic {args.memory_gib or 80:g} GiB (analytic model)"
        budget = int((args.memory_gib or 80) * GiB)
    else:
        import jax

        from earl_jax.parallel.memory import device_memory_budget
        n_dev = args.devices or jax.device_count()
        kind = args.device_kind or jax.devices()[0].device_kind
        budget = int(args.memory_gib * GiB) if args.memory_gib else device_memory_budget()
    waves = args.rollout_waves if args.rollout_waves is not None else synthetic
    memory = MemoryModel(cfg, MemoryConfig(budget_bytes=budget, safety_fraction=args.safety,
                                           rollout_waves=waves, kv_replication=args.kv_replication))
    for t in (args.tp_a, args.tp_b):
        if not any(m.tensor == t for m in candidate_meshes(cfg, n_dev, args.stage)):
            raise SystemExit(f"tensor degree {t} is not a valid {args.stage} mesh for {cfg.name} on {n_dev} devices")

    if args.table is not None:
        table = ProfileTable.load(args.table, device_count=n_dev, model_name=cfg.name,
                                  device_kind=None if args.device_kind is None and synthetic else kind)
    else:
        measure = _noisy(SyntheticThroughput(memory), args.noise, args.seed) if synthetic else default_measure
        table = run_profile(memory, measure, num_devices=n_dev, context_lens=args.contexts,
                            response_counts=args.responses, stages=(args.stage,), device_kind=kind,
                            progress=not args.no_progress)
        table.meta.update(synthetic=synthetic, budget_bytes=budget)
        if args.save_table:
            table.save(args.save_table)
    eval_table = None
    if args.remeasure:
        measure = _noisy(SyntheticThroughput(memory), args.noise, args.seed + 1) if synthetic else default_measure
        eval_table = run_profile(memory, measure, num_devices=n_dev, context_lens=args.contexts,
                                 response_counts=args.responses, stages=(args.stage,), device_kind=table.device_kind,
                                 progress=not args.no_progress)
    result = compute_heatmap(table, memory, stage=args.stage, tp_a=args.tp_a, tp_b=args.tp_b,
                             contexts=args.contexts, responses=args.responses, eval_table=eval_table)
    result.update(synthetic=synthetic, remeasured=args.remeasure, noise=args.noise,
                  memory=dataclasses.asdict(memory.mem) | {"budget_bytes": budget})
    stem = args.name or f"fig3_{cfg.name}_{args.stage}_tp{args.tp_a}_tp{args.tp_b}" + ("_synthetic" if synthetic else "")
    args.out.mkdir(parents=True, exist_ok=True)
    jpath, ppath = args.out / f"{stem}.json", args.out / f"{stem}.png"
    result["paths"] = {"json": str(jpath), "png": str(ppath)}
    if args.table is None:  # keep what was measured next to the figure, reusable with --table
        result["paths"]["profile_table"] = str(table.save(args.out / f"{stem}_profile.json"))
    jpath.write_text(json.dumps(result, indent=1))
    plot_heatmap(result, ppath)
    s = result["summary"]
    print(f"wrote {jpath} and {ppath}; static best {s['static_mesh']}, selector within 3% of best in "
          f"{s['cells_within_3pct']}/{s['cells_scored']} cells (max gap {s['max_gap_to_best_pct']})")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
