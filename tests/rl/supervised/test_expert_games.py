"""rl/supervised/expert_games.py: expert transcripts are exactly what the agent loop writes for a policy that plays
the same
moves (constrained and free text, the minimal, compact and chat styles, truncation); only the expert's moves are in
the loss mask and each is one of its best; dedup by move sequence; a seeded train / held-out split by game."""

import dataclasses

import jax
import numpy as np
import pytest

from earl_jax.envs.env_config import EnvConfig
from earl_jax.envs.games import tic_tac_toe
from earl_jax.envs.vector import VectorTextEnv
from earl_jax.envs.vector.batched_opponents import BatchedOpponent
from earl_jax.models.tokenizer import game_tokenizer, special_ids
from earl_jax.rl.supervised.expert_games import (
    ExpertGames,
    ExpertSpec,
    concat_games,
    dedup_games,
    expert_games,
    split_games,
    unseen_turns,
)
from earl_jax.rollout.agent_loop import Decoded, PlayConfig, play_games
from earl_jax.rollout.moves import MoveTokens, legal_bits

TOK = game_tokenizer()
IDS = special_ids(TOK)


class ReplayOpponent(BatchedOpponent):
    """The opponent's moves of recorded games: game i's move at ply k is moves[i][k]."""

    def __init__(self, moves):
        super().__init__(len(moves))
        self.moves = moves

    def act(self, rows, me, opp, legal):
        ply = np.bitwise_count(me | opp)
        return np.array([self.moves[r][k] for r, k in zip(rows.tolist(), ply.tolist())], np.int64)


class ReplayPolicy:
    """An agent-loop Policy that answers each game's recorded agent moves, as the sampler's policy writes answers:
    constrained [move token, stop] (the move scored, its legal set in choices), or free text (the move's text and
    the end token, budget-cut)."""

    def __init__(self, games, moves: MoveTokens | None):
        self.games, self.mt = games, moves
        self.made = np.zeros(len(games), np.int64)

    def reset(self, batch, max_len):
        pass

    def extend(self, tokens, counts):
        pass

    def take_rows(self, rows, batch):
        raise AssertionError("compaction is off")

    def generate(self, budgets, rng, row_ids, legal=None):
        b = len(budgets)
        going = budgets > 0
        move = np.zeros(b, np.int64)
        for r in np.flatnonzero(going):
            g = int(row_ids[r])
            move[r] = self.games.moves[g][2 * self.made[g] + self.games.agent_player[g]]
            self.made[g] += 1
        if self.mt is not None:
            tokens = np.stack([np.asarray(self.mt.token_ids)[move], np.full(b, self.mt.stop_id)], 1).astype(np.int32)
            counts = np.where(going, np.minimum(budgets, 2), 0).astype(np.int32)
            scored = np.zeros((b, 2), bool)
            scored[:, 0] = going
            choices = np.zeros((b, 2), np.int32)
            choices[:, 0] = np.where(going, legal_bits(legal), 0)
            out = Decoded(tokens, np.zeros((b, 2), np.float32), counts, counts == 2, scored=scored, choices=choices,
                          moves=np.where(going, move, -1))
        else:
            answers = [TOK.encode(str(m), add_special_tokens=False).ids + [IDS.eos_id] for m in move.tolist()]
            tokens = np.zeros((b, max(map(len, answers))), np.int32)
            counts = np.zeros(b, np.int32)
            for r, a in enumerate(answers):
                a = a[:budgets[r]]
                tokens[r, :len(a)], counts[r] = a, len(a)
            out = Decoded(tokens, np.zeros(tokens.shape, np.float32), counts, counts > 0)
        return lambda: out


def generate(game="connect_four", style="minimal", constrained=True, n=24, **kw):
    spec_kw = {k: kw.pop(k) for k in ("depth", "opponents", "opening_plies", "seed") if k in kw}
    env_cfg = EnvConfig(game=game, prompt_style=style)
    return env_cfg, expert_games(ExpertSpec(games=n, depth=spec_kw.pop("depth", 2), **spec_kw), env_cfg, TOK,
                                 eos_id=IDS.eos_id, bos_id=IDS.bos_id, constrained=constrained, **kw)


def replay(env_cfg, games, constrained, **play_kw):
    env = VectorTextEnv(env_cfg, len(games))
    env.opponent = ReplayOpponent(games.moves)
    moves = MoveTokens.build(TOK, env.num_actions, IDS.eos_id) if constrained else None
    cfg = PlayConfig(compact=False, constrain_moves=constrained, **play_kw)
    return play_games(ReplayPolicy(games, moves), env, TOK, cfg, jax.random.key(0), list(games.seeds),
                      bos_id=IDS.bos_id)


def opening_answers_removed(traj, games):
    """The loop's loss mask without the answers of each game's random opening turns (answer j is the agent's move
    at ply 2j + seat: random while that ply is below the game's opening length)."""
    mask = traj.loss_mask.copy()
    for i in range(len(games)):
        starts = np.flatnonzero(mask[i] & ~np.r_[False, mask[i][:-1]])  # the first token of each answer
        ends = np.flatnonzero(mask[i] & ~np.r_[mask[i][1:], False])
        for j, (s, e) in enumerate(zip(starts, ends)):
            if 2 * j + games.agent_player[i] < games.opening[i]:
                mask[i, s:e + 1] = False
    return mask


