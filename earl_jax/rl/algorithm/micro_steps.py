"""The experience and train stages' micro-batch steps as pure functions over pytrees (graphdef static, params and
batch traced): cut micro-batch j out of the batch, its log-probs, its weighted loss and gradient, the advantage
step over the whole batch and the optimizer update.

rl/algorithm/packing.py compiles each under `planner.StageRun.jit` per micro-batch shape, and
rl/stages/experience_stage.py and rl/stages/train_stage.py
(the stages the trainer and the profiler run) call it; nothing here knows which mesh it runs on. What the plan decides
arrives as arguments: `micro_batches` and `shards` (how rows split, from `StageRun.micro_batches`) and `chunk` (the
layout's log-prob chunk).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from earl_jax.rl.algorithm.advantages import ESTIMATORS, compute_advantages, group_filter
from earl_jax.rl.algorithm.logprobs import token_logprobs
from earl_jax.rl.algorithm.losses import LossConfig, policy_loss
from earl_jax.sharding.context import constrain

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
    # legal-move bitmask of a constrained move token, 0 elsewhere (rollout/moves.py); None: free-text answers
    choices: Int[Array, "n t"] | None = None
    # supervised steps only: the bitmask of equally right moves at a move token ("sft" learns the set, not one move)
    targets: Int[Array, "n t"] | None = None
    # the sampler's log-probs, for a loss registered with `behaviour` (rl/algorithm/losses.py: decoupled_ppo); None
    # otherwise
    behaviour_logp: Float[Array, "n t"] | None = None


def split_rows(x: Array, micro_batches: int, shards: int) -> Array:
    """[n, ...] -> [micro_batches, n / micro_batches, ...], micro-batch j taking rows j*m..(j+1)*m-1 of every
    batch shard's block (m = n / (shards * micro_batches)): with rows sharded in blocks over `shards`
    devices, every device keeps computing its own rows (a plain reshape would put micro-batch j on 1/k of
    the devices and make XLA move or replicate it)."""
    n = x.shape[0]
    if n % (shards * micro_batches):
        raise ValueError(f"{n} rows do not split into {micro_batches} micro-batches over {shards} shards")
    y = x.reshape(shards, micro_batches, n // (shards * micro_batches), *x.shape[1:]).swapaxes(0, 1)
    y = y.reshape(micro_batches, n // micro_batches, *x.shape[1:])
    return constrain(y, (None, "batch") + (None,) * (x.ndim - 1))


def merge_rows(y: Array, shards: int) -> Array:
    """The inverse of `split_rows`: [micro_batches, n / micro_batches, ...] -> [n, ...] in the original order."""
    k, m = y.shape[:2]
    x = y.reshape(k, shards, m // shards, *y.shape[2:]).swapaxes(0, 1).reshape(k * m, *y.shape[2:])
    return constrain(x, ("batch",) + (None,) * (y.ndim - 2))


# The micro-batched steps in three parts, so that the grouped path (rl/algorithm/packing.py) compiles its heavy programs
# (`micro_logprobs`, `micro_grad`) per micro-batch shape only: cutting micro-batch j out of the batch and writing
# its log-probs back are cheap programs that carry the batch's own shape (its rows, padded width, split).

def micro_logprobs(params: nnx.State, tok: Int[Array, "m w"], ch: Int[Array, "m w"] | None = None, *,
                   graphdef: nnx.GraphDef, chunk: int, choice_tokens: tuple[int, ...] = ()) -> Float[Array, "m w"]:
    """log p of every token of one micro-batch."""
    logp, _ = token_logprobs(nnx.merge(graphdef, params), tok, chunk=chunk, **_choice_kw(ch, choice_tokens))
    return logp


def put_micro(out: Float[Array, "n t"], logp: Float[Array, "m w"], j, *, micro_batches: int, shards: int
              ) -> Float[Array, "n t"]:
    """`out` with micro-batch j's rows (`split_rows`) set to `logp`, padded with zeros to the batch's width."""
    logp = jnp.pad(logp, ((0, 0), (0, out.shape[1] - logp.shape[1])))
    split = jax.lax.dynamic_update_index_in_dim(split_rows(out, micro_batches, shards), logp, j, 0)
    return merge_rows(split, shards)


def take_micro(batch: Any, j, *, micro_batches: int, shards: int, width: int, token_weighted: bool
               ) -> tuple[Any, Float[Array, ""]]:
    """Micro-batch j at `width` columns and its weight in the batch's loss: its share of the batch's loss tokens
    (`token_weighted`) or of its rows, so the weighted micro-batch losses sum to the loss of the whole batch."""
    mb = micro_batch(batch, j, micro_batches, shards, width)
    if token_weighted:
        w = mb.loss_mask.sum().astype(jnp.float32) / jnp.maximum(batch.loss_mask.sum().astype(jnp.float32), 1.0)
    else:
        w = jnp.float32(1.0 / micro_batches)
    return mb, w


def _choice_kw(choices: Int[Array, "n t"] | None, choice_tokens: tuple[int, ...]) -> dict[str, Any]:
    """token_logprobs' arguments for constrained moves; none (the plain path) when the run has none."""
    if not choice_tokens:
        return {}
    if choices is None:
        raise ValueError("constrained moves (choice_tokens) need the batch's legal-move bitmasks (choices)")
    return dict(choices=choices, choice_tokens=choice_tokens)


