"""Token-level policy-gradient losses: PPO-clip (GRPO, REINFORCE++, RLOO use it too), REINFORCE, KL to a reference.

Every input is `[N, T]`, aligned with the tokens: position t holds a quantity of token t
(`logp[n, t] = log p(tokens[n, t] | tokens[n, :t])`). `loss_mask` is nonzero on tokens the policy
generated; everything at other positions is ignored, even NaN or inf, and gets zero gradient.

Algorithms differ in their advantages (see `advantages.compute_advantages`), not in their loss:

- "ppo":          GAE advantages (`advantages.gae`) from per-token values, PPO-clip surrogate. For forks that add
                  a critic: the trainer has none and RLConfig does not offer it (without values, V = 0).
- "grpo":         group-relative advantages (R - group mean) / group std, PPO-clip surrogate.
                  Dr. GRPO = `scale_by_std=False` (with "seq_mean_token_sum" aggregation if wanted).
- "reinforce_pp": REINFORCE++ (EARL's estimator): token returns-to-go with an optional k1 KL penalty
                  folded into the reward, globally whitened over the batch, PPO-clip surrogate.
- "rloo":         leave-one-out baseline within the group, PPO-clip surrogate.

`surrogate="reinforce"` swaps PPO-clip for the ratio-free -A * logp (same gradient at ratio 1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

# Nonzero = token the policy generated (bool, int or float).
TokenMask = Shaped[Array, "n t"]

Algorithm = Literal["ppo", "grpo", "reinforce_pp", "rloo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k3"]

ALGORITHMS = ("ppo", "grpo", "reinforce_pp", "rloo")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k3", None)
SURROGATES = ("ppo_clip", "reinforce")

# exp(20) ~ 4.9e8: log-ratios beyond this are clamped so exp never overflows float32 (as veRL does).
MAX_LOG_RATIO = 20.0


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy loss and advantage estimator. Frozen and hashable, so it can be a static jit argument."""

    algorithm: Algorithm = "grpo"
    clip_eps_low: float = 0.2  # ratio clipped below at 1 - clip_eps_low
    clip_eps_high: float = 0.2  # ratio clipped above at 1 + clip_eps_high (0.28 = DAPO's clip-higher)
    dual_clip: float | None = 3.0  # for A < 0 the loss is capped at -A * dual_clip; None = off
    kl_coef: float = 0.0  # weight of the KL-to-reference term in the loss
    kl_estimator: KLEstimator | None = None  # "k1", "k3" or None (no KL term)
    entropy_coef: float = 0.0  # loss -= entropy_coef * entropy
    entropy_floor: float | None = None  # if set, loss -= entropy_coef * min(entropy, floor): a bonus only below it
    aggregation: Aggregation = "token_mean"
    surrogate: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    # Advantage estimation (see advantages.compute_advantages).
    gamma: float = 1.0  # discount per generated token (reinforce_pp, ppo)
    gae_lambda: float = 1.0  # GAE lambda (ppo)
    scale_by_std: bool = True  # grpo: divide by the group std; False = Dr. GRPO
    between_group_weight: float = 0.0  # grpo / rloo: + this x (group mean - batch mean) / batch std
    turn_discount: float = 1.0  # grpo / rloo: advantage x this ** (turns after the token's turn)
    reward_kl_coef: float = 0.0  # reinforce_pp / ppo: k1 KL to the reference folded into token rewards
    adv_eps: float = 1e-6  # added to standard deviations before dividing

    def __post_init__(self):
        def fail(field: str, msg: str):
            raise ValueError(f"LossConfig.{field}: {msg} (got {getattr(self, field)!r})")

        if self.algorithm not in ALGORITHMS:
            fail("algorithm", f"must be one of {ALGORITHMS}")
        if not 0.0 <= self.clip_eps_low < 1.0:
            fail("clip_eps_low", "must be in [0, 1)")
        if not self.clip_eps_high >= 0.0:
            fail("clip_eps_high", "must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            fail("dual_clip", "must be > 1 or None")
        if self.kl_estimator not in KL_ESTIMATORS:
            fail("kl_estimator", f"must be one of {KL_ESTIMATORS}")
        if not self.kl_coef >= 0.0:
            fail("kl_coef", "must be >= 0")
        if self.kl_coef > 0.0 and self.kl_estimator is None:
            fail("kl_coef", "is positive but kl_estimator is None; set kl_estimator='k1' or 'k3'")
        if not self.entropy_coef >= 0.0:
            fail("entropy_coef", "must be >= 0")
        if self.entropy_floor is not None and not (self.entropy_floor > 0.0 and self.entropy_coef > 0.0):
            fail("entropy_floor", "must be > 0, with entropy_coef > 0 (the bonus it bounds)")
        if self.aggregation not in AGGREGATIONS:
            fail("aggregation", f"must be one of {AGGREGATIONS}")
        if self.surrogate not in SURROGATES:
            fail("surrogate", f"must be one of {SURROGATES}")
        if not 0.0 <= self.gamma <= 1.0:
            fail("gamma", "must be in [0, 1]")
        if not 0.0 <= self.gae_lambda <= 1.0:
            fail("gae_lambda", "must be in [0, 1]")
        if not self.reward_kl_coef >= 0.0:
            fail("reward_kl_coef", "must be >= 0")
        if self.reward_kl_coef > 0.0 and self.algorithm not in ("reinforce_pp", "ppo"):
            fail("reward_kl_coef", "only token-level estimators (reinforce_pp, ppo) fold KL into rewards; "
                 "use kl_coef with kl_estimator for a KL loss term")
        if not self.between_group_weight >= 0.0:
            fail("between_group_weight", "must be >= 0")
        if self.between_group_weight > 0.0 and self.algorithm not in ("grpo", "rloo"):
            fail("between_group_weight", "only group estimators (grpo, rloo) have a group baseline to mix with")
        if not 0.0 < self.turn_discount <= 1.0:
            fail("turn_discount", "must be in (0, 1]")
        if self.turn_discount < 1.0 and self.algorithm not in ("grpo", "rloo"):
            fail("turn_discount", "applies to sequence-level estimators (grpo, rloo); reinforce_pp has gamma")
        if not self.adv_eps > 0.0:
            fail("adv_eps", "must be > 0")


def _f32(x, mask):
    """float32, with masked-out positions replaced by 0 so NaN/inf there cannot leak (nor their gradients)."""
    return jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0)


