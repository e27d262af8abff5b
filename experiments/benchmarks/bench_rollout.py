"""Rollout throughput of earl-jax's Sampler on one device: Qwen2.5-0.5B shape, bf16, random weights,
128 prompt + 256 generated tokens (stop tokens ignored, so every row generates all 256), batch 32 and 128.

Prints and writes (experiments/results/bench_rollout_<device>.json, and $OUT when set):
  - decode tokens/s: generated tokens / wall time of `generate` (after a warm-up compile), median of runs;
  - prefill time (`extend` of the 128-token prompts into an empty cache), separately;
  - the HBM roofline for the same work: every decode step reads all weights plus the KV cache so far
    once, at the device's copy bandwidth MEASURED here (a large device-to-device copy);
  - with --profile, a per-kernel time breakdown of one generate call (jax.profiler trace), per step,
    and the optimized HLO of the decode program.

Run: python experiments/bench_rollout.py [--batches 32,128] [--decode-attention step,xla]
     [--xla-options "default;xla_gpu_enable_triton_gemm=false"] [--profile] [--hlo]
The numbers in experiments/results/bench_rollout_notes.md came from one device call each of this script
with --decode-attention step,xla (plus the variants fused, steprope and pallas, since removed from the
Sampler: none beat step by more than noise), e.g.
  python3 experiments/bench_rollout.py --decode-attention step --xla-options "xla_gpu_enable_triton_gemm=false" \
      --tag cublas --out $OUT
CPU smoke test: python experiments/bench_rollout.py --tiny --batches 4
The peers (tunix, HF generate) run from ../shared/bench/peer_rollout.py in the same device call.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from earl_jax.models.config import ModelConfig, get_config  # noqa: E402
from earl_jax.models.qwen2 import Qwen2  # noqa: E402
from earl_jax.rollout.sampler import Sampler  # noqa: E402
from earl_jax.rollout.sampling import SamplingConfig  # noqa: E402


def make_params(cfg: ModelConfig, dtype):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)))
    params = jax.jit(lambda: nnx.state(Qwen2(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)))()
    return graphdef, params


def copy_bandwidth(gib: float = 2.0, reps: int = 10) -> float:
    """Bytes read + written per second by a large on-device elementwise copy (the HBM ceiling): the best
    of a few element types, since XLA's bf16 kernels vectorize worse than 32-bit ones."""
    best = 0.0
    for dtype, fn in ((jnp.bfloat16, lambda x: -x), (jnp.uint32, lambda x: x + 1), (jnp.float32, lambda x: -x)):
        n = int(gib * 2**30) // jnp.dtype(dtype).itemsize
        x = jnp.arange(n, dtype=jnp.uint32).astype(dtype)  # not zeros: see METHOD.md
        f = jax.jit(fn)
        f(x).block_until_ready()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f(x).block_until_ready()
            ts.append(time.perf_counter() - t)
        best = max(best, 2 * n * jnp.dtype(dtype).itemsize / statistics.median(ts))
        del x
    return best


def kernel_breakdown(trace_dir: str, steps: int, top: int = 30):
    """Sum GPU kernel time by name from a jax.profiler trace (stream lines only)."""
    from jax.profiler import ProfileData
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return None
    pd = ProfileData.from_file(sorted(files)[-1])
    by_name, by_op = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    lines_seen = set()
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            lines_seen.add(line.name)
            table = by_op if line.name == "XLA Ops" else by_name if line.name.startswith("Stream") else None
            if table is None:
                continue
            for e in line.events:
                table[e.name][0] += e.duration_ns / 1e3
                table[e.name][1] += 1

    def summarize(table):
        total = sum(v[0] for v in table.values())
        rows = sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
        return {"total_us": total, "per_step_us": total / steps,
                "top": [{"name": k[:120], "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps,
                         "share": v[0] / max(total, 1e-9)} for k, v in rows]}

    return {"lines": sorted(lines_seen), "kernels": summarize(by_name), "xla_ops": summarize(by_op)}


