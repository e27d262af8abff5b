"""Learning that depends on the observation, and the train pass scoring exactly what the rollout sampled."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.rl.algorithm.packing import scored_spans
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rl.stages.experience_stage import rollout_batch
from earl_jax.rollout.sampler import Sampler
from jobs import job, with_fields
from probe import ShowDigitEnv

TINY = job(groups=4, group_size=4, run__steps=1, sft__steps=0, devices=1, eval__games=8, checkpoint_every=0,
           max_context=512, micro_batch_tokens=8192)


def _sampled_and_recomputed(trainer: Trainer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rollout's sampler log-probs, the experience stage's old-policy log-probs of the same batch under
    the same weights (rows back in game order), and the loss mask (generated tokens)."""
    r = trainer.cfg.rollout
    traj, _ = trainer.play(trainer.env, list(range(r.batch_size)), np.repeat(np.arange(r.groups), r.group_size),
                           jax.random.key(1), trainer.sampling)
    batch = rollout_batch(traj, trainer.policy.moves is not None)
    trainer._observe(batch, traj.stats.turn_context_len_mean, traj.num_games)
    spans = scored_spans(traj.loss_mask) if traj.spans is None else traj.spans
    out = trainer.policy.planner.run("experience", lambda run: trainer._experience(run, batch, spans, traj.local_rows))
    batch, arranged = out.batch, out.arranged
    old = np.empty(np.shape(batch.old_logp), np.float32)
    old[arranged] = np.asarray(batch.old_logp)  # the stage arranges rows by length
    return traj.logprobs, old[:, :traj.tokens.shape[1]], traj.loss_mask


@pytest.mark.parametrize("env_factory, extra", [
    # Connect Four, minimal style: multi-turn cache extends, invalid answers and retries (random weights).
    (None, {"game": "connect_four"}),
    # The probe's digit arrives on turn 3, after two extends of generated and observed tokens.
    (functools.partial(ShowDigitEnv, reveal_turn=2), {"max_turn_tokens": 3, "max_context": 64}),
])
def test_train_pass_scores_exactly_the_sampled_tokens(tmp_path, env_factory, extra):
    """The sampler's log-prob of every generated token equals the experience stage's recomputation.

    With a float32 KV cache they agree to float tolerance; the Trainer's bf16 cache (its default) to ~2e-3.
    An off-by-one in positions, padding, BOS or the extend path would be off by nats: the same comparison
    one position over must fail.
    """
    trainer = Trainer(with_fields(TINY, run_dir=str(tmp_path), **extra), log=False, env_factory=env_factory)
    sampled, old, mask = _sampled_and_recomputed(trainer)  # the Trainer's own sampler (bf16 cache)
    assert mask.sum() > 50 and (mask.sum(1) > mask.sum(1).min()).any()  # many tokens, ragged rows
    np.testing.assert_allclose(sampled[mask], old[mask], atol=1e-2, rtol=0)
    shifted = np.abs(sampled[:, 1:] - old[:, :-1])[mask[:, 1:]]
    assert shifted.mean() > 0.1, shifted.mean()  # the comparison can tell a position apart

    run = trainer.policy.planner.stage_run("rollout")
    policy = trainer.policy
    trainer.rollout.samplers[run.layout.mesh] = Sampler(policy.graphdef, policy.model_cfg, mesh=run.mesh,
                                                        rules=run.rules, cache_dtype=jnp.float32)
    sampled, old, mask = _sampled_and_recomputed(trainer)
    np.testing.assert_allclose(sampled[mask], old[mask], atol=1e-5, rtol=0)


# The probe runs: 8 groups of 8 one-token answers, learning rate 1e-3, plain GRPO (group filter on, no entropy
# term). The digit shown is 0 or 1, so a policy that does not read it scores about 0.5 (always the same digit);
# the 50 evaluation games are greedy, on fixed seeds. At 2e-3 the same run flips between "always 0" and
# "always 1" and ends at 0.46 (experiments/results/learning_notes.md).
PROBE = with_fields(TINY, groups=8, group_size=8, optim__learning_rate=1e-3, max_turn_tokens=1, max_turns=2,
                    max_context=32, eval__games=50, eval__every=0, filter_constant_groups=True,
                    entropy_coef=0.0, entropy_floor=None, turn_discount=1.0,
                    model__name="tiny")  # the probes' thresholds were set on the tiny model's learning


@pytest.mark.slow
def test_policy_learns_to_read_the_first_observation(tmp_path):
    """The first observation shows a digit d; only the answer d is rewarded. After 80 iterations the greedy
    policy answers it in >= 90% of the games (seed 0: 0.54 up to iteration 60, 1.00 at 70 and 80). Its control,
    the digit hidden, is `test_with_the_digit_hidden_every_game_gets_one_answer` below.

    Free text on turn 2 (the cache-extend path) is not learned in 80 iterations (0.46 with plain GRPO, with a turn
    discount of 0.5 or 0.05, or with the entropy floor; learning_notes.md); constrained moves learn it
    (test_moves.py). The trajectories and log-probs of that path are checked above."""
    trainer = Trainer(with_fields(PROBE, run__steps=80, run_dir=str(tmp_path)), log=False,
                      env_factory=functools.partial(ShowDigitEnv, choices=2))
    for _ in range(trainer.cfg.run.steps):
        trainer.iteration()
    success = trainer.evaluate()["eval/win_rate"]
    assert success >= 0.9, success


