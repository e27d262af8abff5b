"""Advantage estimators registered by name (GRPO, Dr. GRPO, RLOO, REINFORCE++), masked statistics, the group filter.

Layout: `rewards [N, T]` is a sparse token-level reward at the last generated token of each turn
(the game outcome on the episode's last generated token); `loss_mask [N, T]` is nonzero on generated
tokens; `group_ids [N]` in [0, num_groups) need not be contiguous. Rewards at masked-out positions
are ignored. Rows without any generated token (batch padding) are not group members and get 0.
Groups use segment ops with a static `num_groups`, so everything jits. Call these on the whole
batch (not per micro-batch): group and global statistics need every sequence.

A new estimator is one function registered with `@register_estimator(name, grouped=...)` (the built-in
ones are at the bottom); `LossConfig(estimator=name)` then runs it.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped


class EstimatorOptions(Protocol):
    """What the estimators read of their config: rl/algorithm/losses.py's `LossConfig` has these fields (a Protocol,
    so that this module needs nothing of the losses that use it)."""

    estimator: str
    adv_eps: float
    gamma: float
    between_group_weight: float
    turn_discount: float

# Nonzero = token the policy generated (bool, int or float).
TokenMask = Shaped[Array, "n t"]


# ---------------------------------------------------------------------------------------------
# Masked statistics


def masked_sum(x: Float[Array, "..."], mask: Array, axis: int | None = None) -> Float[Array, "..."]:
    """Sum of x where mask is nonzero (NaN/inf at masked-out positions are ignored)."""
    return jnp.where(mask.astype(bool), x, 0.0).sum(axis)


def masked_mean(x: Float[Array, "..."], mask: Array, axis: int | None = None) -> Float[Array, "..."]:
    """Mean of x where mask is nonzero; 0 where nothing is masked in."""
    return _masked_center(x, mask, axis)[1]


def masked_var(x: Float[Array, "..."], mask: Array, axis: int | None = None,
               unbiased: bool = False) -> Float[Array, "..."]:
    """Variance of x where mask is nonzero (population, or n - 1 if unbiased); 0 with fewer than two entries."""
    m = mask.astype(bool)
    centered, _, count = _masked_center(x, m, axis)
    sq = jnp.where(m, centered, 0.0) ** 2
    return sq.sum(axis) / jnp.maximum(count - (1 if unbiased else 0), 1)


@functools.partial(jax.jit, static_argnames=("shift_mean",))
def masked_whiten(x: Float[Array, "n t"], mask: TokenMask, eps: float = 1e-6,
                  shift_mean: bool = True) -> Float[Array, "n t"]:
    """(x - mean) / (std + eps), population mean/std over ALL masked entries; 0 at masked-out ones.

    shift_mean=False only rescales: x / (std + eps).
    """
    m = mask.astype(bool)
    centered, mean, count = _masked_center(x, m, None)
    std = jnp.sqrt(jnp.square(jnp.where(m, centered, 0.0)).sum() / jnp.maximum(count, 1))
    out = (centered if shift_mean else centered + mean) / (std + eps)
    return jnp.where(m, out, 0.0)


@functools.partial(jax.jit, static_argnums=2)
def _masked_center(x, mask, axis):
    """(x - mean, mean, count) over masked entries, computed about the masked max so equal values
    give exactly 0 (no 1-ulp residue for the std division to blow up)."""
    m = mask.astype(bool)
    x = jnp.asarray(x, jnp.float32)
    ref = jnp.max(jnp.where(m, x, -jnp.inf), axis=axis, keepdims=True)
    ref = jnp.where(jnp.isfinite(ref), ref, 0.0)
    shifted = jnp.where(m, x - ref, 0.0)
    count = m.sum(axis=axis, keepdims=True)
    shift_mean = shifted.sum(axis=axis, keepdims=True) / jnp.maximum(count, 1)
    mean = ref + shift_mean
    squeeze = (lambda a: a.reshape(())) if axis is None else (lambda a: jnp.squeeze(a, axis))
    return shifted - shift_mean, squeeze(mean), squeeze(count)


# ---------------------------------------------------------------------------------------------
# Token-level returns


@jax.jit
def _reverse_linear_scan(a: Float[Array, "n t"], b: Float[Array, "n t"]) -> Float[Array, "n t"]:
    """c[t] = a[t] * c[t+1] + b[t], c[T] = 0, in O(log T) depth (associative scan, not a T-step loop)."""

    def compose(later, current):  # current o later: f_t(f_{t+1..}(c))
        a_l, b_l = later
        a_c, b_c = current
        return a_c * a_l, a_c * b_l + b_c

    return jax.lax.associative_scan(compose, (a, b), reverse=True, axis=1)[1]


@jax.jit
def discounted_returns(rewards: Float[Array, "n t"], loss_mask: TokenMask,
                       gamma: float = 1.0) -> Float[Array, "n t"]:
    """Returns-to-go G[t] = r[t] + gamma * G[next generated token after t], over generated tokens only.

    Prompt/observation tokens in between are not steps (no discount across them); 0 at them.
    """
    m = loss_mask.astype(bool)
    r = jnp.where(m, jnp.asarray(rewards, jnp.float32), 0.0)
    returns = _reverse_linear_scan(jnp.where(m, jnp.asarray(gamma, jnp.float32), jnp.float32(1.0)), r)
    return jnp.where(m, returns, 0.0)


# ---------------------------------------------------------------------------------------------
# Sequence-level (group) estimators


def sequence_returns(rewards: Float[Array, "n t"], loss_mask: TokenMask) -> Float[Array, " n"]:
    """Undiscounted return of each sequence: the sum of its rewards at generated tokens."""
    return masked_sum(jnp.asarray(rewards, jnp.float32), loss_mask, axis=-1)


class _GroupStats(NamedTuple):
    valid: Bool[Array, " n"]  # row has at least one generated token
    centered: Float[Array, " n"]  # R - group mean (0 for invalid rows)
    count: Float[Array, " n"]  # members of this row's group
    spread: Float[Array, " n"]  # group max - group min of R


def _group_stats(returns, loss_mask, group_ids, num_groups) -> _GroupStats:
    valid = loss_mask.astype(bool).any(-1)
    gid = jnp.asarray(group_ids, jnp.int32)
    seg = lambda v, op=jax.ops.segment_sum: op(v, gid, num_segments=num_groups)[gid]
    count = seg(valid.astype(jnp.float32))
    gmax = seg(jnp.where(valid, returns, -jnp.inf), jax.ops.segment_max)
    gmin = seg(jnp.where(valid, returns, jnp.inf), jax.ops.segment_min)
    # About the group max, so a group of equal returns centres to exactly 0.
    shifted = jnp.where(valid, returns - gmax, 0.0)
    centered = jnp.where(valid, shifted - seg(shifted) / jnp.maximum(count, 1), 0.0)
    spread = jnp.where(valid, gmax - gmin, 0.0)
    return _GroupStats(valid, centered, count, spread)


def _broadcast(adv_n, loss_mask):
    return jnp.where(loss_mask.astype(bool), adv_n[:, None], 0.0)


@functools.partial(jax.jit, static_argnames=("num_groups", "scale_by_std"))
def grpo_advantages(
    rewards: Float[Array, "n t"], loss_mask: TokenMask, group_ids: Int[Array, " n"], num_groups: int,
    scale_by_std: bool = True, eps: float = 1e-6,
) -> Float[Array, "n t"]:
    """GRPO: (R - group mean) / (group std + eps) on every generated token; Dr. GRPO if not scale_by_std.

    The std is the unbiased (n - 1) one, as TRL and veRL compute it. One-member groups get 0.
    """
    returns = sequence_returns(rewards, loss_mask)
    s = _group_stats(returns, loss_mask, group_ids, num_groups)
    adv = s.centered
    if scale_by_std:
        gid = jnp.asarray(group_ids, jnp.int32)
        var = jax.ops.segment_sum(s.centered**2, gid, num_segments=num_groups)[gid] / jnp.maximum(s.count - 1, 1)
        adv = adv / (jnp.sqrt(var) + eps)
    return _broadcast(adv, loss_mask)


@functools.partial(jax.jit, static_argnames=("num_groups",))
def rloo_advantages(
    rewards: Float[Array, "n t"], loss_mask: TokenMask, group_ids: Int[Array, " n"], num_groups: int,
) -> Float[Array, "n t"]:
    """RLOO: R_i - mean of the other members' returns (= n/(n-1) (R_i - mean)); one-member groups get 0."""
    returns = sequence_returns(rewards, loss_mask)
    s = _group_stats(returns, loss_mask, group_ids, num_groups)
    adv = jnp.where(s.count > 1, s.centered * s.count / jnp.maximum(s.count - 1, 1), 0.0)
    return _broadcast(adv, loss_mask)


