"""Time random model init (`init_sharded`) per model x mesh, with its phases and compiled-program count.

Phases of the per-parameter init (`--impl fast`, earl_jax/models/init.py): abstract model (nnx.eval_shape),
shardings (logical axes -> NamedSharding), plan (initializer and salt per parameter), compile (one program
per distinct initializer x shape x dtype x sharding; `distinct_programs` counts them, `backend_s` sums the
seconds XLA spent compiling them, or loading them from a persistent cache, over all threads),
fill (run every parameter's program, until the arrays are ready). `--impl legacy` times the previous
init: one jitted program that builds the whole model with out_shardings (phases: abstract + shardings,
compile, run). `--abstract` only counts the programs a model would need (no device memory), e.g. 72B.

Each case runs in a fresh subprocess (cold jax caches; the persistent compilation cache stays off unless
--compile-cache names a folder), so cases do not warm each other.

    python experiments/benchmarks/bench_init.py --model qwen2.5-0.5b --model qwen2.5-1.5b --model qwen2.5-7b \
        --mesh d1f4t1 --repeats 2
    python experiments/benchmarks/bench_init.py --model qwen2.5-0.5b --mesh d1f4t1 --impl legacy --timeout 300 \
        --out legacy.json
    python experiments/benchmarks/bench_init.py --model qwen2.5-14b --model qwen2.5-72b --mesh d1f8t1 --abstract
    CPU (8 fake devices): add --cpu-devices 8

Writes experiments/results/bench_init_<device>.json (and $OUT/ when set). Meshes are dAfBtC (data x fsdp
x tensor) over the first A*B*C devices; parameters use the train rules (as the trainer does) unless --rules
inference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

RESULTS = Path(__file__).resolve().parents[1] / "results"


def run_case(model: str, mesh_name: str, impl: str, rules_name: str, abstract: bool, workers: int) -> dict:
    """One case in this process: the phases' wall times (s) and program counts."""
    import jax
    from flax import nnx

    from earl_jax.compile_cache import count_compiles
    from earl_jax.models import init
    from earl_jax.models.model_config import get_config
    from earl_jax.sharding.mesh import MeshShape, make_mesh, state_shardings
    from earl_jax.sharding.stage_registry import STAGE_RULES

    cfg = get_config(model)
    shape = MeshShape.parse(mesh_name)
    mesh = make_mesh(shape, jax.devices()[:shape.size])
    rules = STAGE_RULES["train" if rules_name == "train" else "rollout"]
    out = {"model": model, "mesh": str(shape), "impl": impl, "rules": rules_name, "params": cfg.num_params(),
           "layers": cfg.num_hidden_layers, "device": jax.devices()[0].device_kind,
           "platform": jax.devices()[0].platform, "workers": workers}
    t0 = time.perf_counter()
    with count_compiles() as count:
        if impl == "fast":
            graphdef, abstract_state = nnx.split(init.abstract_model(cfg))
        else:  # the previous abstract_model: eval_shape traced every random draw
            from earl_jax.models.qwen2 import Qwen2

            graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0))))
        t_abstract = time.perf_counter()
        shardings = state_shardings(abstract_state, mesh, rules)
        t_shard = time.perf_counter()
        out.update(abstract_s=t_abstract - t0, shardings_s=t_shard - t_abstract)
        if impl == "fast":
            plan = init.init_plan(abstract_state, shardings)
            t_plan = time.perf_counter()
            out.update(plan_s=t_plan - t_shard, num_params_tensors=len(plan),
                       distinct_programs=len({p.key for p in plan}))
            if abstract:
                return out
            out["programs_compiled"] = init.compile_programs(plan, workers=workers)
            t_compile = time.perf_counter()
            state = jax.block_until_ready(init.fill_state(abstract_state, plan, seed=0))
            out.update(compile_wall_s=t_compile - t_plan, fill_s=time.perf_counter() - t_compile)
        else:
            lowered = jax.jit(lambda: nnx.state(Qwen2(cfg, rngs=nnx.Rngs(0))), out_shardings=shardings).lower()
            compiled = lowered.compile()
            t_compile = time.perf_counter()
            state = jax.block_until_ready(compiled())
            out.update(compile_wall_s=t_compile - t_shard, fill_s=time.perf_counter() - t_compile)
    out.update(total_s=time.perf_counter() - t0, lowered=count.lowered, xla_compiles=count.compiled,
               cache_hits=count.cache_hits, backend_s=count.backend_s)
    leaf = nnx.to_flat_state(state)[0][1].get_value()
    out["per_device_bytes"] = sum(s.data.nbytes for v in jax.tree.leaves(state)
                                  for s in v.addressable_shards if s.device == leaf.addressable_shards[0].device)
    return out