CASES = [  # game, prompt style, constrained, rollout limits
    ("connect_four", "minimal", True, {}),
    ("connect_four", "compact", False, {}),
    ("tic_tac_toe", "compact", True, {}),
    ("tic_tac_toe", "chat", False, {"max_turn_tokens": 8}),
    ("connect_four", "minimal", True, {"max_context": 120, "max_turns": 12}),  # games cut by both limits
    ("connect_four", "minimal", False, {"max_context": 110, "max_turn_tokens": 3}),
]


@pytest.mark.parametrize("game, style, constrained, limits", CASES)
def test_transcripts_are_what_the_agent_loop_writes(game, style, constrained, limits):
    env_cfg, games = generate(game, style, constrained, **limits)
    traj = replay(env_cfg, games, constrained, **limits)
    np.testing.assert_array_equal(games.lengths, traj.lengths)
    np.testing.assert_array_equal(games.tokens, traj.tokens)
    np.testing.assert_array_equal(games.choices, traj.choices)  # zeros in free text
    np.testing.assert_array_equal(games.loss_mask, opening_answers_removed(traj, games))
    if not constrained:  # every answer whole (a constrained answer's stop token is outside the loop's mask)
        np.testing.assert_array_equal(games.answers, traj.loss_mask)
    else:
        np.testing.assert_array_equal(games.answers & (games.choices != 0), traj.loss_mask)
    assert games.loss_mask.sum() < traj.loss_mask.sum()  # some openings were random
    if "max_context" in limits:
        assert traj.truncated.any() and (games.winner[traj.truncated] == -1).all()
    else:
        assert [w for w in traj.winners] == [["agent", "opponent", "draw"][w] for w in games.winner]


@pytest.mark.parametrize("constrained", [True, False])
def test_only_expert_moves_are_scored_and_each_is_one_of_its_best(constrained):
    env_cfg, games = generate("tic_tac_toe", "compact", constrained, n=64, opening_plies=3)
    rows, pos = games.expert_turns()
    assert len(rows) == (games.best != 0).sum() > 0
    move_ids = np.array([TOK.token_to_id(str(a)) for a in range(9)])
    played = np.argmax(games.tokens[rows, pos][:, None] == move_ids, 1)
    assert (games.best[rows, pos] >> played & 1).all()  # the move is in the expert's best set
    assert (games.best & ~games.legal == 0).all()
    # the solver's best moves keep the game's value for the side to move (win / draw / loss)
    per_token = games.loss_mask.sum() / len(rows)
    assert per_token == (1 if constrained else 2)  # the move token; free text: and its end token
    assert games.loss_mask[rows, pos].all()
    # no answer of an opening turn is scored: every scored move token is an expert turn
    scored_moves = games.loss_mask & np.isin(games.tokens, move_ids)
    np.testing.assert_array_equal(scored_moves, games.best != 0)


def test_the_tic_tac_toe_expert_keeps_the_game_value():
    _, games = generate("tic_tac_toe", "compact", True, n=128, opening_plies=4)
    for r, c in zip(*games.expert_turns()):
        k = games.best[r, c]
        turn = int(np.sum(games.choices[r, :c] != 0))  # the agent's moves before this one
        moves = games.moves[r][:2 * turn + games.agent_player[r]]
        x, o = sum(1 << m for m in moves[0::2]), sum(1 << m for m in moves[1::2])
        me, opp = (x, o) if len(moves) % 2 == 0 else (o, x)
        classes = tic_tac_toe.move_classes(np.array([me], np.uint64), np.array([opp], np.uint64))[0]
        legal = [a for a in range(9) if not (x | o) >> a & 1]
        assert {a for a in range(9) if k >> a & 1} <= {a for a in legal if classes[a] == max(classes[legal])}


@pytest.mark.parametrize("game", ["tic_tac_toe", "connect_four"])
def test_tactics_mark_the_expert_turns_with_a_win_or_a_block_due(game):
    from earl_jax.envs.games import get_game

    rules = get_game(game).rules
    _, games = generate(game, "compact", False, n=64, depth=2)
    seen = set()
    for r, c in zip(*games.expert_turns()):
        turn = int(np.sum(games.answers[r, :c] & ~games.answers[r, np.maximum(np.arange(c) - 1, 0)]))  # answers before
        moves = games.moves[r][:2 * turn + games.agent_player[r]]
        stones = np.zeros((1, 2), np.uint64)
        for k, m in enumerate(moves):
            stones[0, k % 2] |= rules.drop(stones, np.array([m]))[0]
        me, opp = stones[0, len(moves) % 2], stones[0, 1 - len(moves) % 2]
        cells = [rules.drop(stones, np.array([a]))[0] for a in np.flatnonzero(rules.legal_mask(stones)[0])]
        win = any(rules.is_win(np.array([me | b]))[0] for b in cells)
        block = any(rules.is_win(np.array([opp | b]))[0] for b in cells)
        assert games.tactics[r, c] == win + 2 * block
        seen.add(int(games.tactics[r, c]))
    assert {0, 1, 2} <= seen
    # the tactical batch scores exactly the answers (move and end token) of those turns
    batch = games.batch(np.arange(len(games)), games.tokens.shape[1], tactics_only=True)["loss_mask"]
    assert (batch <= games.loss_mask).all()
    move_at = games.best != 0
    np.testing.assert_array_equal(batch & move_at, move_at & (games.tactics != 0))
    np.testing.assert_array_equal(batch & ~move_at, np.roll(batch & move_at, 1, axis=1) & games.loss_mask)