@jax.jit
def reinforce_pp_advantages(rewards: Float[Array, "n t"], loss_mask: TokenMask, gamma: float = 1.0,
                            eps: float = 1e-6) -> Float[Array, "n t"]:
    """REINFORCE++ (EARL's estimator): returns-to-go, whitened with the mean/std over all generated tokens of
    the batch (no critic, no groups)."""
    m = loss_mask.astype(bool)
    r = jnp.where(m, jnp.asarray(rewards, jnp.float32), 0.0)
    return masked_whiten(discounted_returns(r, m, gamma), m, eps)


@functools.partial(jax.jit, static_argnames=("num_groups",))
def between_group_advantages(
    rewards: Float[Array, "n t"], loss_mask: TokenMask, group_ids: Int[Array, " n"], num_groups: int,
    eps: float = 1e-6,
) -> Float[Array, "n t"]:
    """(group mean - batch mean) / batch std on every generated token: how a group did against the batch.

    GRPO's group baseline removes exactly this part of R - batch mean (R - batch mean = (R - group mean)
    + (group mean - batch mean)). Added back with a small weight it is the signal that says "this answer
    is good *here*, not everywhere": a policy that always answers the same scores in the groups where that
    answer fits and not elsewhere, so its constant groups differ from each other even when no group varies
    inside. Rows without generated tokens get 0; a batch of equal returns gets 0.
    """
    returns = sequence_returns(rewards, loss_mask)
    s = _group_stats(returns, loss_mask, group_ids, num_groups)
    centered_batch, _, count = _masked_center(returns, s.valid, None)
    std = jnp.sqrt(jnp.square(jnp.where(s.valid, centered_batch, 0.0)).sum() / jnp.maximum(count, 1))
    between = jnp.where(s.valid, centered_batch - s.centered, 0.0)  # group mean - batch mean
    return _broadcast(between / (std + eps), loss_mask)