@functools.partial(jax.jit, static_argnames=("dual_clip",))
def ppo_clip(
    logp: Float[Array, "n t"],
    old_logp: Float[Array, "n t"],
    advantages: Float[Array, "n t"],
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = 3.0,
) -> tuple[Float[Array, "n t"], Shaped[Array, "n t"], Shaped[Array, "n t"], Float[Array, "n t"]]:
    """Per-token PPO-clip loss -min(r A, clip(r) A), dual-clipped at -A c for A < 0.

    Returns (loss, clipped, dual_clipped, ratio); `clipped` marks tokens where the clip bound is
    active (veRL's pg_clipfrac), `dual_clipped` where the dual-clip cap is; both have zero gradient.
    """
    log_ratio = jnp.clip(logp - old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = jnp.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if dual_clip is None:
        return loss, clipped, jnp.zeros_like(clipped), ratio
    # Negative advantage and huge ratio: the unclipped -A r is unbounded; cap it at -A c.
    cap = -advantages * dual_clip
    dual_clipped = (advantages < 0) & (loss > cap)
    loss = jnp.where(advantages < 0, jnp.minimum(loss, cap), loss)
    return loss, clipped & ~dual_clipped, dual_clipped, ratio


def reinforce(logp: Float[Array, "n t"], advantages: Float[Array, "n t"]) -> Float[Array, "n t"]:
    """Per-token ratio-free policy-gradient loss -A * logp (gradient equals PPO's at ratio 1)."""
    return -advantages * logp


@functools.partial(jax.jit, static_argnames=("estimator",))
def kl_penalty(
    logp: Float[Array, "n t"], ref_logp: Float[Array, "n t"], estimator: KLEstimator
) -> Float[Array, "n t"]:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1 = logp - ref_logp (unbiased, can be negative); k3 = exp(ref - logp) - (ref - logp) - 1
    (unbiased, >= 0, lower variance; Schulman's "Approximating KL divergence").
    """
    log_ratio = jnp.clip(ref_logp - logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return jnp.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kl_penalty: estimator must be 'k1' or 'k3', got {estimator!r}")


@functools.partial(jax.jit, static_argnames=("mode",))
def aggregate(x: Float[Array, "n t"], loss_mask: TokenMask, mode: Aggregation) -> Float[Array, ""]:
    """Reduce a per-token quantity to a scalar over the masked tokens.

    token_mean:          sum over all masked tokens / number of masked tokens in the batch.
    seq_mean_token_mean: mean over each sequence's masked tokens, then mean over sequences.
    seq_mean_token_sum:  sum over each sequence's masked tokens, then mean over sequences.
    Sequences without masked tokens (padding rows, filtered groups) do not count; all-zero mask -> 0.
    """
    m = loss_mask.astype(bool)
    x = jnp.where(m, x, 0.0)
    if mode == "token_mean":
        return x.sum() / jnp.maximum(m.sum(), 1)
    tokens_per_seq = m.sum(-1)
    seq_total = x.sum(-1)
    if mode == "seq_mean_token_mean":
        per_seq = seq_total / jnp.maximum(tokens_per_seq, 1)
    elif mode == "seq_mean_token_sum":
        per_seq = seq_total
    else:
        raise ValueError(f"aggregate: mode must be one of {AGGREGATIONS}, got {mode!r}")
    has_tokens = tokens_per_seq > 0
    return jnp.where(has_tokens, per_seq, 0.0).sum() / jnp.maximum(has_tokens.sum(), 1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def policy_loss(
    logp: Float[Array, "n t"],
    old_logp: Float[Array, "n t"],
    ref_logp: Float[Array, "n t"] | None,
    advantages: Float[Array, "n t"],
    loss_mask: TokenMask,
    entropy: Float[Array, "n t"] | None,
    cfg: LossConfig,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """loss = agg(pg) + kl_coef * agg(kl) - entropy_coef * min(agg(entropy), entropy_floor), and metrics.

    `ref_logp` may be None when `cfg.kl_estimator` is None, `entropy` when not needed (metric 0).
    Gradient flows only through `logp` and `entropy` (old_logp, ref_logp, advantages are stopped).
    Metrics: pg_loss, kl, entropy (aggregated like the loss); clip_frac, dual_clip_frac, approx_kl
    (k3 estimate of KL(old || new)), ratio_mean (token means over masked tokens).
    """
    m = loss_mask.astype(bool)
    # Only the policy's logp (and entropy) carry gradient; behaviour/reference/advantages are data.
    old_logp, advantages = jax.lax.stop_gradient((old_logp, advantages))
    ref_logp = None if ref_logp is None else jax.lax.stop_gradient(ref_logp)
    logp, old_logp, advantages = _f32(logp, m), _f32(old_logp, m), _f32(advantages, m)

    def agg(x):
        return aggregate(x, m, cfg.aggregation)

    def token_mean(x):
        return aggregate(jnp.asarray(x, jnp.float32), m, "token_mean")

    pg_ppo, clipped, dual_clipped, ratio = ppo_clip(
        logp, old_logp, advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip)
    pg_tok = pg_ppo if cfg.surrogate == "ppo_clip" else reinforce(logp, advantages)
    pg_loss = agg(pg_tok)
    loss = pg_loss

    zero = jnp.zeros((), jnp.float32)
    kl = zero
    if cfg.kl_estimator is not None:
        if ref_logp is None:
            raise ValueError("policy_loss: cfg.kl_estimator is set but ref_logp is None")
        kl = agg(kl_penalty(logp, _f32(ref_logp, m), cfg.kl_estimator))
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * kl

    ent = zero
    if entropy is not None:
        ent = agg(_f32(entropy, m))
        if cfg.entropy_coef:
            # With a floor the bonus has no gradient above it: it only stops a collapse, it does not flatten.
            bonus = ent if cfg.entropy_floor is None else jnp.minimum(ent, cfg.entropy_floor)
            loss = loss - cfg.entropy_coef * bonus
    elif cfg.entropy_coef:
        raise ValueError("policy_loss: cfg.entropy_coef > 0 but entropy is None")

    log_ratio = jnp.clip(logp - old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    metrics = {
        "pg_loss": pg_loss,
        "kl": kl,
        "entropy": ent,
        "clip_frac": token_mean(clipped),
        "dual_clip_frac": token_mean(dual_clipped),
        "approx_kl": token_mean(jnp.expm1(log_ratio) - log_ratio),  # (r - 1) - log r
        "ratio_mean": token_mean(ratio),
    }
    return loss, metrics
