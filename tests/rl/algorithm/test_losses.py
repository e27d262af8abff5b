"""Policy losses against hand computations: values, gradients, clipping, aggregation, masking, jit; the config."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.rl.algorithm.losses import (
    POLICY_LOSSES,
    LossConfig,
    aggregate,
    estimator_is_grouped,
    kl_penalty,
    policy_loss,
    ppo_clip,
    reinforce,
)

LN2 = math.log(2.0)

# Two sequences x 4 tokens. Row 0 is all generated; row 1 has 3 generated tokens and one pad.
#            ratio  A    by hand (eps 0.2, dual clip 3)
# row 0 t0:  1.0   +1   -min(1, 1)          = -1.0   grad -A r = -1
#       t1:  1.5   +1   -min(1.5, 1.2)      = -1.2   clipped, grad 0
#       t2:  0.5   -1   max(0.5, 0.8)       =  0.8   clipped, grad 0
#       t3:  5.0   -1   min(max(5, 1.2), 3) =  3.0   dual-clipped, grad 0
# row 1 t0:  0.5   +1   -min(0.5, 0.8)      = -0.5   clip does not help here, grad -0.5
#       t1:  1.5   -1   max(1.5, 1.2)       =  1.5   grad 1.5
#       t2:  1.1   +2   -min(2.2, 2.2)      = -2.2   grad -2.2
#       t3:  (pad)
RATIO = np.array([[1.0, 1.5, 0.5, 5.0], [0.5, 1.5, 1.1, 1.0]], np.float32)
ADV = np.array([[1.0, 1.0, -1.0, -1.0], [1.0, -1.0, 2.0, 0.0]], np.float32)
MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float32)
OLD = np.array([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.7, -2.0, 0.0]], np.float32)
LOGP = (OLD + np.log(RATIO)).astype(np.float32)
TOKEN_LOSS = np.array([[-1.0, -1.2, 0.8, 3.0], [-0.5, 1.5, -2.2, 0.0]], np.float32)
TOKEN_GRAD = np.array([[-1.0, 0.0, 0.0, 0.0], [-0.5, 1.5, -2.2, 0.0]], np.float32)  # d token loss / d logp


def cfg(**kw):
    """The hand example's clip (0.2 both sides), whatever the job's default."""
    return LossConfig(**{"clip_eps_high": 0.2, **kw})


def loss_fn(c, logp=LOGP, old=OLD, ref=None, adv=ADV, mask=MASK, entropy=None):
    return policy_loss(jnp.asarray(logp), jnp.asarray(old), None if ref is None else jnp.asarray(ref),
                       jnp.asarray(adv), jnp.asarray(mask), None if entropy is None else jnp.asarray(entropy), c)


def grad_logp(c, **kw):
    return np.asarray(jax.grad(lambda lp: loss_fn(c, logp=lp, **kw)[0])(jnp.asarray(LOGP)))


def test_ppo_clip_per_token_by_hand():
    loss, clipped, dual, ratio = ppo_clip(jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(ADV), 0.2, 0.2, 3.0)
    np.testing.assert_allclose(np.asarray(loss) * MASK, TOKEN_LOSS, atol=1e-5)
    np.testing.assert_allclose(ratio, RATIO, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(clipped) * MASK, [[0, 1, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(dual) * MASK, [[0, 0, 0, 1], [0, 0, 0, 0]])


def test_ppo_token_mean_loss_metrics_and_gradient():
    loss, metrics = loss_fn(cfg())
    # (-1 - 1.2 + 0.8 + 3 - 0.5 + 1.5 - 2.2) / 7 = 0.4 / 7
    assert float(loss) == pytest.approx(0.4 / 7, abs=1e-6)
    assert float(metrics["pg_loss"]) == pytest.approx(0.4 / 7, abs=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 7)
    assert float(metrics["dual_clip_frac"]) == pytest.approx(1 / 7)
    assert float(metrics["ratio_mean"]) == pytest.approx((1 + 1.5 + 0.5 + 5 + 0.5 + 1.5 + 1.1) / 7, rel=1e-5)
    r = RATIO[MASK > 0]
    assert float(metrics["approx_kl"]) == pytest.approx(np.mean(r - 1 - np.log(r)), rel=1e-5)
    assert float(metrics["kl"]) == 0.0 and float(metrics["entropy"]) == 0.0
    # Gradient is exactly zero where the clip is active in the advantage's direction (and dual clip).
    np.testing.assert_allclose(grad_logp(cfg()), TOKEN_GRAD / 7, atol=1e-6)


def test_gradient_flows_only_through_logp():
    c = cfg(kl_coef=0.1, kl_estimator="k1")
    grads = jax.grad(lambda old, ref, adv: loss_fn(c, old=old, ref=ref, adv=adv)[0], argnums=(0, 1, 2))(
        jnp.asarray(OLD), jnp.asarray(OLD - 0.2), jnp.asarray(ADV))
    for g in grads:
        assert np.all(np.asarray(g) == 0.0)


def test_dual_clip_caps_negative_advantage_loss():
    # Without dual clip, row 0 t3 (ratio 5, A = -1) costs 5 and keeps a gradient of 5.
    loss, _ = loss_fn(cfg(dual_clip=None))
    assert float(loss) == pytest.approx((0.4 + 2.0) / 7, abs=1e-6)
    g = grad_logp(cfg(dual_clip=None))
    assert g[0, 3] == pytest.approx(5.0 / 7, rel=1e-5)
    # With dual clip c, the loss of any negative-advantage token is at most -A * c, however large the ratio.
    for c in (2.0, 3.0, 10.0):
        for log_ratio in (2.0, 10.0, 100.0):
            tok, *_ = ppo_clip(jnp.array([[log_ratio]]), jnp.zeros((1, 1)), jnp.array([[-0.5]]), 0.2, 0.2, c)
            assert float(tok[0, 0]) == pytest.approx(min(0.5 * math.exp(min(log_ratio, 20.0)), 0.5 * c), rel=1e-5)
    # Dual clip leaves positive advantages alone.
    tok, *_ = ppo_clip(jnp.array([[3.0]]), jnp.zeros((1, 1)), jnp.array([[1.0]]), 0.2, 0.2, 3.0)
    assert float(tok[0, 0]) == pytest.approx(-1.2)


def test_asymmetric_clip_higher():
    c = cfg(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=None)
    old = jnp.zeros((1, 4))
    logp = jnp.log(jnp.array([[1.25, 1.3, 0.85, 0.75]]))
    adv = jnp.array([[1.0, 1.0, -1.0, -1.0]])
    tok, clipped, _, _ = ppo_clip(logp, old, adv, 0.2, 0.28, None)
    np.testing.assert_allclose(tok, [[-1.25, -1.28, 0.85, 0.8]], atol=1e-6)
    np.testing.assert_array_equal(clipped, [[False, True, False, True]])
    g = jax.grad(lambda lp: policy_loss(lp, old, None, adv, jnp.ones((1, 4)), None, c)[0])(logp)
    np.testing.assert_allclose(g, [[-1.25 / 4, 0.0, 0.85 / 4, 0.0]], atol=1e-6)


def test_reinforce_value_and_gradient_matches_ppo_at_ratio_one():
    np.testing.assert_allclose(reinforce(jnp.array([[-0.5, -2.0]]), jnp.array([[2.0, -1.0]])), [[1.0, -2.0]])
    c = cfg(policy_loss="reinforce")
    loss, _ = loss_fn(c)
    assert float(loss) == pytest.approx(float(np.sum(-ADV * LOGP * MASK) / 7), rel=1e-5)
    # On-policy (logp == old_logp): same gradient as PPO-clip, which is -A / num_tokens.
    g_rf = jax.grad(lambda lp: loss_fn(c, logp=lp, old=LOGP)[0])(jnp.asarray(LOGP))
    g_ppo = jax.grad(lambda lp: loss_fn(cfg(), logp=lp, old=LOGP)[0])(jnp.asarray(LOGP))
    np.testing.assert_allclose(g_rf, g_ppo, atol=1e-6)
    np.testing.assert_allclose(g_rf, -ADV * MASK / 7, atol=1e-6)


def test_kl_estimators_by_hand():
    logp = jnp.array([[LN2, -LN2, 0.0]])
    ref = jnp.zeros((1, 3))
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), [[LN2, -LN2, 0.0]], atol=1e-6)
    # k3 = exp(ref - logp) - (ref - logp) - 1: 0.5 + ln2 - 1, 2 - ln2 - 1, 0
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), [[0.19314718, 0.30685282, 0.0]], atol=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(logp, ref, "k2")


@pytest.mark.parametrize("estimator,expected_kl",
                         [("k1", (LN2 - LN2 + 0.0) / 3), ("k3", (0.19314718 + 0.30685282) / 3)])
def test_kl_term_in_loss(estimator, expected_kl):
    old = jnp.zeros((1, 3))
    logp = jnp.array([[LN2, -LN2, 0.0]])
    adv = jnp.zeros((1, 3))  # pg term 0, only the KL remains
    c = cfg(kl_coef=0.5, kl_estimator=estimator, dual_clip=None, clip_eps_high=10.0, clip_eps_low=0.9)
    loss, m = policy_loss(logp, old, jnp.zeros((1, 3)), adv, jnp.ones((1, 3)), None, c)
    assert float(m["kl"]) == pytest.approx(expected_kl, abs=1e-6)
    assert float(loss) == pytest.approx(0.5 * expected_kl, abs=1e-6)
    g = jax.grad(lambda lp: policy_loss(lp, old, jnp.zeros((1, 3)), adv, jnp.ones((1, 3)), None, c)[0])(logp)
    if estimator == "k1":  # d/dlogp (logp - ref) = 1
        np.testing.assert_allclose(g, [[0.5 / 3] * 3], atol=1e-6)
    else:  # d/dlogp k3 = 1 - exp(ref - logp): 1 - 1/2, 1 - 2, 0
        np.testing.assert_allclose(g, [[0.5 * 0.5 / 3, 0.5 * -1.0 / 3, 0.0]], atol=1e-6)


def test_entropy_bonus():
    ent = np.array([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 99.0]], np.float32)
    base, _ = loss_fn(cfg())
    loss, m = loss_fn(cfg(entropy_coef=0.1), entropy=ent)
    assert float(m["entropy"]) == pytest.approx(11.5 / 7, rel=1e-6)
    assert float(loss) == pytest.approx(float(base) - 0.1 * 11.5 / 7, rel=1e-5)
    g = jax.grad(lambda e: loss_fn(cfg(entropy_coef=0.1), entropy=e)[0])(jnp.asarray(ent))
    np.testing.assert_allclose(g, -0.1 * MASK / 7, atol=1e-7)


def test_entropy_floor_bounds_the_bonus():
    ent = np.array([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 99.0]], np.float32)  # token mean 11.5 / 7 = 1.64
    base, _ = loss_fn(cfg())
    below = lambda e: loss_fn(cfg(entropy_coef=0.1, entropy_floor=2.0), entropy=e)[0]  # noqa: E731
    above = lambda e: loss_fn(cfg(entropy_coef=0.1, entropy_floor=1.0), entropy=e)[0]  # noqa: E731
    assert float(below(ent)) == pytest.approx(float(base) - 0.1 * 11.5 / 7, rel=1e-5)  # the plain bonus
    np.testing.assert_allclose(jax.grad(below)(jnp.asarray(ent)), -0.1 * MASK / 7, atol=1e-7)
    assert float(above(ent)) == pytest.approx(float(base) - 0.1 * 1.0, rel=1e-5)  # capped at the floor
    np.testing.assert_array_equal(jax.grad(above)(jnp.asarray(ent)), 0.0)  # and no push above it
    with pytest.raises(ValueError, match="entropy_floor"):
        cfg(entropy_floor=1.0)  # a floor without a bonus does nothing


def test_aggregation_modes_on_ragged_mask():
    x = jnp.array([[1.0, 1.0, 1.0, 1.0], [5.0, 7.0, 7.0, 7.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert float(aggregate(x, mask, "token_mean")) == pytest.approx(9 / 5)  # long sequences weigh more
    assert float(aggregate(x, mask, "seq_mean_token_mean")) == pytest.approx((1 + 5) / 2)  # each sequence equal
    assert float(aggregate(x, mask, "seq_mean_token_sum")) == pytest.approx((4 + 5) / 2)
    # Empty rows (padding, filtered groups) do not count as sequences.
    x3, mask3 = jnp.concatenate([x, jnp.full((1, 4), 3.0)]), jnp.concatenate([mask, jnp.zeros((1, 4), int)])
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        assert float(aggregate(x3, mask3, mode)) == float(aggregate(x, mask, mode))
    # Same modes through the loss: per-token losses of the hand example.
    by_mode = {mode: float(loss_fn(cfg(aggregation=mode))[0]) for mode in ("seq_mean_token_mean", "seq_mean_token_sum")}
    row_sums = (TOKEN_LOSS * MASK).sum(1)  # [1.6, -1.2]
    assert by_mode["seq_mean_token_mean"] == pytest.approx((1.6 / 4 - 1.2 / 3) / 2, abs=1e-6)
    assert by_mode["seq_mean_token_sum"] == pytest.approx(row_sums.mean(), abs=1e-6)
    # Gradient weights: seq_mean_token_mean gives row 1 tokens 1/(2*3), row 0 tokens 1/(2*4).
    g = grad_logp(cfg(aggregation="seq_mean_token_mean"))
    np.testing.assert_allclose(g, TOKEN_GRAD * np.array([[1 / 8], [1 / 6]]), atol=1e-6)


def test_masked_out_tokens_never_influence_loss_or_gradient():
    c = cfg(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    ref = OLD - 0.3
    ent = np.ones_like(OLD)
    pad = MASK == 0
    base_loss, base_m = loss_fn(c, ref=ref, entropy=ent)
    base_g = grad_logp(c, ref=ref, entropy=ent)
    for junk in (np.nan, np.inf, -np.inf, 1e30, -7.0):
        def bad(x):
            return np.where(pad, np.float32(junk), x).astype(np.float32)
        loss, m = loss_fn(c, logp=bad(LOGP), old=bad(OLD), ref=bad(ref), adv=bad(ADV), entropy=bad(ent))
        assert float(loss) == float(base_loss)
        for k in base_m:
            assert float(m[k]) == float(base_m[k]), k
        g = np.asarray(jax.grad(lambda lp: loss_fn(c, logp=lp, old=bad(OLD), ref=bad(ref), adv=bad(ADV),
                                                   entropy=bad(ent))[0])(jnp.asarray(bad(LOGP))))
        np.testing.assert_array_equal(g, base_g)
        assert g[1, 3] == 0.0


def test_degenerate_inputs_give_finite_values():
    zeros = jnp.zeros((2, 3))
    c = cfg(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, aggregation="seq_mean_token_mean")
    f = lambda lp: policy_loss(lp, zeros, zeros, zeros, jnp.zeros((2, 3), bool), zeros, c)
    loss, m = f(zeros)
    assert float(loss) == 0.0 and all(float(v) == 0.0 for k, v in m.items() if k != "ratio_mean")
    assert np.all(np.asarray(jax.grad(lambda lp: f(lp)[0])(zeros)) == 0.0)
    # Extreme log-ratios: clamped, no overflow or NaN.
    lp = jnp.array([[200.0, -200.0, 0.0]])
    loss, m = policy_loss(lp, jnp.zeros((1, 3)), jnp.zeros((1, 3)), jnp.array([[-1.0, 1.0, 0.0]]),
                          jnp.ones((1, 3)), None, cfg(kl_coef=0.1, kl_estimator="k3", dual_clip=None))
    assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in m.values())


def test_jit_and_bf16_inputs():
    c = cfg(kl_coef=0.05, kl_estimator="k1", entropy_coef=0.01, aggregation="seq_mean_token_sum")
    args = (LOGP, OLD, OLD - 0.1, ADV, MASK.astype(bool), np.ones_like(OLD))
    jitted = jax.jit(policy_loss, static_argnames="cfg")
    l_eager, m_eager = policy_loss(*map(jnp.asarray, args), cfg=c)
    l_jit, m_jit = jitted(*map(jnp.asarray, args), cfg=c)
    assert float(l_jit) == pytest.approx(float(l_eager), rel=1e-6)
    assert set(m_jit) == {"pg_loss", "kl", "entropy", "clip_frac", "dual_clip_frac", "approx_kl", "ratio_mean"}
    assert set(policy_loss(*map(jnp.asarray, args), cfg=cfg(policy_loss="reinforce"))[1]) == {
        "pg_loss", "kl", "entropy", "approx_kl"}  # no ratio, no clip: no clip metrics
    l_bf16, _ = jitted(*(jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else jnp.asarray(a) for a in args),
                       cfg=c)
    assert l_bf16.dtype == jnp.float32 and float(l_bf16) == pytest.approx(float(l_eager), abs=0.05)


def test_a_loss_metric_named_as_one_of_the_stages_is_refused():
    from earl_jax.rl.algorithm.losses import POLICY_LOSSES, register_policy_loss

    register_policy_loss("shadows_kl")(lambda logp, old, adv, mask, cfg: (-adv * logp, {"kl": logp}))
    try:
        with pytest.raises(ValueError, match="'shadows_kl': its metric.* kl would overwrite"):
            policy_loss(jnp.asarray(LOGP), jnp.asarray(OLD), None, jnp.asarray(ADV), jnp.asarray(MASK), None,
                        cfg=cfg(policy_loss="shadows_kl"))
    finally:
        POLICY_LOSSES.pop("shadows_kl")


@pytest.mark.parametrize("kw,field", [
    ({"estimator": "ppo"}, "estimator"),  # GAE needs a critic: a fork that adds one registers an estimator
    ({"policy_loss": "a2c"}, "policy_loss"),
    ({"clip_eps_low": 1.0}, "clip_eps_low"),
    ({"clip_eps_high": -0.1}, "clip_eps_high"),
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"kl_coef": -1.0}, "kl_coef"),
    ({"kl_estimator": "k2"}, "kl_estimator"),
    ({"kl_estimator": None}, "kl_estimator"),
    ({"entropy_coef": -0.01}, "entropy_coef"),
    ({"entropy_floor": -1.0, "entropy_coef": 0.1}, "entropy_floor"),
    ({"aggregation": "mean"}, "aggregation"),
    ({"gamma": 1.5}, "gamma"),
    ({"gamma": 0.0}, "gamma"),
    ({"turn_discount": 0.0}, "turn_discount"),
    ({"between_group_weight": -0.5, "filter_constant_groups": False}, "between_group_weight"),
    ({"between_group_weight": 0.5}, "filter_constant_groups"),  # the filter drops what the term gives a signal
    ({"adv_eps": 0.0}, "adv_eps"),
    ({"is_cap": 0.5}, "is_cap"),
    ({"policy_loss": "decoupled_ppo", "behaviour": "sampler"}, "behaviour"),  # its old_logp is the proximal policy's
])
def test_config_validation_starts_with_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}: .*\(got "):
        LossConfig(**kw)


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(ValueError, match="registered: dr_grpo, grpo, reinforce_pp, rloo"):
        LossConfig(estimator="ppo")
    with pytest.raises(ValueError, match="registered: .*ppo_clip, reinforce"):
        LossConfig(policy_loss="a2c")
    assert {"ppo_clip", "reinforce"} <= set(POLICY_LOSSES)
    assert estimator_is_grouped("grpo") and estimator_is_grouped("dr_grpo") and estimator_is_grouped("rloo")
    assert not estimator_is_grouped("reinforce_pp")
    with pytest.raises(ValueError, match="^estimator: "):
        estimator_is_grouped("ppo")


def test_config_defaults_are_the_jobs_and_every_field_has_help():
    c = LossConfig()
    assert (c.estimator, c.policy_loss, c.clip_eps_low, c.clip_eps_high) == ("grpo", "ppo_clip", 0.2, 0.28)
    assert c.dual_clip == 3.0 and c.entropy_coef == 0.0 and c.entropy_floor is None
    assert (c.kl_coef, c.kl_estimator, c.aggregation, c.filter_constant_groups) == (0.0, "k3", "token_mean", True)
    for f in dataclasses.fields(LossConfig):
        assert f.metadata.get("help"), f.name


def test_config_is_hashable_and_frozen():
    c = LossConfig(estimator="reinforce_pp", clip_eps_high=0.28, gamma=0.9)
    assert hash(c) == hash(LossConfig(estimator="reinforce_pp", clip_eps_high=0.28, gamma=0.9))
    with pytest.raises(Exception):
        c.kl_coef = 1.0  # type: ignore[misc]


def test_kl_term_runs_only_with_a_positive_coefficient():
    z = jnp.zeros((1, 2))
    # kl_coef 0: no KL term, so no reference log-probs needed, and the KL metric is 0 whatever they are.
    _, m = policy_loss(z, z, z - 1.0, z, jnp.ones((1, 2)), None, cfg(kl_estimator="k1"))
    assert float(m["kl"]) == 0.0
    policy_loss(z, z, None, z, jnp.ones((1, 2)), None, cfg(kl_estimator="k1"))


def test_missing_optional_inputs_raise():
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(z, z, None, z, jnp.ones((1, 2)), None, cfg(kl_coef=0.1, kl_estimator="k1"))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(z, z, None, z, jnp.ones((1, 2)), None, cfg(entropy_coef=0.1))
    with pytest.raises(ValueError, match="behaviour_logp"):
        policy_loss(z, z, None, z, jnp.ones((1, 2)), None, cfg(policy_loss="decoupled_ppo"))


# The decoupled loss on the hand example: old_logp is the proximal policy (the weights at train time), the behaviour
# policy (the sampler's) was older. Per token w = exp(old - behaviour), truncated at the cap (2 here).
LOG_W = np.array([[0.0, np.log(1.5), np.log(0.5), np.log(4.0)], [np.log(3.0), 0.0, np.log(0.25), 0.0]], np.float32)
W = np.minimum(np.exp(LOG_W), 2.0)


def test_decoupled_ppo_weights_each_token_by_its_truncated_importance_weight():
    c = cfg(policy_loss="decoupled_ppo", is_cap=2.0)
    behaviour = jnp.asarray(OLD - LOG_W)
    loss, metrics = policy_loss(jnp.asarray(LOGP), jnp.asarray(OLD), None, jnp.asarray(ADV), jnp.asarray(MASK), None,
                                c, behaviour)
    assert float(loss) == pytest.approx(float(np.sum(W * TOKEN_LOSS * MASK) / 7), abs=1e-6)
    assert float(metrics["is_weight_mean"]) == pytest.approx(float(np.sum(W * MASK) / 7), rel=1e-5)
    assert float(metrics["is_truncated_frac"]) == pytest.approx(2 / 7)  # 4.0 and 3.0 passed the cap
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 7)  # the clip is PPO's against the proximal policy
    # the weight is a constant: the gradient is PPO-clip's, token by token times w, and nothing reaches behaviour
    g = jax.grad(lambda lp, b: policy_loss(lp, jnp.asarray(OLD), None, jnp.asarray(ADV), jnp.asarray(MASK), None, c,
                                           b)[0], argnums=(0, 1))(jnp.asarray(LOGP), behaviour)
    np.testing.assert_allclose(g[0], W * TOKEN_GRAD / 7, atol=1e-6)
    assert np.all(np.asarray(g[1]) == 0.0)


def test_decoupled_ppo_on_fresh_batches_is_ppo_clip():
    c = cfg(policy_loss="decoupled_ppo")
    fresh, _ = policy_loss(jnp.asarray(LOGP), jnp.asarray(OLD), None, jnp.asarray(ADV), jnp.asarray(MASK), None, c,
                           jnp.asarray(OLD))
    assert float(fresh) == float(loss_fn(cfg())[0])