@jax.jit
def later_turns(loss_mask: TokenMask) -> Int[Array, "n t"]:
    """For each generated token, how many of its sequence's turns (runs of generated tokens) come after its own."""
    m = loss_mask.astype(bool)
    starts = m & ~jnp.pad(m[:, :-1], ((0, 0), (1, 0)))
    after = jnp.cumsum(starts[:, ::-1], axis=1)[:, ::-1] - starts  # turn starts strictly after t
    return jnp.where(m, after, 0).astype(jnp.int32)


def discount_by_turn(advantages: Float[Array, "n t"], loss_mask: TokenMask,
                     turn_discount: float) -> Float[Array, "n t"]:
    """advantage x turn_discount ** (turns after this token's turn): a game's outcome credits its last moves most.

    A sequence-level advantage (GRPO, RLOO) credits every turn of a game equally, also turns that did not
    matter; the discount trades that variance for a bias towards late moves (REINFORCE++'s gamma, per turn).
    """
    return advantages * jnp.asarray(turn_discount, jnp.float32) ** later_turns(loss_mask)


# ---------------------------------------------------------------------------------------------
# Group filter


class GroupFilter(NamedTuple):
    keep: Bool[Array, " n"]  # sequence is in a group whose returns vary (and has generated tokens)
    filtered_frac: Float[Array, ""]  # fraction of non-padding sequences dropped


@functools.partial(jax.jit, static_argnames=("num_groups",))
def group_filter(
    rewards: Float[Array, "n t"], loss_mask: TokenMask, group_ids: Int[Array, " n"], num_groups: int,
    atol: float = 1e-6,
) -> GroupFilter:
    """Mark groups whose returns do not vary (max - min <= atol, one-member groups included).

    Such groups carry no group-relative signal; drop them (e.g. `loss_mask * keep[:, None]`) to guard
    against collapse (DAPO's dynamic sampling).
    """
    s = _group_stats(sequence_returns(rewards, loss_mask), loss_mask, group_ids, num_groups)
    keep = s.valid & (s.spread > atol)
    n_valid = s.valid.sum()
    frac = (s.valid & ~keep).sum() / jnp.maximum(n_valid, 1)
    return GroupFilter(keep, frac.astype(jnp.float32))


