"""Text environments: OpenSpiel agreement, parser, opponents, invalid answers, seeding, fuzz.

Boards in this file are drawn as the compact observation prints them: X = the agent (or the
side to move in opponent tests), O = the other side, '.' empty, top row first.
"""
import random

import gymnasium
import numpy as np
import pyspiel
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import earl_jax.envs as envs
from earl_jax.envs import (
    EnvConfig,
    OpenSpielTextEnv,
    canonical_action_text,
    connect_four_search,
    make_opponent,
    observation_alphabet,
    parse_action,
)
from env_replay import drawing, history_from_drawing  # boards drawn as text, shared with the batched-env tests

GAMES = ("connect_four", "tic_tac_toe")


def random_answer(info, rng):
    return canonical_action_text(rng.choice(info["legal_actions"]))


def play_random_game(env, seed, rng):
    """Random agent through the env; returns (all moves in order, last step's outputs)."""
    obs, info = env.reset(seed=seed)
    moves = [info["opponent_action"]] if info["opponent_action"] is not None else []
    observations = [obs]
    while True:
        obs, reward, term, trunc, info = env.step(random_answer(info, rng))
        observations.append(obs)
        moves.append(info["action"])
        if info["opponent_action"] is not None:
            moves.append(info["opponent_action"])
        if term:
            return moves, reward, info, observations


# ---- OpenSpiel agreement ---------------------------------------------------------------------
@pytest.mark.parametrize("game", GAMES)
def test_random_games_match_openspiel(game):
    rng = random.Random(0)
    env = OpenSpielTextEnv(EnvConfig(game=game, opponent="random"))
    seen_winners = set()
    for seed in range(60):
        moves, reward, info, _ = play_random_game(env, seed, rng)
        state = pyspiel.load_game(game).new_initial_state()
        for a in moves:
            state.apply_action(a)
        assert state.is_terminal()
        ret = state.returns()[info["agent_player"]]
        expected = {1.0: ("agent", 1.0), -1.0: ("opponent", -1.0), 0.0: ("draw", 0.0)}[ret]
        assert (info["winner"], reward) == expected
        seen_winners.add(info["winner"])
        # The env's board is OpenSpiel's board seen from the agent's side.
        me = "x" if info["agent_player"] == 0 else "o"
        raw = str(state).replace("\n", "")
        want = np.array([0 if c == "." else (1 if c == me else -1) for c in raw]).reshape(info["board"].shape)
        np.testing.assert_array_equal(info["board"], want)
    assert seen_winners >= {"agent", "opponent"}


# ---- parser -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, move",
    [
        ("3", 3),
        ("[3]", 3),
        ("column 3", 3),
        ("3\n", 3),
        (" 3 because the centre is strong", 3),
        ("I play 3", 3),
        ("I play 3.", 3),
        ("x3", 3),  # OpenSpiel's own action string
        ("03", 3),
        ("3 or 4", 3),  # first number wins: documented rule
        ("4, not 3", 4),
        ("move-3", 3),  # '-' after a letter is a hyphen, not a sign
        ("> 6\n> 1", 6),
        ("12", 12),  # a number; the env decides it is illegal
        ("-3", None),  # negative: not a move
        ("3.5", None),  # fractional: not a move
        ("three", None),
        ("", None),
        ("   \n", None),
        ("٣", None),  # non-ASCII digits are not numbers here
        ("１", None),  # full-width digit
        ("9" * 5000, None),  # too long for int() and for any game
        (None, None),
        (b"3", None),
    ],
)
def test_parse_action_table(text, move):
    assert parse_action(text) == move


@pytest.mark.parametrize("game", [*GAMES, "breakthrough(rows=6,columns=6)"])
def test_every_canonical_action_text_parses_to_its_move(game):
    g = pyspiel.load_game(game)
    for a in range(g.num_distinct_actions()):
        text = canonical_action_text(a)
        assert parse_action(text) == a
        assert parse_action(f"I play {text}.\n") == a


