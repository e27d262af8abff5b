"""The loss-and-advantages config, and token-level policy losses registered by name.

`LossConfig` is the job's "loss and advantages" component: which advantage estimator (rl/algorithm/advantages.py) and
which policy loss (below) run, and their coefficients. Both are looked up by name in a registry, so a new loss is one
decorated function:

    @register_policy_loss("my_loss")
    def my_loss(logp, old_logp, advantages, loss_mask, cfg):
        return -advantages * logp, {}          # per-token loss [n, t], per-token metrics

and `LossConfig(policy_loss="my_loss")` runs it (docs/fork.md, "Changing the loss"). A loss registered with
`behaviour=True` also gets `behaviour_logp`, the log-probs of the weights that sampled each token (the sampler's),
while `old_logp` is then the proximal policy's, recomputed by the experience stage (`decoupled_ppo`).

Every input is `[N, T]`, aligned with the tokens: position t holds a quantity of token t
(`logp[n, t] = log p(tokens[n, t] | tokens[n, :t])`). `loss_mask` is nonzero on tokens the policy
generated; everything at other positions is ignored, even NaN or inf, and gets zero gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import field
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Shaped

from earl_jax.rl.algorithm.advantages import ESTIMATORS, TokenMask

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k3"]

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k3")

# exp(20) ~ 4.9e8: log-ratios beyond this are clamped so exp never overflows float32 (as veRL does).
MAX_LOG_RATIO = 20.0

# name -> fn(logp, old_logp, advantages, loss_mask, cfg) -> (per-token loss, {metric: per-token value}).
PolicyLoss = Callable[..., tuple[Float[Array, "n t"], dict[str, Shaped[Array, "n t"]]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}
BEHAVIOUR_LOSSES: set[str] = set()  # losses that also take behaviour_logp (the sampler's log-probs)
# Metric names the train stage reports itself (policy_loss, the update, the iteration record's train/*): a loss's own
# metric of one of these names would overwrite it, so it is refused.
STAGE_METRICS = ("pg_loss", "kl", "entropy", "approx_kl", "loss", "grad_norm", "skipped", "filtered_frac",
                 "no_signal_iters")


def register_policy_loss(name: str, *, behaviour: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register `fn(logp, old_logp, advantages, loss_mask, cfg)` as the policy loss `name`; with `behaviour`, it is
    called with `behaviour_logp=` too (the sampler's log-probs; `old_logp` is then the recomputed proximal policy's).

    It gets float32 [n, t] arrays with 0 at masked-out positions (old_logp and advantages carry no gradient) and
    returns the per-token loss and per-token metrics; `policy_loss` aggregates the first by `cfg.aggregation`
    and reports each metric's mean over the generated tokens (in metrics.jsonl as `train/<name>`; not one of
    `STAGE_METRICS`).
    """
    def register(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"register_policy_loss: {name!r} is already registered "
                             f"({POLICY_LOSSES[name].__qualname__})")
        POLICY_LOSSES[name] = fn
        if behaviour:
            BEHAVIOUR_LOSSES.add(name)
        return fn
    return register


def estimator_is_grouped(name: str) -> bool:
    """Whether the registered estimator `name` compares games within a group (the job then needs groups of >= 2)."""
    if name not in ESTIMATORS:
        raise ValueError(f"estimator: not a registered estimator; registered: {', '.join(sorted(ESTIMATORS))} "
                         f"(got {name!r})")
    return ESTIMATORS[name].grouped


