"""The game registry (earl_jax/envs/games): each GameSpec agrees with OpenSpiel, and a spec is the one place the
package reads a game from: a fork that changes a spec (a new opponent, ladder or rules text) sees the change in the
per-game env, the batched env, the curriculum and the text, with no other file touched."""
import dataclasses
import random

import numpy as np
import pyspiel
import pytest

from earl_jax.envs import EnvConfig, OpenSpielTextEnv, game_text, games, make_opponent
from earl_jax.envs.games import OpponentSpec, get_game
from earl_jax.envs.vector import make_vector_env
from earl_jax.envs.vector.batched_opponents import BatchedOpponent, make_vector_opponent
from earl_jax.envs.vector.env import VectorTextEnv
from earl_jax.rl.matchups.curriculum import default_ladder, parse_ladder
from env_replay import replay

NAMES = games.game_names()


def test_the_registry_holds_the_batched_games_and_refuses_unknown_or_duplicate_names():
    assert {"connect_four", "tic_tac_toe"} <= set(NAMES)
    with pytest.raises(ValueError, match="no batched game 'chess'.*connect_four"):
        get_game("chess")
    clone = dataclasses.replace(get_game("tic_tac_toe"))
    with pytest.raises(ValueError, match="'tic_tac_toe' is registered already"):
        games.register_game(clone)
    assert games.register_game(get_game("tic_tac_toe")) is get_game("tic_tac_toe")  # the same spec again: a no-op


@pytest.mark.parametrize("name", NAMES)
def test_each_spec_agrees_with_openspiel_and_its_ladder_plays_batched(name):
    spec, game = get_game(name), pyspiel.load_game(name)
    assert games.spec_for(game) is spec and game_text(game) is spec.text
    assert spec.rules.num_actions == spec.text.num_actions == game.num_distinct_actions()
    printed = str(game.new_initial_state()).strip("\n").split("\n")
    assert (len(printed), len(printed[0])) == spec.text.board_shape
    stones = np.zeros((1, 2), np.uint64)
    assert spec.rules.legal_mask(stones)[0].tolist() == [True] * spec.rules.num_actions
    for rung in spec.ladder:  # the default curriculum: every rung per game and batched
        make_opponent(rung, game)
        make_vector_opponent(rung, name, 2)
    for kind in spec.batched_opponents:  # a batched opponent replays a per-game one: that one must exist
        assert kind in spec.opponents or kind in ("random", "mcts", "solver")


@pytest.mark.parametrize("name, rung", [(name, rung) for name in NAMES for rung in get_game(name).ladder])
def test_each_default_rung_plays_batched_as_the_per_game_reference_does(name, rung):
    """A new game's file gets this for free: its batched env against each rung of its ladder replays OpenSpiel."""
    seen = replay(EnvConfig(game=name, opponent=rung, max_retries=1), 6, seed=1)  # asserts every output equal
    assert seen["steps"] > 0 and seen["winners"]


def test_a_registered_game_with_other_parameters_is_any_openspiel_game():
    other = pyspiel.load_game("connect_four(rows=5)")
    assert games.spec_for(other) is None and not game_text(other).is_preset
    assert not isinstance(make_vector_env(EnvConfig(game="connect_four(rows=5)"), 2), VectorTextEnv)


@pytest.mark.parametrize("name", NAMES)
def test_rules_match_openspiel_on_random_games(name):
    """Legal masks, printed cells and the end of the game, move by move, for a batch of 64 games at once."""
    rules, g, rng = get_game(name).rules, pyspiel.load_game(name), random.Random(1)
    states = [g.new_initial_state() for _ in range(64)]
    stones = np.zeros((64, 2), np.uint64)
    printed = np.full((64, len(str(states[0]).replace("\n", ""))), ".")
    while not all(s.is_terminal() for s in states):
        rows = np.array([i for i, s in enumerate(states) if not s.is_terminal()])
        want_legal = np.zeros((len(rows), rules.num_actions), bool)
        for k, i in enumerate(rows):
            want_legal[k, states[i].legal_actions()] = True
        assert np.array_equal(rules.legal_mask(stones[rows]), want_legal)
        actions = np.array([rng.choice(states[i].legal_actions()) for i in rows])
        players = np.array([states[i].current_player() for i in rows])
        bits = rules.drop(stones[rows], actions)
        stones[rows, players] |= bits
        printed[rows, rules.print_index(bits)] = np.array(["x", "o"])[players]
        for i, a in zip(rows, actions):
            states[i].apply_action(int(a))
        for i in rows:
            assert "".join(printed[i]) == str(states[i]).replace("\n", "")
        over = rules.is_win(stones[rows, 0]) | rules.is_win(stones[rows, 1]) | rules.is_full(stones[rows])
        assert over.tolist() == [states[i].is_terminal() for i in rows]


