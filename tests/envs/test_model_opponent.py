"""Games against a policy opponent (envs/vector/model_opponent.py, rollout/frozen_opponent.py): what the policy
sees is what an agent in its seat would see, every move played is legal, games finish, both seats are played."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pyspiel
import pytest
from flax import nnx

from earl_jax.envs import EnvConfig, OpenSpielTextEnv
from earl_jax.envs.vector import ObservationCodec
from earl_jax.envs.vector.model_opponent import ModelOpponentEnv
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.models.tokenizer import game_tokenizer, special_ids
from earl_jax.rollout.agent_loop import PlayConfig, play_games
from earl_jax.rollout.frozen_opponent import FrozenPolicyOpponent
from earl_jax.rollout.policy import SamplerPolicy
from earl_jax.rollout.sampler import Sampler, SamplingConfig

TOK = game_tokenizer()
IDS = special_ids(TOK)


class RecordingEnv(ModelOpponentEnv):
    """Records every stone played (game, action, player) to replay the games through OpenSpiel."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.played: list[list[tuple[int, int]]] = [[] for _ in range(self.num_games)]

    def reset(self, seeds, rows=None, histories=None):
        for r in (range(self.num_games) if rows is None else rows):
            self.played[r] = []
        return super().reset(seeds, rows, histories)

    def _play(self, rows, actions, players):
        for g, a, p in zip(np.asarray(rows).tolist(), np.asarray(actions).tolist(), np.asarray(players).tolist()):
            self.played[g].append((a, p))
        super()._play(rows, actions, players)


class TextPolicy:
    """An OpponentPolicy without a model: records what each game showed it; answers a legal move, or (with
    probability `bad`) an illegal one, through the caller's `pick`."""

    def __init__(self, env, rng, bad=0.0, max_bad_in_a_row=None):
        self.env, self.rng, self.bad, self.max_bad = env, rng, bad, max_bad_in_a_row
        self.seen: dict[int, list[str]] = {}
        self.answers: dict[int, list[int]] = {}
        self.calls = []

    def reset(self, games):
        self.seen = {int(g): [] for g in games}
        self.answers = {int(g): [] for g in games}

    def __call__(self, games, observations):
        self.calls.append(len(games))
        legal = self.env.rules.legal_mask(self.env.stones[games])
        moves = []
        for g, obs, row in zip(games.tolist(), observations, legal):
            self.seen[g].append(obs)
            streak = len(self.answers[g]) - len(_rstrip(self.answers[g], -1))
            may_fail = self.max_bad is None or streak < self.max_bad
            choice = int(self.rng.choice(np.flatnonzero(row))) if self.rng.random() >= self.bad or not may_fail else -1
            moves.append(choice)
            self.answers[g].append(choice)
        return np.array(moves)


def _rstrip(xs, value):
    while xs and xs[-1] == value:
        xs = xs[:-1]
    return xs


def _replay_is_legal(game: str, played: list[tuple[int, int]], first_player: int = 0) -> None:
    state = pyspiel.load_game(game).new_initial_state()
    for a, p in played:
        assert state.current_player() == p, (played, str(state))
        assert a in state.legal_actions(), (a, str(state))
        state.apply_action(a)


def _agent_games(env, policy, n, seeds, rng, bad_agent=0.0):
    """Plays every game to its end with random legal agent answers (sometimes invalid)."""
    step = env.reset(seeds)
    live = ~step.terminated
    while live.any():
        rows = np.flatnonzero(live)
        moves = np.array([int(rng.choice(np.flatnonzero(env.legal[r]))) if rng.random() >= bad_agent else -1
                          for r in rows])
        step = env.step(rows, moves=moves)
        live[rows] = ~(step.terminated | step.truncated)
    return step


@pytest.mark.parametrize("game, style", [("connect_four", "minimal"), ("connect_four", "compact"),
                                         ("tic_tac_toe", "compact"), ("connect_four", "chat")])
def test_the_policy_sees_what_an_agent_in_its_seat_would_see(game, style):
    """Every text the policy got equals the reference env's observations for an agent in the policy's seat
    facing the agent's moves (OpenSpielTextEnv with a scripted opponent), retries included."""
    n = 12
    cfg = EnvConfig(game=game, prompt_style=style, max_retries=2, agent_player=None)
    env = RecordingEnv(cfg, n)
    policy = TextPolicy(env, np.random.default_rng(1), bad=0.3, max_bad_in_a_row=2)  # retries, never a fallback
    games = np.arange(0, n, 2)
    env.assign(policy, games)
    _agent_games(env, policy, n, list(range(100, 100 + n)), np.random.default_rng(2))
    seats = {int(env.agent_player[g]) for g in games}
    assert seats == {0, 1}  # agent_player None: the agent plays both seats against the policy
    compared = 0
    for g in games.tolist():
        policy_seat = 1 - int(env.agent_player[g])
        agent_moves = iter(a for a, p in env.played[g] if p != policy_seat)

        class Scripted:  # the reference's opponent plays the agent's moves of game g
            def reset(self, seed):
                pass

            def act(self, state):
                return next(agent_moves)

        ref = OpenSpielTextEnv(EnvConfig(game=game, prompt_style=style, max_retries=2, agent_player=policy_seat))
        ref.opponent = Scripted()
        obs, _ = ref.reset(seed=0)
        expected = [obs]
        for a in policy.answers[g]:
            obs, _, term, trunc, _ = ref.step(str(a) if a >= 0 else "x")
            expected.append(obs)
            if term or trunc:
                break
        got = policy.seen[g]
        # the policy never sees the game's final text (it is not asked to move again)
        assert got == expected[:len(got)], (g, got, expected)
        compared += len(got)
    assert compared > 3 * len(games) and env.policy_fallbacks == 0
    assert any(-1 in a for a in policy.answers.values())  # retries were exercised


