"""Connect Four's near-exact solver (envs/connect_four_solver.py): forced wins and blocks a reader can check on the
board, exact values where the search reaches the end, the same moves per game and batched, and as an expert."""

from __future__ import annotations

import random

import numpy as np
import pyspiel
import pytest

from earl_jax.envs import connect_four_solver as solver
from earl_jax.envs.connect_four_search import BOTTOM, COLUMN, bitboards_from_history, is_win
from earl_jax.envs.opponents import make_opponent
from earl_jax.envs.vector.batched_opponents import make_vector_opponent


def board(rows: str) -> tuple[int, int, int]:
    """An ASCII board (top row first; x moves first, o second, . empty) -> (stones of the side to move, the other's,
    stone count). The side to move is x when the counts are equal."""
    lines = [r.strip() for r in rows.strip().splitlines()]
    assert len(lines) == 6 and all(len(r) == 7 for r in lines)
    x = o = 0
    for r, line in enumerate(lines):
        for c, ch in enumerate(line):
            bit = 1 << (c * 7 + (5 - r))
            x |= bit if ch == "x" else 0
            o |= bit if ch == "o" else 0
    n = (x | o).bit_count()
    return (x, o, n) if n % 2 == 0 else (o, x, n)


def test_takes_a_win_in_one():
    me, opp, _ = board("""
        .......
        .......
        .......
        .......
        o.o....
        xxx.o..""")  # x to move: column 3 completes the bottom row
    moves, score = solver.solve(me, opp)
    assert moves == (3,) and score == solver.WIN - 7


def test_blocks_the_only_threat_and_loses_to_two():
    me, opp, _ = board("""
        .......
        .......
        .......
        .......
        ....x..
        ooo.x.x""")  # x to move: o threatens column 3 only
    assert solver.solve(me, opp)[0] == (3,)
    me, opp, _ = board("""
        .......
        .......
        .......
        .......
        .....x.
        .ooo.xx""")  # x to move: o threatens columns 0 and 4, x can block one
    moves, score = solver.solve(me, opp)
    assert score == -(solver.WIN - 8) and set(moves) == {0, 1, 2, 3, 4, 5, 6}  # lost whatever it plays


def test_finds_a_forced_win_in_three_by_a_double_threat():
    me, opp, _ = board("""
        .......
        .......
        .......
        .......
        ..oo...
        ..xx...""")  # x to move: 1 or 4 makes three open at both ends; o blocks one end, x wins at the other
    assert solver.solve(me, opp) == ((1, 4), solver.WIN - 7)  # with the 7th stone on the board


def test_does_not_play_under_the_opponents_winning_cell():
    me, opp, _ = board("""
        .......
        .......
        .......
        .......
        .ooo..x
        .xox..x""")  # x to move: o wins on the second row at 0 or 4, so x must not fill the cell below either
    moves, _ = solver.solve(me, opp)
    assert moves and not {0, 4} & set(moves)


def _random_position(rng: random.Random, plies: int) -> list[int]:
    history: list[int] = []
    while len(history) < plies:
        p0, p1 = bitboards_from_history(history)
        legal = [c for c in range(7) if ((p0 | p1) + BOTTOM[c]) & COLUMN[c]]
        nxt = history + [rng.choice(legal)]
        if any(map(is_win, bitboards_from_history(nxt))):
            break
        history = nxt
    return history


def test_an_endgame_searched_to_the_end_is_exact():
    """Where the budget reaches the end of every line, the score is the game's value: the same as a plain minimax
    over the rest of the game (no heuristic, no pruning) on positions 8 stones from a full board."""
    def value(me: int, opp: int) -> int:  # plain negamax to the end: WIN - stones for a win with that stone
        mask = me | opp
        if mask.bit_count() == 42:
            return 0
        best = -2 * solver.WIN
        for c in range(7):
            bit = (mask + BOTTOM[c]) & COLUMN[c]
            if not bit:
                continue
            if is_win(me | bit):
                return solver.WIN - mask.bit_count() - 1
            best = max(best, -value(opp, me | bit))
        return best

    rng, checked = random.Random(3), 0
    while checked < 6:
        history = _random_position(rng, 34)
        if len(history) != 34:
            continue
        p0, p1 = bitboards_from_history(history)
        me, opp = (p0, p1) if len(history) % 2 == 0 else (p1, p0)
        assert solver.solve.__wrapped__(me, opp, 10**9)[1] == value(me, opp)
        checked += 1


def test_the_batched_opponent_plays_the_per_game_ones_moves():
    game = pyspiel.load_game("connect_four")
    rng = random.Random(0)
    batched = make_vector_opponent("solver:1", "connect_four", 12)
    assert batched.per_game and batched.budget == 1000
    seeds = list(range(12))
    batched.reset(np.arange(12), seeds)
    states, mes, opps = [], [], []
    for _ in range(12):
        history = _random_position(rng, rng.randrange(0, 16))
        state = game.new_initial_state()
        for a in history:
            state.apply_action(a)
        p0, p1 = bitboards_from_history(history)
        states.append(state)
        mes.append(p0 if len(history) % 2 == 0 else p1)
        opps.append(p1 if len(history) % 2 == 0 else p0)
    me, opp = np.array(mes, np.uint64), np.array(opps, np.uint64)
    legal = np.array([[s.legal_actions().count(a) > 0 for a in range(7)] for s in states])
    got = batched.act(np.arange(12), me, opp, legal)
    want = [make_opponent("solver:1", game, seed).act(s) for seed, s in zip(seeds, states)]
    assert got.tolist() == want


def test_solver_specs_and_refusals():
    game = pyspiel.load_game("connect_four")
    assert make_opponent("solver", game).budget == solver.DEFAULT_BUDGET
    assert make_opponent("solver:20", game).budget == 20_000
    with pytest.raises(ValueError, match="solver:0"):
        make_opponent("solver:0", game)
    with pytest.raises(ValueError, match="standard 6x7 board"):
        make_opponent("solver", pyspiel.load_game("connect_four(rows=5)"))


def test_the_solver_is_an_expert_of_the_expert_games():
    from earl_jax.rl.supervised.expert_games import EXPERTS, ExpertSpec, expert_of

    expert, strength = expert_of(ExpertSpec(games=1, solver=2), "connect_four")
    assert strength == 2000
    me, opp, _ = board("""
        .......
        .......
        .......
        .......
        o.o....
        xxx.o..""")
    assert expert(np.array([me], np.uint64), np.array([opp], np.uint64), strength)[0].tolist() == [
        False, False, False, True, False, False, False]
    assert expert_of(ExpertSpec(games=1), "connect_four") == (EXPERTS["connect_four"], 4)
    with pytest.raises(ValueError, match="Connect Four's expert"):
        expert_of(ExpertSpec(games=1, solver=1), "tic_tac_toe")
