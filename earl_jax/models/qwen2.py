"""Qwen2-family decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention with q/k/v bias, SwiGLU.

One forward serves every stage: training (no cache, causal attention through
`jax.nn.dot_product_attention`), prefill, decode and multi-turn extend (tokens written into a KV cache at
their own per-row positions, attention over the cache masked by position). Parameters are float32
masters carrying logical axis names; compute runs in `dtype` (bf16 by default).

Shape suffixes: b batch, t new tokens, s cache slots, d embed, n query heads, k kv heads, g query heads
per kv head, h head dim, f mlp, v vocab.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from earl_jax.models.attention import EXTEND_SCORES_BYTES, causal_attention, extend_query_block
from earl_jax.models.cache import KVCache, LayerCache
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.paged_cache import PagedKVCache, PagedLayerCache
from earl_jax.sharding.context import constrain, current_mesh_rules
from earl_jax.sharding.mesh import logical_sharding

_INIT_STD = 0.02

def _normal(key, shape, dtype):
    return _INIT_STD * jax.random.normal(key, shape, dtype)


# Every parameter's initializer, by the name `_param` records in its metadata ("init"): `init_sharded`
# reads it back from the abstract model, so fast sharded init and eager construction share one definition.
INITIALIZERS: dict[str, Callable[[jax.Array | None, tuple[int, ...], Any], jax.Array]] = {
    "normal": _normal,
    "zeros": lambda key, shape, dtype: jnp.zeros(shape, dtype),
    "ones": lambda key, shape, dtype: jnp.ones(shape, dtype),
}


# Set by `shapes_only()`: parameters are placeholders of the right shape (for nnx.eval_shape).
_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("shapes_only", default=False)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Build modules inside nnx.eval_shape without tracing the random draws: tracing nnx.Rngs' counter
    updates and jax.random.normal took 3.2 of 3.4 s of eval_shape for Qwen2.5-0.5B (CPU)."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def _param(rngs: nnx.Rngs, shape, axes, dtype, init: str = "normal") -> nnx.Param:
    if init not in INITIALIZERS:
        raise ValueError(f"unknown initializer {init!r}; choose one of {sorted(INITIALIZERS)}")
    if _SHAPES_ONLY.get():
        value = jnp.zeros(shape, dtype)
    else:
        key = rngs.params() if init == "normal" else None  # only random inits draw keys (the eager sequence)
        value = INITIALIZERS[init](key, shape, dtype)
    return nnx.Param(value, logical_axes=axes, init=init)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
        self.scale = _param(rngs, (dim,), ("embed",), param_dtype, init="ones")
        self.eps = eps

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        # Statistics in float32 as Hugging Face does, then back to the compute dtype.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * x32).astype(x.dtype)


def rope(x: Float[Array, "b t n h"], positions: Int[Array, "b t"], theta: float) -> Float[Array, "b t n h"]:
    """Rotary embedding, Hugging Face's rotate-half layout (first half / second half of head_dim)."""
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # b t h/2
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head
        self.q_dnh = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), param_dtype)
        self.k_dkh = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.v_dkh = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.o_nhd = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), param_dtype)
        if cfg.attention_bias:
            self.q_bias = _param(rngs, (n, h), ("heads", "head_dim"), param_dtype, init="zeros")
            self.k_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype, init="zeros")
            self.v_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype, init="zeros")
        self.cfg, self.dtype = cfg, dtype

    def _proj(self, x, w, b, axes):
        y = jnp.einsum("btd,dnh->btnh", x, w[...].astype(self.dtype))
        if self.cfg.attention_bias:
            y = y + b[...].astype(self.dtype)
        return constrain(y, axes)

    def __call__(self, x: Float[Array, "b t d"], positions: Int[Array, "b t"],
                 cache: LayerCache | PagedLayerCache | None
                 ) -> tuple[Float[Array, "b t d"], LayerCache | PagedLayerCache | None]:
        cfg = self.cfg
        bias = (lambda name: getattr(self, name)) if cfg.attention_bias else (lambda name: None)
        q = self._proj(x, self.q_dnh, bias("q_bias"), ("batch", "length", "act_heads", None))
        k = self._proj(x, self.k_dkh, bias("k_bias"), ("batch", "length", "act_kv_heads", None))
        v = self._proj(x, self.v_dkh, bias("v_bias"), ("batch", "length", "act_kv_heads", None))
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)

        if cache is None:
            out = causal_attention(q, k, v)
        else:
            cache = cache.write(k, v, positions)
            out = cached_attention(q, *cache.keys_values(), positions)
        out = constrain(out, ("batch", "length", "act_heads", None))
        y = jnp.einsum("btnh,nhd->btd", out, self.o_nhd[...].astype(self.dtype))
        return y, cache


