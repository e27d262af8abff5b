"""Vector envs (earl_jax/envs/vector) against the per-game reference, OpenSpielTextEnv.

Boards are drawn as the compact observation prints them, top row first: X = player 0 (moves first),
O = player 1, '.' empty, unless a test says X is the agent.
"""
import itertools
import json
import random

import numpy as np
import pyspiel
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from earl_jax.envs import (
    PROMPT_STYLES,
    EnvConfig,
    OpenSpielTextEnv,
    connect_four_search,
    parse_action,
)
from earl_jax.envs.games import connect_four as c4, tic_tac_toe as ttt
from earl_jax.envs.opponents import _solve, _solver_memo
from earl_jax.envs.vector import (
    ObservationCodec,
    PerGameVectorEnv,
    VectorTextEnv,
    make_vector_env,
    parse_actions,
)
from earl_jax.envs.vector.batched_opponents import StreamBank
from earl_jax.envs.vector.batched_parser import MoveCache
from earl_jax.models.tokenizer import game_tokenizer
from env_replay import (
    _CODEC,
    _TOK,
    assert_same_info,
    assert_same_step,
    drawing,
    history_from_drawing,
    mixed_answer,
    replay,
    stones_from_drawing,
)

OPPONENTS = {"connect_four": ("random", "alphabeta:1", "alphabeta:2"), "tic_tac_toe": ("random", "solver")}


# ---- OpenSpiel agreement: thousands of games ---------------------------------------------------------
CONFIGS = [
    (game, opponent, style, agent, retries)
    for game in ("connect_four", "tic_tac_toe")
    for opponent in OPPONENTS[game]
    for style in PROMPT_STYLES
    for agent in (0, 1, None)
    for retries in (0, 2)
]


@pytest.mark.parametrize("game, opponent, style, agent, retries", CONFIGS)
def test_vector_env_replays_the_reference(game, opponent, style, agent, retries):
    cfg = EnvConfig(game=game, opponent=opponent, prompt_style=style, agent_player=agent, max_retries=retries,
                    retry_reward=-0.25, invalid_reward=-2.0, win_reward=1.5, draw_reward=0.5)
    seen = replay(cfg, 20, seed=CONFIGS.index((game, opponent, style, agent, retries)))
    assert seen["games"] >= 25 and seen["invalid"] > 0 and seen["from_bytes"] > 0
    assert seen["retries"] > 0 or retries == 0
    assert "opponent" in seen["winners"]


@pytest.mark.parametrize("game, first, second", [("connect_four", "random", "alphabeta:2"),
                                                  ("tic_tac_toe", "random", "solver"),
                                                  ("tic_tac_toe", "solver", "random")])
def test_a_batch_mixing_two_opponents_replays_each_games_reference(game, first, second):
    cfg = EnvConfig(game=game, opponent=first, prompt_style="compact", agent_player=None, max_retries=1)
    games = np.arange(24) >= 12  # the last half: whole groups, as the trainer assigns them
    seen = replay(cfg, 24, seed=7, second=(second, games))
    assert seen["games"] >= 30 and "opponent" in seen["winners"]
    env = make_vector_env(cfg, 4)
    with pytest.raises(ValueError, match="mcts:0|opponent"):
        env.assign_opponent("mcts:0", [1])
    with pytest.raises(ValueError):
        env.assign_opponent("alphabeta:2" if game == "tic_tac_toe" else "minimax:2", [1])  # not this game's
    env.assign_opponent(second, [1])
    env.assign_opponent(None)
    assert not env.second_opponent_games.any()


def test_replays_cover_every_outcome():
    # The per-config test checks every output; this checks the games reach each ending at all.
    winners = set()
    for game in ("connect_four", "tic_tac_toe"):
        winners |= replay(EnvConfig(game=game, max_retries=1), 40, seed=99)["winners"]
    assert winners == {"agent", "opponent", "draw"}


