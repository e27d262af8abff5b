"""The agent loop with scripted policies (no model): known outcomes, masks, budgets, context lengths."""

import re

import jax
import numpy as np
import pyspiel
import pytest

from earl_jax.envs import EnvConfig, OpenSpielTextEnv
from earl_jax.envs.vector import make_vector_env
from earl_jax.models.tokenizer import game_tokenizer, special_ids
from earl_jax.rollout.agent_loop import PlayConfig, play_games
from earl_jax.rollout.host_policies import ScriptedPolicy

TOK = game_tokenizer()
IDS = special_ids(TOK)


def _play(answer, n=4, game="connect_four", cfg=PlayConfig(), **env_kw):
    env = make_vector_env(EnvConfig(game=game, **env_kw), n)
    policy = ScriptedPolicy(answer, TOK, IDS.eos_id)
    return play_games(policy, env, TOK, cfg, jax.random.key(0), seeds=list(range(n)), bos_id=IDS.bos_id)


def _lowest_legal(context: str) -> str:
    return context.rsplit("moves:", 1)[1].split()[0]


def test_invalid_answers_end_every_game_at_once():
    traj = _play(lambda ctx: "zz")
    assert traj.stats.invalid_rate == 1.0 and traj.stats.loss_rate == 1.0
    np.testing.assert_array_equal(traj.num_turns, 1)
    np.testing.assert_array_equal(traj.returns, -1.0)
    for row in range(traj.num_games):
        generated = traj.tokens[row][traj.loss_mask[row]]
        assert TOK.decode(generated.tolist(), skip_special_tokens=False).replace(" ", "").endswith("zz<eos>") or \
            list(generated) == TOK.encode("zz", add_special_tokens=False).ids + [IDS.eos_id]


def test_mask_covers_exactly_the_answers_and_rewards_sit_on_turn_ends():
    traj = _play(_lowest_legal, n=3, agent_player=0)
    for row in range(traj.num_games):
        toks, mask = traj.tokens[row, :traj.lengths[row]], traj.loss_mask[row, :traj.lengths[row]]
        answers = toks[mask].tolist()
        # every answer is one digit then the stop token; nothing from the observations leaks in
        assert len(answers) == 2 * traj.num_turns[row]
        assert all(a == IDS.eos_id for a in answers[1::2])
        assert all(TOK.decode([a]).isdigit() for a in answers[0::2])
        nz = np.flatnonzero(traj.rewards[row])
        assert len(nz) <= 1 and (len(nz) == 0 or (mask[nz[0]] and toks[nz[0]] == IDS.eos_id))
        assert traj.returns[row] == {"agent": 1.0, "opponent": -1.0, "draw": 0.0}[traj.winners[row]]
        # context at each turn grows, and the last turn's context is below the final length
        ctx = traj.turn_context_lens[row]
        assert ctx == sorted(ctx) and ctx[-1] < traj.lengths[row]


def test_outcomes_match_openspiel_replay():
    """Replaying the moves each game made through OpenSpiel itself gives the same winner."""
    traj = _play(_lowest_legal, n=6)
    for row in range(traj.num_games):
        env = OpenSpielTextEnv(EnvConfig(game="connect_four"))
        _, info = env.reset(seed=row)
        agent = info["agent_player"]
        state = pyspiel.load_game("connect_four").new_initial_state()
        text = TOK.decode(traj.tokens[row, :traj.lengths[row]].tolist(), skip_special_tokens=True)
        # Agent moves are the answers; opponent moves are the "opp N" lines, in order of play.
        agent_moves = [int(TOK.decode([t])) for t, m in zip(traj.tokens[row], traj.loss_mask[row])
                       if m and t != IDS.eos_id]
        opp_moves = [int(m) for m in re.findall(r"opp (\d+)", text)]  # the answer and "opp" share a line
        for i in range(len(agent_moves) + len(opp_moves)):
            state.apply_action(agent_moves.pop(0) if i % 2 == agent else opp_moves.pop(0))
        if not state.is_terminal():
            # The opponent's winning reply ends the game; its observation is never fed back to the
            # policy, so it is not in the tokens: OpenSpiel must agree that some reply ends it as recorded.
            assert traj.winners[row] == "opponent" and state.current_player() != agent
            finals = [state.child(a) for a in state.legal_actions()]
            assert any(f.is_terminal() and f.returns()[agent] == -1.0 for f in finals)
            continue
        r = state.returns()[agent]
        assert {1.0: "agent", -1.0: "opponent", 0.0: "draw"}[r] == traj.winners[row]


def test_context_budget_truncates_and_records():
    traj = _play(_lowest_legal, n=2, cfg=PlayConfig(max_turn_tokens=4, max_turns=32, max_context=200))
    assert traj.truncated.all() and (traj.lengths <= 200).all()
    assert all(w is None for w in traj.winners)


def test_turn_budget_truncates():
    traj = _play(_lowest_legal, n=2, cfg=PlayConfig(max_turns=2))
    assert traj.truncated.all() and (traj.num_turns == 2).all()


def test_first_observation_longer_than_the_context_is_an_error():
    with pytest.raises(ValueError, match="max_context"):
        _play(_lowest_legal, n=1, cfg=PlayConfig(max_context=10))


def test_extend_widths_are_recorded_for_the_memory_model():
    traj = _play(_lowest_legal, n=3, agent_player=0)
    obs_spans = []  # widths of the observation spans after each answer (the later extends)
    for row in range(traj.num_games):
        mask = traj.loss_mask[row, :traj.lengths[row]]
        edges = np.flatnonzero(np.diff(np.concatenate([[1], mask.astype(int), [1]])))  # runs of False
        spans = list(edges[1::2] - edges[::2])
        assert spans[0] <= traj.stats.prompt_tokens
        obs_spans += spans[1:]
    assert traj.stats.prompt_tokens == max(int(np.argmax(m)) for m in traj.loss_mask)  # prompt = first span
    assert traj.stats.observation_tokens == max(obs_spans) > 0
    assert traj.stats.first_cache_len == traj.stats.prompt_tokens + 4  # + the default turn budget


def test_turn_keys_from_one_program_equal_fold_in_per_turn():
    """The rollout draws every turn's key from one jitted program; a game's stream must stay fold_in(rng, turn)."""
    from earl_jax.rollout.agent_loop import _turn_keys

    rng = jax.random.key(11)
    keys = _turn_keys(rng, 12)
    assert len(keys) == 12
    for t, k in enumerate(keys):
        np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(jax.random.fold_in(rng, t)))