def _f(default, help: str | Callable[[], str]):
    return field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """loss: the advantage estimator and the policy loss (registered names), their coefficients

    Frozen and hashable: the stages take it as a static jit argument.
    """

    # the help lists the registries when it is shown: the built-ins and a fork's own, registered at import
    estimator: str = _f("grpo", lambda: f"advantage estimator by registered name (rl/algorithm/advantages.py): "
                                        f"{', '.join(ESTIMATORS)}")
    policy_loss: str = _f("ppo_clip", lambda: f"policy loss by registered name (rl/algorithm/losses.py): "
                                              f"{', '.join(POLICY_LOSSES)}")
    behaviour: Literal["recompute", "sampler"] = _f(
        "recompute", "the behaviour policy's log-probs (old_logp) the ratio is taken against: recompute = the "
                     "experience stage scores the rollout's tokens again with the weights that sampled them; sampler = "
                     "the sampler's own log-probs, kept with the trajectory (no forward pass; with a bfloat16 KV cache "
                     "they differ by experience/logprob_gap_mean)")
    clip_eps_low: float = _f(0.2, "PPO ratio clip, lower side: the ratio is clipped below at 1 - this")
    clip_eps_high: float = _f(0.28, "PPO ratio clip, upper side: the ratio is clipped above at 1 + this "
                                    "(0.28 > 0.2: DAPO's clip-higher)")
    dual_clip: float | None = _f(3.0, "dual-clip constant for negative advantages: the loss of a token with A < 0 "
                                      "is capped at -A x this (none: off)")
    is_cap: float = _f(5.0, "decoupled_ppo: a token's importance weight proximal / behaviour policy is truncated "
                            "at this (stale tokens the weights have moved far from count at most this much)")
    kl_coef: float = _f(0.0, "KL-to-reference coefficient in the loss (0: no KL term and no reference model)")
    kl_estimator: KLEstimator = _f("k3", "KL estimator of the KL term: k1 (log ratio) or k3 (non-negative, lower "
                                         "variance)")
    entropy_coef: float = _f(0.0, "entropy bonus over the whole vocabulary (0.01 pushed the tiny model towards "
                                  "invalid tokens)")
    entropy_floor: float | None = _f(None, "if set, the entropy bonus acts only while the mean entropy per generated "
                                           "token is below this (nats): it stops a collapse without flattening")
    aggregation: Aggregation = _f("token_mean", "how token losses are averaged: token_mean, seq_mean_token_mean, "
                                                "seq_mean_token_sum")
    gamma: float = _f(1.0, "reinforce_pp: discount per generated token of the returns")
    turn_discount: float = _f(1.0, "group estimators: a token's advantage x this ** (turns after its own): later "
                                   "moves of a game get more of its outcome's credit (1: every turn the same)")
    filter_constant_groups: bool = _f(True, "group estimators: drop groups whose rewards do not vary (no signal, "
                                            "guards collapse)")
    between_group_weight: float = _f(0.0, "group estimators: add this x (group mean - batch mean) / batch std to the "
                                          "advantages (constant groups then still teach; needs the filter off)")
    adv_eps: float = _f(1e-6, "added to standard deviations before dividing by them")

    def __post_init__(self):
        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise ValueError(f"{name}: {msg} (got {getattr(self, name)!r})")

        need(self.estimator in ESTIMATORS, "estimator", f"not a registered estimator; registered: "
             f"{', '.join(sorted(ESTIMATORS))}")
        need(self.policy_loss in POLICY_LOSSES, "policy_loss", f"not a registered policy loss; registered: "
             f"{', '.join(sorted(POLICY_LOSSES))}")
        need(self.behaviour in ("recompute", "sampler"), "behaviour", "must be recompute or sampler")
        need(self.policy_loss not in BEHAVIOUR_LOSSES or self.behaviour == "recompute", "behaviour",
             f"{self.policy_loss} takes the proximal log-probs recomputed at train time as old_logp and the "
             "sampler's as the behaviour policy's: use recompute")
        need(self.is_cap >= 1.0, "is_cap", "must be >= 1")
        need(0.0 <= self.clip_eps_low < 1.0, "clip_eps_low", "must be in [0, 1)")
        need(self.clip_eps_high >= 0.0, "clip_eps_high", "must be >= 0")
        need(self.dual_clip is None or self.dual_clip > 1.0, "dual_clip", "must be > 1 or none")
        need(self.kl_coef >= 0.0, "kl_coef", "must be >= 0")
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"must be one of {', '.join(KL_ESTIMATORS)}")
        need(self.entropy_coef >= 0.0, "entropy_coef", "must be >= 0")
        need(self.entropy_floor is None or (self.entropy_floor > 0.0 and self.entropy_coef > 0.0), "entropy_floor",
             "must be > 0 with entropy_coef > 0")
        need(self.aggregation in AGGREGATIONS, "aggregation", f"must be one of {', '.join(AGGREGATIONS)}")
        need(0.0 < self.gamma <= 1.0, "gamma", "must be in (0, 1]")
        need(0.0 < self.turn_discount <= 1.0, "turn_discount", "must be in (0, 1]")
        need(self.between_group_weight >= 0.0, "between_group_weight", "must be >= 0")
        need(self.adv_eps > 0.0, "adv_eps", "must be > 0")
        grouped = ESTIMATORS[self.estimator].grouped
        need(grouped or self.turn_discount == 1.0, "turn_discount", f"applies to group estimators; {self.estimator} "
             "is not one (reinforce_pp discounts with gamma)")
        need(grouped or not self.between_group_weight, "between_group_weight",
             f"applies to group estimators (a group baseline to mix with); {self.estimator} is not one")
        need(not (self.between_group_weight and self.filter_constant_groups), "filter_constant_groups",
             "drops the constant groups that between_group_weight gives an advantage: turn one of them off")


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


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logp: Float[Array, "n t"], old_logp: Float[Array, "n t"], advantages: Float[Array, "n t"],
                  loss_mask: Bool[Array, "n t"], cfg: LossConfig):
    """PPO-clip with clip-higher and dual clip: what GRPO, Dr. GRPO, RLOO and REINFORCE++ train with."""
    loss, clipped, dual_clipped, ratio = ppo_clip(
        logp, old_logp, advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip)
    return loss, {"clip_frac": clipped, "dual_clip_frac": dual_clipped, "ratio_mean": ratio}


