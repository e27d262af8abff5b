"""The experience and train stages as pure functions over pytrees (graphdef static, params and batch traced).

Each is compiled by `planner.StageRun.jit` under its own stage mesh; nothing here knows which mesh that is.
What the plan decides arrives as arguments: `micro_batches` and `shards` (how rows split, from
`StageRun.micro_batches`) and `chunk` (the layout's log-prob chunk).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from earl_jax.rl.advantages import ESTIMATORS, compute_advantages, group_filter
from earl_jax.rl.logprobs import token_logprobs
from earl_jax.rl.losses import LossConfig, policy_loss
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


def make_optimizer(learning_rate: float, warmup_steps: int, total_steps: int, weight_decay: float,
                   grad_clip: float) -> optax.GradientTransformation:
    # Warm-up starts above zero: a first step at learning rate 0 would waste a whole RL iteration.
    schedule = optax.warmup_cosine_decay_schedule(
        learning_rate / max(warmup_steps, 1), learning_rate, max(warmup_steps, 1), max(total_steps, warmup_steps + 1), end_value=0.1 * learning_rate)
    return optax.chain(optax.clip_by_global_norm(grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay))


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


def logprob_step(params: nnx.State, out: Float[Array, "n t"], tokens: Int[Array, "n t"], j,
                 choices: Int[Array, "n t"] | None = None, *, graphdef: nnx.GraphDef, micro_batches: int, shards: int, width: int, chunk: int,
                 choice_tokens: tuple[int, ...] = ()) -> Float[Array, "n t"]:
    """Write the log-probs of micro-batch j (`split_rows`), computed on its first `width` columns, into
    `out`. Columns past `width` must be padding (causal attention: they change nothing before them).
    `choice_tokens` (static): the move tokens of constrained moves, scored where `choices` != 0."""
    tok, ch = micro_batch((tokens, choices), j, micro_batches, shards, width)
    logp = micro_logprobs(params, tok, ch, graphdef=graphdef, chunk=chunk, choice_tokens=choice_tokens)
    return put_micro(out, logp, j, micro_batches=micro_batches, shards=shards)


# The micro-batched steps in three parts, so that the grouped path (rl/packing.py) compiles its heavy programs
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
    """Micro-batch j at `width` columns and its weight in the batch's loss (`grad_step`)."""
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
                   choices: Int[Array, "n t"] | None = None, *,
                   num_groups: int, loss_cfg: LossConfig) -> tuple[ExperienceBatch, dict[str, Array]]:
    """Rewards -> advantages over the whole batch (groups span micro-batches); for a grouped estimator, constant
    groups masked out if `loss_cfg.filter_constant_groups`."""
    old_logp, ref_logp = jax.lax.stop_gradient(old_logp), jax.lax.stop_gradient(ref_logp)
    adv = compute_advantages(rewards, loss_mask, group_ids, num_groups, loss_cfg, old_logp=old_logp,
                             ref_logp=ref_logp)
    metrics = {}
    mask = loss_mask
    if ESTIMATORS[loss_cfg.estimator].grouped:
        keep = group_filter(rewards, loss_mask, group_ids, num_groups)
        metrics["filtered_frac"] = keep.filtered_frac  # games in constant groups (dropped when filtering)
        if loss_cfg.filter_constant_groups:
            mask = loss_mask & keep.keep[:, None]
    return ExperienceBatch(tokens, mask, old_logp, ref_logp, adv, choices), metrics


def experience_stage(params: nnx.State, ref_params: nnx.State | None, tokens: Int[Array, "n t"],
                     loss_mask: Bool[Array, "n t"], rewards: Float[Array, "n t"], group_ids: Int[Array, " n"],
                     choices: Int[Array, "n t"] | None = None, *, graphdef: nnx.GraphDef, num_groups: int,
                     loss_cfg: LossConfig, micro_batches: int, shards: int, chunk: int,
                     choice_tokens: tuple[int, ...] = ()) -> tuple[ExperienceBatch, dict[str, Array]]:
    """Old-policy (and reference) log-probs, micro-batched over rows and chunked over the vocabulary as the
    plan says, every micro-batch at the full width; then `advantage_step`. One program (the trainer runs the
    same steps per micro-batch, each at its own width)."""
    kw = dict(graphdef=graphdef, micro_batches=micro_batches, shards=shards, width=tokens.shape[1], chunk=chunk,
              choice_tokens=choice_tokens)

    def logprobs(p):
        out = jnp.zeros(tokens.shape, jnp.float32)
        return jax.lax.fori_loop(0, micro_batches, lambda j, o: logprob_step(p, o, tokens, j, choices, **kw), out)

    old_logp = logprobs(params)
    ref_logp = logprobs(ref_params) if ref_params is not None else old_logp
    return advantage_step(old_logp, ref_logp, tokens, loss_mask, rewards, group_ids, choices, num_groups=num_groups,
                          loss_cfg=loss_cfg)


