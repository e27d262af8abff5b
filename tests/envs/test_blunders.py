"""--env.blunder-penalty: move outcome classes against OpenSpiel, the env's reward, and the trainer's wiring."""
import numpy as np
import pyspiel
import pytest

from earl_jax.envs import connect_four_search as c4_ref
from earl_jax.envs.openspiel_env import EnvConfig
from earl_jax.envs.vector import blunders, make_vector_env
from earl_jax.envs.vector.env import VectorTextEnv
from jobs import job


def _random_states(game: str, count: int, seed: int):
    """Non-terminal positions reached by uniformly random play (OpenSpiel's rules)."""
    rng = np.random.default_rng(seed)
    g = pyspiel.load_game(game)
    out = []
    while len(out) < count:
        s = g.new_initial_state()
        for _ in range(rng.integers(0, 30)):
            if s.is_terminal():
                break
            s.apply_action(int(rng.choice(s.legal_actions())))
        if not s.is_terminal():
            out.append(s)
    return out


def _exact_value(state, memo) -> int:
    """Undiscounted minimax value for the player to move (OpenSpiel), by plain search."""
    key = str(state)
    if key not in memo:
        player = state.current_player()
        best = -2
        for a in state.legal_actions():
            child = state.child(a)
            v = int(np.sign(child.returns()[player])) if child.is_terminal() else -_exact_value(child, memo)
            best = max(best, v)
        memo[key] = best
    return memo[key]


def _ttt_stones(state) -> tuple[np.ndarray, np.ndarray]:
    """(mover's stones, other's stones) as bitboards from OpenSpiel's history."""
    bits = [0, 0]
    for i, a in enumerate(state.history()):
        bits[i & 1] |= 1 << a
    p = state.current_player()
    return np.array([bits[p]], np.uint64), np.array([bits[1 - p]], np.uint64)


def test_tic_tac_toe_classes_are_the_exact_values():
    memo: dict = {}
    for state in _random_states("tic_tac_toe", 150, seed=0):
        me, opp = _ttt_stones(state)
        legal = np.zeros((1, 9), bool)
        legal[0, state.legal_actions()] = True
        got = blunders.move_classes("tic_tac_toe", me, opp, legal)[0]
        p = state.current_player()
        for a in range(9):
            if not legal[0, a]:
                assert got[a] == blunders.ILLEGAL
                continue
            child = state.child(a)
            want = int(np.sign(child.returns()[p])) if child.is_terminal() else -_exact_value(child, memo)
            assert got[a] == want, (str(state), a)


def test_connect_four_depth1_classes_are_wins_and_missed_blocks():
    """Depth 1: +1 exactly for a move that wins now, -1 for one after which the opponent wins at once."""
    judged = {1: 0, -1: 0}
    for state in _random_states("connect_four", 200, seed=1):
        p0, p1 = c4_ref.bitboards_from_history(state.history())
        p = state.current_player()
        me, opp = (np.array([p0], np.uint64), np.array([p1], np.uint64)) if p == 0 else \
            (np.array([p1], np.uint64), np.array([p0], np.uint64))
        legal = np.zeros((1, 7), bool)
        legal[0, state.legal_actions()] = True
        got = blunders.move_classes("connect_four", me, opp, legal, depth=1)[0]
        for a in state.legal_actions():
            child = state.child(a)
            if child.is_terminal():
                want = int(np.sign(child.returns()[p]))
            else:
                lost = any(child.child(b).is_terminal() and child.child(b).returns()[p] < 0
                           for b in child.legal_actions())
                want = -1 if lost else 0
            assert got[a] == want, (str(state), a)
            judged[want] = judged.get(want, 0) + 1
    assert judged[1] > 5 and judged[-1] > 5  # the random positions did test both signs


def test_blunder_penalty_lands_on_the_move_that_misses_the_block():
    env = VectorTextEnv(EnvConfig.tic_tac_toe(blunder_penalty=0.5, agent_player=0), 2)
    env.reset([0, 0], histories=[[0, 3, 1, 4], [0, 3, 1, 4]])  # X to move: 2 wins, O threatens 5
    step = env.step(np.arange(2), moves=np.array([2, 8]))
    assert step.blunder.tolist() == [0, 2]  # 8: a win given away, and O now wins at 5 (win -> loss: 2 classes)
    assert step.reward[0] == 1.0  # a win, no penalty
    plain = VectorTextEnv(EnvConfig.tic_tac_toe(agent_player=0), 1)
    plain.reset([0], histories=[[0, 3, 1, 4]])
    base = plain.step(np.arange(1), moves=np.array([8]))
    assert step.reward[1] == pytest.approx(base.reward[0] - 2 * 0.5)
    assert base.blunder is None


def test_blunder_penalty_needs_the_batched_env_and_valid_settings():
    with pytest.raises(ValueError, match="blunder_penalty needs the batched env"):
        make_vector_env(EnvConfig.connect_four(opponent="mcts:4", blunder_penalty=0.1), 2)
    with pytest.raises(ValueError, match="blunder_penalty: must be >= 0"):
        make_vector_env(EnvConfig.tic_tac_toe(blunder_penalty=-1.0), 2)
    with pytest.raises(ValueError, match="--env.blunder-depth"):
        job(blunder_depth=0)
    with pytest.raises(ValueError, match="--env.blunder-penalty"):
        job(blunder_penalty=-0.1)
    with pytest.raises(ValueError, match="not 'chess'"):
        blunders.move_classes("chess", np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.ones((1, 7), bool))


def test_the_trainer_plays_with_the_penalty_and_logs_the_blunder_rate(tmp_path):
    from earl_jax.rl.loop.trainer import Trainer

    cfg = job(game="tic_tac_toe", run__steps=1, groups=2, group_size=2, max_turns=9, max_context=256,
              prompt_style="compact", constrain_moves=True, blunder_penalty=0.3, sft__steps=0,
              eval__opponents=("random", "mcts:4"), eval__games=2, checkpoint_every=0, devices=1,
              run_dir=str(tmp_path))
    trainer = Trainer(cfg, log=False)
    assert trainer.env.config.blunder_penalty == 0.3  # what the config says is what the games use
    record = trainer.iteration()
    assert 0.0 <= record["rollout/blunder_rate"] <= 1.0
    out = trainer.evaluate()  # an mcts opponent plays per game: evaluation judges no moves, so it runs
    assert 0.0 <= out["eval_mcts:4/win_rate"] <= 1.0


def test_connect_four_classes_batch_equals_one_by_one():
    states = _random_states("connect_four", 40, seed=2)
    me, opp, legal = [], [], []
    for s in states:
        p0, p1 = c4_ref.bitboards_from_history(s.history())
        a, b = (p0, p1) if s.current_player() == 0 else (p1, p0)
        me.append(a), opp.append(b)
        row = np.zeros(7, bool)
        row[s.legal_actions()] = True
        legal.append(row)
    me, opp, legal = np.array(me, np.uint64), np.array(opp, np.uint64), np.array(legal)
    batch = blunders.move_classes("connect_four", me, opp, legal, depth=2)
    for k in range(len(states)):
        one = blunders.move_classes("connect_four", me[k:k + 1], opp[k:k + 1], legal[k:k + 1], depth=2)
        assert (one[0] == batch[k]).all()