@pytest.mark.parametrize("game", GAMES)
def test_every_legal_move_text_plays_that_move(game):
    for a in range(envs.game_text(pyspiel.load_game(game)).num_actions):
        env = OpenSpielTextEnv(EnvConfig(game=game, agent_player=0))
        _, info = env.reset(seed=0)
        _, _, _, _, info = env.step(env.canonical_action_text(a))
        assert info["action"] == a and not info["invalid"]
        assert info["board"].flatten().tolist().count(1) == 1


# Each row: position (X = agent, to move), answer, the move it plays (None: invalid -> forfeit).
C4_ANSWERS = [
    (
        """
        ...O...
        ...X...
        ...O...
        ...X...
        ...O...
        ..XXO..
        """,
        "column 3",
        None,  # column 3 is full
    ),
    (
        """
        ...O...
        ...X...
        ...O...
        ...X...
        ...O...
        ..XXO..
        """,
        "[2]",
        2,
    ),
    (
        """
        .......
        .......
        .......
        .......
        .......
        ...XO..
        """,
        "7",
        None,  # no column 7
    ),
    (
        """
        .......
        .......
        .......
        .......
        .......
        ...XO..
        """,
        "I play 6 then 0",
        6,
    ),
]


@pytest.mark.parametrize("board, answer, move", C4_ANSWERS)
def test_connect_four_answers_on_drawn_boards(board, answer, move):
    env = OpenSpielTextEnv(EnvConfig.connect_four(agent_player=0))
    obs, info = env.reset(seed=0, options={"history": history_from_drawing("connect_four", board)})
    assert obs == "\n".join(drawing(board)) + "\nmoves: " + " ".join(map(str, info["legal_actions"])) + "\n> "
    obs, reward, term, _, info = env.step(answer)
    assert info["action"] == move
    if move is None:
        assert info["invalid"] and term and reward == -1.0 and info["winner"] == "opponent"
        assert obs == "invalid move\nresult: loss\n"
    else:
        assert not info["invalid"] and info["board"].sum() == 0  # one X and one O more


def test_tic_tac_toe_occupied_cell_is_invalid():
    board = """
        X..
        .O.
        ...
    """
    env = OpenSpielTextEnv(EnvConfig.tic_tac_toe(agent_player=0))
    obs, _ = env.reset(seed=0, options={"history": history_from_drawing("tic_tac_toe", board)})
    assert obs == "X..\n.O.\n...\nmoves: 1 2 3 5 6 7 8\n> "
    _, reward, term, _, info = env.step("4")
    assert term and info["invalid"] and reward == -1.0 and info["legal_actions"] == []


# ---- invalid answers, retries, rewards ----------------------------------------------------------
def test_invalid_answer_custom_penalty_ends_game():
    env = OpenSpielTextEnv(EnvConfig.connect_four(invalid_reward=-3.0, agent_player=0))
    env.reset(seed=0)
    obs, reward, term, trunc, info = env.step("no idea")
    assert (reward, term, trunc, info["invalid"], info["winner"]) == (-3.0, True, False, True, "opponent")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("3")


def test_retries_then_penalty():
    env = OpenSpielTextEnv(EnvConfig.tic_tac_toe(max_retries=2, agent_player=0, retry_reward=-0.1))
    env.reset(seed=0)
    moves_line = "moves: 0 1 2 3 4 5 6 7 8\n> "
    for left in (1, 0):
        obs, reward, term, _, info = env.step("nine")
        assert obs == "invalid move\n" + moves_line
        assert (reward, term, info["invalid"], info["retries_left"], info["turn"]) == (-0.1, False, True, left, 0)
    obs, reward, term, _, info = env.step("9")
    assert (obs, reward, term, info["winner"]) == ("invalid move\nresult: loss\n", -1.0, True, "opponent")


def test_valid_move_restores_retries():
    env = OpenSpielTextEnv(EnvConfig.connect_four(max_retries=1, agent_player=0))
    env.reset(seed=0)
    assert env.step("x")[4]["retries_left"] == 0
    _, _, term, _, info = env.step("3")
    assert not term and info["retries_left"] == 1 and info["turn"] == 1
    assert not env.step("?")[2]  # a retry again, not the forfeit


