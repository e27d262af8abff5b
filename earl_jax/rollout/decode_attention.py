"""Decode attention (one new query token per row) as a Pallas GPU kernel over the ragged KV cache.

XLA's version of the decode step runs five kernels per layer (scores matmul, max, sum, cast, probs x V)
over the whole bucketed cache. This one is a single kernel per layer: one program per (row, kv head)
streams K and V blocks of that row only up to its own position (flash-decoding online softmax), so it
reads the valid prefix once and nothing else. Cache layout [b, kv_heads, s, h] as in models/cache.py.
Runs under `interpret=True` on CPU (tests).
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


def _kernel(len_ref, q_ref, k_ref, v_ref, o_ref, *, block_k: int, scale: float):
    length = len_ref[()]  # this row attends to cache slots [0, length)
    q = q_ref[...].astype(jnp.float32) * scale  # [G, h]
    g, h = q.shape
    q = q.astype(k_ref.dtype)
    init = (jnp.zeros((g, h), jnp.float32), jnp.full((g,), -1e30, jnp.float32), jnp.zeros((g,), jnp.float32))
    o_ref[...] = _attend_blocks(functools.partial(_dot_scores, q, k_ref), v_ref, length, block_k,
                                init).astype(o_ref.dtype)


# Kernel launch parameters (overridable for tuning sweeps: EARL_DECODE_{BLOCK_K,WARPS,STAGES}).
KERNEL_BLOCK_K = int(os.environ.get("EARL_DECODE_BLOCK_K", 128))
KERNEL_WARPS = int(os.environ.get("EARL_DECODE_WARPS", 4))
KERNEL_STAGES = int(os.environ.get("EARL_DECODE_STAGES", 2))


def block_size(s: int, max_block: int = 128) -> int | None:
    """KV block: a power of two >= 16 dividing the cache length, or None (kernel not applicable)."""
    b = math.gcd(s, max_block)
    return b if b >= 16 else None


def decode_attention(q: Float[Array, "b 1 n h"], k: Float[Array, "b k s h"], v: Float[Array, "b k s h"],
                     positions: Int[Array, "b 1"], *, interpret: bool = False, num_warps: int = 4,
                     num_stages: int = 2) -> Float[Array, "b 1 n h"]:
    """Same result as `qwen2.cached_attention` for one query token per row (slots 0..position)."""
    b, t, n, h = q.shape
    _, kv, s, _ = k.shape
    assert t == 1, "decode_attention takes one query token per row"
    g = n // kv
    gp = max(16, pl.next_power_of_2(g))  # tensor-core tile minimum; extra query rows are zeros
    bk = block_size(s)
    assert bk is not None, f"cache length {s} needs a power-of-two divisor >= 16"
    qg = q.reshape(b, kv, g, h)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    lengths = jnp.minimum(positions[:, 0] + 1, s).astype(jnp.int32)  # rows writing nowhere: clamp
    lengths = jnp.broadcast_to(lengths[:, None], (b, kv))
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, scale=h ** -0.5),
        grid=(b, kv),
        in_specs=[
            pl.BlockSpec((None, None), lambda i, j: (i, j)),
            pl.BlockSpec((None, None, gp, h), lambda i, j: (i, j, 0, 0)),
            pl.BlockSpec((None, None, s, h), lambda i, j: (i, j, 0, 0)),
            pl.BlockSpec((None, None, s, h), lambda i, j: (i, j, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, gp, h), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kv, gp, h), q.dtype),
        interpret=interpret,
        name="earl_decode_attention",
        **kwargs,
    )(lengths, qg, k, v)
    return out[:, :, :g].reshape(b, 1, n, h)


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


def _rope_kernel(pos_ref, q_ref, kn_ref, vn_ref, k_ref, v_ref, o_ref, k_out_ref, v_out_ref, *, block_k: int,
                 scale: float, s: int, theta: float):
    """`_fused_kernel` that also applies RoPE (rotate-half) to the query rows and the new key."""
    pos = pos_ref[()]
    g, h = q_ref.shape
    half = h // 2
    inv_freq = jnp.exp(jnp.arange(half).astype(jnp.float32) * (-2.0 * math.log(theta) / h))
    ang = pos.astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(ang)[None, :], jnp.sin(ang)[None, :]
    lo, hi = pl.ds(0, half), pl.ds(half, half)

    def rot(ref):
        x1, x2 = ref[:, lo].astype(jnp.float32), ref[:, hi].astype(jnp.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    q1, q2 = rot(q_ref)
    k1, k2 = rot(kn_ref)  # [1, half] each
    # Rounded to the cache dtype as the model does (rope output in the compute dtype).
    q1, q2 = q1.astype(k_ref.dtype).astype(jnp.float32), q2.astype(k_ref.dtype).astype(jnp.float32)
    k1, k2 = k1.astype(k_ref.dtype), k2.astype(k_ref.dtype)

    @pl.when(pos < s)
    def _():
        k_out_ref[pl.ds(pos, 1), lo] = k1
        k_out_ref[pl.ds(pos, 1), hi] = k2
        v_out_ref[pl.ds(pos, 1), :] = vn_ref[...]

    q1s, q2s = (q1 * scale).astype(k_ref.dtype), (q2 * scale).astype(k_ref.dtype)
    s_new = (jnp.sum(q1 * k1.astype(jnp.float32), axis=-1) + jnp.sum(q2 * k2.astype(jnp.float32), axis=-1)) * scale
    o = jnp.broadcast_to(vn_ref[...].astype(jnp.float32), (g, h))

    def scores(sl):  # q . k as two half-dot products: the rotated halves never get concatenated
        return (jnp.dot(q1s, k_ref[sl, lo].T, preferred_element_type=jnp.float32)
                + jnp.dot(q2s, k_ref[sl, hi].T, preferred_element_type=jnp.float32))

    carry = (o, s_new, jnp.ones((g,), jnp.float32))
    o_ref[...] = _attend_blocks(scores, v_ref, jnp.minimum(pos, s), block_k, carry).astype(o_ref.dtype)


def write_and_attend_grouped(qg: Float[Array, "b k G h"], k_new: Float[Array, "b k h"], v_new: Float[Array, "b k h"],
                             cache, positions: Int[Array, "b"], *, interpret: bool = False,
                             num_warps: int | None = None, num_stages: int | None = None,
                             block_k: int | None = None, rope_theta: float | None = None):
    """The fused decode kernel on grouped queries (G = query heads per kv head, a power of two >= 16,
    padding rows zero): writes k_new/v_new at each row's position in place (the cache buffers are
    aliased to the outputs) and attends over slots 0..position. Returns (out [b k G h], cache).
    With rope_theta, q and k_new come without RoPE and the kernel applies it at each row's position."""
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
    kernel = (functools.partial(_fused_kernel, block_k=bk, scale=h ** -0.5, s=s) if rope_theta is None else
              functools.partial(_rope_kernel, block_k=bk, scale=h ** -0.5, s=s, theta=float(rope_theta)))
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


def write_and_attend(q: Float[Array, "b 1 n h"], k_new: Float[Array, "b 1 k h"], v_new: Float[Array, "b 1 k h"],
                     cache, positions: Int[Array, "b 1"], *, interpret: bool = False):
    """`write_and_attend_grouped` in the model's layout (pads the query groups, slices them off)."""
    b, t, n, h = q.shape
    kv = cache.k.shape[1]
    assert t == 1
    g, gp = n // kv, grouped_width(n, kv)
    qg = q.reshape(b, kv, g, h)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    out, cache = write_and_attend_grouped(qg, k_new.reshape(b, kv, h), v_new.reshape(b, kv, h), cache,
                                          positions[:, 0], interpret=interpret)
    return out[:, :, :g].reshape(b, 1, n, h), cache