def test_the_connect_four_expert_wins_against_random_and_every_opponent_gets_its_share():
    _, games = generate(n=30, depth=3, opening_plies=0, opponents=("random", "alphabeta:1", "alphabeta:3"))
    stats = games.stats()
    assert [stats[f"expert_vs_{o}"]["games"] for o in ("random", "alphabeta:1", "alphabeta:3")] == [10, 10, 10]
    assert stats["expert_vs_random"]["agent"] == 1.0
    assert set(games.agent_player.tolist()) == {0, 1}  # both seats


def test_dedup_keeps_one_game_per_seat_and_move_sequence():
    _, played = generate("tic_tac_toe", "compact", True, n=48, opening_plies=0, opponents=("solver",))
    games = played.take(np.r_[np.arange(48), np.arange(0, 48, 3)])  # 16 games twice
    unique = dedup_games(games)
    keys = list(zip(games.agent_player.tolist(), games.moves))
    assert len(unique) == len(set(keys)) <= 48
    assert len(set(zip(unique.agent_player.tolist(), unique.moves))) == len(unique)
    first = [keys.index(k) for k in dict.fromkeys(keys)]
    np.testing.assert_array_equal(unique.tokens, games.take(first).tokens)
    # the same moves from the other seat are another game (another transcript)
    other = dataclasses.replace(games.take([0]), agent_player=1 - games.agent_player[:1])
    assert len(dedup_games(concat_games([games.take([0]), other]))) == 2


def test_split_is_by_game_seeded_and_disjoint():
    _, games = generate("tic_tac_toe", "compact", True, n=80, opening_plies=2)
    games = dedup_games(games)
    train, held = split_games(games, 0.25, seed=3)
    assert len(train) + len(held) == len(games) and len(held) == round(0.25 * len(games))
    keys = lambda g: set(zip(g.agent_player.tolist(), g.moves))  # noqa: E731
    assert not keys(train) & keys(held) and keys(train) | keys(held) == keys(games)
    again, _ = split_games(games, 0.25, seed=3)
    other, _ = split_games(games, 0.25, seed=4)
    assert again.moves == train.moves and other.moves != train.moves
    unseen = unseen_turns(train, held)
    assert len(unseen) == (held.best != 0).sum() and unseen.any()
    assert not unseen_turns(games, held).any()  # every held-out position is in the whole set
    with pytest.raises(ValueError, match="held_out must be in"):
        split_games(games, 1.0, seed=0)


def test_generation_is_reproducible_and_batches_fit_the_sft_stage():
    _, a = generate(n=16, seed=5)
    _, b = generate(n=16, seed=5)
    _, c = generate(n=16, seed=6)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.moves == b.moves and a.moves != c.moves
    batch = a.batch(np.arange(4), 64)
    assert set(batch) == {"tokens", "loss_mask", "choices", "lengths"}
    assert batch["tokens"].shape == (4, 64) and (batch["lengths"] <= 64).all()
    np.testing.assert_array_equal(batch["tokens"], a.tokens[:4, :64])
    free = dataclasses.replace(a, constrained=False)
    assert "choices" not in free.batch(np.arange(4), 64)
    # the whole transcript but the random turns' answers
    lm = a.batch(np.arange(4), 64, transcript=True)["loss_mask"]
    within = np.arange(64) < batch["lengths"][:, None]
    random_answers = a.answers[:4, :64] & ~a.loss_mask[:4, :64]
    np.testing.assert_array_equal(lm[:, 1:], (within & ~random_answers)[:, 1:])
    assert not lm[:, 0].any() and (batch["loss_mask"] <= lm).all()


def test_saved_games_load_back_whole_and_a_different_key_is_a_miss(tmp_path):
    _, games = generate(n=12)
    games.save(tmp_path / "g.npz", key="depth 2")
    again = ExpertGames.load(tmp_path / "g.npz", key="depth 2")
    for f in dataclasses.fields(games):
        a, b = getattr(games, f.name), getattr(again, f.name)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, f.name
    assert ExpertGames.load(tmp_path / "g.npz", key="depth 3") is None


def test_bad_specs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        ExpertSpec(games=4, depth=0)
    with pytest.raises(ValueError, match="no expert for 'breakthrough'"):
        expert_games(ExpertSpec(games=2), EnvConfig(game="breakthrough"), TOK, eos_id=IDS.eos_id, bos_id=None,
                     constrained=True)