class _RecordedDigits(ShowDigitEnv):
    digits: list[int] = []  # every reset's digit, in order (the test clears it)

    def reset(self, seed=None, options=None):
        out = super().reset(seed, options)
        _RecordedDigits.digits.append(self.digit)
        return out


@pytest.mark.parametrize("reveal_turn", [0, 1])
def test_with_the_digit_hidden_every_game_gets_one_answer(tmp_path, monkeypatch, reveal_turn):
    """The control of the learning tests (this file's, reveal_turn 0; test_moves.py's constrained one, 1), without
    their 80 training iterations (75 s each under CI): with the digit printed as "?", every evaluation game shows
    the policy the same tokens turn after turn, so whatever it learned it gives every game one answer, and the
    evaluation seeds' digits are balanced: no policy passes 0.6, the learning tests' bar being 0.9."""
    cfg = with_fields(PROBE, run__steps=3, run_dir=str(tmp_path), max_turns=2 + reveal_turn, constrain_moves=True,
                      max_turn_tokens=2, optim__learning_rate=2e-3)
    trainer = Trainer(cfg, log=False, env_factory=functools.partial(
        _RecordedDigits, choices=2, reveal_turn=reveal_turn, hidden=True, warmup_moves=(0, 1)))
    for _ in range(cfg.run.steps):  # weights that are not the initial ones
        trainer.iteration()
    played = []
    play = trainer.play
    monkeypatch.setattr(trainer, "play", lambda *a, **k: played.append(play(*a, **k)) or played[-1])
    _RecordedDigits.digits.clear()
    success = trainer.evaluate()["eval/win_rate"]
    (traj, _), digits = played[-1], np.array(_RecordedDigits.digits)
    assert len(digits) == traj.tokens.shape[0] == cfg.eval.games
    assert len(np.unique(traj.tokens, axis=0)) == 1  # one context and one answer for every game
    share_of_zeros = float(np.mean(digits == 0))
    assert max(share_of_zeros, 1 - share_of_zeros) <= 0.6, share_of_zeros
    assert success in (pytest.approx(share_of_zeros), pytest.approx(1 - share_of_zeros)), (success, share_of_zeros)


def test_a_collapsed_run_has_no_gradient_and_says_so(tmp_path):
    """Force the collapse the issue describes: the format warm-up on the probe, drawing from the one answer "0"
    (`warmup_moves`), teaches that constant answer. Every group is then constant (always right where d = 0,
    always wrong where d = 1), every advantage is 0, the weights do not move, and the trainer warns and counts it."""
    cfg = with_fields(PROBE, run__steps=3, sft__steps=40, sft__games=64, run_dir=str(tmp_path))
    trainer = Trainer(cfg, log=False, env_factory=functools.partial(ShowDigitEnv, choices=2, warmup_moves=(0,)))
    trainer.format_warmup()
    before = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]
    with pytest.warns(RuntimeWarning, match="no learning signal"):
        first = trainer.iteration()
    assert first["train/no_signal_iters"] == 1
    assert first["train/filtered_frac"] == 1.0 and first["train/grad_norm"] == 0.0
    assert 0 < first["episode/win_rate"] < 1  # right exactly where d happens to be 0
    for a, b in zip(before, jax.tree.leaves(trainer.state.params)):
        np.testing.assert_array_equal(a, b)
    # The counter runs while every group stays constant and resets on the first gradient. (A rare sampled
    # "1", p ~ 3e-3 a game after this warm-up, gives its group a signal: at this seed iteration 2 has one.)
    records = [first] + [trainer.iteration() for _ in range(4)]
    for prev, r in zip(records, records[1:]):
        silent = r["train/grad_norm"] == 0.0
        assert silent == (r["train/filtered_frac"] == 1.0)
        assert r["train/no_signal_iters"] == (prev["train/no_signal_iters"] + 1 if silent else 0)


def test_the_entropy_floor_keeps_a_collapsed_run_learning(tmp_path):
    """The same forced collapse with the entropy floor (and the filter off, so the collapsed groups' tokens count):
    the floor's gradient un-freezes the run and groups vary again. From this saturated start it acts as a reset
    rather than a nudge: Adam turns the floor's tiny but steady gradient into full steps, and the entropy went
    0.004 -> 4.6 nats (uniform) at iteration 6 before RL sharpened it again. It does not promise the answer is
    found quickly: the greedy policy was still the constant "0" after 60 iterations (learning_notes.md)."""
    cfg = with_fields(PROBE, run__steps=15, optim__learning_rate=2e-3, sft__steps=40, sft__games=64,
                      filter_constant_groups=False, entropy_coef=1.0, entropy_floor=0.5, run_dir=str(tmp_path))
    trainer = Trainer(cfg, log=False, env_factory=functools.partial(ShowDigitEnv, choices=2, warmup_moves=(0,)))
    trainer.format_warmup()
    records = [trainer.iteration() for _ in range(15)]
    entropy = [float(r["train/entropy"]) for r in records]
    assert all(r["train/grad_norm"] > 0 and r["train/no_signal_iters"] == 0 for r in records)
    assert entropy[0] < 0.1 and max(entropy) > 0.5, entropy
    rise = int(np.argmax(np.asarray(entropy) > 0.5))
    assert min(r["train/filtered_frac"] for r in records[rise:]) < 1.0  # some group's answers differ again
