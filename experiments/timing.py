"""Timing helpers shared by the dispatch benchmarks (Fig. 4 and the weight-move benchmark)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def median_ms(fn, repeats: int, setup=lambda: None, warmup: int = 2) -> float:
    """Median wall time of fn(setup()); setup runs outside the clock. A fresh on-device copy of the
    input each time matters: jax caches an array's host copy after the first np.asarray, which would
    let the host-bound baselines skip their device-to-host transfer on every repeat."""
    ts = []
    for k in range(warmup + repeats):
        arg = jax.block_until_ready(setup())
        t = time.perf_counter()
        jax.block_until_ready(fn(arg))
        if k >= warmup:
            ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


_copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))


def fresh_copy(tree):
    """New device buffers with the same values and shardings (no host involved)."""
    out = _copy(tree)
    assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree)))
    return out
