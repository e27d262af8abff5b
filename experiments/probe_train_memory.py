"""XLA's own memory plan of one train micro-batch step (`rl.stages.grad_step`) against the memory model's
estimate, per layer count, tokens and remat: the temp bytes XLA assigns (compile only, nothing runs).

    python experiments/probe_train_memory.py                 # this machine's first device, 2 and 4 layers
    python experiments/probe_train_memory.py --full          # all 28 layers at 16 and 4 rows x 2048 (printed)
    JAX_PLATFORMS=cpu python experiments/probe_train_memory.py

Why: on 4 H100s a 1.5B train step planned at 16 rows x 2048 tokens per device (estimate ~31 GiB) asked XLA for a
50 GiB temp buffer and ran out of memory; the slope of temp over layers and tokens says what is kept per layer.
Writes experiments/results/probe_train_memory_<device>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from earl_jax.models.config import get_config  # noqa: E402
from earl_jax.models.init import abstract_model  # noqa: E402
from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel  # noqa: E402
from earl_jax.parallel.profile import device_slug  # noqa: E402
from earl_jax.rl import stages  # noqa: E402
from earl_jax.rl.losses import LossConfig  # noqa: E402
from earl_jax.sharding.mesh import MeshShape  # noqa: E402


def probe(model_name: str, layers: int, rows: int, t: int, remat: bool) -> dict:
    cfg = get_config(model_name, vocab_size=101).replace(num_hidden_layers=layers)
    model = abstract_model(cfg, dtype=jnp.bfloat16)
    model.remat = remat
    graphdef, params = nnx.split(model)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    spec = lambda dt: jax.ShapeDtypeStruct((rows, t), dt)  # noqa: E731
    batch = stages.ExperienceBatch(spec(jnp.int32), spec(jnp.bool_), spec(jnp.float32), spec(jnp.float32),
                                   spec(jnp.float32))
    kw = dict(graphdef=graphdef, loss="policy", loss_cfg=LossConfig(), chunk=256)
    acc = jax.eval_shape(lambda p, b: stages.zero_acc(p, b, **kw), params, batch)
    step = jax.jit(lambda p, a, b: stages.grad_step(p, a, b, 0, micro_batches=1, shards=1, width=t,
                                                     token_weighted=True, **kw), donate_argnums=(1,))
    m = step.lower(params, acc, batch).compile().memory_analysis()
    est = MemoryModel(cfg, MemoryConfig(budget_bytes=80 * GiB, remat=remat)).estimate(
        "train", MeshShape(1, 1, 1), t, rows, rows, 256)
    return {"model": model_name, "layers": layers, "rows": rows, "t": t, "remat": remat,
            "xla_temp_gib": m.temp_size_in_bytes / GiB, "xla_args_gib": m.argument_size_in_bytes / GiB,
            "model_activations_gib": est.activations / GiB, "model_total_gib": est.total / GiB}


def main() -> None:
    full = "--full" in sys.argv  # the whole 28-layer model at the 4-GPU pod run's micro-batches
    cases = ([(28, 16, 2048, True), (28, 4, 2048, True)] if full else
             [(layers, rows, t, remat) for layers in (2, 4) for rows, t in ((4, 512), (8, 1024)) for remat in (True, False)])
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
