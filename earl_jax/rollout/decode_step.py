"""The decode step (one token per row) of the Qwen2 model through the Pallas kernels, for one device's hot loop.

Same math as `Qwen2.hidden` + `Qwen2.logits` on one token per row, as five kernels a layer
(kernels/linear.py, kernels/decode_attention.py):

    qkv = r1 * (x @ (norm1 * Wqkv)) + bias       norm folded into the weights, r1 from x's tiles
    o   = attention(rope(qkv), cache)             writes the new key/value in place
    x   = x + o @ Wo
    m   = silu(r2 * (x @ (norm2 * Wg))) * (r2 * (x @ (norm2 * Wu)))
    x   = x + m @ Wd

Each matmul runs in Pallas or in XLA's dot as the `DecodePlan` says (kernels/tuning.py); both compute in
float32 from the same `DecodeWeights`. `prepare` lays the weights out for this once per weight version (the
Sampler keeps the result while the weights stay the same objects): q/k/v as one [N, K] matrix, gate and up
as one, every matrix [N, K] so a kernel program's block is contiguous, the norm scales folded in. It costs one
copy of the layer weights in the compute dtype. Sampler tests compare this step with the model's own.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from earl_jax.kernels.decode_attention import decode_attention, decode_attention_xla, inv_frequencies
from earl_jax.kernels.linear import LinearConfig, linear, linear_xla
from earl_jax.kernels.tuning import DecodePlan
from earl_jax.models.cache import KVCache
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import Qwen2


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    qkv: Float[Array, "nqkv d"]  # rows: query heads, key heads, value heads (each h wide); input norm folded in
    qkv_bias: Float[Array, " nqkv"] | None
    out: Float[Array, "d nh"]
    gate_up: Float[Array, "f2 d"]  # gate rows then up rows; post-attention norm folded in
    down: Float[Array, "d f"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeWeights:
    layers: tuple[LayerWeights, ...]
    embed: Float[Array, "v d"]  # token lookup, and the logits when tied
    final_norm: Float[Array, " d"]
    lm_head: Float[Array, "d v"] | None  # untied models only ([K, N]: read as stored)


def prepare(model: Qwen2) -> DecodeWeights:
    """The model's weights laid out for `decode_hidden` / `decode_logits`, in its compute dtype."""
    cfg, dt = model.cfg, model.dtype
    d = cfg.hidden_size
    f32 = jnp.float32

    def folded(w_dn, scale):  # [d, N] with the norm scale on d -> [N, d]
        return (w_dn.astype(f32) * scale.astype(f32)[:, None]).T.astype(dt)

    layers = []
    for layer in model.layers:
        a, m = layer.attn, layer.mlp
        qkv = jnp.concatenate([a.q_dnh[...].reshape(d, -1), a.k_dkh[...].reshape(d, -1),
                               a.v_dkh[...].reshape(d, -1)], axis=1)
        bias = None
        if cfg.attention_bias:
            bias = jnp.concatenate([a.q_bias[...].reshape(-1), a.k_bias[...].reshape(-1),
                                    a.v_bias[...].reshape(-1)]).astype(dt)
        gate_up = jnp.concatenate([m.gate_df[...], m.up_df[...]], axis=1)
        layers.append(LayerWeights(
            qkv=folded(qkv, layer.input_norm.scale[...]), qkv_bias=bias,
            out=a.o_nhd[...].reshape(-1, d).T.astype(dt),
            gate_up=folded(gate_up, layer.post_attn_norm.scale[...]),
            down=m.down_fd[...].T.astype(dt)))
    lm_head = None if cfg.tie_word_embeddings else model.lm_head_dv[...].astype(dt)
    return DecodeWeights(tuple(layers), model.embed_vd[...].astype(dt), model.final_norm.scale[...], lm_head)


def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * x32).astype(x.dtype)


def _linear(launch: LinearConfig | None, plan: DecodePlan, x, w, **kw):
    if launch is None:
        return linear_xla(x, w, **kw)
    return linear(x, w, config=launch, interpret=plan.interpret, **kw)


def decode_hidden(w: DecodeWeights, cfg: ModelConfig, tokens: Int[Array, " b"], positions: Int[Array, " b"],
                  cache: KVCache, plan: DecodePlan) -> tuple[Float[Array, "b d"], KVCache]:
    """Final-norm hidden state after one token per row at `positions` (>= cache length: no write)."""
    n, kv, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head
    eps = cfg.rms_norm_eps
    b = tokens.shape[0]
    inv_freq = inv_frequencies(h, cfg.rope_theta)
    att = plan.attention
    x = jnp.take(w.embed, tokens, axis=0)  # b d
    new_layers = []
    for lw, lc in zip(w.layers, cache.layers):
        qkv = _linear(plan.qkv, plan, x, lw.qkv, bias=lw.qkv_bias, norm_eps=eps)
        if att is None:
            o, lc = decode_attention_xla(qkv.reshape(b, n + 2 * kv, h), lc, positions, cfg.rope_theta, n)
        else:
            o, lc = decode_attention(qkv.reshape(b, n + 2 * kv, h), lc, positions, inv_freq, n, splits=att.splits,
                                     block=att.block, warps=att.warps, stages=att.stages, interpret=plan.interpret)
        new_layers.append(lc)
        x = _linear(plan.out, plan, o.reshape(b, n * h), lw.out, residual=x)
        mid = _linear(plan.gate_up, plan, x, lw.gate_up, norm_eps=eps, swiglu=True)
        x = _linear(plan.down, plan, mid, lw.down, residual=x)
    return _rms_norm(x, w.final_norm, eps), KVCache(tuple(new_layers))


def decode_logits(w: DecodeWeights, hidden: Float[Array, "b d"], plan: DecodePlan) -> Float[Array, "b v"]:
    """float32 logits of final-norm hidden states (the tied embedding or the lm_head)."""
    if w.lm_head is None:
        return _linear(plan.logits, plan, hidden, w.embed, out_dtype=jnp.float32)
    return _linear(plan.logits, plan, hidden, w.lm_head, w_layout="kn", out_dtype=jnp.float32)
