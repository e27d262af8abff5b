"""rollout/host_policies.py through the one agent loop: host answers are written as the model writes them (free text
and constrained moves), a cut answer says what was written, the turn hook sees every turn where its answer sits, and
`whole_answers` ends a game whose answer does not fit, unwritten."""

import numpy as np

from earl_jax.envs.env_config import EnvConfig
from earl_jax.envs.vector import VectorTextEnv
from earl_jax.models.tokenizer import game_tokenizer, special_ids
from earl_jax.rollout.agent_loop import PlayConfig, play_games
from earl_jax.rollout.host_policies import HostAnswers, HostPolicy, random_legal
from earl_jax.rollout.moves import MoveTokens, legal_bits

TOK = game_tokenizer()
IDS = special_ids(TOK)


def _play(policy, n=6, cfg=PlayConfig(), hook=None, game="connect_four"):
    env = VectorTextEnv(EnvConfig(game=game, prompt_style="minimal"), n)
    return play_games(policy, env, TOK, cfg, None, list(range(n)), bos_id=IDS.bos_id, hook=hook)


def test_the_hook_sees_every_turn_where_its_answer_sits_and_among_which_moves_it_was_chosen():
    turns = []
    traj = _play(HostPolicy(random_legal(np.random.default_rng(0)), TOK, IDS.eos_id), hook=turns.append)
    assert turns[0].answers is None and turns[0].games.tolist() == list(range(6))  # the reset
    answered = np.zeros(traj.tokens.shape, bool)
    for turn in turns[1:]:
        for g, start, count, move, legal in zip(turn.games, turn.start, turn.answers.counts, turn.answers.moves,
                                                turn.legal):
            answer = traj.tokens[g, start:start + count].tolist()
            assert answer == TOK.encode(str(move), add_special_tokens=False).ids + [IDS.eos_id] and legal[move]
            answered[g, start:start + count] = True
        np.testing.assert_array_equal(turn.step.action, turn.answers.moves)  # the env played the move written
    np.testing.assert_array_equal(answered, traj.loss_mask)  # every answer, nothing else
    assert [sum(g in t.games for t in turns[1:]) for g in range(6)] == traj.num_turns.tolist()


def test_constrained_host_moves_are_written_as_the_sampler_writes_them_and_only_their_own_are_scored():
    moves = MoveTokens.build(TOK, 7, IDS.eos_id)
    draw = random_legal(np.random.default_rng(1))

    def choose(games, legal):
        got = draw(games, legal)
        return HostAnswers(moves=got.moves, own=games % 2 == 0)  # odd games' moves are not the policy's own

    turns = []
    traj = _play(HostPolicy(choose, TOK, IDS.eos_id, moves), cfg=PlayConfig(constrain_moves=True),
                 hook=turns.append)
    for turn in turns[1:]:
        g, at = turn.games, turn.start
        np.testing.assert_array_equal(traj.tokens[g, at], np.asarray(moves.token_ids)[turn.answers.moves])
        np.testing.assert_array_equal(traj.tokens[g, at + 1], IDS.eos_id)
        np.testing.assert_array_equal(traj.choices[g, at], legal_bits(turn.legal))
        np.testing.assert_array_equal(traj.loss_mask[g, at], g % 2 == 0)
    assert traj.loss_mask[1::2].sum() == 0 and traj.loss_mask[0::2].sum() == traj.num_turns[0::2].sum()


def test_a_free_text_answer_cut_by_its_budget_says_what_was_written():
    policy = HostPolicy(lambda games, legal: HostAnswers(moves=np.array([12, 3, 45])), TOK, IDS.eos_id,
                        reads_legal=False)
    out = policy.generate(np.array([1, 5, 2, 0]), None, np.array([0, 1, 2, 3]))()
    assert out.counts.tolist() == [1, 2, 2, 0] and out.stopped.tolist() == [False, True, False, False]
    assert out.texts[:3] == ["1", "3", "45"] and out.moves.tolist() == [1, 3, 45, -1]  # "45" lost only its stop


def test_whole_answers_end_a_game_whose_answer_is_cut_unwritten():
    policy = HostPolicy(random_legal(np.random.default_rng(2)), TOK, IDS.eos_id)
    cut = _play(policy, cfg=PlayConfig(max_turn_tokens=1, whole_answers=True))  # a digit and its stop: 2 tokens
    assert cut.truncated.all() and not cut.loss_mask.any() and (cut.num_turns == 0).all()
    played = _play(policy, cfg=PlayConfig(max_turn_tokens=1))  # without: the digit alone is the answer
    assert not played.truncated.any() and (played.loss_mask.sum(1) == played.num_turns).all()
    np.testing.assert_array_equal(cut.lengths, [c[0] for c in played.turn_context_lens])  # the prompt alone
