"""Activation sharding by logical axis names, active only inside `use_mesh_rules(...)`.

Model code calls `constrain(x, ("batch", "length", "act_embed"))`; a stage traces its program inside
`use_mesh_rules(mesh, rules)`, and the names become a `with_sharding_constraint` for that mesh. Outside
a context (single device, tests of the bare model) it is a no-op, so model code never names mesh axes.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Sequence

import jax
from jax.sharding import Mesh

from earl_jax.sharding.mesh import Rules, logical_sharding

_CURRENT: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("earl_mesh_rules", default=None)


@contextlib.contextmanager
def use_mesh_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    token = _CURRENT.set((mesh, rules))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_mesh_rules() -> tuple[Mesh, Rules] | None:
    return _CURRENT.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, logical_sharding(mesh, rules, logical_axes, x.shape))
