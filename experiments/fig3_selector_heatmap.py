"""Figure 3 of EARL (arXiv 2510.05943): Speedup%(TP a -> TP b) of a stage's throughput over context length
(rows) x number of responses (columns), Eq. 1: (TGS(b) - TGS(a)) / TGS(a) x 100, with each cell marked by
the Parallelism Selector's choice and out-of-memory cells; plus, per cell, the selector's choice against
the best configuration measured for that cell (gap %, target <= 3%) and against the best static
configuration (one mesh for the whole grid).

    # plotting smoke test / qualitative picture from the analytic throughput model (no accelerator):
    python experiments/fig3_selector_heatmap.py --synthetic
    # from a saved profile table:
    python experiments/fig3_selector_heatmap.py --table experiments/results/profile_72b.json
    # measuring on this machine's devices (earl_jax.rl.job.measure.RealMeasure):
    python experiments/fig3_selector_heatmap.py --gpu --remeasure
    # split over device calls: first measurement, then the rest + the second (scoring) measurement, each
    # table saved after every context row; a call cut short is drawn afterwards from its tables, on the CPU:
    python experiments/fig3_selector_heatmap.py --gpu --save-table t1.json
    python experiments/fig3_selector_heatmap.py --gpu --continue-table t1.json --save-table t1.json \
        --remeasure --save-remeasure-table t2.json
    python experiments/fig3_selector_heatmap.py --table t1.json --eval-table t2.json [--eval-table ...] --devices 2 \
        --device-kind "NVIDIA H100 80GB HBM3"

Writes experiments/results/<name>.json and <name>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

# CPU runs (--small, or JAX_PLATFORMS=cpu) measure on 8 fake devices: the flag must precede jax's start-up.
if "--small" in sys.argv or os.environ.get("JAX_PLATFORMS", "") == "cpu":
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
    if "--small" in sys.argv:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from earl_jax.models.model_config import get_config
from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel, candidate_meshes
from earl_jax.parallel.plan import ContextStats
from earl_jax.parallel.profile import HUNG, ProfileTable, SyntheticThroughput, device_slug, run_profile
from earl_jax.parallel.selector import NoFeasibleLayoutError, ParallelismSelector
from earl_jax.parallel.selector_config import SelectorConfig
from earl_jax.rl.job.measure import RealMeasure, profile_rows
from earl_jax.sharding.mesh import MeshShape

RESULTS = Path(__file__).resolve().parent / "results"


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
    p.add_argument("--tp-c", type=int, default=None, help="a third tensor degree: also Speedup%% TP b -> c")
    p.add_argument("--contexts", type=_ints, default=_ints("1K,2K,4K,8K,16K,32K"))
    p.add_argument("--responses", type=_ints, default=_ints("8,16,32,64,128"))
    p.add_argument("--devices", type=int, default=None, help="device count (default: jax.device_count(); 8 synthetic)")
    p.add_argument("--device-kind", default=None, help="name in the title / table (default: the device's kind)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="per-device budget (default: the device's; 80 synthetic)")
    p.add_argument("--safety", type=float, default=0.9)
    p.add_argument("--table", type=Path, default=None, help="use this profile table instead of measuring")
    p.add_argument("--save-table", type=Path, default=None, help="save the measured profile table here")
    p.add_argument("--synthetic", action="store_true", help="measure with the analytic throughput model")
    p.add_argument("--remeasure", action="store_true",
                   help="evaluate the selector's choices on a second, independent measurement")
    p.add_argument("--save-remeasure-table", type=Path, default=None,
                   help="real measure: save the --remeasure pass's table here (after each context row)")
    p.add_argument("--eval-table", type=Path, action="append", default=None,
                   help="score the selector on this saved second measurement (instead of --remeasure); "
                        "repeat it for a second measurement saved over several calls (rows merged)")
    p.add_argument("--noise", type=float, default=0.0, help="synthetic: relative measurement noise (e.g. 0.02)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default=None, help="output file stem (default fig3_<model>_<stage>_tp<a>_tp<b>)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--small", action="store_true",
                   help="CPU: tiny model on 8 fake devices, TP1 vs TP2, contexts 64..256, responses 8..32")
    p.add_argument("--gpu", action="store_true",
                   help="1-2 GPUs: Qwen2.5-0.5B, TP1 vs TP2, contexts 1K,32K,8K,4K,16K,2K (that order, as the "
                        "270 s budget allows) x responses 8,32,128, 16 decode steps; --remeasure gets 150 s")
    p.add_argument("--gpu4", action="store_true",
                   help="4 GPUs: Qwen2.5-7B, TP1 / TP2 / TP4 (d4t1, d2t2, d1t4), contexts 1K,32K,8K (that order, as "
                        "the 330 s budget allows) x responses 8,128; --remeasure gets 150 s")
    p.add_argument("--decode-steps", type=int, default=None, help="real rollout measure: new tokens per cell")
    p.add_argument("--measure-repeats", type=int, default=2)
    p.add_argument("--continue-table", type=Path, default=None,
                   help="real measure: a profile table an earlier call saved; only its missing cells are measured "
                        "(a cell its watchdog ended is recorded 'hung'; one cut from outside is measured again); the "
                        "--remeasure pass goes on from --save-remeasure-table likewise when that file exists")
    p.add_argument("--retry-hung", action="store_true",
                   help="with --continue-table: measure the cells it records 'hung' again (after a fix, or under "
                        "other allocator settings)")
    p.add_argument("--cell-timeout", type=float, default=None,
                   help="real measure: end the process (exit code 75, tables saved) when one cell takes longer than "
                        "this many seconds; run it again with --continue-table to record the cell 'hung' and go on")
    p.add_argument("--remeasure-budget", type=float, default=None,
                   help="real measure: like --time-budget, for the --remeasure pass")
    p.add_argument("--time-budget", type=float, default=None,
                   help="real measure: start no new context row after this many seconds (rows left out of the figure)")
    args = p.parse_args(argv)
    if args.small:
        args.model = args.model or "tiny"
        args.tp_a, args.tp_b = 1, 2
        if "--contexts" not in (argv or sys.argv):
            args.contexts = [64, 128, 256]
        if "--responses" not in (argv or sys.argv):
            args.responses = [8, 16, 32]
        args.decode_steps = args.decode_steps or 8
    elif args.gpu:
        args.model = args.model or "qwen2.5-0.5b"
        args.tp_a, args.tp_b = 1, 2
        if "--contexts" not in (argv or sys.argv):
            args.contexts = _ints("1K,32K,8K,4K,16K,2K")
        if "--responses" not in (argv or sys.argv):
            args.responses = [8, 32, 128]
        args.time_budget = args.time_budget if args.time_budget is not None else 270.0
        args.remeasure_budget = args.remeasure_budget if args.remeasure_budget is not None else 150.0
    elif args.gpu4:
        args.model = args.model or "qwen2.5-7b"
        args.tp_a, args.tp_b, args.tp_c = 1, 2, 4
        if "--contexts" not in (argv or sys.argv):
            args.contexts = _ints("1K,32K,8K")
        if "--responses" not in (argv or sys.argv):
            args.responses = [8, 128]
        args.time_budget = args.time_budget if args.time_budget is not None else 330.0
        args.remeasure_budget = args.remeasure_budget if args.remeasure_budget is not None else 150.0
    args.decode_steps = args.decode_steps or 16
    args.tps = tuple(t for t in (args.tp_a, args.tp_b, args.tp_c) if t is not None)
    return args


class _Logged:
    """A measure that prints one line per measured cell: TGS, or the error, and its seconds (compiles in)."""

    def __init__(self, measure, label: str):
        self.measure, self.label, self.t0 = measure, label, time.perf_counter()

    def __getattr__(self, name):  # decode_steps, ... (profile_rows reads them)
        return getattr(self.measure, name)

    def __call__(self, stage, mesh, ctx, n, **kw):
        t, res = time.perf_counter(), "interrupted"
        try:
            v = self.measure(stage, mesh, ctx, n, **kw)
            res = f"{float(v):,.1f} tok/s/dev"
            return v
        except Exception as e:  # noqa: BLE001 - reported, then re-raised (run_profile records an OOM)
            res = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            raise
        finally:
            now = time.perf_counter()
            print(f"[{self.label} {now - self.t0:6.1f} s] {stage} {mesh} ctx {ctx} n {n}: {res} "
                  f"({now - t:.1f} s)", flush=True)


def measure_table(memory: MemoryModel, args, n_dev: int, kind: str, stages: tuple[str, ...],
                  tensors: tuple[int, ...] | None = None, table: ProfileTable | None = None,
                  save: Path | None = None, time_budget: float | None = None, label: str = "measure") -> ProfileTable:
    """Profile with the library's `RealMeasure`, one context row at a time (`profile_rows`)."""
    measure = RealMeasure(memory.cfg, decode_steps=args.decode_steps, repeats=args.measure_repeats, seed=args.seed)
    if args.no_progress:
        measure = _Logged(measure, label)
    return profile_rows(memory, measure, contexts=args.contexts, responses=args.responses, stages=stages,
                        num_devices=n_dev, device_kind=kind, tensors=tensors, table=table, save=save,
                        time_budget=time_budget, progress=not args.no_progress, cell_timeout_s=args.cell_timeout)