def advantage_step(old_logp: Float[Array, "n t"], ref_logp: Float[Array, "n t"], tokens: Int[Array, "n t"],
                   loss_mask: Bool[Array, "n t"], rewards: Float[Array, "n t"], group_ids: Int[Array, " n"],
                   choices: Int[Array, "n t"] | None = None, sampler_logp: Float[Array, "n t"] | None = None,
                   behaviour_logp: Float[Array, "n t"] | None = None, *, num_groups: int, loss_cfg: LossConfig
                   ) -> tuple[ExperienceBatch, dict[str, Array]]:
    """Rewards -> advantages over the whole batch (groups span micro-batches); for a grouped estimator, constant
    groups masked out if `loss_cfg.filter_constant_groups`. `sampler_logp` (the rollout's own log-probs): the
    largest and mean gap to `old_logp` over the scored tokens are reported (0 when the loss takes them as old).
    `behaviour_logp`: kept in the batch for a loss that weighs tokens by it (decoupled_ppo)."""
    old_logp, ref_logp = jax.lax.stop_gradient(old_logp), jax.lax.stop_gradient(ref_logp)
    adv = compute_advantages(rewards, loss_mask, group_ids, num_groups, loss_cfg, old_logp=old_logp,
                             ref_logp=ref_logp)
    metrics = {}
    if sampler_logp is not None:
        gap = jnp.where(loss_mask, jnp.abs(old_logp - sampler_logp), 0.0)
        metrics["logprob_gap_max"] = jnp.max(gap)
        metrics["logprob_gap_mean"] = jnp.sum(gap) / jnp.maximum(jnp.sum(loss_mask), 1)
    mask = loss_mask
    if ESTIMATORS[loss_cfg.estimator].grouped:
        keep = group_filter(rewards, loss_mask, group_ids, num_groups)
        metrics["filtered_frac"] = keep.filtered_frac  # games in constant groups (dropped when filtering)
        if loss_cfg.filter_constant_groups:
            mask = loss_mask & keep.keep[:, None]
    behaviour_logp = None if behaviour_logp is None else jax.lax.stop_gradient(behaviour_logp)
    return ExperienceBatch(tokens, mask, old_logp, ref_logp, adv, choices, behaviour_logp=behaviour_logp), metrics


def _policy_loss(params, graphdef, mb: ExperienceBatch, loss_cfg: LossConfig, chunk: int, choice_tokens=()):
    model = nnx.merge(graphdef, params)
    logp, entropy = token_logprobs(model, mb.tokens, chunk=chunk, **_choice_kw(mb.choices, choice_tokens))
    return policy_loss(logp, mb.old_logp, mb.ref_logp, mb.advantages, mb.loss_mask, entropy, loss_cfg,
                       mb.behaviour_logp)


