"""The decode step's attention as one Pallas kernel: RoPE, the new token's cache write, flash-decoding.

XLA runs a decode layer's attention as a RoPE fusion, slices, a scatter for the new key/value and five kernels
over the whole bucketed cache (scores, max, sum, cast, probs x V). Here one program per (row, kv head[, cache
split]) reads the row's q/k/v straight from the q/k/v projection's output ([b, heads + 2 kv_heads, h], the query
heads unpadded: a group of G < 16 is loaded as 16 rows, the rest masked), rotates q and k (Hugging Face's
rotate-half layout, the partner column loaded by index), writes k/v in place at the row's position (the cache
buffers are aliased to the outputs) and streams K/V blocks of that row only up to its position (online
softmax). Long caches are split into `splits` chunks on separate programs, whose partial results XLA then
combines: 32 rows x 2 kv heads are 64 programs, too few to fill 132 SMs when each reads a 16K-token cache.

Cache layout [b, kv_heads, s, h] (models/cache.py). Rows at position >= s write nowhere (finished rows).

Measured on one H200 (experiments/benchmarks/bench_decode_ops.py), per layer at 16448-token contexts, batch 32:
142 us at 1.5B (3.8 TB/s of KV read, 91% of the 4.17 TB/s copy), 251 us at 7B; XLA's step reads the whole
24576-slot bucket there (>= 193 us at 1.5B). Short caches (384 slots): 7.9 us at 0.5B b32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from earl_jax.kernels.common import compiler_params, largest_divisor, pow2_at_least
from earl_jax.models.cache import LayerCache

NUM_SMS = 132  # H100 / H200: the splits aim at two programs per multiprocessor


def block_size(s: int, max_block: int = 128) -> int | None:
    """KV block: the largest power of two >= 16 and <= max_block dividing the cache length, else None (the
    kernel does not apply; the XLA step runs)."""
    return largest_divisor(s, tuple(c for c in (128, 64, 32, 16) if c <= max_block))


def num_splits(b: int, kv: int, s: int, block: int, min_chunk: int = 1024, programs: int = 2 * NUM_SMS) -> int:
    """Cache chunks per (row, kv head): enough programs to fill the GPU, each chunk >= min_chunk slots and a
    whole number of blocks."""
    want = min(-(-programs // (b * kv)), s // min_chunk)
    return max((d for d in range(1, max(want, 1) + 1) if (s // block) % d == 0), default=1)


def inv_frequencies(h: int, theta: float) -> Float[Array, " h"]:
    """RoPE's inverse frequency per column of a head (models/qwen2.rope's, both halves)."""
    inv = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    return jnp.concatenate([inv, inv])


def _rotated(ref, rows, rmask, cols, partner, sign, cos, sin):
    """Rows of ref [r, h] with RoPE applied (float32), masked rows zero."""
    from jax.experimental.pallas import triton as pltr
    x = pltr.load(ref.at[rows[:, None], cols[None, :]], mask=rmask[:, None], other=0).astype(jnp.float32)
    xp = pltr.load(ref.at[rows[:, None], partner[None, :]], mask=rmask[:, None], other=0).astype(jnp.float32)
    return x * cos[None, :] + sign[None, :] * xp * sin[None, :]


def _kernel(pos_ref, inv_ref, qkv_ref, k_ref, v_ref, *out_refs, n: int, kv: int, g: int, gp: int, h: int, s: int,
            block: int, chunk: int, splits: int, scale: float):
    if splits == 1:
        o_ref, k_out, v_out = out_refs
    else:
        po_ref, pm_ref, pl_ref, k_out, v_out = out_refs
    j, sp = pl.program_id(1), pl.program_id(2)
    pos = pos_ref[()]
    dt = k_ref.dtype
    cols = jnp.arange(h)
    partner = (cols + h // 2) % h
    sign = jnp.where(cols < h // 2, -1.0, 1.0).astype(jnp.float32)
    angles = pos.astype(jnp.float32) * inv_ref[...]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    local = jnp.arange(gp)
    rmask = local < g
    q = _rotated(qkv_ref, j * g + local, rmask, cols, partner, sign, cos, sin).astype(dt)  # [gp, h]
    one = jnp.zeros((1,), jnp.int32)
    k_new = _rotated(qkv_ref, n + j + one, one == 0, cols, partner, sign, cos, sin).astype(dt)  # [1, h]
    v_new = qkv_ref[n + kv + j, :][None, :].astype(dt)

    @pl.when((pos < s) & (sp == 0))
    def _():
        k_out[pl.ds(pos, 1), :] = k_new
        v_out[pl.ds(pos, 1), :] = v_new

    # Split 0 starts the online softmax from the new token's own score; the cache supplies slots [0, pos).
    s_new = jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32), axis=1) * scale  # [gp]
    first = (sp == 0).astype(jnp.float32)  # arithmetic, not a select: Triton wants operands of one shape
    o = jnp.broadcast_to(v_new.astype(jnp.float32), (gp, h)) * first
    m = s_new * first - 1e30 * (1.0 - first)
    l = jnp.ones((gp,), jnp.float32) * first
    start = sp * chunk
    end = jnp.minimum(jnp.minimum(pos, s), start + chunk)
    idx = jnp.arange(block)

    def body(t, carry):
        o, m, l = carry
        at = start + t * block
        sl = pl.ds(at, block)
        sc = jnp.dot(q, k_ref[sl, :].T, preferred_element_type=jnp.float32) * scale  # [gp, block]
        sc = jnp.where((at + idx)[None, :] < end, sc, -1e30)
        m_new = jnp.maximum(m, sc.max(axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(sc - m_new[:, None])
        l = l * corr + p.sum(axis=1)
        o = o * corr[:, None] + jnp.dot(p.astype(dt), v_ref[sl, :], preferred_element_type=jnp.float32)
        return o, m_new, l

    o, m, l = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(end - start, 0), block), body, (o, m, l))
    if splits == 1:
        from jax.experimental.pallas import triton as pltr
        rows = j * g + local
        pltr.store(o_ref.at[rows[:, None], cols[None, :]], (o / l[:, None]).astype(o_ref.dtype),
                   mask=rmask[:, None])
    else:
        po_ref[...] = o
        pm_ref[...] = m
        pl_ref[...] = l


def decode_attention(qkv: Float[Array, "b heads h"], cache: LayerCache, positions: Int[Array, " b"],
                     inv_freq: Float[Array, " h"], num_heads: int, *, splits: int | None = None,
                     block: int | None = None, warps: int = 4, stages: int = 2, interpret: bool = False
                     ) -> tuple[Float[Array, "b n h"], LayerCache]:
    """Attention of one new token per row: `qkv` holds the row's query heads, then its new keys, then its new
    values (heads = n + 2 kv, unrotated). Writes the rotated key and the value at `positions` in place and
    attends over slots [0, position] of each row. Returns (out [b, n, h], cache)."""
    b, heads, h = qkv.shape
    _, kv, s, _ = cache.k.shape
    n = heads - 2 * kv
    if n <= 0 or n % kv:
        raise ValueError(f"decode_attention: {heads} heads do not split into queries + 2 x {kv} kv heads")
    g = n // kv
    gp = pow2_at_least(g)
    block = block or block_size(s)
    if block is None or s % block:
        raise ValueError(f"decode_attention: cache length {s} has no block of 16..128 slots")
    splits = splits or num_splits(b, kv, s, block)
    if (s // block) % splits:
        raise ValueError(f"decode_attention: {splits} splits do not divide {s // block} blocks")
    chunk = s // splits
    kernel = functools.partial(_kernel, n=n, kv=kv, g=g, gp=gp, h=h, s=s, block=block, chunk=chunk, splits=splits,
                               scale=h ** -0.5)
    cache_spec = pl.BlockSpec((None, None, s, h), lambda i, j, p: (i, j, 0, 0))
    in_specs = [pl.BlockSpec((None,), lambda i, j, p: (i,)), pl.BlockSpec((h,), lambda i, j, p: (0,)),
                pl.BlockSpec((None, heads, h), lambda i, j, p: (i, 0, 0)), cache_spec, cache_spec]
    cache_shapes = [jax.ShapeDtypeStruct(cache.k.shape, cache.k.dtype),
                    jax.ShapeDtypeStruct(cache.v.shape, cache.v.dtype)]
    if splits == 1:
        out_specs = [pl.BlockSpec((None, n, h), lambda i, j, p: (i, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, n, h), qkv.dtype)]
    else:
        part = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda i, j, p: (i, j, p) + (0,) * len(shape))
        out_specs = [part(gp, h), part(gp), part(gp)]
        out_shape = [jax.ShapeDtypeStruct((b, kv, splits, gp, h), jnp.float32),
                     jax.ShapeDtypeStruct((b, kv, splits, gp), jnp.float32),
                     jax.ShapeDtypeStruct((b, kv, splits, gp), jnp.float32)]
    outs = pl.pallas_call(
        kernel,
        grid=(b, kv, splits),
        in_specs=in_specs,
        out_specs=out_specs + [cache_spec, cache_spec],
        out_shape=out_shape + cache_shapes,
        input_output_aliases={3: len(out_shape), 4: len(out_shape) + 1},
        interpret=interpret,
        name="earl_decode_attention",
        **compiler_params(interpret, warps, stages),
    )(positions.astype(jnp.int32), inv_freq, qkv, cache.k, cache.v)
    if splits == 1:
        return outs[0], LayerCache(outs[1], outs[2])
    po, pm, pl_, k_cache, v_cache = outs
    top = pm.max(axis=2, keepdims=True)
    w = jnp.exp(pm - top)  # [b, kv, splits, gp]
    o = (w[..., None] * po).sum(axis=2) / (w * pl_).sum(axis=2)[..., None]  # [b, kv, gp, h]
    return o[:, :, :g].reshape(b, n, h).astype(qkv.dtype), LayerCache(k_cache, v_cache)


def decode_attention_xla(qkv: Float[Array, "b heads h"], cache: LayerCache, positions: Int[Array, " b"],
                         theta: float, num_heads: int) -> tuple[Float[Array, "b n h"], LayerCache]:
    """The same function through the model's own ops (models/qwen2: rope, cache write, cached attention)."""
    from earl_jax.models.qwen2 import cached_attention, rope
    b, heads, h = qkv.shape
    n, kv = num_heads, (heads - num_heads) // 2
    q, k, v = qkv[:, None, :n], qkv[:, None, n:n + kv], qkv[:, None, n + kv:]
    pos = positions[:, None]
    q, k = rope(q, pos, theta), rope(k, pos, theta)
    cache = cache.write(k, v, pos)
    return cached_attention(q, cache.k, cache.v, pos)[:, 0], cache
