"""The experience and train stages as pure functions over pytrees (graphdef static, params and batch traced).

Each is jitted by the trainer under its own stage mesh; nothing here knows which mesh that is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from earl_jax.rl.advantages import compute_advantages, group_filter
from earl_jax.rl.logprobs import token_logprobs
from earl_jax.rl.losses import LossConfig, policy_loss

# optax.tree.norm replaces the deprecated optax.global_norm (older optax has only the latter)
_global_norm = optax.tree.norm if hasattr(getattr(optax, "tree", None), "norm") else optax.global_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExperienceBatch:
    """What the train stage consumes; every leaf is [n, t] or [n] so it shards over the batch axis."""

    tokens: Int[Array, "n t"]
    loss_mask: Bool[Array, "n t"]
    old_logp: Float[Array, "n t"]
    ref_logp: Float[Array, "n t"]
    advantages: Float[Array, "n t"]


def make_optimizer(learning_rate: float, warmup_steps: int, total_steps: int, weight_decay: float,
                   grad_clip: float) -> optax.GradientTransformation:
    # Warm-up starts above zero: a first step at learning rate 0 would waste a whole RL iteration.
    schedule = optax.warmup_cosine_decay_schedule(
        learning_rate / max(warmup_steps, 1), learning_rate, max(warmup_steps, 1), max(total_steps, warmup_steps + 1), end_value=0.1 * learning_rate)
    return optax.chain(optax.clip_by_global_norm(grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay))


def experience_stage(graphdef: nnx.GraphDef, params: nnx.State, ref_params: nnx.State | None,
                     tokens: Int[Array, "n t"], loss_mask: Bool[Array, "n t"], rewards: Float[Array, "n t"],
                     group_ids: Int[Array, " n"], *, num_groups: int, loss_cfg: LossConfig, chunk: int,
                     filter_constant_groups: bool) -> tuple[ExperienceBatch, dict[str, Array]]:
    """Old-policy (and reference) log-probs in vocabulary chunks, rewards -> advantages."""
    model = nnx.merge(graphdef, params)
    old_logp, _ = token_logprobs(model, tokens, chunk=chunk)
    if ref_params is not None:
        ref_logp, _ = token_logprobs(nnx.merge(graphdef, ref_params), tokens, chunk=chunk)
    else:
        ref_logp = old_logp
    old_logp, ref_logp = jax.lax.stop_gradient(old_logp), jax.lax.stop_gradient(ref_logp)
    adv = compute_advantages(rewards, loss_mask, group_ids, num_groups, loss_cfg, old_logp=old_logp,
                             ref_logp=ref_logp)
    metrics = {}
    mask = loss_mask
    if loss_cfg.algorithm in ("grpo", "rloo"):
        keep = group_filter(rewards, loss_mask, group_ids, num_groups)
        metrics["filtered_frac"] = keep.filtered_frac  # games in constant groups (dropped when filtering)
        if filter_constant_groups:
            mask = loss_mask & keep.keep[:, None]
    return ExperienceBatch(tokens, mask, old_logp, ref_logp, adv), metrics


def _policy_loss(params, graphdef, mb: ExperienceBatch, loss_cfg: LossConfig, chunk: int):
    model = nnx.merge(graphdef, params)
    logp, entropy = token_logprobs(model, mb.tokens, chunk=chunk)
    return policy_loss(logp, mb.old_logp, mb.ref_logp, mb.advantages, mb.loss_mask, entropy, loss_cfg)


def _sft_loss(params, graphdef, mb: ExperienceBatch, loss_cfg: None, chunk: int):
    logp, _ = token_logprobs(nnx.merge(graphdef, params), mb.tokens, chunk=chunk)
    m = mb.loss_mask.astype(jnp.float32)
    loss = -(logp * m).sum() / jnp.maximum(m.sum(), 1.0)
    return loss, {"sft_loss": loss}


def _step(loss_fn, graphdef, params, opt_state, batch: ExperienceBatch, optimizer, loss_cfg, micro_batches: int,
          chunk: int, token_weighted: bool):
    """Accumulate gradients over micro-batches (lax.scan), then one optimizer update, skipped if not finite."""
    n = batch.tokens.shape[0]
    if n % micro_batches:
        raise ValueError(f"batch of {n} rows does not split into {micro_batches} micro-batches")
    split = jax.tree.map(lambda x: x.reshape(micro_batches, n // micro_batches, *x.shape[1:]), batch)
    # Each micro-batch's loss is weighted by its share of the tokens so a token mean matches one big batch.
    tokens_per_mb = split.loss_mask.sum(axis=(1, 2)).astype(jnp.float32)
    weights = tokens_per_mb / jnp.maximum(tokens_per_mb.sum(), 1.0)
    if not token_weighted:
        weights = jnp.full((micro_batches,), 1.0 / micro_batches)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulate(carry, xs):
        mb, w = xs
        (loss, metrics), grads = grad_fn(params, graphdef, mb, loss_cfg, chunk)
        g_acc, l_acc, m_acc = carry
        g_acc = jax.tree.map(lambda a, g: a + w * g, g_acc, grads)
        m_acc = jax.tree.map(lambda a, m: a + w * m, m_acc, metrics)
        return (g_acc, l_acc + w * loss, m_acc), None

    first = jax.tree.map(lambda x: x[0], split)
    m0 = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                      jax.eval_shape(lambda: loss_fn(params, graphdef, first, loss_cfg, chunk)[1]))
    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, loss, metrics), _ = jax.lax.scan(accumulate, (zeros, jnp.zeros((), jnp.float32), m0), (split, weights))
    grad_norm = _global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    metrics = {**metrics, "loss": loss, "grad_norm": grad_norm, "skipped": 1.0 - finite.astype(jnp.float32)}
    return keep(new_params, params), keep(new_opt_state, opt_state), metrics


def train_stage(graphdef: nnx.GraphDef, params: nnx.State, opt_state: Any, batch: ExperienceBatch, *,
                optimizer: optax.GradientTransformation, loss_cfg: LossConfig, micro_batches: int,
                chunk: int) -> tuple[nnx.State, Any, dict[str, Array]]:
    """One optimizer step of the policy loss over `micro_batches` accumulated micro-batches.

    A non-finite loss or gradient skips the update (params and optimizer state unchanged) and sets
    metrics["skipped"] = 1: NaN never reaches the weights.
    """
    return _step(_policy_loss, graphdef, params, opt_state, batch, optimizer, loss_cfg, micro_batches, chunk,
                 token_weighted=loss_cfg.aggregation == "token_mean")


def sft_stage(graphdef: nnx.GraphDef, params: nnx.State, opt_state: Any, tokens: Int[Array, "n t"],
              loss_mask: Bool[Array, "n t"], *, optimizer: optax.GradientTransformation, micro_batches: int,
              chunk: int) -> tuple[nnx.State, Any, dict[str, Array]]:
    """Cross-entropy on the masked tokens (the format warm-up): maximise log p of the demonstrated answers."""
    zeros = jnp.zeros(tokens.shape, jnp.float32)
    batch = ExperienceBatch(tokens, loss_mask, zeros, zeros, zeros)
    return _step(_sft_loss, graphdef, params, opt_state, batch, optimizer, None, micro_batches, chunk,
                 token_weighted=True)