_FUZZ = {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    game=st.sampled_from(["connect_four", "tic_tac_toe"]),
    retries=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**32 - 1),
    answers=st.lists(
        st.lists(
            st.one_of(
                st.text(max_size=20),
                st.text(alphabet="0123456789 -.[]xX\n", max_size=10),
                st.integers(-3, 12).map(str),
                st.sampled_from(["", "\x00", "9" * 100, "a" * 500 + "3", "\U0001f600 4", "3" * 7, "<eos>4"]),
            ),
            min_size=3, max_size=3,
        ),
        max_size=10,
    ),
)
def test_fuzzed_answers_match_the_reference(game, retries, seed, answers):
    key = (game, retries)
    if key not in _FUZZ:
        cfg = EnvConfig(game=game, max_retries=retries)
        _FUZZ[key] = (VectorTextEnv(cfg, 3), [OpenSpielTextEnv(cfg) for _ in range(3)])
    env, refs = _FUZZ[key]
    seeds = [seed, seed ^ 1, seed // 2]
    first = env.reset(seeds)
    for k, (ref, s) in enumerate(zip(refs, seeds)):
        obs, info = ref.reset(seed=s)
        assert first.obs[k] == obs
        assert_same_info(info, first.infos()[k])
    for turn in answers:
        rows = np.flatnonzero(env.live)
        if not len(rows):
            break
        step = env.step(rows, [turn[i] for i in rows])
        for k, i in enumerate(rows.tolist()):
            assert_same_step(step, k, refs[i].step(turn[i]), step.infos()[k])


def test_seed_none_continues_each_games_stream_like_gymnasium():
    cfg = EnvConfig.connect_four()  # agent_player drawn from the stream too
    env, refs = VectorTextEnv(cfg, 3), [OpenSpielTextEnv(cfg) for _ in range(3)]
    for seeds in ([5, 6, 7], [None, None, 8], [None, 9, None], [None, None, None]):
        step = env.reset(seeds)
        for k, (ref, s) in enumerate(zip(refs, seeds)):
            obs, info = ref.reset(seed=s)
            assert step.obs[k] == obs and step.infos()[k]["agent_player"] == info["agent_player"]
            _, _, _, _, info = ref.step("3")
            assert_same_info(info, env.step([k], ["3"]).infos()[0])


# ---- rules on drawn boards -------------------------------------------------------------------------------
C4_BOARDS = [  # (what, board, X has four, O has four)
    ("horizontal, bottom row", """
        .......
        .......
        .......
        .......
        OOO....
        ...XXXX
    """, True, False),
    ("vertical, right column", """
        ......O
        ......O
        ......O
        .X....O
        XX....X
        XX....X
    """, False, True),
    ("diagonal up to the right", """
        .......
        .......
        ......X
        .....XO
        ....XOO
        ...XOOO
    """, True, False),
    ("diagonal down to the right", """
        .......
        .......
        O......
        XO.....
        XXO....
        XXXO...
    """, False, True),
    ("three in a row is not four", """
        .......
        .......
        .......
        X......
        X......
        X.OOO..
    """, False, False),
    ("no wrap from the top of one column to the bottom of the next", """
        XX.....
        XX.....
        O......
        O......
        OX.....
        OX.....
    """, False, True),
    ("broken line", """
        .......
        .......
        .......
        .......
        .......
        XXX.XXX
    """, False, False),
]


@pytest.mark.parametrize("what, board, x_wins, o_wins", C4_BOARDS, ids=[b[0] for b in C4_BOARDS])
def test_connect_four_win_detection(what, board, x_wins, o_wins):
    stones = stones_from_drawing("connect_four", board)
    assert c4.is_win(stones[:, 0]).tolist() == [x_wins] and c4.is_win(stones[:, 1]).tolist() == [o_wins]
    for p, wins in ((0, x_wins), (1, o_wins)):  # the per-game search's test agrees
        assert connect_four_search.is_win(int(stones[0, p])) == wins


def test_connect_four_full_board_without_four_is_a_draw():
    board = """
        XXOOXXO
        OOXXOOX
        XXOOXXO
        OOXXOOX
        XXOOXXO
        OOXXOOX
    """
    stones = stones_from_drawing("connect_four", board)
    assert c4.is_full(stones).tolist() == [True] and not c4.legal_mask(stones).any()
    assert not c4.is_win(stones[:, 0])[0] and not c4.is_win(stones[:, 1])[0]


TTT_BOARDS = [
    ("row", "...\nXXX\nOO.", True, False),
    ("column", "OX.\nOX.\nO.X", False, True),
    ("diagonal", "XO.\nOX.\n..X", True, False),
    ("anti-diagonal", "XXO\nXO.\nO..", False, True),
    ("full board, no line: a draw", "XOX\nXOO\nOXX", False, False),
]


@pytest.mark.parametrize("what, board, x_wins, o_wins", TTT_BOARDS, ids=[b[0] for b in TTT_BOARDS])
def test_tic_tac_toe_win_detection(what, board, x_wins, o_wins):
    stones = stones_from_drawing("tic_tac_toe", board)
    assert ttt.is_win(stones[:, 0]).tolist() == [x_wins] and ttt.is_win(stones[:, 1]).tolist() == [o_wins]
    assert ttt.is_full(stones)[0] == (board.count(".") == 0)


# ---- opponents ------------------------------------------------------------------------------------------------
def random_positions(count: int, seed: int, max_moves: int = 30) -> list[list[int]]:
    rng, g, out = random.Random(seed), pyspiel.load_game("connect_four"), []
    while len(out) < count:
        state = g.new_initial_state()
        for _ in range(rng.randrange(0, max_moves)):
            if state.is_terminal():
                break
            state.apply_action(rng.choice(state.legal_actions()))
        if not state.is_terminal():
            out.append(state.history())
    return out


@pytest.mark.parametrize("depth, chunked", [(1, False), (2, False), (2, True), (3, False)])
def test_batched_alphabeta_finds_the_reference_best_moves(depth, chunked, monkeypatch):
    if chunked:  # a slice of 7 positions at a time, as deep searches of big batches go
        monkeypatch.setattr(c4, "MAX_LEAVES", 7 * 7**depth)
    histories = random_positions(150 if depth < 3 else 40, seed=depth)
    sides = [connect_four_search.bitboards_from_history(h) for h in histories]
    me = np.array([s[len(h) % 2] for s, h in zip(sides, histories)], np.uint64)
    opp = np.array([s[1 - len(h) % 2] for s, h in zip(sides, histories)], np.uint64)
    best, score = c4.best_moves(me, opp, depth)
    immediate_wins = 0
    for k, h in enumerate(histories):
        moves, want = connect_four_search.best_moves(h, depth)
        assert (np.flatnonzero(best[k]).tolist(), int(score[k])) == (moves, want), h
        immediate_wins += want == connect_four_search.WIN - 1
    assert 0 < immediate_wins < len(histories)  # both branches of the search were compared


def test_batched_alphabeta_takes_the_first_immediate_win_in_search_order():
    # X to move wins in column 0 or column 4; the reference returns only the first in ORDER (3, 2, 4, ...).
    stones = stones_from_drawing("connect_four", """
        .......
        .......
        .......
        X...X..
        X...X..
        XOOOXOO
    """)
    best, score = c4.best_moves(stones[:, 0], stones[:, 1], 2)
    assert np.flatnonzero(best[0]).tolist() == [4] and score[0] == connect_four_search.WIN - 1


def test_solver_table_is_the_solver_on_every_reachable_position():
    g = pyspiel.load_game("tic_tac_toe")
    memo, seen = _solver_memo(str(g)), {}

    def walk(state):
        key = str(state)
        if key in seen or state.is_terminal():
            return
        player = state.current_player()
        scored = [(_solve(state.child(a), memo)[player], a) for a in state.legal_actions()]
        best = max(v for v, _ in scored)
        seen[key] = sum(1 << a for v, a in scored if v >= best - 1e-9)
        for a in state.legal_actions():
            walk(state.child(a))

    walk(g.new_initial_state())
    assert len(seen) == 4520  # every non-terminal position reachable in play
    boards = list(seen)
    stones = np.array([[sum(1 << k for k, c in enumerate(b.replace("\n", "")) if c == s) for s in "xo"]
                       for b in boards], np.uint64)
    assert ttt.solver_best_moves(stones).tolist() == [seen[b] for b in boards]


def test_stream_bank_draws_what_random_randrange_draws():
    seeds = [0, 3, 3, 2**31 - 1, 123456]
    bank, refs = StreamBank(len(seeds)), [random.Random(s) for s in seeds]
    bank.reset(range(len(seeds)), seeds)
    rng = np.random.default_rng(0)
    for _ in range(300):  # far past the first buffered block of every stream
        rows = np.flatnonzero(rng.random(len(seeds)) < 0.8)
        n = rng.integers(1, 10, len(rows))
        n[rng.random(len(rows)) < 0.1] = 1_000_003  # rejections of a 20-bit draw, too
        assert bank.randbelow(rows, n).tolist() == [refs[i].randrange(int(k)) for i, k in zip(rows, n)]
    assert (bank.blocks > 2).all()


# ---- histories: starting from a drawn position -------------------------------------------------------------
def test_vector_env_plays_from_a_drawn_position_like_the_reference():
    # X (the agent, to move) completes the diagonal in column 3: its final observation shows the board.
    board = """
        .......
        .......
        .......
        ..XO...
        .XOO...
        XOOX..X
    """
    cfg = EnvConfig.connect_four(agent_player=0)
    history = history_from_drawing("connect_four", board)
    env, ref = VectorTextEnv(cfg, 2), OpenSpielTextEnv(cfg)
    first = env.reset([0, 0], histories=[history, []])
    obs, info = ref.reset(seed=0, options={"history": history})
    assert first.obs[0] == obs == "\n".join(drawing(board)) + "\nmoves: 0 1 2 3 4 5 6\n> "
    step = env.step([0], ["3"])
    want = ref.step("3")
    assert_same_step(step, 0, want, step.infos()[0])
    assert step.obs[0] == ".......\n.......\n...X...\n..XO...\n.XOO...\nXOOX..X\nresult: win\n"
    assert step.winners == ["agent"] and step.reward.tolist() == [1.0]
    before = env.stones.copy(), env.live.copy()
    with pytest.raises(ValueError, match="not legal"):
        env.reset([0], rows=[1], histories=[[3] * 7])  # column 3 holds six
    with pytest.raises(ValueError, match="seeds"):
        env.reset([-1], rows=[1])
    assert np.array_equal(env.stones, before[0]) and np.array_equal(env.live, before[1])  # nothing changed
    assert not env.step([1], ["3"]).invalid[0]  # game 1 plays on


# ---- per-game path ----------------------------------------------------------------------------------------
class ParrotEnv:
    """A user env that reads answers its own way: repeat the word it shows, twice, to win."""

    def __init__(self, cfg):
        self.word, self.left = None, 0

    def reset(self, seed=None, options=None):
        self.word, self.left = ("cat", "dog")[seed % 2], 2
        return f"say {self.word}\n> ", {}

    def step(self, text):
        if text.strip() != self.word:
            return "", -1.0, True, False, {"winner": "opponent", "invalid": True}
        self.left -= 1
        if self.left:
            return "again\n> ", 0.0, False, False, {"winner": None, "invalid": False}
        return "", 1.0, True, False, {"winner": "agent", "invalid": False}


@pytest.mark.parametrize("cfg, batched", [
    (EnvConfig.connect_four(opponent="alphabeta:3"), True),
    (EnvConfig.tic_tac_toe(opponent="solver"), True),
    (EnvConfig.tic_tac_toe(opponent="mcts:10"), False),
    (EnvConfig(game="breakthrough(rows=6,columns=6)"), False),
    (EnvConfig(game="connect_four(rows=5)"), False),  # a preset with other parameters is a generic game
])
def test_make_vector_env_picks_the_batched_path_only_where_it_exists(cfg, batched):
    env = make_vector_env(cfg, 2)
    assert isinstance(env, VectorTextEnv if batched else PerGameVectorEnv)


@pytest.mark.parametrize("cfg", [EnvConfig.tic_tac_toe(opponent="mcts:10", max_retries=1),
                                 EnvConfig(game="breakthrough(rows=6,columns=6)", prompt_style="chat")])
def test_per_game_wrapper_matches_its_envs(cfg):
    env = make_vector_env(cfg, 4)
    refs = [OpenSpielTextEnv(cfg) for _ in range(4)]
    rng = random.Random(0)
    first = env.reset([10, 11, 12, 13])
    infos = []
    for k, ref in enumerate(refs):
        obs, info = ref.reset(seed=10 + k)
        assert first.obs[k] == obs
        assert_same_info(info, first.infos()[k])
        infos.append(info)
    for _ in range(6):
        rows = np.flatnonzero(env.live)
        if not len(rows):
            break
        answers = [mixed_answer(infos[i], rng, 9) for i in rows]
        by_moves = rng.random() < 0.5  # the moves route means the same as the answer's text
        moves = parse_actions(answers)
        step = env.step(rows, moves=moves) if by_moves else env.step(rows, answers)
        for k, i in enumerate(rows.tolist()):
            want = refs[i].step(answers[k] if not by_moves else (str(moves[k]) if moves[k] >= 0 else ""))
            assert_same_step(step, k, want, step.infos()[k])
            assert step.winners[k] == want[4]["winner"] and step.invalid[k] == want[4]["invalid"]
            infos[i] = want[4]


def _mcts_games(workers: int, assigned: bool = False):
    """12 Connect Four games against mcts:8 (the env's own opponent, or assigned to half the games), the agent's
    moves drawn from one seeded stream: every step's observations, rewards and outcomes."""
    cfg = EnvConfig.connect_four(opponent="random" if assigned else "mcts:8", search_workers=workers)
    env = VectorTextEnv(cfg, 12, per_game_opponents=True)
    if assigned:
        env.assign_opponent("mcts:8", np.arange(0, 12, 2))
    rng, out = np.random.default_rng(0), []
    for round_ in range(2):  # the second round resets the kept opponents' games
        if assigned:
            env.assign_opponents([("mcts:8", np.arange(0, 12, 2)), ("alphabeta:1", [1])])
        out.append(env.reset(list(range(100 + 12 * round_, 112 + 12 * round_))).obs)
        while env.live.any():
            rows = np.flatnonzero(env.live)
            moves = np.array([rng.choice(np.flatnonzero(env.legal[r])) for r in rows])
            step = env.step(rows, moves=moves)
            out.append((rows.tolist(), step.obs, step.reward.tolist(), step.winners))
    return out, env


@pytest.mark.parametrize("assigned", [False, True])
def test_search_workers_play_the_moves_one_process_plays(assigned):
    one, _ = _mcts_games(0, assigned)
    several, env = _mcts_games(3, assigned)
    assert one == several
    opponent = env._others[0][0] if assigned else env.opponent
    assert type(opponent).__name__ == "WorkerOpponents" and opponent.workers == 3
    opponent.close()


def test_search_workers_outlive_a_stop_signal_to_the_process_group():
    """Ctrl-C and `timeout` signal the whole group: the job's graceful stop still needs its workers' moves."""
    import os
    import signal

    from earl_jax.envs.vector.per_game_opponents import WorkerOpponents

    opponent = WorkerOpponents("mcts:4", "connect_four", 4, 2)
    opponent.reset([0, 1, 2, 3], [1, 2, 3, 4])
    for proc in opponent._procs:
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGINT)
    empty = np.zeros(4, np.uint64)
    moves = opponent.act(np.arange(4), empty, empty, np.ones((4, 7), bool))
    assert all(proc.is_alive() for proc in opponent._procs) and len(moves) == 4
    opponent.close()
    assert not any(proc.is_alive() for proc in opponent._procs)


