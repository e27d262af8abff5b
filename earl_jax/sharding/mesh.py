"""Meshes per stage and the logical-axis rules that map model axes onto them (MaxText style).

Model code names axes logically (vocab, embed, heads, ...); a stage's rules table maps each to a mesh
axis, so a new layout is a new table, never new model code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Mesh axis names. Rollout and experience use (data, tensor); training adds fsdp between them.
DATA, FSDP, TENSOR = "data", "fsdp", "tensor"

Rules = Mapping[str, Any]  # logical axis -> mesh axis name, tuple of names, or None (replicated)

# Inference stages: Megatron-style tensor parallelism, batch over data.
INFERENCE_RULES: Rules = {
    "vocab": TENSOR, "embed": None, "heads": TENSOR, "kv_heads": TENSOR, "head_dim": None, "mlp": TENSOR,
    "layers": None,
    # activations
    "batch": DATA, "length": None, "cache_length": None, "act_embed": None,
    "act_heads": TENSOR, "act_kv_heads": TENSOR, "act_mlp": TENSOR, "act_vocab": TENSOR,
}
# Training: parameters (and so gradients and optimizer state) also split over fsdp along embed.
TRAIN_RULES: Rules = {**INFERENCE_RULES, "embed": FSDP, "batch": (DATA, FSDP)}
# Each stage names its table when it registers (sharding/stage_registry.py: STAGE_RULES).


@dataclasses.dataclass(frozen=True, order=True)
class MeshShape:
    """A stage's mesh: data x fsdp x tensor devices (fsdp is 1 outside training)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def axis_names(self) -> tuple[str, ...]:
        return (DATA, FSDP, TENSOR)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.data, self.fsdp, self.tensor)

    def __str__(self) -> str:
        return f"d{self.data}f{self.fsdp}t{self.tensor}"

    @classmethod
    def parse(cls, s: str) -> "MeshShape":
        """Inverse of str(): 'd2f1t4' -> MeshShape(2, 1, 4); also accepts '2x4' as data x tensor."""
        s = s.strip().lower()
        try:
            if "x" in s:
                d, t = (int(v) for v in s.split("x"))
                return cls(d, 1, t)
            d, rest = s[1:].split("f")
            f, t = rest.split("t")
            return cls(int(d), int(f), int(t))
        except ValueError as e:
            raise ValueError(f"cannot parse mesh shape {s!r}: expected 'dAfBtC' or 'AxB'") from e


def make_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 3-axis mesh (data, fsdp, tensor) over `devices` (default: all), tensor innermost (fastest links)."""
    devices = list(jax.devices() if devices is None else devices)
    if shape.size != len(devices):
        raise ValueError(f"mesh {shape} needs {shape.size} devices, got {len(devices)}")
    return Mesh(np.asarray(devices, dtype=object).reshape(shape.shape), shape.axis_names)


def logical_to_spec(logical_axes: Iterable[str | None], rules: Rules, mesh: Mesh | None = None,
                    shape: Sequence[int] | None = None) -> P:
    """Map logical axis names to a PartitionSpec. A dimension that the mesh axes do not divide stays
    replicated (e.g. 2 KV heads on tensor=4), and each mesh axis is used at most once."""
    used: set[str] = set()
    out = []
    for i, name in enumerate(logical_axes):
        target = rules.get(name) if name is not None else None
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        axes = tuple(a for a in axes if a not in used and (mesh is None or mesh.shape.get(a, 1) > 1))
        if mesh is not None and shape is not None and axes:
            if shape[i] % math.prod(mesh.shape[a] for a in axes):
                axes = ()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def logical_sharding(mesh: Mesh, rules: Rules, logical_axes: Sequence[str | None],
                     shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh, shape))


def batch_axes(mesh: Mesh, rules: Rules) -> tuple[str, ...]:
    """The mesh axes rows are split over: the rules table's "batch" entry, those the mesh has."""
    entry = rules.get("batch")
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(a for a in axes if a in mesh.shape)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """NamedSharding for every variable of an (abstract or concrete) nnx.State, from its `logical_axes`.

    The result has the state's own tree structure (each Variable holds its sharding), so it can be
    flattened alongside the state: jit out_shardings, the dispatcher's targets.
    """

    def one(v: nnx.Variable) -> nnx.Variable:
        shape = v.get_value().shape
        axes = v.get_metadata().get("logical_axes") or (None,) * len(shape)
        return v.replace(logical_sharding(mesh, rules, axes, shape))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def mesh_shape_of(mesh: Mesh) -> MeshShape:
    return MeshShape(mesh.shape.get(DATA, 1), mesh.shape.get(FSDP, 1), mesh.shape.get(TENSOR, 1))