def categorize(kernels) -> dict:
    """Coarse buckets of per-step kernel time by kernel name."""
    cats = defaultdict(float)
    for r in kernels["top"]:
        n = r["name"].lower()
        if "gemm" in n or "xmma" in n or "cutlass" in n or "triton" in n or "dot" in n or "matmul" in n:
            c = "matmul"
        elif "scatter" in n or "dynamic_update" in n:
            c = "cache write"
        elif "reduce" in n or "softmax" in n:
            c = "reductions"
        elif "memcpy" in n or "copy" in n or "transpose" in n:
            c = "copies"
        else:
            c = "other fusions"
        cats[c] += r["us_per_step"]
    return dict(cats)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--tiny", action="store_true", help="small model, short lengths (CPU smoke test)")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--steps-per-check", default="1", help="decode steps per while_loop iteration, list")
    ap.add_argument("--decode-attention", default="auto",
                    help="comma list of Sampler decode_attention (auto, step, xla)")
    ap.add_argument("--xla-options", default="default",
                    help="';'-separated variants of comma-separated XLA options for the sampler's programs, "
                         "e.g. 'default;xla_gpu_enable_triton_gemm=false'")
    ap.add_argument("--hlo", action="store_true", help="write the optimized HLO of each decode program")
    ap.add_argument("--tag", default="", help="suffix of the JSON name (exploration runs)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()

    cfg = get_config(args.preset)
    prompt, gen = args.prompt, args.gen
    if args.tiny:
        cfg, prompt, gen = ModelConfig.tiny(vocab_size=2048), 16, 16
    dtype = jnp.bfloat16
    dev = jax.devices()[0]
    device = dev.device_kind
    print(f"device: {device} ({dev.platform}), jax {jax.__version__}, model {cfg.name}", flush=True)

    graphdef, params = make_params(cfg, dtype)
    nparams = sum(x.size for x in jax.tree.leaves(params))
    results = {"device": device, "platform": dev.platform, "jax": jax.__version__, "model": cfg.name,
               "params": int(nparams), "prompt": prompt, "gen": gen, "dtype": "bfloat16", "runs": []}

    bw = copy_bandwidth(0.25 if args.tiny else 2.0)
    results["copy_GBps"] = bw / 1e9
    print(f"measured copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)", flush=True)

    weight_bytes = 2 * nparams
    kv_token = cfg.kv_bytes_per_token(2)
    sampling = SamplingConfig(temperature=1.0)  # as the peers: plain sampling, no truncation
    rng = np.random.default_rng(0)
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)

    for b in [int(x) for x in args.batches.split(",")]:
        prompts = rng.integers(3, 1000, (b, prompt)).astype(np.int32)
        kv_avg = kv_token * (prompt + gen / 2) * b
        roof = b / ((weight_bytes + kv_avg) / bw)
        variants = [(k, att, xo) for k in [int(x) for x in args.steps_per_check.split(",")]
                    for att in args.decode_attention.split(",") for xo in args.xla_options.split(";")]
        for k, att, xo in variants:
            try:
                opts = None if xo == "default" else {
                    kv.split("=")[0]: {"true": True, "false": False}.get(kv.split("=")[1], kv.split("=")[1])
                    for kv in xo.split(",")}
                sampler = Sampler(graphdef, cfg, cache_dtype=dtype, steps_per_check=k, decode_attention=att,
                                  compiler_options=opts)
                vname = f"b{b}_k{k}_{att}_{'default' if opts is None else re.sub('[^A-Za-z0-9]+', '_', xo)}"

                def prefill():
                    state = sampler.init_state(b, prompt + gen)
                    jax.block_until_ready(state)
                    t = time.perf_counter()
                    state = sampler.extend(params, state, prompts, np.full((b,), prompt))
                    jax.block_until_ready(state)
                    return state, time.perf_counter() - t

                def decode(state, key):
                    t = time.perf_counter()
                    state, g = sampler.generate(params, state, key, max_new_tokens=gen, budget=gen,
                                                stop_tokens=(), sampling=sampling)
                    jax.block_until_ready(g)
                    return state, g, time.perf_counter() - t

                t0 = time.perf_counter()
                state, _ = prefill()
                _, g, _ = decode(state, jax.random.key(0))  # warm-up: compiles
                compile_s = time.perf_counter() - t0
                assert int(np.asarray(g.num_tokens).sum()) == b * gen, np.asarray(g.num_tokens)
                pre, dec = [], []
                for r in range(args.runs):
                    state, tp = prefill()
                    _, g, td = decode(state, jax.random.key(r + 1))
                    pre.append(tp)
                    dec.append(td)
                td, tp = statistics.median(dec), statistics.median(pre)
                run = {"variant": vname, "batch": b, "steps_per_check": k, "decode_attention": att,
                       "xla_options": xo, "decode_s": td, "tok_s": b * gen / td,
                       "step_ms": td / gen * 1e3, "prefill_s": tp, "prefill_tok_s": b * prompt / tp,
                       "roofline_tok_s": roof, "frac_roofline": b * gen / td / roof,
                       "achieved_GBps": (weight_bytes + kv_avg) * gen / td / 1e9,
                       "warmup_compile_s": compile_s, "decode_runs_s": dec, "compile_count": sampler.compile_count}
                print(json.dumps({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in run.items()
                                  if k_ != "decode_runs_s"}), flush=True)

                if args.profile and out_dir is not None:
                    tdir = f"/tmp/trace_{vname}"
                    state, _ = prefill()
                    with jax.profiler.trace(tdir):
                        _, g, _ = decode(state, jax.random.key(99))
                    try:
                        run["profile"] = kernel_breakdown(tdir, gen)
                        if run["profile"]:
                            run["profile"]["categories"] = categorize(run["profile"]["kernels"])
                            ks = run["profile"]["kernels"]
                            print(f"profile {vname}: kernel time {ks['per_step_us']:.0f} us/step of "
                                  f"{run['step_ms'] * 1e3:.0f} us wall; lines {run['profile']['lines']}", flush=True)
                            for row in ks["top"][:18]:
                                print(f"  {row['us_per_step']:7.1f} us/step x{row['calls_per_step']:4.0f} {row['name'][:60]}")
                            print("  categories:", json.dumps({c: round(v, 1) for c, v in
                                                                run["profile"]["categories"].items()}), flush=True)
                    except Exception as e:  # the numbers above stand without the breakdown
                        run["profile_error"] = repr(e)[:300]
                        print("profile failed:", repr(e)[:300], flush=True)
                if args.hlo and out_dir is not None:
                    try:
                        state, _ = prefill()
                        hlo = sampler._generate.lower(params, state, jax.random.key(0), jnp.full((b,), gen, jnp.int32),
                                                      gen, (), sampling, jnp.int32(gen)).compile().as_text()
                        (out_dir / f"hlo_{vname}.txt").write_text(hlo)
                    except Exception as e:
                        print("hlo dump failed:", repr(e)[:300], flush=True)
                results["runs"].append(run)
            except Exception as e:  # a variant that fails to compile or run must not lose the others
                import traceback
                traceback.print_exc()
                results["runs"].append({"variant": f"b{b}_k{k}_{att}_{xo}", "error": repr(e)[:500]})

    from earl_jax.parallel.profile import device_slug

    path = Path(__file__).parent / "results" / f"bench_rollout_{device_slug(device)}{'_' + args.tag if args.tag else ''}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    if out_dir is not None:
        (out_dir / path.name).write_text(json.dumps(results, indent=1))
    print("summary:")
    for r in results["runs"]:
        if "error" in r:
            print(f"  {device} {r['variant']}: FAILED {r['error'][:200]}")
            continue
        print(f"  {device} {r['variant']}: {r['tok_s']:9.0f} tok/s "
              f"({r['step_ms']:.3f} ms/step, {100 * r['frac_roofline']:.0f}% of roofline {r['roofline_tok_s']:.0f}), "
              f"prefill {r['prefill_s'] * 1e3:.1f} ms")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