def test_a_failing_search_worker_names_itself():
    from earl_jax.envs.vector.per_game_opponents import WorkerOpponents

    opponent = WorkerOpponents("mcts:4", "connect_four", 4, 2)
    opponent.reset([0, 1, 2, 3], [1, 2, 3, 4])
    bad = np.full(4, np.uint64(2**63))  # no Connect Four position has this stone
    with pytest.raises(RuntimeError, match=r"(?s)search worker \d.*not reachable"):
        opponent.act(np.arange(4), bad, bad, np.ones((4, 7), bool))
    opponent.reset([0, 1, 2, 3], [1, 2, 3, 4])  # both workers answered: the next call reads its own replies
    opponent._procs[1].kill()
    opponent._procs[1].join()
    with pytest.raises(RuntimeError, match="search worker 1:\nthe process exited"):
        opponent.reset([0, 1], [5, 6])
    opponent.close()


def test_per_game_wrapper_over_a_user_env():
    env = make_vector_env(EnvConfig(), 3, env_factory=ParrotEnv)
    assert isinstance(env, PerGameVectorEnv) and not env.accepts_moves
    assert env.reset([0, 1, 2]).obs == ["say cat\n> ", "say dog\n> ", "say cat\n> "]
    step = env.step([0, 1, 2], ["cat", "dog\n", "3"])
    assert step.obs == ["again\n> ", "again\n> ", ""] and step.reward.tolist() == [0.0, 0.0, -1.0]
    assert step.terminated.tolist() == [False, False, True] and step.winners == [None, None, "opponent"]
    assert step.invalid.tolist() == [False, False, True] and env.live.tolist() == [True, True, False]
    step = env.step([0, 1], ["cat", "cat"])
    assert step.winners == ["agent", "opponent"] and step.reward.tolist() == [1.0, -1.0] and not env.live.any()
    env.reset([0], rows=[0])
    with pytest.raises(ValueError, match="texts"):  # its envs read text their own way: no moves route
        env.step([0], moves=np.array([7]))


