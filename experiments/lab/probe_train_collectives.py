"""Why a data-parallel train step needs more memory per device than the same per-device work on one device:
the collectives XLA put into one micro-batch step (`rl.algorithm.micro_steps.take_micro` + `micro_grad`, as
rl/algorithm/packing.py runs it) and the largest buffers it assigned.

    python experiments/lab/probe_train_collectives.py d1f1t1 4 16 2048 d2f1t1 4 32 2048  # pairs: mesh layers
                                                                                                 # rows t
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
        python experiments/lab/probe_train_collectives.py d4f1t1 2 8 512

Compile only (nothing runs), with the options the planner gives the train stage (`stage_compiler_options`;
EARL_XLA_LHS=1 for XLA's defaults). Prints one JSON line per case: XLA's temp bytes, the collectives by kind and
result shape, and the 15 largest values in its temp allocation (from an XLA dump in a temp folder).
Qwen2.5-1.5B shape with the layer count given, bf16, remat on, the game vocabulary (101).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

DUMP = tempfile.mkdtemp(prefix="xla_dump_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} "
                           "--xla_dump_hlo_module_re=.*step.*").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from earl_jax.models.init import abstract_model  # noqa: E402
from earl_jax.models.model_config import get_config  # noqa: E402
from earl_jax.parallel.planner import stage_compiler_options  # noqa: E402
from earl_jax.rl.algorithm import micro_steps as stages  # noqa: E402
from earl_jax.rl.algorithm.losses import LossConfig  # noqa: E402
from earl_jax.sharding.context import use_mesh_rules  # noqa: E402
from earl_jax.sharding.mesh import MeshShape, logical_sharding, make_mesh, state_shardings  # noqa: E402
from earl_jax.sharding.stage_registry import STAGE_RULES  # noqa: E402

COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
ALLOC = re.compile(r"allocation (\d+): size (\d+)(.*)")


VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (.*)")


def temp_values(before: set[str]) -> list[dict]:
    """Every value XLA placed in the step's temp allocation (they overlap in time: sizes, not a sum)."""
    out = []
    for path in Path(DUMP).glob("*buffer-assignment.txt"):
        if str(path) in before:
            continue
        in_temp = False
        for line in path.read_text().splitlines():
            if line.startswith("allocation "):
                in_temp = "preallocated-temp" in line
            elif in_temp and (m := VALUE.search(line)):
                out.append({"mib": round(int(m.group(2)) / 2**20, 1), "name": m.group(1), "shape": m.group(3)[:80]})
    return sorted(out, key=lambda v: -v["mib"])


def by_shape(values: list[dict], min_mib: float = 32.0) -> dict[str, int]:
    """How many temp values of each shape of at least `min_mib` (what a mesh program holds that one device's
    does not shows up here as a shape or a count)."""
    return dict(Counter(v["shape"].split("{")[0] for v in values if v["mib"] >= min_mib).most_common(25))


def probe(mesh: str, layers: int, rows: int, t: int) -> dict:
    cfg = get_config("qwen2.5-1.5b", vocab_size=101).replace(num_hidden_layers=layers)
    model = abstract_model(cfg, dtype=jnp.bfloat16)
    model.remat = True
    graphdef, params = nnx.split(model)
    shape = MeshShape.parse(mesh)
    jmesh = make_mesh(shape, jax.devices()[:shape.size])
    rules = STAGE_RULES["train"]
    ctx = (lambda: use_mesh_rules(jmesh, rules)) if shape.size > 1 else contextlib.nullcontext
    put = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    params = jax.tree.map(put, params, state_shardings(params, jmesh, rules))
    spec = lambda dt: jax.ShapeDtypeStruct((rows, t), dt, sharding=logical_sharding(jmesh, rules, ("batch", None)))  # noqa: E731
    batch = stages.ExperienceBatch(spec(jnp.int32), spec(jnp.bool_), spec(jnp.float32), spec(jnp.float32),
                                   spec(jnp.float32))
    kw = dict(graphdef=graphdef, loss="policy", loss_cfg=LossConfig(), chunk=256)

    def zero(p, b):
        with ctx():
            return stages.zero_acc(p, b, **kw)

    def step(p, a, b):
        with ctx():
            mb, w = stages.take_micro(b, 0, micro_batches=1, shards=shape.data * shape.fsdp, width=t,
                                      token_weighted=True)
            return stages.micro_grad(p, a, mb, w, **kw)

    grads, loss, metrics = jax.eval_shape(zero, params, batch)
    rep = jax.sharding.NamedSharding(jmesh, jax.sharding.PartitionSpec())
    acc = (jax.tree.map(lambda g, p: put(g, p.sharding), grads, params), put(loss, rep),
           jax.tree.map(lambda m: put(m, rep), metrics))
    before = {str(p) for p in Path(DUMP).glob("*buffer-assignment.txt")}
    options = stage_compiler_options("train", jmesh)  # what the planner compiles the train stage with
    compiled = jax.jit(step, donate_argnums=(1,), compiler_options=options).lower(params, acc, batch).compile()
    collectives = Counter()
    for line in compiled.as_text().splitlines():
        m = COLLECTIVE.search(line)
        if m:
            collectives[f"{m.group(2)} {m.group(1)[:120]}"] += 1
    mem = compiled.memory_analysis()
    values = temp_values(before)
    return {"device": jax.devices()[0].device_kind, "mesh": mesh, "compiler_options": options, "layers": layers,
            "rows": rows, "t": t,
            "temp_gib": mem.temp_size_in_bytes / 2**30, "args_gib": mem.argument_size_in_bytes / 2**30,
            "collectives": dict(collectives.most_common(20)), "largest_temp_values": values[:15],
            "temp_values_by_shape": by_shape(values),
            "temp_values": len(values)}


def main(argv: list[str]) -> None:
    for i in range(0, len(argv), 4):
        print(json.dumps(probe(argv[i], *map(int, argv[i + 1:i + 4]))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["d1f1t1", "2", "8", "512"])