def _compile_cache() -> None:
    """Persistent compilation cache: the --remeasure pass (and reruns) reuse the first pass's programs.
    A cache the caller already configured (e.g. the test suite's) wins; $EARL_JAX_CACHE still names one."""
    from earl_jax.compile_cache import enable_compile_cache

    enable_compile_cache(os.environ.get("EARL_JAX_CACHE") or None)


def _noisy(measure, noise: float, seed: int):
    if noise <= 0:
        return measure
    rng = random.Random(seed)

    def m(stage, mesh, ctx, n):
        return measure(stage, mesh, ctx, n) * (1 + rng.uniform(-noise, noise))
    return m


def best_tgs(table: ProfileTable, stage: str, ctx: int, n: int,
             tensor: int | None = None) -> tuple[float | None, MeshShape | None]:
    best = (None, None)
    for m in table.meshes(stage):
        if tensor is not None and m.tensor != tensor:
            continue
        v = table.tgs(stage, m, ctx, n)
        if v is not None and (best[0] is None or v > best[0]):
            best = (v, m)
    return best


def _status(table: ProfileTable, stage: str, ctx: int, n: int, tensor: int) -> str:
    found = [e.status for m in table.meshes(stage) if m.tensor == tensor
             for e in [table.get(stage, m, ctx, n)] if e is not None]
    return "ok" if "ok" in found else "oom" if "oom" in found else found[0] if found else "missing"


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
                    # why a side has no number: "oom" (ran out of memory when measured), "hung" (its process was
                    # ended in it, profile.HUNG), "infeasible" (the memory model rejected it, so it was never run),
                    # "missing" (not measured)
                    "status_a": _status(table, stage, ctx, n, tp_a), "status_b": _status(table, stage, ctx, n, tp_b),
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
    """One row of panels per tensor-degree pair (result, then result["next_pair"] when a third TP was measured)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [result] + ([result["next_pair"]] if result.get("next_pair") else [])
    ress, rows = result["responses"], result["contexts"]
    fig, grid = plt.subplots(len(pairs), 2, figsize=(4 + 2.4 * len(ress), (1.2 + 0.7 * len(rows)) * len(pairs)),
                             gridspec_kw={"width_ratios": [1.25, 1]}, squeeze=False)
    for axes, res in zip(grid, pairs):
        _draw_pair(fig, axes, res, scored_apart=result.get("remeasured", True) or result.get("synthetic", False))
    fig.suptitle(f"{result['model']} on {result['device_count']} x {result['device_kind']}", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _draw_pair(fig, axes, result: dict, scored_apart: bool = True) -> None:
    import matplotlib
    matplotlib.use("Agg")
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
    lim = max(1.0, float(np.nanmax(np.abs(sp)))) if np.isfinite(sp).any() else 1.0
    cmap = matplotlib.colormaps["RdBu"].with_extremes(bad="#bbbbbb")
    im = axes[0].imshow(np.ma.masked_invalid(sp), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto")
    fig.colorbar(im, ax=axes[0], label=f"Speedup% TP{a} -> TP{b}")
    for i, ctx in enumerate(rows):
        for j, n in enumerate(ress):
            c = by[(ctx, n)]
            if c["oom_a"] or c["oom_b"]:  # measured OOM, or "no fit": the memory model ruled it out unrun
                word = {"infeasible": "no fit", "missing": "n/a", "hung": "hung"}
                txt = " / ".join(f"TP{t} {word.get(c.get(k), 'OOM')}" for t, o, k in
                                 ((a, c["oom_a"], "status_a"), (b, c["oom_b"], "status_b")) if o)
            else:
                txt = f"{c['speedup_pct']:+.1f}"
            sel = c.get("selector_tensor")
            txt += f"\nsel TP{sel}" if sel else "\nsel: none fits"
            axes[0].text(j, i, txt, ha="center", va="center", fontsize=8)
    vmax = max(3.0, float(np.nanmax(gap)) if np.isfinite(gap).any() else 3.0)
    im2 = axes[1].imshow(np.ma.masked_invalid(gap), cmap="Oranges", vmin=0, vmax=vmax, aspect="auto")
    fig.colorbar(im2, ax=axes[1], label="selector gap to best %")
    for i, ctx in enumerate(rows):
        for j, n in enumerate(ress):
            c = by[(ctx, n)]
            g, vs = c["gap_to_best_pct"], c["gain_vs_static_pct"]
            txt = ("-" if g is None else f"gap {g:.1f}") + "\n" + (
                ("static no fit" if "infeasible" in (c.get("status_a"), c.get("status_b")) else "static OOM")
                if c["static_tgs"] is None else "" if vs is None else f"vs static {vs:+.1f}")
            axes[1].text(j, i, txt, ha="center", va="center", fontsize=8)
    titles = (f"{result['stage']}:\nSpeedup% TP{a} -> TP{b}",
              f"selector: gap % to best per cell;\ngain % vs best static ({result['summary']['static_mesh']})"
              + ("" if scored_apart else "\n(no second measurement: gap 0 by construction)"))
    for ax, t in zip(axes, titles):
        ax.set_xticks(range(len(ress)), [str(n) for n in ress])
        ax.set_yticks(range(len(rows)), [_label(c) for c in rows])
        ax.set_xlabel("number of responses")
        ax.set_ylabel("context length")
        ax.set_title(t, fontsize=10)


def load_table(path: Path, **check) -> ProfileTable:
    """A profile table JSON, or a figure JSON of this script (which holds the table it was drawn from)."""
    d = json.loads(Path(path).read_text())
    table = ProfileTable.from_json(d.get("profile_table", d))
    table.check_compatible(**check, source=f"profile table in {path}")
    return table


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.gpu or args.gpu4:  # the pre-run memory check's numbers per program: what an out-of-memory cell saw
        logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
        logging.getLogger("earl_jax.parallel.memory_check").setLevel(logging.INFO)
    model = args.model or (args.table and load_table(args.table).model_name) or "qwen2.5-72b"
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
        # a saved real table keeps the budget it was measured under: drawing it elsewhere (the CPU) keeps it
        saved = load_table(args.table).meta.get("budget_bytes") if args.table is not None else None
        budget = int(args.memory_gib * GiB) if args.memory_gib else int(saved) if saved else device_memory_budget()
    memory = MemoryModel(cfg, MemoryConfig(budget_bytes=budget, safety_fraction=args.safety))
    for t in args.tps:
        if not any(m.tensor == t for m in candidate_meshes(cfg, n_dev, args.stage)):
            raise SystemExit(f"tensor degree {t} is not a valid {args.stage} mesh for {cfg.name} on {n_dev} devices")

    if args.table is not None:
        table = load_table(args.table, device_count=n_dev, model_name=cfg.name,
                           device_kind=None if args.device_kind is None and synthetic else kind)
    elif synthetic:
        measure = _noisy(SyntheticThroughput(memory), args.noise, args.seed)
        table = run_profile(memory, measure, num_devices=n_dev, context_lens=args.contexts,
                            response_counts=args.responses, stages=(args.stage,), device_kind=kind,
                            progress=not args.no_progress)
        table.meta.update(synthetic=synthetic, budget_bytes=budget)
        if args.save_table:
            table.save(args.save_table)
    else:
        _compile_cache()
        print(f"{cfg.name} {args.stage} on {n_dev} x {kind}: budget {budget} bytes per device "
              f"({budget / GiB:.2f} GiB, safety {args.safety}); contexts {args.contexts} x responses "
              f"{args.responses}, TP {args.tps}, {args.decode_steps} decode steps", flush=True)
        previous = None
        if args.continue_table is not None:  # rows measured by an earlier call on the same kind of machine
            previous = load_table(args.continue_table, device_count=n_dev, model_name=cfg.name, device_kind=kind)
            if args.retry_hung:
                print(f"--retry-hung: measuring {previous.forget(HUNG)} hung cell(s) again", flush=True)
        table = measure_table(memory, args, n_dev, kind, (args.stage,), args.tps, table=previous,
                              save=args.save_table, time_budget=args.time_budget, label="first")
        table.meta.update(synthetic=False, budget_bytes=budget)
        if args.save_table:
            table.save(args.save_table)
        measured = set(table.context_lens(args.stage))
        args.contexts = [c for c in args.contexts if c in measured]  # rows the time budget cut are left out
    eval_table = None
    if args.eval_table:  # a second measurement saved by earlier calls (--save-remeasure-table), merged
        for path in args.eval_table:
            part = load_table(path, device_count=n_dev, model_name=cfg.name, device_kind=table.device_kind)
            if eval_table is None:
                eval_table = part
            else:
                for e in part.entries.values():
                    eval_table.add(e)
                eval_table.meta.setdefault("merged_from", []).append(part.meta)
    elif args.remeasure:
        if synthetic:
            eval_table = run_profile(memory, _noisy(SyntheticThroughput(memory), args.noise, args.seed + 1),
                                     num_devices=n_dev, context_lens=args.contexts, response_counts=args.responses,
                                     stages=(args.stage,), device_kind=table.device_kind,
                                     progress=not args.no_progress)
        else:
            # Same order as the first pass; rows the budget cuts here stay in the figure but are not scored.
            again = None  # the second pass of a call that ended in a hung cell goes on where it stopped
            if args.continue_table is not None and args.save_remeasure_table and args.save_remeasure_table.exists():
                again = load_table(args.save_remeasure_table, device_count=n_dev, model_name=cfg.name,
                                   device_kind=table.device_kind)
            eval_table = measure_table(memory, args, n_dev, table.device_kind, (args.stage,), args.tps, table=again,
                                       save=args.save_remeasure_table, time_budget=args.remeasure_budget,
                                       label="second")
            eval_table.meta.update(synthetic=False, budget_bytes=budget)
            if args.save_remeasure_table:
                eval_table.save(args.save_remeasure_table)
    result = compute_heatmap(table, memory, stage=args.stage, tp_a=args.tp_a, tp_b=args.tp_b,
                             contexts=sorted(args.contexts), responses=args.responses, eval_table=eval_table)
    if args.tp_c is not None:  # the same measurements, the next pair of tensor degrees
        result["next_pair"] = compute_heatmap(table, memory, stage=args.stage, tp_a=args.tp_b, tp_b=args.tp_c,
                                              contexts=sorted(args.contexts), responses=args.responses,
                                              eval_table=eval_table)
    result.update(synthetic=synthetic, remeasured=args.remeasure or bool(args.eval_table), noise=args.noise,
                  memory=dataclasses.asdict(memory.mem) | {"budget_bytes": budget})
    stem = args.name or f"fig3_{cfg.name}_{args.stage}_" + "_".join(f"tp{t}" for t in args.tps) + "_" + (
        "synthetic" if synthetic else device_slug(kind, n_dev))
    args.out.mkdir(parents=True, exist_ok=True)
    jpath, ppath = args.out / f"{stem}.json", args.out / f"{stem}.png"
    # what the figure was drawn from, reusable with --table / --continue-table (one JSON per figure)
    result["profile_table"] = table.to_json()
    if eval_table is not None:
        result["remeasure_table"] = eval_table.to_json()
    jpath.write_text(json.dumps(result, indent=1))
    result["paths"] = {"json": str(jpath), "png": str(ppath)}  # returned only, not saved
    plot_heatmap(result, ppath)
    s = result["summary"]
    print(f"wrote {jpath} and {ppath}; static best {s['static_mesh']}, selector within 3% of best in "
          f"{s['cells_within_3pct']}/{s['cells_scored']} cells (max gap {s['max_gap_to_best_pct']})"
          + ("" if result["remeasured"] or synthetic else "; no second measurement: that score is by construction"))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