def _policy_loss(params, graphdef, mb: ExperienceBatch, loss_cfg: LossConfig, chunk: int, choice_tokens=()):
    model = nnx.merge(graphdef, params)
    logp, entropy = token_logprobs(model, mb.tokens, chunk=chunk, **_choice_kw(mb.choices, choice_tokens))
    return policy_loss(logp, mb.old_logp, mb.ref_logp, mb.advantages, mb.loss_mask, entropy, loss_cfg)


def _sft_loss(params, graphdef, mb: ExperienceBatch, loss_cfg: None, chunk: int, choice_tokens=()):
    logp, _ = token_logprobs(nnx.merge(graphdef, params), mb.tokens, chunk=chunk, **_choice_kw(mb.choices, choice_tokens))
    m = mb.loss_mask.astype(jnp.float32)
    loss = -(logp * m).sum() / jnp.maximum(m.sum(), 1.0)
    return loss, {"sft_loss": loss}


# What `grad_step` differentiates, by name: fn(params, graphdef, mb, loss_cfg, chunk, choice_tokens) -> (loss, metrics)
LOSSES = {"policy": _policy_loss, "sft": _sft_loss}


def sft_batch(tokens: Int[Array, "n t"], loss_mask: Bool[Array, "n t"]) -> ExperienceBatch:
    """The supervised batch of the format warm-up's "sft" loss (old_logp, ref_logp, advantages unused)."""
    zeros = jnp.zeros(tokens.shape, jnp.float32)
    return ExperienceBatch(tokens, loss_mask, zeros, zeros, zeros)


def micro_batch(batch: Any, j, micro_batches: int, shards: int, width: int) -> Any:
    """Micro-batch j of `split_rows` (every leaf [n, ...]), its first `width` columns for [n, t] leaves."""
    def one(x):
        mb = jax.lax.dynamic_index_in_dim(split_rows(x, micro_batches, shards), j, 0, keepdims=False)
        return mb[:, :width] if x.ndim == 2 else mb
    return jax.tree.map(one, batch)


def grad_step(params: nnx.State, acc: Any, batch: ExperienceBatch, j, *, graphdef: nnx.GraphDef, loss: str,
              loss_cfg: LossConfig | None, micro_batches: int, shards: int, width: int, chunk: int,
              token_weighted: bool, choice_tokens: tuple[int, ...] = ()) -> Any:
    """Add micro-batch j's weighted loss, metrics and gradient to `acc` = (grads, loss, metrics). Each
    micro-batch's loss is weighted by its share of the batch's loss tokens (token mean) or of its rows
    (sequence means), so the sum equals the loss of the whole batch. Columns past `width` must be padding:
    with causal attention they change no log-prob of the columns kept."""
    mb, w = take_micro(batch, j, micro_batches=micro_batches, shards=shards, width=width, token_weighted=token_weighted)
    return micro_grad(params, acc, mb, w, graphdef=graphdef, loss=loss, loss_cfg=loss_cfg, chunk=chunk,
                      choice_tokens=choice_tokens)


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
    """The empty accumulator for `grad_step`: zero gradients, loss and metrics."""
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


def _step(loss: str, graphdef, params, opt_state, batch: ExperienceBatch, optimizer, loss_cfg, micro_batches: int,
          shards: int, chunk: int, token_weighted: bool, choice_tokens: tuple[int, ...] = ()):
    """Every micro-batch at the full width in one program (a loop over `grad_step`), then `apply_step`."""
    kw = dict(graphdef=graphdef, loss=loss, loss_cfg=loss_cfg, chunk=chunk, choice_tokens=choice_tokens)
    acc = zero_acc(params, batch, **kw)
    acc = jax.lax.fori_loop(0, micro_batches, lambda j, a: grad_step(
        params, a, batch, j, micro_batches=micro_batches, shards=shards, width=batch.tokens.shape[1],
        token_weighted=token_weighted, **kw), acc)
    return apply_step(params, opt_state, acc, optimizer=optimizer)


def train_stage(params: nnx.State, opt_state: Any, batch: ExperienceBatch, *, graphdef: nnx.GraphDef,
                optimizer: optax.GradientTransformation, loss_cfg: LossConfig, micro_batches: int, shards: int = 1,
                chunk: int, choice_tokens: tuple[int, ...] = ()) -> tuple[nnx.State, Any, dict[str, Array]]:
    """One optimizer step of the policy loss over `micro_batches` accumulated micro-batches (rows split as
    `split_rows` does over `shards` batch shards).

    A non-finite loss or gradient skips the update (params and optimizer state unchanged) and sets
    metrics["skipped"] = 1: NaN never reaches the weights.
    """
    return _step("policy", graphdef, params, opt_state, batch, optimizer, loss_cfg, micro_batches, shards,
                 chunk, token_weighted=loss_cfg.aggregation == "token_mean", choice_tokens=choice_tokens)
