"""The decode step's cache write + attention (one new query token per row) as one Pallas GPU kernel.

XLA's version runs a scatter for the new key/value and five kernels per layer for the attention (scores
matmul, max, sum, cast, probs x V) over the whole bucketed cache. This is a single kernel per layer: one
program per (row, kv head) writes the new key/value in place (the cache buffers are aliased to the
outputs) and streams K and V blocks of that row only up to its own position (flash-decoding online
softmax). Cache layout [b, kv_heads, s, h] as in models/cache.py. Runs under `interpret=True` on CPU
(tests). Variants measured and dropped (a separate flash-decoding kernel after XLA's write, RoPE inside
the kernel): experiments/results/bench_rollout_notes.md.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int


def _attend_blocks(scores, v_ref, length, block_k: int, carry):
    """Flash-decoding online softmax over cache blocks [0, length): `scores(sl)` -> [G, block_k] float32
    for the block at slice `sl`; `carry` = (o, m, l) to start from. Returns the normalized output [G, h]."""
    idx = jnp.arange(block_k)

    def body(i, carry):
        o, m, l = carry
        sl = pl.ds(i * block_k, block_k)
        sc = jnp.where((i * block_k + idx)[None, :] < length, scores(sl), -1e30)
        m_new = jnp.maximum(m, sc.max(axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(sc - m_new[:, None])
        l = l * corr + p.sum(axis=-1)
        v = v_ref[sl, :]
        o = o * corr[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o, m_new, l

    o, _, l = jax.lax.fori_loop(0, pl.cdiv(length, block_k), body, carry)
    return o / l[:, None]


def _dot_scores(q, k_ref, sl):
    return jnp.dot(q, k_ref[sl, :].T, preferred_element_type=jnp.float32)  # [G, block_k]


# Kernel launch parameters (overridable for tuning sweeps: EARL_DECODE_{BLOCK_K,WARPS,STAGES}).
KERNEL_BLOCK_K = int(os.environ.get("EARL_DECODE_BLOCK_K", 128))
KERNEL_WARPS = int(os.environ.get("EARL_DECODE_WARPS", 4))
KERNEL_STAGES = int(os.environ.get("EARL_DECODE_STAGES", 2))


def block_size(s: int, max_block: int = 128) -> int | None:
    """KV block: a power of two >= 16 dividing the cache length, or None (kernel not applicable)."""
    b = math.gcd(s, max_block)
    return b if b >= 16 else None


def _fused_kernel(pos_ref, q_ref, kn_ref, vn_ref, k_ref, v_ref, o_ref, k_out_ref, v_out_ref, *, block_k: int,
                  scale: float, s: int):
    pos = pos_ref[()]  # the new token's slot; >= s writes nowhere
    q = (q_ref[...].astype(jnp.float32) * scale).astype(k_ref.dtype)  # [G, h]
    k_new, v_new = kn_ref[...], vn_ref[...]  # [1, h]

    @pl.when(pos < s)
    def _():
        k_out_ref[pl.ds(pos, 1), :] = k_new
        v_out_ref[pl.ds(pos, 1), :] = v_new

    # The new token's own score starts the online softmax; the cache supplies slots [0, pos).
    s_new = jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32), axis=-1)  # [G]
    g, h = q.shape
    o = jnp.broadcast_to(v_new.astype(jnp.float32), (g, h))
    carry = (o, s_new, jnp.ones((g,), jnp.float32))
    o_ref[...] = _attend_blocks(functools.partial(_dot_scores, q, k_ref), v_ref, jnp.minimum(pos, s), block_k,
                                carry).astype(o_ref.dtype)


def write_and_attend_grouped(qg: Float[Array, "b k G h"], k_new: Float[Array, "b k h"], v_new: Float[Array, "b k h"],
                             cache, positions: Int[Array, "b"], *, interpret: bool = False,
                             num_warps: int | None = None, num_stages: int | None = None,
                             block_k: int | None = None):
    """The fused decode kernel on grouped queries (G = query heads per kv head, a power of two >= 16,
    padding rows zero): writes k_new/v_new at each row's position in place (the cache buffers are
    aliased to the outputs) and attends over slots 0..position. Returns (out [b k G h], cache)."""
    from earl_jax.models.cache import LayerCache
    b, kv, gp, h = qg.shape
    s = cache.k.shape[2]
    bk = block_size(s, block_k or KERNEL_BLOCK_K)
    pos = jnp.broadcast_to(positions[:, None].astype(jnp.int32), (b, kv))
    kn = k_new.reshape(b, kv, 1, h).astype(cache.k.dtype)
    vn = v_new.reshape(b, kv, 1, h).astype(cache.v.dtype)
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps or KERNEL_WARPS,
                                                         num_stages=num_stages or KERNEL_STAGES)
    row = lambda shape: pl.BlockSpec((None, None, *shape), lambda i, j: (i, j, 0, 0))
    kernel = functools.partial(_fused_kernel, block_k=bk, scale=h ** -0.5, s=s)
    out, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(b, kv),
        in_specs=[pl.BlockSpec((None, None), lambda i, j: (i, j)), row((gp, h)), row((1, h)), row((1, h)),
                  row((s, h)), row((s, h))],
        out_specs=[row((gp, h)), row((s, h)), row((s, h))],
        out_shape=[jax.ShapeDtypeStruct((b, kv, gp, h), qg.dtype), jax.ShapeDtypeStruct(cache.k.shape, cache.k.dtype),
                   jax.ShapeDtypeStruct(cache.v.shape, cache.v.dtype)],
        input_output_aliases={4: 1, 5: 2},
        interpret=interpret,
        name="earl_decode_write_attend",
        **kwargs,
    )(pos, qg, kn, vn, cache.k, cache.v)
    return out, LayerCache(k_cache, v_cache)


def grouped_width(num_heads: int, num_kv_heads: int) -> int:
    """Query rows per kv head in the kernel: the group size padded to a power of two >= 16."""
    return max(16, pl.next_power_of_2(num_heads // num_kv_heads))