def _spawn(args, model, mesh, impl) -> dict:
    cmd = [sys.executable, __file__, "--case", model, mesh, impl, "--rules", args.rules, "--workers",
           str(args.workers), "--compile-cache", args.compile_cache or "off"]
    cmd += ["--abstract"] if args.abstract else []
    env = dict(os.environ)
    if args.cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}")
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "mesh": mesh, "impl": impl, "error": f"timed out after {args.timeout} s"}
    if p.returncode:
        return {"model": model, "mesh": mesh, "impl": impl, "returncode": p.returncode,  # -9: killed (memory?)
                "error": p.stderr.strip().splitlines()[-1:]}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t  # includes python + jax import and device start
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="preset (repeatable); default tiny and qwen2.5-0.5b")
    ap.add_argument("--mesh", action="append", help="dAfBtC (repeatable); default d1f8t1 and d8f1t1")
    ap.add_argument("--impl", action="append", choices=["fast", "legacy"], help="repeatable; default fast")
    ap.add_argument("--rules", choices=["train", "inference"], default="train")
    ap.add_argument("--abstract", action="store_true", help="only count programs (no device memory)")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="compile threads")
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per case; the fastest is reported")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per case")
    ap.add_argument("--cpu-devices", type=int, default=0, help="run on N fake CPU devices")
    ap.add_argument("--compile-cache", default="", help="persistent compile cache folder (default: off)")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench_init_<device>.json)")
    ap.add_argument("--case", nargs=3, metavar=("MODEL", "MESH", "IMPL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        from earl_jax.compile_cache import enable_compile_cache

        enable_compile_cache(args.compile_cache or "off")  # off unless asked: cold compiles are the measure
        print(json.dumps(run_case(*args.case, args.rules, args.abstract, args.workers)))
        return

    rows = []
    for model in args.model or ["tiny", "qwen2.5-0.5b"]:
        for mesh in args.mesh or ["d1f8t1", "d8f1t1"]:
            for impl in args.impl or ["fast"]:
                runs = [_spawn(args, model, mesh, impl) for _ in range(args.repeats)]
                ok = [r for r in runs if "error" not in r]
                # the fastest run's phases (shared machines only add noise), with every run's total
                r = min(ok, key=lambda r: r["total_s"]) if ok else runs[-1]
                r["totals_s"] = [round(x["total_s"], 2) for x in ok]
                rows.append(r)
                keys = ("abstract_s", "shardings_s", "compile_wall_s", "fill_s", "total_s", "process_s")
                print(f"{model:14s} {mesh:8s} {impl:6s} " + ("ERROR " + str(r["error"]) if "error" in r else
                      " ".join(f"{k[:-2]} {r[k]:6.2f}" for k in keys if k in r)
                      + f"  programs {r.get('distinct_programs', r.get('xla_compiles'))}  totals {r['totals_s']}"),
                      flush=True)
    device = next((r["device"] for r in rows if "device" in r), "unknown")
    tag = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    path = Path(args.out) if args.out else RESULTS / f"bench_init_{tag}{'_abstract' if args.abstract else ''}.json"
    result = {"device": device, "cpu_devices": args.cpu_devices or None, "rows": rows,
              "note": "seconds of wall time; each case in fresh processes (--repeats, fastest reported); compile cache "
                      + (args.compile_cache or "off")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / path.name).write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
