"""Causal self-attention for full sequences (training, experience) with bounded memory.

On GPU with bf16/fp16 inputs this is cuDNN's fused flash attention through
`jax.nn.dot_product_attention`. Elsewhere (CPU, float32) the queries are processed in blocks under
`jax.checkpoint`, so memory holds [b, heads, q_block, t] scores instead of [b, heads, t, t] (2048
tokens x 64 rows would otherwise need tens of GB for the backward pass).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

Q_BLOCK = 256
# A rollout extend's attention over its cache materializes [rows, heads, new tokens, cache slots] float32 scores per
# device; above this many bytes the new tokens are processed in blocks (`extend_query_block`). 8192 games of the tiny
# model at 1.5K cache slots asked 12 GiB here and ran out of memory on an H100; every measured
# default configuration stays below it, so their programs are unchanged.
EXTEND_SCORES_BYTES = 4 * 2**30


def extend_query_block(rows: int, heads: int, new_tokens: int, slots: int,
                       limit_bytes: int = EXTEND_SCORES_BYTES) -> int:
    """Query positions an extend attends at once so that rows x heads x block x slots float32 scores (per device)
    stay within `limit_bytes`: all of them when they fit, else the largest power of two that fits (at least 1).
    Shared by the model (models/qwen2.cached_attention) and the memory model (parallel/memory.py)."""
    per_query = max(1, rows * heads * slots * 4)
    if new_tokens * per_query <= limit_bytes:
        return new_tokens
    block = 1
    while block * 2 <= new_tokens and block * 2 * per_query <= limit_bytes:
        block *= 2
    return block


# cuDNN attention under a mesh through shard_map (see _per_shard); EARL_PER_SHARD_CUDNN=0 leaves it to XLA
PER_SHARD_CUDNN = os.environ.get("EARL_PER_SHARD_CUDNN", "1") != "0"


def _use_cudnn(q: jax.Array) -> bool:
    return jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)


def _cudnn_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _per_shard(q, k, v, fn=_cudnn_attention):
    """cuDNN attention run on each device's own rows and heads (shard_map), when a stage's mesh rules split
    them: what the kernel sees is then plain local arrays, never a partitioning decision for XLA to make about
    a custom call. None when no rules are active or nothing is split. Where the query heads are split and the kv
    heads replicated (tensor > kv heads: 3B's 2 kv heads on TP4), each kv head is repeated for its query heads first,
    so both split alike: cuDNN's partitioner refuses q and kv sharded differently (Fig. 3), and the local
    grouping of query heads onto kv heads would not hold otherwise."""
    from earl_jax.sharding.context import current_mesh_rules
    from earl_jax.sharding.mesh import logical_to_spec

    ctx = current_mesh_rules()
    if ctx is None:
        return None
    mesh, rules = ctx
    q_spec = logical_to_spec(("batch", "length", "act_heads", None), rules, mesh, q.shape)
    kv_spec = logical_to_spec(("batch", "length", "act_kv_heads", None), rules, mesh, k.shape)
    if not any(q_spec):
        return None
    if len(q_spec) > 2 and q_spec[2] is not None and (len(kv_spec) < 3 or kv_spec[2] is None):
        group = q.shape[2] // k.shape[2]  # query heads per kv head; each device then holds its heads' own copies
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        kv_spec = q_spec
    return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v)


def causal_attention(q: Float[Array, "b t n h"], k: Float[Array, "b t k h"], v: Float[Array, "b t k h"],
                     q_block: int = Q_BLOCK) -> Float[Array, "b t n h"]:
    if _use_cudnn(q):
        local = _per_shard(q, k, v) if PER_SHARD_CUDNN else None
        return _cudnn_attention(q, k, v) if local is None else local
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
