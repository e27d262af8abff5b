"""Build a model abstractly, or directly into a target sharding (never whole on one device).

Random init compiles one small program per distinct (initializer, shape, dtype, sharding), not one program
for the whole model. Every decoder layer has the same shapes, so a Qwen2 of any depth needs about ten
programs (embedding, q/k/v/o, biases, norm scale, gate/up, down, lm head), each reused for all its
parameters; the program size no longer grows with the model. The old single `jit(make)` over all
parameters did not finish compiling in 190 s for Qwen2.5-0.5B on 4 x H100. On 8 fake CPU devices
(2 shared cores, d1f8t1) it compiled in 20-39 s against 4-6.5 s for the 9 programs here
(experiments/benchmarks/bench_init.py, `--impl legacy`; experiments/results/bench_init_cpu.json).

Each program takes (seed, salt) and draws `fold_in(key(seed), salt)` with salt = crc32 of the parameter's
path ("layers.3.mlp.up_df"), so a parameter's values depend only on the seed and its own name (not on
construction order, and never on Python's salted hash), and with JAX's partitionable threefry they do not
depend on the mesh either. Programs write straight into their out_shardings: each device generates only
its own shard. The initializer comes from the parameter's metadata ("init", recorded by qwen2._param),
so init kinds are defined once, in the model.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import INITIALIZERS, Qwen2, shapes_only
from earl_jax.progress import mesh_str, params_str, phase
from earl_jax.sharding.mesh import Rules, state_shardings


def abstract_model(cfg: ModelConfig, **kw: Any) -> Qwen2:
    """Shapes, dtypes and metadata (logical axes, initializer) only: a 72B model costs no memory."""
    def build():
        with shapes_only():
            return Qwen2(cfg, rngs=nnx.Rngs(0), **kw)

    return nnx.eval_shape(build)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules, **kw: Any) -> nnx.State:
    _, state = nnx.split(abstract_model(cfg, **kw))
    return state_shardings(state, mesh, rules)


@dataclasses.dataclass(frozen=True)
class ParamInit:
    """How one parameter is created: its program (`key`) and its own random stream (`salt`)."""

    path: tuple
    kind: str  # a name in qwen2.INITIALIZERS
    shape: tuple[int, ...]
    dtype: Any
    sharding: NamedSharding
    salt: int

    @property
    def key(self) -> tuple:
        return (self.kind, self.shape, np.dtype(self.dtype).name, self.sharding)


def init_plan(abstract_state: nnx.State, shardings: nnx.State) -> list[ParamInit]:
    """One ParamInit per variable; fails on a variable without a known initializer or on a salt clash."""
    targets = {p: s.get_value() for p, s in nnx.to_flat_state(shardings)}
    plan, salts = [], {}
    for path, var in nnx.to_flat_state(abstract_state):
        name = ".".join(str(p) for p in path)
        kind = var.get_metadata().get("init")
        if kind not in INITIALIZERS:
            raise ValueError(f"parameter {name} has initializer {kind!r}, not one of {sorted(INITIALIZERS)}: "
                             f"create parameters with qwen2._param so init_sharded knows how to fill them")
        salt = zlib.crc32(name.encode())
        if salt in salts:  # two parameters with one random stream would be identical
            raise ValueError(f"parameters {salts[salt]} and {name} hash to the same init salt")
        salts[salt] = name
        value = var.get_value()
        plan.append(ParamInit(path, kind, tuple(value.shape), value.dtype, targets[path], salt))
    return plan


# Compiled init programs by ParamInit.key: a second model of the same shapes on the same mesh compiles none.
_PROGRAMS: dict[tuple, Callable] = {}


def clear_program_cache() -> None:
    _PROGRAMS.clear()


def _lower(p: ParamInit):
    init = INITIALIZERS[p.kind]
    shape, dtype = p.shape, p.dtype

    def make(seed, salt):
        return init(jax.random.fold_in(jax.random.key(seed), salt), shape, dtype)

    scalar = NamedSharding(p.sharding.mesh, P())  # (seed, salt): the same on every device and process
    u32 = jax.ShapeDtypeStruct((), jnp.uint32)
    # Partitionable threefry (jax's default since 0.5, pinned here): each device draws only its shard, and
    # the values do not depend on the sharding; the other scheme may materialize the whole array per device.
    with jax.threefry_partitionable(True):
        return jax.jit(make, in_shardings=(scalar, scalar), out_shardings=p.sharding).lower(u32, u32)


def compile_programs(plan: list[ParamInit], workers: int = 8) -> int:
    """Compile the plan's programs not yet cached; returns how many it compiled.

    Lowering (tracing, Python) runs here one by one; XLA compiles run in threads (XLA releases the GIL),
    so on a machine with free cores they overlap.
    """
    todo = {}
    for p in plan:
        if p.key not in _PROGRAMS and p.key not in todo:
            todo[p.key] = _lower(p)
    if todo:
        with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
            for key, compiled in zip(todo, pool.map(lambda lowered: lowered.compile(), todo.values())):
                _PROGRAMS[key] = compiled
    return len(todo)


def fill_state(abstract_state: nnx.State, plan: list[ParamInit], seed: int) -> nnx.State:
    """Run each parameter's program (compiling what is missing); returns the concrete state."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    compile_programs(plan)
    by_path = dict(nnx.to_flat_state(abstract_state))
    leaves = [(p.path, by_path[p.path].replace(value=_PROGRAMS[p.key](np.uint32(seed), np.uint32(p.salt))))
              for p in plan]
    return nnx.from_flat_state(leaves)


def init_sharded(cfg: ModelConfig, mesh: Mesh, rules: Rules, seed: int = 0, **kw: Any) -> Qwen2:
    """Random init (std-0.02 normal matrices, zero biases, unit norm scales), each parameter created in
    its sharding under `rules`: deterministic for a seed, independent of the mesh."""
    with phase(f"model: {cfg.name}, {params_str(cfg.num_params())} params, init on mesh {mesh_str(mesh)}",
               compiles=True):
        graphdef, abstract_state = nnx.split(abstract_model(cfg, **kw))
        plan = init_plan(abstract_state, state_shardings(abstract_state, mesh, rules))
        # Wait for the values, so the logged time is the real one (dispatch is asynchronous).
        state = jax.block_until_ready(fill_state(abstract_state, plan, seed))
    return nnx.merge(graphdef, state)

