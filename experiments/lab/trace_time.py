"""Python tracing and lowering of the train stage's gradient program (`stages.micro_grad`, remat on, chunked
log-probs) for a real-size model shape, with the decoder layers as one nested program traced once
(`models/qwen2._apply_layer`, the default) and as a plain Python loop over the layers (the code before it). No
weights are made: the model is abstract (`nnx.eval_shape`), so this runs on the CPU in seconds. Tracing and lowering
are what a warm start still pays (the compile cache saves only XLA's compile): on 4 H100s tracing this program for
Qwen2.5-1.5B took 8.7 s of a warm start (docs/results.md, "Start-up").

    python experiments/lab/trace_time.py [--model qwen2.5-1.5b] [--rows 8] [--width 1536] [--repeats 3]

Appends a run to experiments/results/trace_time_<backend>.json (medians over fresh traces of each variant, alternated).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure(model: str, rows: int, width: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from earl_jax.models import qwen2
    from earl_jax.models.model_config import PRESETS
    from earl_jax.rl.algorithm import micro_steps as stages
    from earl_jax.rl.algorithm.losses import LossConfig

    cfg = PRESETS[model]()
    abstract = nnx.eval_shape(lambda: qwen2.Qwen2(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    abstract.remat = True  # as the trainer sets it on accelerators
    graphdef, params = nnx.split(abstract)
    spec = jax.ShapeDtypeStruct
    batch = stages.ExperienceBatch(spec((rows, width), jnp.int32), spec((rows, width), jnp.bool_),
                                   *(spec((rows, width), jnp.float32) for _ in range(3)))
    kw = dict(graphdef=graphdef, loss="policy", loss_cfg=LossConfig(), chunk=512)
    acc = jax.eval_shape(lambda p, b: stages.zero_acc(p, b, **kw), params, batch)
    nested = qwen2._apply_layer

    def plain(layer, x, positions, cache, remat):  # the loop as it was: every layer traced on its own
        if cache is not None or not remat:
            return layer(x, positions, cache)
        layer_graphdef, state = nnx.split(layer)
        run = lambda st, h, pos: nnx.merge(layer_graphdef, st)(h, pos, None)[0]  # noqa: E731
        return jax.checkpoint(run, policy=qwen2._remat_policy(remat))(state, x, positions), None

    times: dict[str, list[tuple[float, float]]] = {"nested": [], "plain": []}
    try:
        for _ in range(repeats):
            for name, apply in (("nested", nested), ("plain", plain)):
                qwen2._apply_layer = apply
                qwen2._layer_program.cache_clear()  # a fresh process's traces: nothing cached from the last repeat
                fn = jax.jit(lambda p, a, b, w: stages.micro_grad(p, a, b, w, **kw))  # a new function: traced anew
                t0 = time.perf_counter()
                traced = fn.trace(params, acc, batch, spec((), jnp.float32))
                t1 = time.perf_counter()
                traced.lower()
                times[name].append((t1 - t0, time.perf_counter() - t1))
    finally:
        qwen2._apply_layer = nested
    out = {"model": model, "rows": rows, "width": width, "repeats": repeats, "backend": jax.default_backend(),
           "device": f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores"}
    for name, runs in times.items():
        out[name] = {"trace_s_median": round(statistics.median(t for t, _ in runs), 3),
                     "lower_s_median": round(statistics.median(lo for _, lo in runs), 3),
                     "all": [[round(t, 3), round(lo, 3)] for t, lo in runs]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    result = measure(args.model, args.rows, args.width, args.repeats)
    out = args.out or ROOT / "experiments" / "results" / f"trace_time_{result['backend']}.json"
    doc = json.loads(out.read_text()) if out.exists() else {"script": "experiments/trace_time.py", "runs": []}
    doc["runs"].append(result)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for name in ("nested", "plain"):
        print(f"{name}: trace {result[name]['trace_s_median']} s, lower {result[name]['lower_s_median']} s")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