@register_policy_loss("decoupled_ppo", behaviour=True)
def decoupled_ppo_loss(logp: Float[Array, "n t"], old_logp: Float[Array, "n t"], advantages: Float[Array, "n t"],
                       loss_mask: Bool[Array, "n t"], cfg: LossConfig, *, behaviour_logp: Float[Array, "n t"]):
    """AReaL's decoupled PPO (Fu et al. 2025) for batches sampled by older weights (--rollout.max-staleness): the
    PPO-clip term against the proximal policy (`old_logp`: the weights at train time, recomputed by the experience
    stage), times the importance weight proximal / behaviour (`behaviour_logp`: the sampler's), a constant truncated
    at `cfg.is_cap` (AReaL drops a token above its cap instead). With fresh batches the weight is ~1 (the sampler's
    numerics only)."""
    loss, clipped, dual_clipped, ratio = ppo_clip(
        logp, old_logp, advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip)
    weight = jnp.exp(jnp.clip(old_logp - behaviour_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    truncated = weight > cfg.is_cap
    weight = jax.lax.stop_gradient(jnp.minimum(weight, cfg.is_cap))
    return weight * loss, {"clip_frac": clipped, "dual_clip_frac": dual_clipped, "ratio_mean": ratio,
                           "is_weight_mean": weight, "is_truncated_frac": truncated}


@register_policy_loss("reinforce")
def reinforce_loss(logp: Float[Array, "n t"], old_logp: Float[Array, "n t"], advantages: Float[Array, "n t"],
                   loss_mask: Bool[Array, "n t"], cfg: LossConfig):
    """-A log p: no ratio and no clip, so off-policy updates (PPO epochs, mini-batches) are not bounded."""
    return reinforce(logp, advantages), {}


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
    behaviour_logp: Float[Array, "n t"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """loss = agg(pg) + kl_coef * agg(kl) - entropy_coef * min(agg(entropy), entropy_floor), and metrics.

    pg is the registered policy loss `cfg.policy_loss`. `ref_logp` may be None when `cfg.kl_coef` is 0,
    `entropy` when not needed (metric 0), `behaviour_logp` (the sampler's) unless the loss is registered with
    `behaviour`. Gradient flows only through `logp` and `entropy` (old_logp, ref_logp, advantages and
    behaviour_logp are stopped). Metrics: pg_loss, kl, entropy (aggregated like the loss); approx_kl
    (k3 estimate of KL(old || new)) and the policy loss's own (ppo_clip: clip_frac, dual_clip_frac,
    ratio_mean), token means over masked tokens.
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

    kw = {}
    if cfg.policy_loss in BEHAVIOUR_LOSSES:
        if behaviour_logp is None:
            raise ValueError(f"policy loss {cfg.policy_loss!r} needs the sampler's log-probs (behaviour_logp)")
        kw["behaviour_logp"] = _f32(jax.lax.stop_gradient(behaviour_logp), m)
    pg_tok, token_metrics = POLICY_LOSSES[cfg.policy_loss](logp, old_logp, advantages, m, cfg, **kw)
    taken = sorted(set(token_metrics) & set(STAGE_METRICS))
    if taken:
        raise ValueError(f"policy loss {cfg.policy_loss!r}: its metric(s) {', '.join(taken)} would overwrite the "
                         "train stage's own of that name; rename them")
    pg_loss = agg(pg_tok)
    loss = pg_loss

    zero = jnp.zeros((), jnp.float32)
    kl = zero
    if cfg.kl_coef:
        if ref_logp is None:
            raise ValueError("policy_loss: cfg.kl_coef > 0 but ref_logp is None")
        kl = agg(kl_penalty(logp, _f32(ref_logp, m), cfg.kl_estimator))
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
        **{name: token_mean(x) for name, x in token_metrics.items()},
        "approx_kl": token_mean(jnp.expm1(log_ratio) - log_ratio),  # (r - 1) - log r
    }
    return loss, metrics