def test_custom_win_loss_draw_rewards():
    cfg = EnvConfig.tic_tac_toe(win_reward=2.0, loss_reward=-5.0, draw_reward=0.5)
    env = OpenSpielTextEnv(cfg)
    rng = random.Random(1)
    rewards = {}
    for seed in range(40):
        _, reward, info, _ = play_random_game(env, seed, rng)
        rewards[info["winner"]] = reward
    assert rewards == {"agent": 2.0, "opponent": -5.0, "draw": 0.5}


# ---- who moves first ----------------------------------------------------------------------------
def test_agent_second_sees_opponent_move_first():
    env = OpenSpielTextEnv(EnvConfig.connect_four(agent_player=1))
    obs, info = env.reset(seed=3)
    a = info["opponent_action"]
    assert isinstance(a, int) and info["agent_player"] == 1 and info["turn"] == 0
    row = "." * a + "O" + "." * (6 - a)
    assert obs == f"opp {a}\n" + ".......\n" * 5 + row + "\nmoves: 0 1 2 3 4 5 6\n> "
    assert info["board"].sum() == -1 and info["board"][5, a] == -1


def test_agent_second_chat_style_names_the_opening_move():
    env = OpenSpielTextEnv(EnvConfig.tic_tac_toe(agent_player=1, prompt_style="chat"))
    obs, info = env.reset(seed=0)
    assert obs.startswith("We play Tic-Tac-Toe")
    assert f"Your opponent played cell {info['opponent_action']}." in obs
    assert obs.endswith("Answer with the cell number.\n")


def test_random_agent_player_follows_the_seed():
    env = OpenSpielTextEnv(EnvConfig.connect_four())
    players = [env.reset(seed=s)[1]["agent_player"] for s in range(20)]
    assert set(players) == {0, 1}
    assert players == [env.reset(seed=s)[1]["agent_player"] for s in range(20)]


# ---- seeding --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "game, opponent", [("connect_four", "random"), ("connect_four", "alphabeta:3"), ("tic_tac_toe", "mcts:25")]
)
def test_same_seed_same_game(game, opponent):
    def transcript(seed):
        env = OpenSpielTextEnv(EnvConfig(game=game, opponent=opponent))
        return play_random_game(env, seed, random.Random(7))[3]

    assert transcript(11) == transcript(11)
    assert any(transcript(11) != transcript(s) for s in (12, 13, 14))


# ---- opponents ------------------------------------------------------------------------------------
def c4_state(board: str) -> pyspiel.State:
    state = pyspiel.load_game("connect_four").new_initial_state()
    for a in history_from_drawing("connect_four", board):
        state.apply_action(a)
    return state


@pytest.mark.parametrize("depth", [1, 2, 4, 5])
def test_alphabeta_takes_immediate_win(depth):
    # X to move wins with column 3 (bottom row); O would win there too, one row up.
    state = c4_state(
        """
        .......
        .......
        .......
        .......
        OOO....
        XXX....
        """
    )
    for seed in range(5):
        assert make_opponent(f"alphabeta:{depth}", state.get_game(), seed).act(state) == 3


@pytest.mark.parametrize("depth", [1, 2, 4, 5])
def test_alphabeta_blocks_immediate_loss(depth):
    # X to move; O threatens the bottom of column 3. X has no win of its own.
    state = c4_state(
        """
        .......
        .......
        .......
        .......
        X......
        OOO.XX.
        """
    )
    for seed in range(5):
        assert make_opponent(f"alphabeta:{depth}", state.get_game(), seed).act(state) == 3


def test_alphabeta_move_is_fast():
    import time

    state = c4_state(
        """
        .......
        .......
        ...O...
        ..XX...
        ..OXO..
        .XOXO..
        """
    )
    t = time.perf_counter()
    connect_four_search.best_moves(state.history(), 5)
    assert time.perf_counter() - t < 0.5  # typically ~10 ms; generous for loaded CI machines


def test_tic_tac_toe_solver_wins_and_blocks():
    g = pyspiel.load_game("tic_tac_toe")

    def solver_move(board, first="X"):
        state = g.new_initial_state()
        for a in history_from_drawing("tic_tac_toe", board, first=first):
            state.apply_action(a)
        return make_opponent("solver", g).act(state)

    # X to move (X moved first): complete the top row.
    assert solver_move("XX.\nOO.\n...") == 2
    # X to move: O threatens the diagonal 0-4-8.
    assert solver_move("OX.\n.O.\nX..") == 8