def test_opponent_spec_parses_kind_and_argument_and_names_a_bad_count():
    assert OpponentSpec.parse(" AlphaBeta:3 ", "x") == OpponentSpec(" AlphaBeta:3 ", "alphabeta", "3")
    assert OpponentSpec.parse("alphabeta", "x").positive_int(4) == 4
    with pytest.raises(ValueError, match="'mcts:-2': '-2' is not a positive integer"):
        OpponentSpec.parse("mcts:-2", "x").positive_int(200)
    with pytest.raises(ValueError, match="must be a string, one of x; got 3"):
        OpponentSpec.parse(3, "x")


# ---- a fork's game: Tic-Tac-Toe with a new opponent, ladder and rules text, registered in place of the built-in
CORNERS = (0, 2, 6, 8)


class CornerOpponent:
    """Per game: the first free corner, else the lowest free cell (deterministic: the seed is unused)."""

    def reset(self, seed: int) -> None:
        pass

    def act(self, state) -> int:
        legal = state.legal_actions()
        return next((c for c in CORNERS if c in legal), min(legal))


class CornerOpponents(BatchedOpponent):
    def act(self, rows, me, opp, legal):
        order = list(CORNERS) + [c for c in range(9) if c not in CORNERS]
        ranked = legal[:, order]
        return np.array(order)[ranked.argmax(1)]


@pytest.fixture
def forked(monkeypatch):
    base = get_game("tic_tac_toe")
    spec = dataclasses.replace(
        base, ladder=("random", "corner", "solver"),
        text=dataclasses.replace(base.text, rules="Corners first! Cells 0 to 8.\n"),
        opponents={"corner": lambda spec, seed: CornerOpponent()},
        batched_opponents={**base.batched_opponents, "corner": lambda spec, n: CornerOpponents(n)})
    monkeypatch.setitem(games._REGISTRY, "tic_tac_toe", spec)
    return spec


def test_a_changed_spec_reaches_every_reader(forked):
    assert default_ladder("tic_tac_toe") == ("random", "corner", "solver")
    assert parse_ladder("", "tic_tac_toe") == forked.ladder
    env = OpenSpielTextEnv(EnvConfig.tic_tac_toe(opponent="corner", agent_player=1, prompt_style="chat"))
    obs, info = env.reset(seed=0)
    assert obs.startswith("Corners first!") and info["opponent_action"] == 0
    batched = make_vector_env(EnvConfig.tic_tac_toe(opponent="corner"), 4)
    assert isinstance(batched, VectorTextEnv)
    seen = replay(EnvConfig.tic_tac_toe(opponent="corner", max_retries=1), 16, seed=3)  # asserts == per game
    assert seen["steps"] > 0 and seen["winners"]
    with pytest.raises(ValueError, match="'corner'"):  # still the fork's game only
        OpenSpielTextEnv(EnvConfig.connect_four(opponent="corner"))


def test_the_opponent_help_says_which_games_refuse_the_solver(monkeypatch):
    from earl_jax.cli import fields_of
    from earl_jax.rl.loop.job_config import JobConfig

    def shown() -> str:  # --env.opponent's help, as the job's --help shows it
        return next(f.help for f in fields_of(JobConfig()) if f.path == ("env", "opponent"))

    solver = shown().split("solver", 1)[1].split(")")[0]
    assert "connect_four plays its own search" in solver and "tic_tac_toe" not in solver
    # what the help says is what the job does: Connect Four's own node-budgeted search, the exact one elsewhere
    assert type(make_opponent("solver", pyspiel.load_game("connect_four"))).__module__.endswith("connect_four")
    with pytest.raises(ValueError, match="6x7 board only"):  # another board size refuses the generic solver
        make_opponent("solver", pyspiel.load_game("connect_four(rows=5)"))
    make_opponent("solver", pyspiel.load_game("tic_tac_toe"))
    base = get_game("tic_tac_toe")  # a fork's game that refuses it too: the help reads the registry
    monkeypatch.setitem(games._REGISTRY, "tic_tac_toe", dataclasses.replace(base, refused_opponents={"solver": "no"}))
    assert "tic_tac_toe refuses it" in shown()


def test_a_spec_the_batched_path_cannot_play_is_refused_when_built():
    base = get_game("tic_tac_toe")
    wide = dataclasses.replace(base.rules, num_actions=12)
    with pytest.raises(ValueError,
                       match="'tic_tac_toe': text.num_actions \\(9\\) must equal rules.num_actions \\(12\\)"):
        dataclasses.replace(base, rules=wide)
    with pytest.raises(ValueError, match="rules.num_actions must be 1 .. 10"):
        dataclasses.replace(base, rules=wide, text=dataclasses.replace(base.text, num_actions=12))
    with pytest.raises(ValueError, match="at most 64 cells"):
        dataclasses.replace(base, text=dataclasses.replace(base.text, board_shape=(9, 9)))
    with pytest.raises(ValueError, match="ladder"):
        dataclasses.replace(base, ladder=())
