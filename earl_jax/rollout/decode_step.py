"""The decode step (one token per row) of the Qwen2 model, specialised for a single device's hot loop.

Same math as `Qwen2.hidden` on one token per row, with the weights laid out once per `generate` call,
before its loop: q/k/v as one matrix (query heads grouped per kv head and padded to the kernel's group
width with zero columns, so the fused write+attention kernel reads the projection's output as is and
the output projection consumes the padded rows against zero weights: no pad or slice per step),
gate/up as one matrix. Sampler tests compare it with the model through full forwards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from earl_jax.models.cache import KVCache
from earl_jax.models.config import ModelConfig
from earl_jax.models.qwen2 import Qwen2, rope
from earl_jax.rollout.decode_attention import grouped_width, write_and_attend_grouped


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    input_norm: Array  # d
    qkv: Array  # d, (kv*G + 2*kv)*h: [queries (kv, G padded, h) | keys (kv, h) | values (kv, h)]
    qkv_bias: Array | None
    out: Array  # kv*G*h, d (padded rows zero)
    post_norm: Array  # d
    gate_up: Array  # d, 2f
    down: Array  # f, d


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeWeights:
    layers: tuple[LayerWeights, ...]
    final_norm: Array


def prepare(model: Qwen2) -> DecodeWeights:
    """Rearrange (and cast to the compute dtype) the model's weights for `decode_hidden`."""
    cfg, dt = model.cfg, model.dtype
    n, kv, h, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head, cfg.hidden_size
    g, gp = n // kv, grouped_width(n, kv)
    layers = []
    for layer in model.layers:
        a = layer.attn
        q = a.q_dnh[...].astype(dt).reshape(d, kv, g, h)
        q = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0))).reshape(d, -1)
        # Contiguous column blocks, so each slice of the projection's output is a plain reshape.
        qkv = jnp.concatenate([q, a.k_dkh[...].astype(dt).reshape(d, -1), a.v_dkh[...].astype(dt).reshape(d, -1)], 1)
        bias = None
        if cfg.attention_bias:
            qb = jnp.pad(a.q_bias[...].astype(dt).reshape(kv, g, h), ((0, 0), (0, gp - g), (0, 0)))
            bias = jnp.concatenate([qb.reshape(-1), a.k_bias[...].astype(dt).reshape(-1),
                                    a.v_bias[...].astype(dt).reshape(-1)])
        out = jnp.pad(a.o_nhd[...].astype(dt).reshape(kv, g, h, d), ((0, 0), (0, gp - g), (0, 0), (0, 0)))
        out = out.reshape(kv * gp * h, d)
        m = layer.mlp
        gate_up = jnp.concatenate([m.gate_df[...].astype(dt), m.up_df[...].astype(dt)], axis=1)
        layers.append(LayerWeights(layer.input_norm.scale[...], qkv, bias, out, layer.post_attn_norm.scale[...],
                                   gate_up, m.down_fd[...].astype(dt)))
    return DecodeWeights(tuple(layers), model.final_norm.scale[...])


def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * x32).astype(x.dtype)


def decode_hidden(model: Qwen2, w: DecodeWeights, tokens: Int[Array, "b"], positions: Int[Array, "b"],
                  cache: KVCache, *, interpret: bool = False) -> tuple[Float[Array, "b d"], KVCache]:
    """Final-norm hidden state after one token per row at `positions` (>= cache length: no write)."""
    cfg: ModelConfig = model.cfg
    n, kv, h, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head, cfg.hidden_size
    gp = grouped_width(n, kv)
    b = tokens.shape[0]
    x = jnp.take(model.embed_vd[...], tokens, axis=0).astype(model.dtype)  # b d
    new_layers = []
    for lw, lc in zip(w.layers, cache.layers):
        y = _rms_norm(x, lw.input_norm, cfg.rms_norm_eps) @ lw.qkv
        if lw.qkv_bias is not None:
            y = y + lw.qkv_bias
        nq, nk = kv * gp * h, kv * h
        q, k, v = y[:, :nq].reshape(b, kv, gp, h), y[:, nq:nq + nk].reshape(b, kv, h), y[:, nq + nk:].reshape(b, kv, h)
        q = rope(q.reshape(b, 1, kv * gp, h), positions[:, None], cfg.rope_theta).reshape(b, kv, gp, h)
        k = rope(k.reshape(b, 1, kv, h), positions[:, None], cfg.rope_theta).reshape(b, kv, h)
        o, lc = write_and_attend_grouped(q, k, v, lc, positions, interpret=interpret)
        new_layers.append(lc)
        x = x + o.reshape(b, nq) @ lw.out
        gu = _rms_norm(x, lw.post_norm, cfg.rms_norm_eps) @ lw.gate_up
        gate, up = jnp.split(gu, 2, axis=-1)
        x = x + (jax.nn.silu(gate) * up) @ lw.down
    return _rms_norm(x, w.final_norm, cfg.rms_norm_eps), KVCache(tuple(new_layers))