# ---- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda cfg: VectorTextEnv(cfg, 3), lambda cfg: PerGameVectorEnv(
    [OpenSpielTextEnv(cfg) for _ in range(3)])])
def test_bad_calls_raise_and_leave_the_batch_as_it_was(make):
    cfg = EnvConfig.connect_four(agent_player=0)
    env, ref = make(cfg), OpenSpielTextEnv(cfg)
    with pytest.raises(RuntimeError, match="reset"):
        env.step([0], ["3"])  # never reset
    env.reset([1, 2, 3])
    bad_calls = [
        (ValueError, lambda: env.step([0, 1], ["3"])),  # wrong number of answers
        (ValueError, lambda: env.step([0], "3")),  # a string is not a list of answers
        (ValueError, lambda: env.step([0, 0], ["3", "4"])),  # one game twice
        (ValueError, lambda: env.step([3], ["3"])),  # no such game
        (ValueError, lambda: env.step([0], ["3"], moves=np.array([3]))),  # both
        (ValueError, lambda: env.step([0], moves=np.array([3.0]))),  # moves must be integers
        (ValueError, lambda: env.reset([1, 2])),  # seeds for 3 games
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            call()
    ref.reset(seed=1)
    step = env.step([0], [None])  # junk that is not even text: an invalid move, a forfeit here
    assert_same_step(step, 0, ref.step(None), step.infos()[0])
    with pytest.raises(RuntimeError, match="finished"):
        env.step([0, 1], ["3", "3"])  # game 0 is over
    assert env.live.tolist() == [False, True, True]
    step = env.step([1, 2], ["3", "3"])  # the others play on
    assert not step.invalid.any()


# ---- parser and codec ------------------------------------------------------------------------------------------
answer_text = st.one_of(
    st.text(max_size=30),
    st.text(alphabet="0123456789-.aZ \n\t\x00é", max_size=16),
    st.sampled_from(["9" * 7, "1" * 6, "a" * 70 + "5", "-" * 70 + "5", "x-3", "3.", "3.5", "٣", "<eos>3"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(answer_text, st.none(), st.just(b"3")), max_size=12))
def test_parse_actions_is_parse_action(texts):
    want = [-1 if (m := parse_action(t)) is None else m for t in texts]
    assert parse_actions(texts).tolist() == want


def test_move_cache_gives_what_it_was_given_even_when_full():
    cache, calls = MoveCache(limit=3), []

    def parse(miss):
        calls.append(len(miss))
        return parse_actions([texts[k] for k in miss])

    texts = ["3", "x4", "3", "no", "12", "3", "x4"]
    assert cache(texts, parse).tolist() == [3, 4, 3, -1, 12, 3, 4]
    assert cache(texts[:2], parse).tolist() == [3, 4] and len(cache.moves) <= 3
    assert calls[0] == 7  # misses are read in one batch, repeats included


def observations_of_every_kind():
    """Observations of both games in all styles: turns, retries, forfeits, results, first prompts."""
    out = []
    rng = random.Random(3)
    for game, style in itertools.product(("connect_four", "tic_tac_toe"), PROMPT_STYLES):
        env = OpenSpielTextEnv(EnvConfig(game=game, prompt_style=style, max_retries=1))
        for seed in range(6):
            obs, info = env.reset(seed=seed)
            out.append(obs)
            done = False
            while not done:
                obs, _, done, _, info = env.step(mixed_answer(info, rng, env.num_actions))
                out.append(obs)
    return out


def test_codec_encodes_every_observation_as_the_tokenizer_does():
    tok = game_tokenizer()
    codec = ObservationCodec(tok)
    assert codec.fast
    texts = observations_of_every_kind() + ["", "<eos>3", "é\n", "tab\tand ~", "\x00"]
    want = [tok.encode(t).ids for t in texts]
    assert codec.encode(texts) == want
    ids, lengths = codec.encode_padded(texts, pad_id=0)
    assert [row[:n].tolist() for row, n in zip(ids, lengths)] == want and ids.shape[1] == max(map(len, want))
    assert codec.encode(texts[:40]) == want[:40]  # the all-fast branch, too


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(-2, 110), max_size=6), max_size=8))
def test_codec_reads_answer_ids_as_the_tokenizer_and_parser_do(ids):
    tok, codec = _TOK, _CODEC  # ids past the vocabulary (101..110) included: the tokenizer decodes them to ""
    ids = [row for row in ids if min(row, default=0) >= 0]  # negative ids: the tokenizer refuses them
    texts = [tok.decode(row, skip_special_tokens=True) for row in ids]
    assert codec.decode(ids) == texts
    want = [-1 if (m := parse_action(t)) is None else m for t in texts]
    assert codec.answers_to_moves(ids).tolist() == want
    padded, counts = _pad(ids)
    assert codec.padded_answers_to_moves(padded, counts).tolist() == want