# ---------------------------------------------------------------------------------------------
# Registry and entry point


class AdvantageInputs(NamedTuple):
    """What an estimator reads, over the whole batch (groups span micro-batches)."""

    rewards: Float[Array, "n t"]
    loss_mask: TokenMask
    group_ids: Int[Array, " n"]
    num_groups: int  # static: the segment ops' size
    old_logp: Float[Array, "n t"] | None  # the policy that played the games
    ref_logp: Float[Array, "n t"] | None  # the reference model (old_logp when the job keeps none)


class Estimator(NamedTuple):
    fn: Callable[[AdvantageInputs, EstimatorOptions], Float[Array, "n t"]]
    grouped: bool  # relative to the game's group: the group filter, between-group term and turn discount apply


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, *, grouped: bool) -> Callable:
    """Register `fn(x: AdvantageInputs, cfg: EstimatorOptions) -> advantages [n, t]` (0 on masked-out tokens) as `name`.

    grouped=True: advantages are relative to the game's group, so LossConfig's group options (filter_constant_groups,
    between_group_weight, turn_discount) apply and the job needs groups of at least two games. `fn` runs inside
    `compute_advantages`' jit (cfg and num_groups static): it needs no jit of its own.
    """
    def register(fn):
        if name in ESTIMATORS:
            raise ValueError(f"register_estimator: {name!r} is already registered "
                             f"({ESTIMATORS[name].fn.__qualname__})")
        ESTIMATORS[name] = Estimator(fn, grouped)
        return fn
    return register


@register_estimator("grpo", grouped=True)
def grpo(x: AdvantageInputs, cfg: EstimatorOptions) -> Float[Array, "n t"]:
    """GRPO: (R - group mean) / (group std + eps)."""
    return grpo_advantages(x.rewards, x.loss_mask, x.group_ids, x.num_groups, True, cfg.adv_eps)


@register_estimator("dr_grpo", grouped=True)
def dr_grpo(x: AdvantageInputs, cfg: EstimatorOptions) -> Float[Array, "n t"]:
    """Dr. GRPO: R - group mean, no std division (pair with aggregation="seq_mean_token_sum" for the paper's loss)."""
    return grpo_advantages(x.rewards, x.loss_mask, x.group_ids, x.num_groups, False, cfg.adv_eps)


@register_estimator("rloo", grouped=True)
def rloo(x: AdvantageInputs, cfg: EstimatorOptions) -> Float[Array, "n t"]:
    """RLOO: R - mean of the other group members' returns."""
    return rloo_advantages(x.rewards, x.loss_mask, x.group_ids, x.num_groups)


@register_estimator("reinforce_pp", grouped=False)
def reinforce_pp(x: AdvantageInputs, cfg: EstimatorOptions) -> Float[Array, "n t"]:
    """REINFORCE++: returns-to-go discounted by cfg.gamma per generated token, whitened over the batch."""
    return reinforce_pp_advantages(x.rewards, x.loss_mask, cfg.gamma, cfg.adv_eps)


@functools.partial(jax.jit, static_argnames=("num_groups", "cfg"))
def compute_advantages(
    rewards: Float[Array, "n t"],
    loss_mask: TokenMask,
    group_ids: Int[Array, " n"],
    num_groups: int,
    cfg: EstimatorOptions,
    *,
    old_logp: Float[Array, "n t"] | None = None,
    ref_logp: Float[Array, "n t"] | None = None,
) -> Float[Array, "n t"]:
    """Advantages [N, T] of the registered estimator `cfg.estimator` (0 on masked-out tokens).

    For a grouped estimator, plus cfg.between_group_weight times `between_group_advantages`, then discounted
    by cfg.turn_discount per later turn. jit with cfg and num_groups static.
    """
    estimator = ESTIMATORS[cfg.estimator]
    adv = estimator.fn(AdvantageInputs(rewards, loss_mask, group_ids, num_groups, old_logp, ref_logp), cfg)
    if not estimator.grouped:
        return adv
    if cfg.between_group_weight:
        adv = adv + cfg.between_group_weight * between_group_advantages(
            rewards, loss_mask, group_ids, num_groups, cfg.adv_eps)
    return adv if cfg.turn_discount == 1.0 else discount_by_turn(adv, loss_mask, cfg.turn_discount)