@pytest.mark.parametrize("agent_player", [0, 1])
def test_solver_never_loses_tic_tac_toe_to_random(agent_player):
    env = OpenSpielTextEnv(EnvConfig.tic_tac_toe(opponent="solver", agent_player=agent_player))
    rng = random.Random(agent_player)
    winners = [play_random_game(env, seed, rng)[2]["winner"] for seed in range(150)]
    assert "agent" not in winners and "opponent" in winners


def test_mcts_opponent_beats_random_mostly():
    env = OpenSpielTextEnv(EnvConfig.tic_tac_toe(opponent="mcts:100", agent_player=0))
    rng = random.Random(0)
    winners = [play_random_game(env, seed, rng)[2]["winner"] for seed in range(20)]
    assert winners.count("agent") <= 4


@pytest.mark.parametrize(
    "spec, game, message",
    [
        ("minimax", "tic_tac_toe", "'minimax'"),
        ("mcts:lots", "tic_tac_toe", "'mcts:lots'"),
        ("mcts:0", "connect_four", "'mcts:0'"),
        ("random:3", "connect_four", "'random:3'"),
        ("alphabeta:4", "tic_tac_toe", "'alphabeta:4'"),
        ("solver:0", "connect_four", "'solver:0'"),
        (None, "connect_four", "None"),
    ],
)
def test_bad_opponent_spec_names_it(spec, game, message):
    with pytest.raises(ValueError, match=message):
        OpenSpielTextEnv(EnvConfig(game=game, opponent=spec))


# ---- gymnasium, batches, generic games -----------------------------------------------------------------
@pytest.mark.parametrize(
    "env_id, kwargs",
    [
        ("earl_jax/ConnectFour-v0", {"opponent": "alphabeta:2"}),
        ("earl_jax/TicTacToe-v0", {"opponent": "solver", "agent_player": 1}),
        ("earl_jax/OpenSpiel-v0", {"game": "breakthrough(rows=5,columns=5)", "prompt_style": "chat"}),
    ],
)
def test_gymnasium_make(env_id, kwargs):
    env = gymnasium.make(env_id, **kwargs)
    obs, info = env.reset(seed=0)
    assert isinstance(obs, str) and info["legal_actions"]
    obs, reward, term, trunc, info = env.step(canonical_action_text(info["legal_actions"][0]))
    assert isinstance(obs, str) and isinstance(reward, float) and not info["invalid"]
    assert env.unwrapped.config.opponent == kwargs.get("opponent", "random")


def test_generic_game_with_chance_nodes_plays_to_the_end():
    env = gymnasium.make("earl_jax/OpenSpiel-v0", game="kuhn_poker", agent_player=0)
    rng = random.Random(0)
    winners = set()
    for seed in range(30):
        winners.add(play_random_game(env, seed, rng)[2]["winner"])
    assert winners == {"agent", "opponent"}


# ---- text: alphabet and length ----------------------------------------------------------------------
@pytest.mark.parametrize("game", GAMES)
@pytest.mark.parametrize("style", ["compact", "chat", "labeled"])
def test_observations_stay_in_the_alphabet(game, style):
    alphabet = set(observation_alphabet(game, style))
    env = OpenSpielTextEnv(EnvConfig(game=game, prompt_style=style, max_retries=1))
    rng = random.Random(0)
    longest = 0
    for seed in range(30):
        obs, info = env.reset(seed=seed)
        texts = [obs]
        term = False
        while not term:
            answer = "??" if rng.random() < 0.1 else random_answer(info, rng)
            obs, _, term, _, info = env.step(answer)
            texts.append(obs)
        for t in texts:
            assert set(t) <= alphabet, set(t) - alphabet
        longest = max(longest, max(map(len, texts[1:])))
    if style in ("compact", "labeled"):
        assert longest <= {"connect_four": 80, "tic_tac_toe": 48}[game]


def test_compact_alphabet_is_small_and_fixed():
    assert observation_alphabet("connect_four") == "\n .0123456789:>OXadeilmnoprstuvw" == envs.COMPACT_ALPHABET
    assert observation_alphabet("tic_tac_toe") == observation_alphabet("connect_four")
    with pytest.raises(ValueError, match="preset"):
        observation_alphabet("breakthrough")