def test_invalid_answers_fall_back_to_legal_moves_and_games_finish():
    n = 16
    env = RecordingEnv(EnvConfig(game="connect_four", prompt_style="minimal", max_retries=1), n)
    policy = TextPolicy(env, np.random.default_rng(0), bad=0.7)
    env.assign(policy, np.arange(n))
    _agent_games(env, policy, n, [5] * 8 + [6] * 8, np.random.default_rng(3), bad_agent=0.1)
    assert not env.live.any()
    assert 0 < env.policy_fallbacks < env.policy_moves  # some moves needed the random fallback
    for g in range(n):
        _replay_is_legal("connect_four", env.played[g])
    # one policy call per opponent turn for all games that wait (plus retries): never one call per game
    assert max(policy.calls) > 1


def test_games_without_the_policy_play_the_scripted_opponent_unchanged():
    """The policy's games do not shift the scripted games' random streams: those replay move for move."""
    from earl_jax.envs.vector import VectorTextEnv

    n = 8
    cfg = EnvConfig(game="connect_four", opponent="random", prompt_style="minimal", max_retries=0)
    mixed, plain = RecordingEnv(cfg, n), VectorTextEnv(cfg, n)
    mixed.assign(TextPolicy(mixed, np.random.default_rng(0)), [1, 3])
    seeds = list(range(n))
    a, b = mixed.reset(seeds), plain.reset(seeds)
    scripted = [0, 2, 4, 5, 6, 7]
    assert [a.obs[i] for i in scripted] == [b.obs[i] for i in scripted]
    rng = np.random.default_rng(0)
    rows = np.array(scripted)
    while len(rows):
        moves = np.array([int(rng.choice(np.flatnonzero(plain.legal[r]))) for r in rows])
        sa, sb = mixed.step(rows, moves=moves), plain.step(rows, moves=moves)
        assert sa.obs == sb.obs and np.array_equal(sa.reward, sb.reward)
        rows = rows[~sb.terminated]


def test_a_partial_reset_of_policy_games_is_refused():
    env = ModelOpponentEnv(EnvConfig(game="tic_tac_toe"), 4)
    env.assign(TextPolicy(env, np.random.default_rng(0)), [0, 1])
    with pytest.raises(ValueError, match="reset every game the policy plays"):
        env.reset([0], rows=[0])


CFG = ModelConfig.tiny(vocab_size=TOK.get_vocab_size()).replace(num_hidden_layers=2, hidden_size=64,
                                                                 intermediate_size=128)


def test_a_frozen_model_plays_legal_moves_through_the_parser_in_both_seats():
    """The tiny model (random weights) as the opponent and as the agent: one decode per opponent turn,
    answers read by the codec, invalid ones retried then replaced; every game ends; replays are legal."""
    graphdef, params = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32))
    frozen = jax.tree.map(np.array, params)  # a host snapshot, as the league keeps it
    sampler = Sampler(graphdef, CFG, cache_dtype=jnp.float32)
    sampling = SamplingConfig(temperature=1.0)
    n = 8
    env = RecordingEnv(EnvConfig(game="tic_tac_toe", prompt_style="compact", max_retries=2), n)
    codec = ObservationCodec(TOK)
    opponent = FrozenPolicyOpponent(SamplerPolicy(sampler, frozen, sampling, (IDS.eos_id,), 3), codec,
                                    jax.random.key(5), max_turn_tokens=3, bos_id=IDS.bos_id, min_batch=4)
    calls = []
    real = opponent.__call__

    def counted(games, observations):
        calls.append(len(games))
        moves = real(games, observations)
        assert moves.shape == (len(games),) and moves.min() >= -1
        return moves

    games = np.arange(n)[n // 2:]  # the last half (two groups of two) against the frozen model
    env.assign(counted_policy := _Wrap(opponent, counted), games)
    agent = SamplerPolicy(sampler, params, sampling, (IDS.eos_id,), 3)
    seeds = [11, 11, 12, 12, 13, 13, 14, 14]
    traj = play_games(agent, env, TOK, PlayConfig(max_turn_tokens=3, max_turns=9, max_context=512),
                      jax.random.key(0), seeds, bos_id=IDS.bos_id, codec=codec)
    assert all(w is not None or t for w, t in zip(traj.winners, traj.truncated))
    assert not env.live.any() or traj.truncated.any()
    for g in range(n):
        _replay_is_legal("tic_tac_toe", env.played[g])
    assert {int(env.agent_player[g]) for g in range(n)} == {0, 1}
    assert env.policy_moves > 0 and calls and max(calls) <= len(games)
    assert counted_policy.resets == 1


class _Wrap:
    def __init__(self, inner, call):
        self.inner, self.call, self.resets = inner, call, 0

    def reset(self, games):
        self.resets += 1
        self.inner.reset(games)

    def __call__(self, games, observations):
        return self.call(games, observations)
