"""Each op of the decode step alone, Pallas against XLA, at the shapes of the rollout benchmark: what
earl_jax/kernels/tuning.py's MEASURED table and the attention defaults come from.

Per op (q/k/v, out, gate/up, down, logits projections with their fused epilogues; the attention) and shape
(model, batch, cache length): XLA (`linear_xla` / the model's cached attention) and a few Pallas launches.
Every candidate runs over L distinct weight copies (or caches), as the layers of a step do, with more bytes
than the L2 holds; time per op = wall time of 20 back-to-back calls / (20 L), the host's dispatch hidden
behind the GPU's queue. GB/s counts the weights (or KV) read once. Correctness first: each Pallas op against
XLA on random inputs (relative error; bf16).

Run: python experiments/benchmarks/bench_decode_ops.py [--quick] [--out DIR]
Writes experiments/results/bench_decode_ops_<device>.json (and DIR/ when given).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from earl_jax.kernels.decode_attention import (  # noqa: E402
    block_size,
    decode_attention,
    decode_attention_xla,
    inv_frequencies,
    num_splits,
)
from earl_jax.kernels.linear import LinearConfig, default_config, fit_smem, linear, linear_xla  # noqa: E402
from earl_jax.kernels.tuning import op_shapes  # noqa: E402
from earl_jax.models.cache import LayerCache  # noqa: E402
from earl_jax.models.model_config import get_config  # noqa: E402

BF16 = jnp.bfloat16
CALLS = 20
INTERPRET = False  # --tiny: the kernels under the interpreter (a CPU smoke run of this script)


def _timed(fn, state, calls: int = CALLS, reps: int = 3) -> tuple[float, object]:
    """(seconds per call, last state) of state -> state: `calls` calls queued back to back, median of reps."""
    state = fn(state)
    jax.block_until_ready(state)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            state = fn(state)
        jax.block_until_ready(state)
        ts.append((time.perf_counter() - t) / calls)
    return statistics.median(ts), state


def _timed_calls(fn, calls: int = CALLS, reps: int = 3) -> float:
    """Seconds per call of fn() (its outputs kept only until the next call), median of reps."""
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t) / calls)
        del outs
    return statistics.median(ts)


def _op_kwargs(op: str, rng, m: int, k: int, n: int, cfg):
    extra = {}
    if op == "qkv":
        extra = dict(norm_eps=1e-6, bias=jnp.asarray(rng.normal(size=(n,)), BF16))
    elif op == "gate_up":
        extra = dict(norm_eps=1e-6, swiglu=True)
    elif op in ("out", "down"):
        extra = dict(residual=jnp.asarray(rng.normal(size=(m, n)), BF16))
    elif op == "logits":
        extra = dict(out_dtype=jnp.float32, w_layout="nk" if cfg.tie_word_embeddings else "kn")
    return extra


def linear_candidates(m: int, k: int, n: int, swiglu: bool, quick: bool) -> list[LinearConfig]:
    bm = default_config(m, k, n).bm
    raw = [(bm, 32, 128, 4, 3), (bm, 64, 128, 4, 3), (bm, 128, 64, 4, 3)]
    if quick:
        raw = raw[:2]
    out = []
    for bm_, bn, bk, w, s in raw:
        c = fit_smem(LinearConfig(bm_, bn, bk, w, s), swiglu)
        if n % c.bn == 0 and k % c.bk == 0 and c not in out:
            out.append(c)
    d = default_config(m, k, n, swiglu)
    if d is not None and d not in out:
        out.append(d)
    return out


def sweep_linear(model: str, batch: int, quick: bool, pool, rng) -> list[dict]:
    cfg = get_config(model)
    rows = []
    for op, (k, n, swiglu) in op_shapes(cfg).items():
        extra = _op_kwargs(op, rng, batch, k, n, cfg)
        layout = extra.get("w_layout", "nk")
        n_w = 2 * n if swiglu else n
        wbytes = n_w * k * 2
        copies = int(min(32, max(4, -(-160 * 2**20 // wbytes))))  # > 3x the L2 in weights (at most 32 calls)
        wshape = (n_w, k) if layout == "nk" else (k, n_w)
        draw = jax.jit(lambda key, shape, scale: scale * jax.random.normal(key, shape, BF16), static_argnums=(1,))
        ws = [draw(jax.random.key(i), wshape, 0.02) for i in range(copies)]  # on the device: GBs at 7B
        xs = [draw(jax.random.key(1000 + i), (batch, k), 1.0) for i in range(copies)]

        arrays = {a: v for a, v in extra.items() if a in ("bias", "residual")}
        flags = {a: v for a, v in extra.items() if a not in arrays}

        def program(launch):
            def run(xs_, ws_, arrays_):
                return [(linear_xla(x, w, **flags, **arrays_) if launch is None
                         else linear(x, w, config=launch, interpret=INTERPRET, **flags, **arrays_))
                        for x, w in zip(xs_, ws_)]
            return jax.jit(run)

        cands = [None] + linear_candidates(batch, k, n, swiglu, quick)
        progs = {c: program(c) for c in cands}
        compiled = {}
        futs = {pool.submit(lambda c=c: progs[c].lower(xs, ws, arrays).compile()): c for c in cands}  # noqa: F821
        for f in concurrent.futures.as_completed(futs):
            c = futs[f]
            try:
                compiled[c] = f.result()
            except Exception as e:  # a launch Triton refuses (e.g. shared memory) is a finding, not a crash
                rows.append({"model": model, "batch": batch, "op": op, "config": _cfg(c), "error": repr(e)[:300]})
        # correctness of every launch against XLA, on the first weight copy
        ref = compiled[None](xs, ws, arrays)[0].astype(jnp.float32) if None in compiled else None
        for c in cands[1:]:
            if c not in compiled:
                continue
            err = None
            if ref is not None:
                got = compiled[c](xs, ws, arrays)[0].astype(jnp.float32)
                err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            t = _timed_calls(lambda c=c: compiled[c](xs, ws, arrays))  # noqa: F821 (`del`-ed below, after the last call)
            rows.append({"model": model, "batch": batch, "op": op, "K": k, "N": n, "config": _cfg(c),
                         "us": t / copies * 1e6, "GBps": wbytes / (t / copies) / 1e9, "rel_err": err})
        if None in compiled:
            t = _timed_calls(lambda: compiled[None](xs, ws, arrays))  # noqa: F821 (`del`-ed below, after the last call)
            rows.append({"model": model, "batch": batch, "op": op, "K": k, "N": n, "config": "xla",
                         "us": t / copies * 1e6, "GBps": wbytes / (t / copies) / 1e9})
        best = min((r for r in rows if r.get("op") == op and r.get("batch") == batch and r.get("model") == model
                    and "us" in r), key=lambda r: r["us"])
        xla = next((r["us"] for r in rows if r.get("op") == op and r.get("batch") == batch
                    and r.get("model") == model and r.get("config") == "xla"), float("nan"))
        print(f"{model} b{batch} {op:8s} K={k} N={n}: xla {xla:7.1f} us | best {best['config']} {best['us']:7.1f} us "
              f"({best['GBps']:.0f} GB/s)", flush=True)
        del ws, xs
    return rows


def _cfg(c):
    return "xla" if c is None else dataclasses.asdict(c)


def attention_candidates(batch: int, kv: int, s: int, quick: bool) -> list[tuple[int, int, int, int]]:
    """(block, splits, warps, stages) launches to try."""
    block = block_size(s)
    if s <= 2048:
        cands = [(block, 1, 4, 2), (64, 1, 4, 3)]
    else:
        default = num_splits(batch, kv, s, block)
        cands = [(block, default, 4, 2), (block, 2 * default, 4, 2), (block, max(1, default // 2), 4, 3)]
    out = [c for c in dict.fromkeys(cands) if s % c[0] == 0 and (s // c[0]) % c[1] == 0]
    return out[:1] if quick else out


def sweep_attention(model: str, batch: int, s: int, context: int, quick: bool, pool) -> list[dict]:
    cfg = get_config(model)
    n, kv, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head
    kv_bytes = batch * kv * context * h * 2 * 2
    layers = int(min(cfg.num_hidden_layers, max(4, -(-512 * 2**20 // (2 * batch * kv * s * h * 2)))))
    inv = inv_frequencies(h, cfg.rope_theta)
    draw = jax.jit(lambda key, shape: jax.random.normal(key, shape, BF16), static_argnums=(1,))
    qkv = [draw(jax.random.key(500 + i), (batch, n + 2 * kv, h)) for i in range(layers)]
    pos = jnp.full((batch,), context, jnp.int32)

    def fresh():  # random caches, made on the device (15 GB at 7B x 16K)
        return [LayerCache(draw(jax.random.key(2 * i), (batch, kv, s, h)),
                           draw(jax.random.key(2 * i + 1), (batch, kv, s, h)))
                for i in range(layers)]

    def program(cand):
        if cand is None:
            step = lambda q, c: decode_attention_xla(q, c, pos, cfg.rope_theta, n)
        else:
            bl, sp, w, st = cand
            step = lambda q, c: decode_attention(q, c, pos, inv, n, splits=sp, block=bl, warps=w, stages=st,
                                                 interpret=INTERPRET)

        def run(cs):
            outs = [step(q, c) for q, c in zip(qkv, cs)]
            # every layer's output is returned (else XLA drops the unused attention and times only the cache writes)
            return [c for _, c in outs], [o for o, _ in outs]
        return jax.jit(run, donate_argnums=(0,))

    cands = [None] + attention_candidates(batch, kv, s, quick)
    caches = fresh()
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), caches)
    progs = {c: program(c) for c in cands}
    futs = {pool.submit(lambda c=c: progs[c].lower(like).compile()): c for c in cands}
    compiled, rows = {}, []
    for f in concurrent.futures.as_completed(futs):
        try:
            compiled[futs[f]] = f.result()
        except Exception as e:  # noqa: BLE001 - a launch that does not compile is a finding
            rows.append({"model": model, "batch": batch, "op": "attention", "cache": s, "config": str(futs[f]),
                         "error": repr(e)[:300]})
    ref = None
    for cand in cands:
        if cand not in compiled:
            continue
        try:
            # every candidate first runs on the same fresh caches: its first layer's output against XLA's
            caches, o = compiled[cand](fresh())
            o = o[0].astype(jnp.float32)
            if cand is None:
                ref = o
            err = None if cand is None or ref is None else float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
            t, caches = _timed(lambda cs, c=cand: compiled[c](cs)[0], caches)
            rows.append({"model": model, "batch": batch, "op": "attention", "cache": s, "context": context,
                         "config": "xla" if cand is None else dict(zip(("block", "splits", "warps", "stages"), cand)),
                         "us": t / layers * 1e6, "GBps": kv_bytes / (t / layers) / 1e9, "rel_err": err})
        except Exception as e:  # noqa: BLE001
            rows.append({"model": model, "batch": batch, "op": "attention", "cache": s, "config": str(cand),
                         "error": repr(e)[:300]})
    del caches
    ok = [r for r in rows if "us" in r]
    if ok:
        best = min(ok, key=lambda r: r["us"])
        xla = next((r["us"] for r in ok if r["config"] == "xla"), float("nan"))
        print(f"{model} b{batch} attention s={s} ctx={context}: xla {xla:8.1f} us | best {best['config']} "
              f"{best['us']:8.1f} us ({best['GBps']:.0f} GB/s, err {best['rel_err']})", flush=True)
    return rows


def tuning(rows: list[dict], max_err: float = 2e-2) -> dict:
    """The fastest correct Pallas launch per shape with the XLA time beside it (kernels/tuning.load_tuning)."""
    out = {"linear": {}, "attention": []}
    groups = {}
    for r in rows:
        if "us" in r:
            key = (r["op"], r["model"], r["batch"], r.get("cache"))
            groups.setdefault(key, []).append(r)
    for (op, model, batch, s), rs in groups.items():
        xla = next((r["us"] for r in rs if r["config"] == "xla"), None)
        ok = [r for r in rs if r["config"] != "xla" and r.get("rel_err") is not None and r["rel_err"] < max_err]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        if xla is None and best is None:
            continue
        cfg = get_config(model)
        if op == "attention":
            out["attention"].append([cfg.num_key_value_heads, cfg.dim_per_head, batch, s,
                                     None if best is None else best["config"], best["us"] if best else None, xla])
        elif best is not None:
            out["linear"].setdefault(op, []).append([best["K"], best["N"], batch, best["config"], best["us"],
                                                     xla if xla is not None else float("inf")])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two launches per op (smoke run)")
    ap.add_argument("--parts", default="linear,attention")
    ap.add_argument("--tiny", action="store_true", help="a small model under the Pallas interpreter (CPU smoke run)")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds: linear shapes stop at half, attention at all")
    ap.add_argument("--tuning-out", help="write the winners as a tuning JSON (EARL_DECODE_TUNING, kernels/tuning.py)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    global INTERPRET, CALLS
    linear_shapes = (("qwen2.5-0.5b", 32), ("qwen2.5-0.5b", 128), ("qwen2.5-7b", 32), ("qwen2.5-7b", 128),
                     ("qwen2.5-1.5b", 32))
    attention_shapes = (("qwen2.5-0.5b", 32, 384, 256), ("qwen2.5-0.5b", 128, 384, 256),
                        ("qwen2.5-7b", 32, 384, 256), ("qwen2.5-7b", 128, 384, 256),
                        ("qwen2.5-1.5b", 32, 24576, 16448), ("qwen2.5-7b", 32, 24576, 16448))
    if args.tiny:
        INTERPRET, CALLS = True, 2
        linear_shapes, attention_shapes = (("small", 16),), (("small", 4, 384, 200), ("small", 2, 2048, 1500))
    from earl_jax.parallel.profile import device_slug
    path = Path(__file__).resolve().parents[1] / "results" / f"bench_decode_ops_{device_slug(dev.device_kind)}.json"

    def save():  # after every shape: a call cut short (or a kernel fault) keeps what was measured
        res = {"device": dev.device_kind, "jax": jax.__version__, "rows": rows, "tuning": tuning(rows)}
        if args.tuning_out:
            Path(args.tuning_out).write_text(json.dumps(res["tuning"], indent=1))
        if not args.tiny:
            path.write_text(json.dumps(res, indent=1))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / path.name).write_text(json.dumps(res, indent=1))

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        if "linear" in args.parts:
            for model, batch in linear_shapes:
                if time.perf_counter() > t0 + args.deadline / 2:
                    rows.append({"model": model, "batch": batch, "skipped": "deadline"})
                    continue
                rows += sweep_linear(model, batch, args.quick, pool, rng)
                save()
                print(f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        deadline = t0 + args.deadline
        if "attention" in args.parts:
            for model, batch, s, ctx in attention_shapes:
                if time.perf_counter() > deadline:
                    rows.append({"model": model, "batch": batch, "op": "attention", "skipped": "deadline"})
                    continue
                rows += sweep_attention(model, batch, s, ctx, args.quick, pool)
                save()
                print(f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
    save()
    print(f"wrote {path} ({len(rows)} rows, {sum('error' in r for r in rows)} errors)")


if __name__ == "__main__":
    main()