MIDGAME = """
    .......
    .......
    .......
    ...O...
    ..XXO..
    .OXXO..
"""


def test_render_board_matches_the_drawing():
    board = MIDGAME
    state = c4_state(board)
    assert envs.render_board(state, agent_player=0) == "\n".join(drawing(board))
    swapped = "\n".join(drawing(board)).translate(str.maketrans("XO", "OX"))
    assert envs.render_board(state, agent_player=1) == swapped
    assert envs.render_board(state, 0, "chat").splitlines()[-2:] == [". O X X O . .", "0 1 2 3 4 5 6"]


def test_labeled_style_writes_each_legal_move_where_it_lands():
    state = c4_state(MIDGAME)
    labeled = envs.render_board(state, 0, "labeled").split("\n")
    assert labeled == [".......", ".......", "...3...", "..2O4..", ".1XXO..", "0OXXO56"]
    # every label is a legal move and every legal move is labeled once
    digits = [ch for ch in "".join(labeled) if ch.isdigit()]
    assert sorted(map(int, digits)) == sorted(state.legal_actions())
    ttt = pyspiel.load_game("tic_tac_toe").new_initial_state()
    for a in (4, 0, 8):
        ttt.apply_action(a)
    assert envs.render_board(ttt, 0, "labeled") == "O12\n3X5\n67X"
    assert envs.render_board(ttt, 1, "labeled") == "X12\n3O5\n67O"
    env = OpenSpielTextEnv(EnvConfig.tic_tac_toe(prompt_style="labeled", agent_player=0))
    obs, _ = env.reset(seed=0)
    assert obs.startswith("012\n345\n678\nmoves: 0 1 2 3 4 5 6 7 8\n> "), obs


def test_final_observation_shows_result():
    # X (agent, to move) wins with column 3.
    board = """
        .......
        .......
        .......
        .......
        OOO....
        XXX....
    """
    env = OpenSpielTextEnv(EnvConfig.connect_four(agent_player=0))
    env.reset(seed=0, options={"history": history_from_drawing("connect_four", board)})
    obs, reward, term, _, info = env.step("3")
    assert obs == ".......\n" * 4 + "OOO....\nXXXX...\nresult: win\n"
    assert (reward, term, info["winner"], info["opponent_action"]) == (1.0, True, "agent", None)


# ---- fuzz ------------------------------------------------------------------------------------------------
_FUZZ_ENVS = {g: OpenSpielTextEnv(EnvConfig(game=g, max_retries=1)) for g in GAMES}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    game=st.sampled_from(GAMES),
    seed=st.integers(0, 2**32 - 1),
    answers=st.lists(
        st.one_of(
            st.text(),
            st.text(alphabet="0123456789 -.[]x\n", max_size=12),
            st.integers(-10, 20).map(str),
            st.sampled_from(["", "\x00", "9" * 10_000, "a" * 200_000 + "3", "\U0001f600 4", "3" * 7]),
        ),
        max_size=12,
    ),
)
def test_step_never_crashes(game, seed, answers):
    env = _FUZZ_ENVS[game]
    _, info = env.reset(seed=seed)
    for answer in answers:
        obs, reward, term, trunc, info = env.step(answer)
        assert isinstance(obs, str) and isinstance(reward, float) and trunc is False
        move = parse_action(answer)
        assert info["invalid"] == (move is None or info["action"] != move)
        if term:
            assert info["winner"] in ("agent", "opponent", "draw") and info["legal_actions"] == []
            break
        assert info["legal_actions"] and obs.endswith("> ")


