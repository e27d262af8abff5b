"""Advantage estimators against hand computations and plain numpy loops; group filter; degenerate inputs; jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.rl.algorithm.advantages import (
    between_group_advantages,
    compute_advantages,
    discount_by_turn,
    discounted_returns,
    group_filter,
    grpo_advantages,
    later_turns,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_returns,
)
from earl_jax.rl.algorithm.losses import LossConfig

# Five games in two groups, not contiguous: ids [0, 1, 0, 1, 1]. T = 6, two turns each:
# generated tokens at t = 1, 2 (turn 1) and t = 4, 5 (turn 2); t = 0 prompt, t = 3 observation.
# Turn rewards sit on t = 2 and t = 5. Returns R = [1, 2, 0, -1, 2].
GROUP_IDS = np.array([0, 1, 0, 1, 1], np.int32)
MASK = np.tile(np.array([0, 1, 1, 0, 1, 1], np.float32), (5, 1))
REWARDS = np.zeros((5, 6), np.float32)
REWARDS[:, 2] = [0.0, 0.5, 0.0, 0.0, 1.0]
REWARDS[:, 5] = [1.0, 1.5, 0.0, -1.0, 1.0]
REWARDS[1, 3] = 100.0  # on an observation token: not the policy's, ignored


def per_seq(adv):
    """Advantage of each row, checking it is constant over generated tokens and 0 elsewhere."""
    adv = np.asarray(adv)
    np.testing.assert_array_equal(adv * (1 - MASK), 0.0)
    np.testing.assert_allclose(adv, adv[:, [1]] * MASK, atol=1e-7)
    return adv[:, 1]


# ---------------------------------------------------------------------------------------------


def test_masked_statistics_by_hand():
    x = jnp.array([[1.0, 2.0, 3.0, 100.0], [4.0, 4.0, np.nan, 4.0]])
    m = jnp.array([[1, 1, 1, 0], [1, 1, 0, 1]])
    assert float(masked_sum(x, m)) == 18.0
    np.testing.assert_allclose(masked_mean(x, m, axis=-1), [2.0, 4.0])
    assert float(masked_mean(x, m)) == pytest.approx(3.0)
    np.testing.assert_allclose(masked_var(x[:1], m[:1]), 2 / 3, rtol=1e-6)  # population
    np.testing.assert_allclose(masked_var(x[:1], m[:1], unbiased=True), 1.0, rtol=1e-6)
    np.testing.assert_allclose(masked_var(x, m, axis=-1), [2 / 3, 0.0], atol=1e-6)
    np.testing.assert_allclose(masked_whiten(x[:1], m[:1]), [[-1.2247433, 0.0, 1.2247433, 0.0]], atol=1e-5)
    np.testing.assert_allclose(masked_whiten(x[:1], m[:1], shift_mean=False), [[1.2247433, 2.4494867, 3.674235, 0]],
                               atol=1e-5)
    # Equal values whiten to exactly 0 (no 1-ulp residue divided by a ~0 std); empty mask gives 0, not NaN.
    assert np.all(np.asarray(masked_whiten(jnp.full((3, 5), 0.1), jnp.ones((3, 5)))) == 0.0)
    assert float(masked_mean(x, jnp.zeros_like(m))) == 0.0 and float(masked_var(x, jnp.zeros_like(m))) == 0.0
    assert np.all(np.asarray(masked_whiten(x, jnp.zeros_like(m))) == 0.0)


def test_discounted_returns_by_hand():
    m = jnp.array([[0, 1, 1, 0, 1, 1]])
    r = jnp.array([[0, 0, 0.5, 0, 0, 1.0]])
    # gamma 0.5, backwards: t5 1; t4 0.5; t3 (observation) 0, not a step; t2 0.5 + 0.25; t1 0.375.
    np.testing.assert_allclose(discounted_returns(r, m, 0.5), [[0, 0.375, 0.75, 0, 0.5, 1.0]], atol=1e-7)
    np.testing.assert_allclose(discounted_returns(r, m, 1.0), [[0, 1.5, 1.5, 0, 1.0, 1.0]], atol=1e-7)
    np.testing.assert_allclose(discounted_returns(r, m, 0.0), [[0, 0, 0.5, 0, 0, 1.0]], atol=1e-7)


def numpy_returns(r, m, gamma):
    out = np.zeros_like(r)
    for n in range(r.shape[0]):
        g = 0.0
        for t in reversed(range(r.shape[1])):
            if m[n, t]:
                g = r[n, t] + gamma * g
                out[n, t] = g
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.5])
def test_discounted_returns_match_loop_on_long_ragged_batch(gamma):
    rng = np.random.default_rng(0)
    m = (rng.random((4, 301)) < 0.6).astype(np.float32)
    m[3] = 0.0
    r = (rng.random((4, 301)) < 0.05) * rng.normal(size=(4, 301))
    got = jax.jit(discounted_returns, static_argnums=2)(jnp.asarray(r, jnp.float32), jnp.asarray(m), gamma)
    np.testing.assert_allclose(got, numpy_returns(r * m, m, gamma), rtol=1e-4, atol=1e-5)


def test_sequence_returns_ignore_masked_out_rewards():
    np.testing.assert_allclose(sequence_returns(jnp.asarray(REWARDS), jnp.asarray(MASK)), [1, 2, 0, -1, 2])


def test_grpo_by_hand():
    adv = per_seq(grpo_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS), 2))
    # Group 0 (rows 0, 2): R 1, 0; mean 0.5; unbiased std sqrt(0.5) -> +-0.5/0.7071.
    # Group 1 (rows 1, 3, 4): R 2, -1, 2; mean 1; unbiased var (1 + 4 + 1) / 2 = 3 -> 1/sqrt3, -2/sqrt3, 1/sqrt3.
    np.testing.assert_allclose(adv, [0.70710678, 0.57735027, -0.70710678, -1.15470054, 0.57735027], rtol=1e-5)


def test_dr_grpo_by_hand():
    adv = per_seq(grpo_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS), 2,
                                  scale_by_std=False))
    np.testing.assert_allclose(adv, [0.5, 1.0, -0.5, -2.0, 1.0], atol=1e-6)


def test_rloo_by_hand():
    adv = per_seq(rloo_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS), 2))
    # Row 1: 2 - mean(-1, 2) = 1.5; row 3: -1 - mean(2, 2) = -3; row 0: 1 - 0; row 2: 0 - 1.
    np.testing.assert_allclose(adv, [1.0, 1.5, -1.0, -3.0, 1.5], atol=1e-6)


def test_between_group_term_by_hand():
    adv = per_seq(between_group_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS), 2))
    # R = [1, 2, 0, -1, 2]: batch mean 0.8, population std sqrt(1.36); group means 0.5 (rows 0, 2), 1 (rows 1, 3, 4).
    sd = np.sqrt(np.mean((np.array([1, 2, 0, -1, 2]) - 0.8) ** 2))
    np.testing.assert_allclose(adv, np.array([-0.3, 0.2, -0.3, 0.2, 0.2]) / sd, rtol=1e-5)
    # Added with its weight to GRPO; constant groups that differ from each other now get an advantage.
    cfg = LossConfig(estimator="grpo", between_group_weight=0.5, filter_constant_groups=False)
    got = per_seq(compute_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS), 2, cfg))
    plain = per_seq(grpo_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS), 2))
    np.testing.assert_allclose(got, plain + 0.5 * adv, rtol=1e-5)
    r = np.zeros((4, 2), np.float32)
    r[:2, 1] = 1.0  # two constant groups: one always right, one always wrong
    const = compute_advantages(jnp.asarray(r), jnp.ones((4, 2)), jnp.asarray([0, 0, 1, 1]), 2, cfg)
    np.testing.assert_allclose(np.asarray(const)[:, 0], [0.5, 0.5, -0.5, -0.5], atol=1e-5)
    with pytest.raises(ValueError, match="between_group_weight"):
        LossConfig(estimator="reinforce_pp", between_group_weight=0.5, filter_constant_groups=False)


def test_turn_discount_credits_late_turns_more():
    # Row 0: turns at t = 1-2, 4, 6-7 (three turns); row 1: one turn.
    m = np.array([[0, 1, 1, 0, 1, 0, 1, 1], [0, 0, 1, 0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(later_turns(jnp.asarray(m)), [[0, 2, 2, 0, 1, 0, 0, 0], [0] * 8])
    adv = discount_by_turn(jnp.where(jnp.asarray(m), 2.0, 0.0), jnp.asarray(m), 0.5)
    np.testing.assert_allclose(adv, [[0, 0.5, 0.5, 0, 1, 0, 2, 2], [0, 0, 2, 0, 0, 0, 0, 0]])
    # Through compute_advantages: the same GRPO advantages, discounted per later turn (MASK: two turns a row).
    got = np.asarray(compute_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS), 2,
                                        LossConfig(estimator="grpo", turn_discount=0.5)))
    plain = np.asarray(grpo_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS), 2))
    np.testing.assert_allclose(got[:, 4:], plain[:, 4:], rtol=1e-6)  # the last turn keeps its credit
    np.testing.assert_allclose(got[:, :4], 0.5 * plain[:, :4], rtol=1e-6)
    with pytest.raises(ValueError, match="turn_discount"):
        LossConfig(estimator="reinforce_pp", turn_discount=0.5)


def test_reinforce_pp_by_hand():
    m = np.array([[1, 1, 1, 0], [0, 1, 1, 1]], np.float32)
    r = np.array([[0, 0, 1.0, 0], [0, 0, 0, -1.0]], np.float32)
    # Without KL: returns [1 1 1 .] and [. -1 -1 -1]; global mean 0, std 1 -> advantages = returns.
    adv = reinforce_pp_advantages(jnp.asarray(r), jnp.asarray(m))
    np.testing.assert_allclose(adv, [[1, 1, 1, 0], [0, -1, -1, -1]], atol=1e-5)
    # Global (batch) normalization: over all generated tokens, not per sequence.
    a = np.asarray(adv)[m > 0]
    assert abs(a.mean()) < 1e-5 and a.std() == pytest.approx(1.0, rel=1e-4)
    assert np.asarray(adv)[0, :3].mean() > 0.5  # a per-sequence whitening would centre each row at 0
    # Discounted: gamma 0.5 on the first example.
    adv = reinforce_pp_advantages(jnp.asarray(r), jnp.asarray(m), gamma=0.5)
    ret = np.array([0.25, 0.5, 1.0, -0.25, -0.5, -1.0])
    np.testing.assert_allclose(np.asarray(adv)[m > 0], (ret - ret.mean()) / (ret.std() + 1e-6), atol=1e-5)


def test_group_filter():
    ids = np.array([2, 0, 1, 0, 2, 1, 3, 3], np.int32)
    R = np.array([1, 0, 1, 0, 0, 1, 0.5, 0.5], np.float32)  # only group 2 (rows 0, 4) varies
    r = np.zeros((8, 3), np.float32)
    r[:, 2] = R
    m = np.ones((8, 3), np.float32)
    out = group_filter(jnp.asarray(r), jnp.asarray(m), jnp.asarray(ids), 4)
    np.testing.assert_array_equal(out.keep, [True, False, False, False, True, False, False, False])
    assert float(out.filtered_frac) == pytest.approx(6 / 8)
    # One-member group: filtered. Padding row (no generated tokens) is neither kept nor counted.
    m[1] = 0.0
    keep, frac = group_filter(jnp.asarray(r), jnp.asarray(m), jnp.asarray(ids), 4)
    np.testing.assert_array_equal(keep, [True, False, False, False, True, False, False, False])
    assert float(frac) == pytest.approx(5 / 7)
    # Tolerance: returns that differ by less than atol count as equal.
    r[4, 2] = 1.0 - 1e-8
    keep, _ = group_filter(jnp.asarray(r), jnp.asarray(m), jnp.asarray(ids), 4)
    assert not bool(keep[0]) and not bool(keep[4])
    # Filtered groups would have had zero GRPO advantage anyway.
    adv = np.asarray(grpo_advantages(jnp.asarray(r), jnp.asarray(m), jnp.asarray(ids), 4))
    np.testing.assert_array_equal(adv[~np.asarray(keep)], 0.0)


def test_padding_rows_are_not_group_members():
    mask = MASK.copy()
    rewards = REWARDS.copy()
    ids = GROUP_IDS.copy()
    # Append a padding row to group 0 with a reward that would move its mean if counted.
    mask, rewards, ids = np.vstack([mask, np.zeros(6)]), np.vstack([rewards, np.full(6, 5.0)]), np.append(ids, 0)
    for fn in (grpo_advantages, rloo_advantages):
        with_pad = np.asarray(fn(jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(ids), 2))
        without = np.asarray(fn(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS), 2))
        np.testing.assert_allclose(with_pad[:5], without, atol=1e-6)
        np.testing.assert_array_equal(with_pad[5], 0.0)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_degenerate_inputs_no_nan(estimator):
    cfg = LossConfig(estimator=estimator)
    adv_fn = functools.partial(compute_advantages, cfg=cfg)
    ids = jnp.array([0, 1, 1])
    outcome = jnp.zeros((3, 4)).at[:, 3].set(1.0)  # every game ends with the same reward
    cases = {
        "one-member group + equal rewards": (outcome, jnp.ones((3, 4))),
        "all-zero mask": (outcome, jnp.zeros((3, 4))),
        "single token": (outcome, jnp.zeros((3, 4)).at[0, 0].set(1)),
        "equal non-round rewards": (0.1 * outcome, jnp.ones((3, 4))),
    }
    for name, (r, m) in cases.items():
        adv = np.asarray(adv_fn(r, m, ids, 3))
        assert np.all(np.isfinite(adv)), name
        np.testing.assert_array_equal(adv * (1 - np.asarray(m)), 0.0)
        # Nothing to prefer: every advantage is exactly 0 (not a rounding residue over a ~0 std).
        assert np.all(adv == 0.0), (name, adv)


def test_compute_advantages_dispatch_and_jit():
    r, m, ids = jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS)
    old, ref = jnp.full((5, 6), -1.0), jnp.full((5, 6), -1.2)
    jitted = jax.jit(compute_advantages, static_argnames=("num_groups", "cfg"))
    expected = {
        LossConfig(estimator="grpo"): grpo_advantages(r, m, ids, 2),
        LossConfig(estimator="dr_grpo"): grpo_advantages(r, m, ids, 2, scale_by_std=False),
        LossConfig(estimator="rloo"): rloo_advantages(r, m, ids, 2),
        LossConfig(estimator="reinforce_pp", gamma=0.9): reinforce_pp_advantages(r, m, 0.9),
    }
    for cfg, want in expected.items():
        got = jitted(r, m, ids, num_groups=2, cfg=cfg, old_logp=old, ref_logp=ref)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=str(cfg))
    # Dr. GRPO by name is the hand example's R - group mean.
    np.testing.assert_allclose(per_seq(compute_advantages(r, m, ids, 2, LossConfig(estimator="dr_grpo"))),
                               [0.5, 1.0, -0.5, -2.0, 1.0], atol=1e-6)


def test_advantages_feed_policy_loss():
    """End to end: GRPO advantages into the loss; on-policy gradient pushes winners' tokens up."""
    from earl_jax.rl.algorithm.losses import policy_loss

    cfg = LossConfig(estimator="grpo")
    adv = compute_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS), 2, cfg)
    logp = jnp.full((5, 6), -1.0)
    g = jax.grad(lambda lp: policy_loss(lp, logp, None, adv, jnp.asarray(MASK), None, cfg)[0])(logp)
    g = np.asarray(g)
    assert np.all(g[[0, 1, 4]][:, [1, 2, 4, 5]] < 0) and np.all(g[[2, 3]][:, [1, 2, 4, 5]] > 0)
    np.testing.assert_array_equal(g * (1 - MASK), 0.0)