def _sft_loss(params, graphdef, mb: ExperienceBatch, loss_cfg: None, chunk: int, choice_tokens=()):
    logp, _ = token_logprobs(nnx.merge(graphdef, params), mb.tokens, chunk=chunk, right=mb.targets,
                             **_choice_kw(mb.choices, choice_tokens))
    m = mb.loss_mask.astype(jnp.float32)
    loss = -(logp * m).sum() / jnp.maximum(m.sum(), 1.0)
    return loss, {"sft_loss": loss}


# What `micro_grad` differentiates, by name: fn(params, graphdef, mb, loss_cfg, chunk, choice_tokens) -> (loss, metrics)
LOSSES = {"policy": _policy_loss, "sft": _sft_loss}


def sft_batch(tokens: Int[Array, "n t"], loss_mask: Bool[Array, "n t"], choices: Int[Array, "n t"] | None = None,
              targets: Int[Array, "n t"] | None = None) -> ExperienceBatch:
    """The supervised batch of the "sft" loss (old_logp, ref_logp, advantages unused); `choices`: the legal-move
    bitmasks of constrained moves, so a move is learned under the same masked softmax the rollout samples from;
    `targets` (constrained moves only): the right moves' bitmasks, learned as a set (the probability of any of them)."""
    if targets is not None and choices is None:
        raise ValueError("sft_batch: targets (a set of right moves) need constrained moves (choices)")
    zeros = jnp.zeros(tokens.shape, jnp.float32)
    return ExperienceBatch(tokens, loss_mask, zeros, zeros, zeros, choices, targets)


def micro_batch(batch: Any, j, micro_batches: int, shards: int, width: int) -> Any:
    """Micro-batch j of `split_rows` (every leaf [n, ...]), its first `width` columns for [n, t] leaves."""
    def one(x):
        mb = jax.lax.dynamic_index_in_dim(split_rows(x, micro_batches, shards), j, 0, keepdims=False)
        return mb[:, :width] if x.ndim == 2 else mb
    return jax.tree.map(one, batch)


def micro_grad(params: nnx.State, acc: Any, mb: ExperienceBatch, w: Float[Array, ""], *, graphdef: nnx.GraphDef,
               loss: str, loss_cfg: LossConfig | None, chunk: int, choice_tokens: tuple[int, ...] = ()) -> Any:
    """`acc` plus one micro-batch's loss, metrics and gradient, weighted by `w` (`take_micro`)."""
    (value, metrics), grads = jax.value_and_grad(LOSSES[loss], has_aux=True)(params, graphdef, mb, loss_cfg, chunk,
                                                                             choice_tokens)
    g_acc, l_acc, m_acc = acc
    return (jax.tree.map(lambda a, g: a + w * g, g_acc, grads), l_acc + w * value,
            jax.tree.map(lambda a, m: a + w * m, m_acc, metrics))


def zero_acc(params: nnx.State, batch: ExperienceBatch, *, graphdef: nnx.GraphDef, loss: str,
             loss_cfg: LossConfig | None, chunk: int, choice_tokens: tuple[int, ...] = ()) -> Any:
    """The empty accumulator for `micro_grad`: zero gradients, loss and metrics."""
    m = jax.eval_shape(lambda: LOSSES[loss](params, graphdef, jax.tree.map(lambda x: x[:1], batch), loss_cfg,
                                            chunk, choice_tokens)[1])
    return (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
            jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), m))


def apply_step(params: nnx.State, opt_state: Any, acc: Any, *, optimizer: optax.GradientTransformation
               ) -> tuple[nnx.State, Any, dict[str, Array]]:
    """One optimizer update from the accumulated gradient; skipped (params and state unchanged, metrics
    "skipped" = 1) when the loss or the gradient is not finite: NaN never reaches the weights."""
    grads, loss, metrics = acc
    grad_norm = _global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    metrics = {**metrics, "loss": loss, "grad_norm": grad_norm, "skipped": 1.0 - finite.astype(jnp.float32)}
    return keep(new_params, params), keep(new_opt_state, opt_state), metrics
