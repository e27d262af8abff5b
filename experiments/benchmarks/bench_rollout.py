"""Rollout decode throughput on one device, earl-jax's XLA and Pallas decode steps and tunix's sampler side by side.

Shapes (bf16, random weights, stop tokens ignored so every row generates all its tokens, plain sampling):
  short: 128 prompt + 256 generated, Qwen2.5-0.5B and 7B, batch 32 and 128
  long:  16K prompt + 128 generated, Qwen2.5-1.5B and 7B, batch 32
Per row and decode implementation (Sampler(decode_impl=...)): decode tok/s (generated tokens / wall time of
`generate` after a warm-up compile, median of runs), ms/step, prefill time (`extend` of the prompts into an empty
cache), and the fraction of the HBM roofline: every step reads all weights once plus the KV cache so far (mean
context prompt + gen/2), at the best copy bandwidth measured in the same call (a device-to-device copy through
torch, and a JAX elementwise copy; the larger). Long rows first try the one-shot prefill of the 16K prompts and
record how it ends; the decode then starts from a cache filled with random keys/values (decode time does not depend
on the values) at the prompt's length. Cache sizes are the Sampler's default buckets (384; 24576 for 16512 tokens).
tunix 0.1.7's vanilla sampler runs the same shapes first, in a subprocess of the same call (its wheels carried
in .whl_tunix); its tok/s covers its whole call (prefill included), compared with our prefill + decode.

Run (GPU):  python experiments/benchmarks/bench_rollout.py [--rows short,long] [--impls xla,pallas] [--profile]
CPU smoke:  python experiments/benchmarks/bench_rollout.py --tiny
Writes experiments/results/bench_rollout_<device>.json and .png (and $OUT/ when set); --plot JSON redraws a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ROWS = {  # name: (model preset, prompt, generated, batch)
    "short-0.5b-b32": ("qwen2.5-0.5b", 128, 256, 32), "short-0.5b-b128": ("qwen2.5-0.5b", 128, 256, 128),
    "short-7b-b32": ("qwen2.5-7b", 128, 256, 32), "short-7b-b128": ("qwen2.5-7b", 128, 256, 128),
    "long-1.5b-b32": ("qwen2.5-1.5b", 16384, 128, 32), "long-7b-b32": ("qwen2.5-7b", 16384, 128, 32),
}
TINY_ROWS = {"short-tiny-b4": ("small", 16, 16, 4), "long-tiny-b4": ("small", 600, 8, 4)}
TUNIX_MODEL = {"qwen2.5-0.5b": "0p5b", "qwen2.5-1.5b": "1p5b", "qwen2.5-7b": "7b"}
# tunix's long prefill materializes [b, heads, T, S] float32 scores: 771 GiB at 1.5B, more at 7B; tried at 1.5B only
TUNIX_SKIP = {n: "not run: its prefill of 16K prompts at b32 asks 771 GiB at 1.5B (attention scores; measured on one "
                 "H200, issue 41), more at 7B" for n in ("long-1.5b-b32", "long-7b-b32")}


def torch_copy_GBps(gib: float = 2.0, reps: int = 20) -> float | None:
    """Bytes read + written per second of a device-to-device copy through torch (None without CUDA)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        a = torch.randn(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda")
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            b.copy_(a)
            t1.record()
            torch.cuda.synchronize()
            ts.append(t0.elapsed_time(t1) / 1e3)
        bw = 2 * a.numel() * 2 / statistics.median(ts) / 1e9
        del a, b
        torch.cuda.empty_cache()  # JAX takes its share of the device's memory next
        return bw
    except Exception as e:  # noqa: BLE001 - the JAX copy stands alone
        print("torch copy failed:", repr(e)[:200], flush=True)
        return None


def jax_copy_GBps(gib: float, reps: int = 10) -> float:
    """Bytes read + written per second of a large on-device elementwise copy (best of a few element types)."""
    import jax
    import jax.numpy as jnp
    best = 0.0
    for dtype, fn in ((jnp.bfloat16, lambda x: -x), (jnp.uint32, lambda x: x + 1), (jnp.float32, lambda x: -x)):
        n = int(gib * 2**30) // jnp.dtype(dtype).itemsize
        x = jnp.arange(n, dtype=jnp.uint32).astype(dtype)  # not zeros
        f = jax.jit(fn)
        f(x).block_until_ready()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f(x).block_until_ready()
            ts.append(time.perf_counter() - t)
        best = max(best, 2 * n * jnp.dtype(dtype).itemsize / statistics.median(ts) / 1e9)
        del x
    return best


def tunix_worker(specs: list[tuple[str, str, int, int, int]]) -> None:
    """Child process: tunix's sampler on each (row, model, prompt, gen, batch); prints one JSON line per row."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tunix.generate import sampler as ts
    from tunix.models.qwen2 import model as qm

    class Tok:  # ids as words; eos an id never drawn
        def encode(self, text, **kw): return [int(t) for t in text.split()]
        def decode(self, ids, **kw): return " ".join(map(str, ids))
        def bos_id(self): return 1
        def eos_id(self): return 2
        def pad_id(self): return 0

    models = {}
    for row, model, prompt, gen, b in specs:
        out = {"row": row}
        try:
            if model not in models:
                models.clear()
                cfg = getattr(qm.ModelConfig, f"qwen2p5_{TUNIX_MODEL[model]}")()
                cfg = dataclasses.replace(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
                models[model] = (cfg, qm.Qwen2(cfg, rngs=nnx.Rngs(0)))
            cfg, m = models[model]
            s = ts.Sampler(m, Tok(), ts.CacheConfig(cache_size=2 * prompt + gen + 8, num_layers=cfg.num_layers,
                                                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
            rng = np.random.default_rng(0)
            texts = [" ".join(map(str, rng.integers(3, 1000, prompt))) for _ in range(b)]

            def go():
                s(texts, max_generation_steps=gen, max_prompt_length=prompt, eos_tokens=[cfg.vocab_size + 5],
                  temperature=1.0, top_p=1.0, seed=0)
                jax.effects_barrier()
            go()
            runs = []
            for _ in range(3):
                t = time.perf_counter()
                go()
                runs.append(time.perf_counter() - t)
            out.update(tok_s=b * gen / statistics.median(runs), runs_s=runs)
        except Exception as e:  # noqa: BLE001 - recorded in the row
            out["error"] = f"{type(e).__name__}: {e}"[:400]
        print("TUNIX " + json.dumps(out), flush=True)


def run_tunix(names: list[str], rows: dict, timeout_s: float) -> dict:
    specs = [(n, *rows[n]) for n in names if n not in TUNIX_SKIP]
    found = {n: {"error": why} for n, why in TUNIX_SKIP.items() if n in names}
    if not specs:
        return found
    try:
        proc = subprocess.run([sys.executable, __file__, "--tunix-worker", json.dumps(specs)], capture_output=True,
                              text=True, timeout=timeout_s)
        lines, tail = proc.stdout.splitlines(), proc.stderr[-800:]
    except subprocess.TimeoutExpired as e:
        lines, tail = (e.stdout or b"").decode().splitlines() if isinstance(e.stdout, bytes) else [], "timeout"
    for line in lines:
        if line.startswith("TUNIX "):
            r = json.loads(line[6:])
            found[r.pop("row")] = r
    for n, *_ in specs:
        found.setdefault(n, {"error": f"no result ({tail[-300:]})"})
    return found


def make_params(cfg, dtype):
    import jax
    from flax import nnx

    from earl_jax.models.qwen2 import Qwen2
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)))
    params = jax.jit(lambda: nnx.state(Qwen2(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)))()
    return graphdef, params


def random_state(sampler, cfg, batch: int, prompt: int, total: int, seed: int):
    """A state whose rows hold `prompt` tokens of random keys/values (what a prefill would leave, for timing).
    One jitted draw per array shape, reused for every layer: a single program filling all layers took 3 min 40 s
    to compile on the H200."""
    import jax
    import jax.numpy as jnp

    from earl_jax.models.cache import KVCache, LayerCache
    from earl_jax.rollout.sampler import SamplerState, bucket

    shape = (batch, cfg.num_key_value_heads, bucket(total, sampler.cache_buckets), cfg.dim_per_head)
    keys = jax.random.split(jax.random.key(seed), 2 * cfg.num_hidden_layers + 1)
    cache = KVCache(tuple(LayerCache(_normal(keys[2 * i], shape, sampler.cache_dtype),
                                     _normal(keys[2 * i + 1], shape, sampler.cache_dtype))
                          for i in range(cfg.num_hidden_layers)))
    return SamplerState(cache, jnp.full((batch,), prompt, jnp.int32),
                        _normal(keys[-1], (batch, cfg.vocab_size), jnp.float32))


def _normal(key, shape, dtype):
    import jax
    global _NORMAL
    if _NORMAL is None:
        _NORMAL = jax.jit(lambda k, shape, dtype: jax.random.normal(k, shape, dtype), static_argnums=(1, 2))
    return _NORMAL(key, shape, dtype)


_NORMAL = None


def kernel_breakdown(trace_dir: str, steps: int, top: int = 25):
    """GPU kernel time by name from a jax.profiler trace, per decode step."""
    import glob
    from collections import defaultdict

    from jax.profiler import ProfileData
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return None
    table = defaultdict(lambda: [0.0, 0])
    for plane in ProfileData.from_file(sorted(files)[-1]).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    for e in line.events:
                        table[e.name][0] += e.duration_ns / 1e3
                        table[e.name][1] += 1
    total = sum(v[0] for v in table.values())
    rows = sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
    return {"per_step_us": total / steps, "top": [{"name": k[:100], "us_per_step": v[0] / steps,
                                                   "calls_per_step": v[1] / steps} for k, v in rows]}


def measure_row(name: str, spec, impls: list[str], runs: int, bw: float, profile: list[str],
                prefill_attempt: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from earl_jax.models.model_config import get_config
    from earl_jax.rollout.sampler import DEFAULT_CACHE_BUCKETS, Sampler, bucket
    from earl_jax.rollout.sampling import SamplingConfig

    model, prompt, gen, b = spec
    cfg = get_config(model)
    dtype = jnp.bfloat16
    graphdef, params = make_params(cfg, dtype)
    nparams = int(sum(x.size for x in jax.tree.leaves(params)))
    bytes_step = 2 * nparams + cfg.kv_bytes_per_token(2) * (prompt + gen / 2) * b
    roof = b / (bytes_step / (bw * 1e9))
    row = {"row": name, "model": model, "params": nparams, "prompt": prompt, "gen": gen, "batch": b,
           "cache_len": bucket(prompt + gen, DEFAULT_CACHE_BUCKETS), "bytes_per_step": bytes_step,
           "roofline_tok_s": roof, "impls": {}}
    long = name.startswith("long")
    prompts = np.random.default_rng(0).integers(3, 1000, (b, prompt)).astype(np.int32)
    sampling = SamplingConfig(temperature=1.0)
    filler = Sampler(graphdef, cfg, cache_dtype=dtype, decode_impl="xla")  # every impl's prefill: one program

    def prefill():
        state = filler.init_state(b, prompt + gen)  # noqa: F821 (`del`-ed below, after the last call)
        jax.block_until_ready(state)
        t = time.perf_counter()
        state = filler.extend(params, state, prompts, np.full((b,), prompt))  # noqa: F821 (`del`-ed at the end)
        jax.block_until_ready(state)
        return state, time.perf_counter() - t

    if long and not prefill_attempt:
        row["prefill"] = {"one_shot_error": "not attempted in this call (--no-prefill-attempt)"}
    elif long:
        try:
            _, tp = prefill()  # compile + run; a second run times it
            _, tp = prefill()
            row["prefill"] = {"one_shot_s": tp}
        except Exception as e:  # noqa: BLE001 - the known failure of issue 41 item 4, recorded
            row["prefill"] = {"one_shot_error": f"{type(e).__name__}: {e}"[:400]}
        print(f"{name}: one-shot prefill {row['prefill']}", flush=True)
    for impl in impls:
        try:
            sampler = Sampler(graphdef, cfg, cache_dtype=dtype, decode_impl=impl)

            def start(seed):
                if long:
                    st = random_state(filler, cfg, b, prompt, prompt + gen, seed)  # noqa: F821 (`del`-ed at the end)
                    jax.block_until_ready(st)
                    return st, float("nan")
                return prefill()

            def decode(state, key):
                t = time.perf_counter()
                state, g = sampler.generate(params, state, key, max_new_tokens=gen, budget=gen,  # noqa: F821 (`del`-ed)
                                            stop_tokens=(), sampling=sampling)
                jax.block_until_ready(g)
                return g, time.perf_counter() - t

            t0 = time.perf_counter()
            g, _ = decode(start(0)[0], jax.random.key(0))
            warm = time.perf_counter() - t0
            assert int(np.asarray(g.num_tokens).sum()) == b * gen, np.asarray(g.num_tokens)
            dec, pre = [], []
            for r in range(runs):
                state, tp = start(r + 1)
                _, td = decode(state, jax.random.key(r + 1))
                dec.append(td)
                pre.append(tp)
            td, tp = statistics.median(dec), statistics.median(pre)
            res = {"tok_s": b * gen / td, "step_ms": td / gen * 1e3, "decode_s": td, "decode_runs_s": dec,
                   "frac_roofline": b * gen / td / roof, "achieved_GBps": bytes_step * gen / td / 1e9,
                   "warmup_s": warm}
            if not long:
                res.update(prefill_s=tp, e2e_tok_s=b * gen / (td + tp))
            if impl != "xla":
                from earl_jax.kernels.tuning import plan
                res["plan"] = plan(cfg, b, bucket(prompt + gen, DEFAULT_CACHE_BUCKETS),
                                   "pallas" if impl.startswith("pallas") else "auto").describe()
            if impl in profile:
                tdir = f"/tmp/trace_{name}_{impl}"
                state, _ = start(99)
                with jax.profiler.trace(tdir):
                    decode(state, jax.random.key(99))
                res["profile"] = kernel_breakdown(tdir, gen)
            row["impls"][impl] = res
            print(f"{name} {impl}: {res['tok_s']:.0f} tok/s, {res['step_ms']:.3f} ms/step, "
                  f"{100 * res['frac_roofline']:.0f}% of roofline ({roof:.0f}), warm-up {warm:.0f} s", flush=True)
            if res.get("profile"):
                for k in res["profile"]["top"][:12]:
                    print(f"    {k['us_per_step']:8.1f} us/step x{k['calls_per_step']:5.1f} {k['name'][:70]}")
            del sampler
        except Exception as e:  # noqa: BLE001 - one impl failing must not lose the others
            import traceback
            traceback.print_exc()
            row["impls"][impl] = {"error": f"{type(e).__name__}: {e}"[:500]}
    del params, filler
    return row


def plot(results: dict, path: Path) -> None:
    """tok/s per row: earl-jax's decode implementations, tunix, and the roofline; fractions of the roofline above."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = results["rows"]
    impls = sorted({i for r in rows for i in r["impls"]}, key=lambda i: ("xla", "pallas", "auto").index(i)
                   if i in ("xla", "pallas", "auto") else 9)
    series = [(f"earl-jax {i}", lambda r, i=i: r["impls"].get(i, {}).get("tok_s")) for i in impls]
    series += [("tunix (vanilla sampler)", lambda r: r.get("tunix", {}).get("tok_s")),
               ("HBM roofline", lambda r: r["roofline_tok_s"])]
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(rows)), 4.5))
    width = 0.8 / len(series)
    for k, (label, get) in enumerate(series):
        for x, r in enumerate(rows):
            v = get(r)
            if v:
                bar = ax.bar(x + (k - (len(series) - 1) / 2) * width, v, width, color=f"C{k}",
                             label=label if x == next(i for i, rr in enumerate(rows) if get(rr)) else None,
                             alpha=0.35 if label == "HBM roofline" else 1.0)
                if label.startswith("earl-jax"):
                    ax.annotate(f"{100 * v / r['roofline_tok_s']:.0f}%", (bar[0].get_x() + width / 2, v),
                                ha="center", va="bottom", fontsize=7)
            elif label.startswith("tunix") and r.get("tunix", {}).get("error"):
                ax.annotate("OOM" if "RESOURCE" in r["tunix"]["error"] or "771" in r["tunix"]["error"] else "n/a",
                            (x + (k - (len(series) - 1) / 2) * width, 1), ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [r["row"] for r in rows], fontsize=8)
    ax.set_ylabel("generated tokens / s (decode)")
    bws = sorted({round(r.get("copy_GBps", results["copy_GBps"])["best"]) for r in rows})
    ax.set_title(f"Rollout decode, {results['device']} (bf16; % = share of the HBM roofline at the call's best copy "
                 f"bandwidth, {'-'.join(map(str, bws))} GB/s)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="short,long", help="row names or prefixes (short, long, short-7b, ...)")
    ap.add_argument("--impls", default="xla,pallas", help="Sampler decode_impl values, comma list")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tunix", default="auto", help="auto (when importable), off")
    ap.add_argument("--tunix-timeout", type=float, default=400)
    ap.add_argument("--profile", default="", help="impls whose kernel time per step is traced (one generate a row)")
    ap.add_argument("--tiny", action="store_true", help="a small model on CPU (smoke run; kernels interpreted)")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds: rows not started by then are skipped")
    ap.add_argument("--plot", help="redraw the PNG of this JSON and exit")
    ap.add_argument("--merge", action="store_true", help="add this call's rows to the JSON already there")
    ap.add_argument("--no-prefill-attempt", default="", help="long rows whose one-shot prefill is not tried")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--tunix-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tunix_worker:
        return tunix_worker([tuple(s) for s in json.loads(args.tunix_worker)])
    if args.plot:
        return plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
    t_start = time.perf_counter()
    table = TINY_ROWS if args.tiny else ROWS
    names = list(dict.fromkeys(n for p in args.rows.split(",") for n in table if n == p or n.startswith(p + "-")))
    impls = args.impls.split(",")
    if args.tiny:
        impls = ["pallas_interpret" if i == "pallas" else i for i in impls]
    torch_bw = None if args.tiny else torch_copy_GBps()  # before JAX takes the device's memory
    tunix = {}
    if args.tunix == "auto" and not args.tiny:
        import importlib.util
        if importlib.util.find_spec("tunix") is not None:  # found, not imported: the worker imports it
            tunix = run_tunix(names, table, args.tunix_timeout)
        else:
            tunix = {n: {"error": "tunix not importable (carry .whl_tunix)"} for n in names}
        print("tunix:", json.dumps(tunix)[:1500], flush=True)
    import jax

    from earl_jax.parallel.profile import device_slug
    dev = jax.devices()[0]
    jax_bw = jax_copy_GBps(0.25 if args.tiny else 2.0)
    bw = max(jax_bw, torch_bw or 0.0)
    results = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
               "copy_GBps": {"jax": jax_bw, "torch": torch_bw, "best": bw}, "dtype": "bfloat16", "rows": []}
    print(f"device {dev.device_kind}, jax {jax.__version__}; copy GB/s: torch {torch_bw}, jax {jax_bw:.0f}", flush=True)
    slug = device_slug(dev.device_kind)
    path = Path(__file__).resolve().parents[1] / "results" / f"bench_rollout_{slug}{'_tiny' if args.tiny else ''}.json"
    out_dir = Path(args.out) if args.out else None
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    if args.merge and path.exists():  # rows of earlier calls stay, each with its own call's copy bandwidth
        results["rows"] = [r for r in json.loads(path.read_text())["rows"] if r["row"] not in names]
    for name in names:
        if time.perf_counter() - t_start > args.deadline:
            results["rows"].append({"row": name, "skipped": "deadline"})
            continue
        row = measure_row(name, table[name], impls, args.runs, bw, args.profile.split(","),
                          name not in args.no_prefill_attempt.split(","))
        row.update(tunix=tunix.get(name, {"error": "not run in this call"}), copy_GBps=results["copy_GBps"],
                   call_started=started)
        results["rows"] = [r for r in results["rows"] if r["row"] != name] + [row]
        for p in [path] + ([out_dir / path.name] if out_dir else []):  # after every row: a cut call keeps its rows
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(results, indent=1))
    order = list(table)
    results["rows"].sort(key=lambda r: order.index(r["row"]) if r["row"] in order else len(order))
    done = [r for r in results["rows"] if "impls" in r]
    if done:
        plot({**results, "rows": done}, path.with_suffix(".png"))
        if out_dir:
            plot({**results, "rows": done}, out_dir / path.with_suffix(".png").name)
    print("summary (tok/s, % of roofline):")
    for r in results["rows"]:
        if "impls" not in r:
            print(f"  {r['row']}: {r.get('skipped')}")
            continue
        cells = [f"{i} " + (f"{v['tok_s']:.0f} ({100 * v['frac_roofline']:.0f}%, {v['step_ms']:.3f} ms)"
                            if "tok_s" in v else "FAILED") for i, v in r["impls"].items()]
        t = r["tunix"]
        cells.append("tunix " + (f"{t['tok_s']:.0f}" if "tok_s" in t else t.get("error", "-")[:60]))
        print(f"  {r['row']}: roofline {r['roofline_tok_s']:.0f} | " + " | ".join(cells))
    print(f"wrote {path} in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
