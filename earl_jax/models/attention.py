"""Causal self-attention for full sequences (training, experience) with bounded memory.

On GPU with bf16/fp16 inputs this is cuDNN's fused flash attention through
`jax.nn.dot_product_attention`. Elsewhere (CPU, float32) the queries are processed in blocks under
`jax.checkpoint`, so memory holds [b, heads, q_block, t] scores instead of [b, heads, t, t] (2048
tokens x 64 rows would otherwise need tens of GB for the backward pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

Q_BLOCK = 256


def _use_cudnn(q: jax.Array) -> bool:
    return jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)


def causal_attention(q: Float[Array, "b t n h"], k: Float[Array, "b t k h"], v: Float[Array, "b t k h"],
                     q_block: int = Q_BLOCK) -> Float[Array, "b t n h"]:
    if _use_cudnn(q):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    b, t, n, h = q.shape
    if t <= q_block:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    kv = k.shape[2]
    pad = (-t) % q_block
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, -1, q_block, kv, n // kv, h)
    starts = jnp.arange(qp.shape[1]) * q_block
    scale = h ** -0.5

    @jax.checkpoint
    def block(q_blk, start):  # q_blk: b q k g h
        s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k, preferred_element_type=jnp.float32) * scale
        mask = (start + jnp.arange(q_block))[:, None] >= jnp.arange(t)[None, :]
        s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgqs,bskh->bqkgh", p, v)

    out = jax.lax.map(lambda xs: block(*xs), (qp.swapaxes(0, 1), starts))  # blocks b q k g h
    out = out.swapaxes(0, 1).reshape(b, -1, n, h)
    return out[:, :t]