def cached_attention(q: Float[Array, "b t n h"], k: Float[Array, "b k s h"], v: Float[Array, "b k s h"],
                     positions: Int[Array, "b t"], limit_bytes: int = EXTEND_SCORES_BYTES) -> Float[Array, "b t n h"]:
    """Queries at absolute `positions` attend to cache slots 0..position (slot index == position). A wide extend
    whose scores would pass `limit_bytes` per device attends one block of queries at a time (the same values: each
    query's softmax is its own)."""
    b, t, n, h = q.shape
    rows, _, heads, _ = _shard_shape(q.shape, ("batch", "length", "act_heads", None))
    block = extend_query_block(rows, heads, t, k.shape[2], limit_bytes)
    if block >= t:
        return _cached_attention(q, k, v, positions)
    nb = -(-t // block)
    pad = nb * block - t  # padded queries sit at position 0 and are cut off after
    qb = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, block, n, h).swapaxes(0, 1)
    pb = jnp.pad(positions, ((0, 0), (0, pad))).reshape(b, nb, block).swapaxes(0, 1)
    out = jax.lax.map(lambda qp: _cached_attention(qp[0], k, v, qp[1]), (qb, pb))  # nb x [b, block, n, h]
    return out.swapaxes(0, 1).reshape(b, nb * block, n, h)[:, :t]


def _shard_shape(shape: tuple[int, ...], logical_axes: tuple[str | None, ...]) -> tuple[int, ...]:
    """One device's share of an array of `shape` under the active mesh rules (the whole shape without rules)."""
    ctx = current_mesh_rules()
    return tuple(shape) if ctx is None else logical_sharding(*ctx, logical_axes, shape).shard_shape(tuple(shape))


def _cached_attention(q, k, v, positions):
    b, t, n, h = q.shape
    kv = k.shape[1]
    q = q.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bksh->bkgts", q, k, preferred_element_type=jnp.float32) * (h ** -0.5)
    slots = jnp.arange(k.shape[2])
    mask = slots[None, None, :] <= positions[:, :, None]  # b t s
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksh->btkgh", probs, v)
    return out.reshape(b, t, n, h)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_df = _param(rngs, (d, f), ("embed", "mlp"), param_dtype)
        self.up_df = _param(rngs, (d, f), ("embed", "mlp"), param_dtype)
        self.down_fd = _param(rngs, (f, d), ("mlp", "embed"), param_dtype)
        self.dtype = dtype

    def __call__(self, x: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
        gate = jnp.einsum("btd,df->btf", x, self.gate_df[...].astype(self.dtype))
        up = jnp.einsum("btd,df->btf", x, self.up_df[...].astype(self.dtype))
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        return jnp.einsum("btf,fd->btd", hidden, self.down_fd[...].astype(self.dtype))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions, cache: LayerCache | None):
        y, cache = self.attn(self.input_norm(x), positions, cache)
        x = constrain(x + y, ("batch", "length", "act_embed"))
        x = constrain(x + self.mlp(self.post_attn_norm(x)), ("batch", "length", "act_embed"))
        return x, cache


