"""XLA's own memory plan of one train micro-batch step (`rl.algorithm.micro_steps.take_micro` + `micro_grad`, as
rl/algorithm/packing.py
runs it) against the memory model's estimate, per layer count, tokens and remat: the temp bytes XLA assigns
(compile only, nothing runs).

    python experiments/lab/probe_train_memory.py                 # this machine's first device, 2 and 4 layers
    python experiments/lab/probe_train_memory.py --full  # all 28 layers at 16 and 4 rows x 2048 (printed)
    python experiments/lab/probe_train_memory.py --mesh d2f1t1 4 32 2048   # one case on a train mesh (printed);
    EARL_PER_SHARD_CUDNN=0 ...                                          # cuDNN attention left to XLA's partitioner
    JAX_PLATFORMS=cpu python experiments/lab/probe_train_memory.py

Why: on 4 H100s a 1.5B train step planned at 16 rows x 2048 tokens per device (estimate ~31 GiB) asked XLA for a
50 GiB temp buffer and ran out of memory; the slope of temp over layers and tokens says what is kept per layer.
Writes experiments/results/probe_train_memory_<device>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from earl_jax.models.init import abstract_model  # noqa: E402
from earl_jax.models.model_config import get_config  # noqa: E402
from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel  # noqa: E402
from earl_jax.parallel.profile import device_slug  # noqa: E402
from earl_jax.rl.algorithm import micro_steps as stages  # noqa: E402
from earl_jax.rl.algorithm.losses import LossConfig  # noqa: E402
from earl_jax.sharding.mesh import MeshShape  # noqa: E402


def probe(model_name: str, layers: int, rows: int, t: int, remat: bool, mesh: str | None = None) -> dict:
    """`rows` are global; with `mesh` (dAfBtC over the first devices) the step is compiled for the train
    stage's shardings of that mesh, and XLA reports the bytes of one device."""
    import contextlib

    from earl_jax.sharding.context import use_mesh_rules
    from earl_jax.sharding.mesh import logical_sharding, make_mesh, state_shardings
    from earl_jax.sharding.stage_registry import STAGE_RULES

    cfg = get_config(model_name, vocab_size=101).replace(num_hidden_layers=layers)
    model = abstract_model(cfg, dtype=jnp.bfloat16)
    model.remat = remat
    graphdef, params = nnx.split(model)
    shape = MeshShape.parse(mesh) if mesh else MeshShape()
    jmesh = make_mesh(shape, jax.devices()[:shape.size])
    rules = STAGE_RULES["train"]
    ctx = (lambda: use_mesh_rules(jmesh, rules)) if mesh else contextlib.nullcontext
    put = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    params = jax.tree.map(put, params, state_shardings(params, jmesh, rules))
    rows_sharding = logical_sharding(jmesh, rules, ("batch", None))
    spec = lambda dt: jax.ShapeDtypeStruct((rows, t), dt, sharding=rows_sharding)  # noqa: E731
    batch = stages.ExperienceBatch(spec(jnp.int32), spec(jnp.bool_), spec(jnp.float32), spec(jnp.float32),
                                   spec(jnp.float32))
    kw = dict(graphdef=graphdef, loss="policy", loss_cfg=LossConfig(), chunk=256)
    # EARL_PROBE_SHARDS=1: no interleaved row split (split_rows reshapes rows as (shards, micro-batches, ...))
    shards = int(__import__("os").environ.get("EARL_PROBE_SHARDS", shape.data * shape.fsdp))

    def zero(p, b):
        with ctx():
            return stages.zero_acc(p, b, **kw)

    def step(p, a, b):
        with ctx():
            mb, w = stages.take_micro(b, 0, micro_batches=1, shards=shards, width=t, token_weighted=True)
            return stages.micro_grad(p, a, mb, w, **kw)

    grads, loss, metrics = jax.eval_shape(zero, params, batch)
    replicated = jax.sharding.NamedSharding(jmesh, jax.sharding.PartitionSpec())
    acc = (jax.tree.map(lambda g, p: put(g, p.sharding), grads, params), put(loss, replicated),
           jax.tree.map(lambda m: put(m, replicated), metrics))
    m = jax.jit(step, donate_argnums=(1,)).lower(params, acc, batch).compile().memory_analysis()
    est = MemoryModel(cfg, MemoryConfig(budget_bytes=80 * GiB, remat=remat)).estimate(
        "train", MeshShape(1, 1, 1), t, rows, rows, 256)
    return {"model": model_name, "layers": layers, "rows": rows, "t": t, "remat": remat, "mesh": str(shape),
            "per_shard_cudnn": __import__("earl_jax.models.attention", fromlist=["x"]).PER_SHARD_CUDNN,
            "xla_temp_gib": m.temp_size_in_bytes / GiB, "xla_args_gib": m.argument_size_in_bytes / GiB,
            "model_activations_gib": est.activations / GiB, "model_total_gib": est.total / GiB}


def main() -> None:
    if "--mesh" in sys.argv:  # one sharded case: python probe_train_memory.py --mesh d2f1t1 LAYERS ROWS T
        i = sys.argv.index("--mesh")
        mesh, layers, rows, t = sys.argv[i + 1], *map(int, sys.argv[i + 2:i + 5])
        print(json.dumps(probe("qwen2.5-1.5b", layers, rows, t, True, mesh)), flush=True)
        return
    full = "--full" in sys.argv  # the whole 28-layer model at the 4-GPU pod run's micro-batches
    cases = ([(28, 16, 2048, True), (28, 4, 2048, True)] if full else
             [(layers, rows, t, remat) for layers in (2, 4) for rows, t in ((4, 512), (8, 1024))
              for remat in (True, False)])
    out = []
    for layers, rows, t, remat in cases:
        r = probe("qwen2.5-1.5b", layers, rows, t, remat)
        print(json.dumps(r), flush=True)
        out.append(r)
    if full:
        return
    kind = jax.devices()[0].device_kind
    path = ROOT / "experiments" / "results" / f"probe_train_memory_{device_slug(kind)}.json"
    path.write_text(json.dumps({"device": kind, "jax": jax.__version__, "probes": out}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