def _full_minimax(me, opp, depth, ply):
    """connect_four_search._negamax without pruning: the reference for the pruned search."""
    cs = connect_four_search
    mask = me | opp
    moves = [(mask + cs.BOTTOM[c]) & cs.COLUMN[c] for c in cs.ORDER if not mask & cs.TOP[c]]
    if not moves:
        return 0
    if any(cs.is_win(me | bit) for bit in moves):
        return cs.WIN - ply - 1
    if depth == 0:
        return cs.evaluate(me, opp)
    return max(-_full_minimax(opp, me | bit, depth - 1, ply + 1) for bit in moves)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_alphabeta_agrees_with_unpruned_minimax(depth):
    cs = connect_four_search
    rng = random.Random(depth)
    g = pyspiel.load_game("connect_four")
    for _ in range(12):
        state = g.new_initial_state()
        for _ in range(rng.randrange(0, 16)):
            if state.is_terminal():
                break
            state.apply_action(rng.choice(state.legal_actions()))
        if state.is_terminal():
            continue
        history = state.history()
        p0, p1 = cs.bitboards_from_history(history)
        me, opp = (p0, p1) if len(history) % 2 == 0 else (p1, p0)
        mask = me | opp
        scores = {}
        for c in state.legal_actions():
            bit = (mask + cs.BOTTOM[c]) & cs.COLUMN[c]
            scores[c] = cs.WIN - 1 if cs.is_win(me | bit) else -_full_minimax(opp, me | bit, depth - 1, 1)
        best = max(scores.values())
        moves, score = cs.best_moves(history, depth)
        if best == cs.WIN - 1:  # an immediate win is returned alone
            assert score == best and scores[moves[0]] == best
        else:
            assert (moves, score) == (sorted(c for c, v in scores.items() if v == best), best)


def test_alphabeta_beats_random():
    env = OpenSpielTextEnv(EnvConfig.connect_four(opponent="alphabeta:3"))
    rng = random.Random(0)
    winners = [play_random_game(env, seed, rng)[2]["winner"] for seed in range(20)]
    assert winners.count("opponent") >= 19


@pytest.mark.parametrize(
    "override", [{"prompt_style": "verbose"}, {"agent_player": 2}, {"max_retries": -1}, {"game": "matrix_rps"}]
)
def test_bad_config_is_rejected(override):
    with pytest.raises(ValueError):
        OpenSpielTextEnv(EnvConfig(**override))


def test_minimal_style_shows_the_board_once_then_only_replies():
    from earl_jax.envs import EnvConfig, OpenSpielTextEnv

    env = OpenSpielTextEnv(EnvConfig.connect_four(prompt_style="minimal", agent_player=0))
    first, _ = env.reset(seed=0)
    assert first.endswith("moves: 0 1 2 3 4 5 6\n> ") and "......." in first
    obs, *_ = env.step("3")
    assert obs.startswith("opp ") and obs.endswith("\n> ") and obs.count("\n") == 1
    done = False
    while not done:  # stack column 0: the game ends with a full board shown and a result line
        obs, _, done, _, info = env.step("0")
    assert "result:" in obs or "invalid" in obs


def test_minimal_style_lists_the_legal_moves_after_an_invalid_answer():
    from earl_jax.envs import EnvConfig, OpenSpielTextEnv

    env = OpenSpielTextEnv(EnvConfig.connect_four(prompt_style="minimal", agent_player=0, max_retries=2))
    env.reset(seed=0)
    obs, *_ = env.step("9")  # no such column: a retry, with the moves to choose from
    assert obs == "invalid move\nmoves: 0 1 2 3 4 5 6\n> "
    for seed in range(100):  # a game where column 0 fills up (the random opponent plays there too) before it ends
        env.reset(seed=seed)
        done = False
        while not done and 0 in env.state.legal_actions():
            _, _, done, _, _ = env.step("0")
        if not done:
            obs, *_ = env.step("0")  # the full column
            assert obs.startswith("invalid move\nmoves: ") and "0" not in obs.split("moves:")[1], obs
            return
    pytest.fail("no seed filled column 0 before the game ended")


def test_importing_earl_jax_alone_registers_the_gymnasium_ids():
    """`import earl_jax` (not earl_jax.envs) is enough for gymnasium.make, and loads no OpenSpiel until then."""
    import subprocess
    import sys

    code = ("import sys, gymnasium, earl_jax; assert 'pyspiel' not in sys.modules; "
            "env = gymnasium.make('earl_jax/ConnectFour-v0', opponent='random'); "
            "obs, info = env.reset(seed=0); assert info['legal_actions'] and obs.endswith('> '); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-1500:]