def _remat_policy(remat: bool | str):
    if remat is False or remat is None or remat is True or remat == "full":
        return None
    if remat == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    policy = getattr(jax.checkpoint_policies, str(remat), None)
    if policy is None:
        raise ValueError(f"remat={remat!r}: expected a bool, 'full', 'dots' or a jax.checkpoint_policies name")
    return policy


def _apply_layer(layer: DecoderLayer, x, positions, cache: LayerCache | None, remat: bool | str):
    """One decoder layer as a nested jit, traced once for all layers of the same shapes: every layer of a model has
    the same structure, so JAX's trace cache (and the caches of its derivative and lowering rules) serve layers 2..L
    from layer 1's trace. A Python loop of L layers otherwise traces, differentiates and lowers L copies, which on 4
    H100s made tracing the 1.5B train program 8.7 s of a warm start. XLA inlines the calls,
    so the compiled program is the one the loop gave. `remat` (no cache): the layer under jax.checkpoint."""
    graphdef, state = nnx.split(layer)
    ctx = current_mesh_rules()  # the sharding names resolve at trace time: part of what a cached trace is
    key = None if ctx is None else (ctx[0], tuple(sorted(ctx[1].items())))
    return _layer_program(graphdef, remat if cache is None else False, key)(state, x, positions, cache)


@functools.lru_cache(maxsize=256)
def _layer_program(graphdef: nnx.GraphDef, remat: bool | str, context: Any) -> Callable:
    # `context` (mesh, rules) is only a key: one jitted function per context, so no cached trace crosses layouts
    def run(state, x, positions, cache):
        return nnx.merge(graphdef, state)(x, positions, cache)

    if not remat:
        return jax.jit(run)
    checkpointed = jax.checkpoint(lambda state, x, positions: run(state, x, positions, None)[0],
                                  policy=_remat_policy(remat))
    return jax.jit(lambda state, x, positions, cache: (checkpointed(state, x, positions), None))


class Qwen2(nnx.Module):
    """The decoder. `__call__` returns float32 logits; `hidden` + `logits` let callers chunk the vocab."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.bfloat16,
                 param_dtype: Any = jnp.float32, remat: bool | str = False):
        # remat (full-sequence forward only, i.e. training / log-probs; never with a cache): False = keep all
        # activations; True or "full" = save nothing per layer (recompute its forward in the backward pass);
        # "dots" = save matmul outputs, recompute the elementwise ops; any other name is a
        # jax.checkpoint_policies attribute.
        _remat_policy(remat)  # validate early
        self.cfg, self.dtype, self.remat = cfg, dtype, remat
        self.embed_vd = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype)
        self.layers = nnx.List(
            [DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head_dv = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype)

    def hidden(self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"],
               cache: KVCache | PagedKVCache | None = None) -> tuple[Float[Array, "b t d"], Any]:
        """Final-norm hidden states; writes the new tokens' keys and values into `cache` when given."""
        x = jnp.take(self.embed_vd[...], tokens, axis=0).astype(self.dtype)
        x = constrain(x, ("batch", "length", "act_embed"))
        new_layers = []
        remat = getattr(self, "remat", False)
        for i, layer in enumerate(self.layers):
            x, layer_cache = _apply_layer(layer, x, positions, None if cache is None else cache.layer(i), remat)
            new_layers.append(layer_cache)
        x = self.final_norm(x)
        return x, (None if cache is None else cache.with_layers(new_layers))

    def logits(self, h: Float[Array, "b t d"]) -> Float[Array, "b t v"]:
        if self.cfg.tie_word_embeddings:
            w = self.embed_vd[...].astype(self.dtype)
            out = jnp.einsum("btd,vd->btv", h, w, preferred_element_type=jnp.float32)
        else:
            w = self.lm_head_dv[...].astype(self.dtype)
            out = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        return constrain(out, ("batch", "length", "act_vocab"))

    def __call__(self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"] | None = None,
                 cache: KVCache | PagedKVCache | None = None) -> tuple[Float[Array, "b t v"], Any]:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        h, cache = self.hidden(tokens, positions, cache)
        return self.logits(h), cache
