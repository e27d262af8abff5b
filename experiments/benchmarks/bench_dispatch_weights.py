"""Weight dispatch train -> rollout (every RL iteration), Qwen2.5 shapes, centralized vs device_put vs earl.

Parameters are laid out by mesh.STAGE_RULES: train splits embed over fsdp and heads / mlp / vocab over
tensor; rollout keeps tensor parallelism only. The moves:

- fsdp->tp:    train (1, n, 1) -> rollout (1, 1, n): all-to-all per weight (the case XLA would
               rematerialize without the dispatcher's intermediate layout),
- fsdp->dp:    train (1, n, 1) -> rollout (n, 1, 1): every rollout replica needs all weights (all-gather),
- half->half:  train on the first half of the devices, rollout (tensor) on the second (two_step).

    python experiments/benchmarks/bench_dispatch_weights.py                 # GPUs: qwen2.5-0.5b in bf16
    python experiments/benchmarks/bench_dispatch_weights.py --small         # CPU, 8 fake devices, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/timing.py

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from earl_jax.models.model_config import ModelConfig, get_config  # noqa: E402
from earl_jax.parallel.dispatch import Dispatcher  # noqa: E402
from earl_jax.sharding.mesh import MeshShape, logical_sharding, make_mesh  # noqa: E402
from earl_jax.sharding.stage_registry import STAGE_RULES  # noqa: E402
from timing import fresh_copy, median_ms  # noqa: E402


def param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Shape and logical axes of every parameter, one leaf per layer and tensor (as an nnx state has)."""
    d, f, v, h = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.dim_per_head
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = {"embed": ((v, d), ("vocab", "embed")), "final_norm": ((d,), ("embed",))}
    for i in range(cfg.num_hidden_layers):
        p = f"layer{i:02d}/"
        out |= {p + "q": ((d, nq, h), ("embed", "heads", "head_dim")),
                p + "k": ((d, nkv, h), ("embed", "kv_heads", "head_dim")),
                p + "v": ((d, nkv, h), ("embed", "kv_heads", "head_dim")),
                p + "o": ((nq, h, d), ("heads", "head_dim", "embed")),
                p + "gate": ((d, f), ("embed", "mlp")), p + "up": ((d, f), ("embed", "mlp")),
                p + "down": ((f, d), ("mlp", "embed")), p + "norm1": ((d,), ("embed",)),
                p + "norm2": ((d,), ("embed",))}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((d, v), ("embed", "vocab"))
    return out


def shardings(specs, shape: MeshShape, stage: str, devices=None):
    mesh = make_mesh(shape, devices)
    return {k: logical_sharding(mesh, STAGE_RULES[stage], ax, s) for k, (s, ax) in specs.items()}




def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", default=None)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = p.parse_args(argv)
    devs = jax.devices()
    n = len(devs)
    small = args.small if args.small is not None else devs[0].platform == "cpu"
    cfg = ModelConfig.tiny(vocab_size=256).replace(num_hidden_layers=4) if small else get_config(args.model)
    repeats = args.repeats or (3 if small else 10)
    specs = param_specs(cfg)
    moves = {"fsdp->tp": (shardings(specs, MeshShape(1, n, 1), "train"),
                          shardings(specs, MeshShape(1, 1, n), "rollout")),
             "fsdp->dp": (shardings(specs, MeshShape(1, n, 1), "train"),
                          shardings(specs, MeshShape(n, 1, 1), "rollout"))}
    if n >= 2:
        h = n // 2
        moves["half->half"] = (shardings(specs, MeshShape(1, h, 1), "train", devs[:h]),
                               shardings(specs, MeshShape(1, 1, h), "rollout", devs[h:2 * h]))
    dispatcher = Dispatcher()
    rows = []
    for name, (src, dst) in moves.items():
        keys = list(specs)
        init = lambda key: {k: jax.random.normal(jax.random.fold_in(key, i), specs[k][0], jnp.bfloat16)  # noqa: E731
                            for i, k in enumerate(keys)}
        params = jax.jit(init, out_shardings=src)(jax.random.key(0))  # one program, made on device
        total = sum(x.nbytes for x in params.values())
        out = dispatcher(fresh_copy(params), dst)
        route = dispatcher.last.route
        compiles = dispatcher.last.compiled
        for k in keys[:3] + keys[-3:]:  # spot-check values and layouts (outside the timed loop)
            assert (np.array_equal(np.asarray(out[k]), np.asarray(params[k]))
                    and out[k].sharding.is_equivalent_to(dst[k], out[k].ndim))
        del out
        r = {"move": name, "route": route, "leaves": len(keys), "MiB": total / 2**20, "compiles": compiles}
        for m, route_name in (("centralized", "centralized"), ("device_put", "device_put"), ("earl", "auto")):
            r[f"{m}_ms"] = median_ms(lambda w: dispatcher(w, dst, route=route_name), repeats,
                                     setup=lambda: fresh_copy(params))  # noqa: F821 (`del`-ed below, after the last call)
        r["x_vs_centralized"] = r["centralized_ms"] / r["earl_ms"]
        r["x_vs_device_put"] = r["device_put_ms"] / r["earl_ms"]
        r["effective_GBps"] = total / r["earl_ms"] / 1e6
        rows.append(r)
        del params
    res = {"device_kind": devs[0].device_kind, "platform": devs[0].platform, "n_devices": n, "jax": jax.__version__,
           "model": cfg.name, "dtype": "bfloat16", "repeats": repeats, "small": small, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    from earl_jax.parallel.profile import device_slug

    path = args.out / f"bench_dispatch_weights_{device_slug(res['device_kind'], res['n_devices'])}.json"
    path.write_text(json.dumps(res, indent=1))

    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"Weight dispatch train -> rollout, {cfg.name} bf16 ({n} x {res['device_kind']}, "
                    f"median of {repeats})")
    for c in ("move", "route", "leaves", "MiB", "central ms", "device_put ms", "earl ms", "x central", "x device_put",
              "eff GB/s"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["move"], r["route"], str(r["leaves"]), f"{r['MiB']:.0f}", f"{r['centralized_ms']:.2f}",
                  f"{r['device_put_ms']:.2f}", f"{r['earl_ms']:.3f}", f"{r['x_vs_centralized']:.1f}",
                  f"{r['x_vs_device_put']:.1f}", f"{r['effective_GBps']:.1f}")
    Console(width=200).print(t)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