def _pad(ids: list[list[int]], fill: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """Rows padded with junk past their counts (what a decode batch holds there)."""
    counts = np.array([len(r) for r in ids], np.int64)
    out = np.full((len(ids), int(counts.max(initial=0))), fill, np.int32)
    for k, row in enumerate(ids):
        out[k, :len(row)] = row
    return out, counts




def test_codec_reads_long_answers_and_repeats_alike():
    three, eos, bos = (_TOK.token_to_id(t) for t in ("3", "<eos>", "<bos>"))
    minus, dot = _TOK.token_to_id("-"), _TOK.token_to_id(".")
    ids = [[three] * 70 + [eos], [bos] * 80 + [three, eos], [minus, eos, three], [three, dot, three], [three, eos]] * 2
    want = [-1 if (m := parse_action(_TOK.decode(row, skip_special_tokens=True))) is None else m for row in ids]
    assert want[:5] == [-1, 3, -1, -1, 3]  # too long; specials are dropped ("-" "3" joins into "-3")
    assert _CODEC.answers_to_moves(ids).tolist() == want  # long rows: the uncached path
    assert _CODEC.answers_to_moves(ids[2:5] * 3).tolist() == want[2:5] * 3  # short rows: cached, twice
    assert _CODEC.padded_answers_to_moves(*_pad(ids)).tolist() == want  # wide: no integer keys
    for _ in range(2):  # short rows as one integer key each: read, then cached
        assert _CODEC.padded_answers_to_moves(*_pad(ids[2:5] * 3)).tolist() == want[2:5] * 3


def test_codec_falls_back_to_the_tokenizer_for_any_other_tokenizer():
    # Same vocabulary, but whole words: a table per character would be wrong, so the codec must notice.
    vocab = json.loads(_TOK.to_str())["model"]["vocab"]
    words = Tokenizer(models.WordLevel({**vocab, "moves:": len(vocab)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    codec = ObservationCodec(words)
    assert not codec.fast
    texts = observations_of_every_kind()[:30]
    assert codec.encode(texts) == [words.encode(t).ids for t in texts]
    ids = [words.encode(t).ids for t in ["3", "moves: 4", "x"]]
    assert codec.answers_to_moves(ids).tolist() == [
        -1 if (m := parse_action(words.decode(i))) is None else m for i in ids]


def test_a_step_result_keeps_its_moment():
    # Its board is built on first use: a later step must not show through.
    env = VectorTextEnv(EnvConfig.tic_tac_toe(agent_player=0), 2)
    env.reset([0, 1])
    first = env.step([0, 1], ["4", "4"])
    second = env.step([0, 1], ["0", "8"])
    assert (np.abs(first.board).sum(axis=(1, 2)) == 2).all() and (np.abs(second.board).sum(axis=(1, 2)) == 4).all()
    assert (first.board[:, 1, 1] == 1).all() and first.infos()[0]["turn"] == 1 and second.infos()[0]["turn"] == 2


def test_a_finished_games_text_is_rendered_only_when_read(monkeypatch):
    env = VectorTextEnv(EnvConfig.tic_tac_toe(agent_player=0, opponent="solver"), 3)
    env.reset([0, 1, 2])
    rendered = []
    texts = env.renderer.texts
    monkeypatch.setattr(env.renderer, "texts", lambda *a, **k: rendered.append(1) or texts(*a, **k))
    step = env.step([0, 1, 2], ["4", "oops", "4"])  # game 1 forfeits; the others go on
    going = ~step.terminated
    assert going.tolist() == [True, False, True] and step.obs_bytes(going) is not None
    ids, _ = _CODEC.encode_step(step, going)
    assert len(ids) == 2 and rendered == [] and step.obs_bytes(np.ones(3, bool)) is None
    while not step.terminated.all():  # play the games out: end texts are built on the first read of `obs`
        live = np.flatnonzero(env.live)
        step = env.step(live, moves=np.array([np.flatnonzero(env.legal[i])[0] for i in live]))
        assert rendered == []
    assert all(step.obs) and rendered == [1]


def test_an_empty_step_is_a_no_op():
    env = VectorTextEnv(EnvConfig.connect_four(), 2)
    env.reset([0, 1])
    step = env.step([], [])
    assert len(step) == 0 and step.obs == [] and env.live.all()
