"""rl/supervised/expert_replay.py: a replay in the same format is the same games; in another prompt style it keeps
every expert
turn and its best set; a mirror image is the reflected game (moves, move sets, winner), and mirroring twice is the
identity; the SFT stage's best-set target is the log-probability of any best move."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.envs.env_config import EnvConfig
from earl_jax.models.tokenizer import game_tokenizer, special_ids
from earl_jax.rl.algorithm.micro_steps import LOSSES, sft_batch
from earl_jax.rl.supervised.expert_games import TOKEN_FIELDS, ExpertSpec, expert_games
from earl_jax.rl.supervised.expert_replay import MIRRORS, replay_games

TOK = game_tokenizer()
IDS = special_ids(TOK)
KW = dict(eos_id=IDS.eos_id, bos_id=IDS.bos_id)


def generate(game: str, style: str, constrained: bool = True, n: int = 24, **limits):
    cfg = EnvConfig(game=game, prompt_style=style)
    return cfg, expert_games(ExpertSpec(games=n, depth=2, seed=3), cfg, TOK, constrained=constrained, **KW, **limits)


@pytest.mark.parametrize("game, style, constrained", [("connect_four", "minimal", True),
                                                      ("tic_tac_toe", "compact", False)])
def test_a_replay_in_the_same_format_is_the_same_games_and_two_mirrors_are_none(game, style, constrained):
    cfg, games = generate(game, style, constrained)
    same = replay_games(games, cfg, TOK, constrained=constrained, **KW)
    twice = replay_games(replay_games(games, cfg, TOK, constrained=constrained, mirror=True, **KW), cfg, TOK,
                         constrained=constrained, mirror=True, **KW)
    for out in (same, twice):
        for k in TOKEN_FIELDS:
            np.testing.assert_array_equal(getattr(out, k), getattr(games, k), err_msg=k)
        assert out.moves == games.moves and (out.winner == games.winner).all()
        assert (out.opponent == games.opponent).all() and out.opponents == games.opponents


def test_a_mirror_image_is_the_reflected_game():
    cfg, games = generate("connect_four", "minimal")
    mirrored = replay_games(games, cfg, TOK, constrained=True, mirror=True, **KW)
    perm = np.array(MIRRORS["connect_four"])
    assert mirrored.moves == [tuple(perm[list(m)].tolist()) for m in games.moves]
    np.testing.assert_array_equal(mirrored.winner, games.winner)
    np.testing.assert_array_equal(mirrored.agent_player, games.agent_player)
    np.testing.assert_array_equal(mirrored.loss_mask, games.loss_mask)  # the same turns, scored the same
    rows, cols = games.expert_turns()
    flip = lambda m: sum(((m >> a) & 1) << int(b) for a, b in enumerate(perm))  # noqa: E731
    assert [flip(int(m)) for m in games.best[rows, cols]] == mirrored.best[rows, cols].tolist()
    assert [flip(int(m)) for m in games.legal[rows, cols]] == mirrored.legal[rows, cols].tolist()
    np.testing.assert_array_equal(mirrored.tactics, games.tactics)  # a win or a block is due in both or neither
    assert (mirrored.tokens != games.tokens).any(1).mean() > 0.9  # a game and its mirror image read differently


def test_a_replay_in_another_style_keeps_every_expert_turn_and_its_best_set():
    cfg, games = generate("connect_four", "minimal", n=16)
    labeled = replay_games(games, dataclasses.replace(cfg, prompt_style="labeled"), TOK, constrained=True, **KW)
    assert (labeled.lengths > 2 * games.lengths).all()  # the board every turn
    assert labeled.moves == games.moves
    rows, cols = games.expert_turns()
    new_rows, new_cols = labeled.expert_turns()
    np.testing.assert_array_equal(new_rows, rows)
    np.testing.assert_array_equal(labeled.best[new_rows, new_cols], games.best[rows, cols])
    np.testing.assert_array_equal(labeled.tactics[new_rows, new_cols], games.tactics[rows, cols])


def test_bad_replays_are_refused():
    cfg, games = generate("tic_tac_toe", "compact", n=4)
    with pytest.raises(ValueError, match="no mirror for 'connect_four_x'"):
        replay_games(games, dataclasses.replace(cfg, game="connect_four_x"), TOK, constrained=True, mirror=True, **KW)
    cut = dataclasses.replace(games, winner=np.full(len(games), -1))
    with pytest.raises(ValueError, match="no finished game"):
        replay_games(cut, cfg, TOK, constrained=True, **KW)


def test_the_best_set_target_is_the_log_probability_of_any_best_move():
    from flax import nnx

    from earl_jax.models.model_config import ModelConfig
    from earl_jax.models.qwen2 import Qwen2
    from earl_jax.rollout.moves import MoveTokens

    _, games = generate("tic_tac_toe", "compact", n=8)
    width = int(games.lengths.max())
    b = games.batch(np.arange(8), width, best_set=True)
    model = Qwen2(ModelConfig.tiny(vocab_size=TOK.get_vocab_size()), rngs=nnx.Rngs(0), dtype=jnp.float32)
    graphdef, params = nnx.split(model)
    choice_tokens = tuple(MoveTokens.build(TOK, 9, IDS.eos_id).token_ids)
    loss = lambda targets: LOSSES["sft"](params, graphdef, sft_batch(  # noqa: E731
        jnp.asarray(b["tokens"]), jnp.asarray(b["loss_mask"]), jnp.asarray(b["choices"]), targets), None, 64,
        choice_tokens)[0]
    # by hand: at each expert move, -log sum over its best moves of the softmax over its legal moves
    h, _ = model.hidden(jnp.asarray(b["tokens"]), jnp.broadcast_to(jnp.arange(width), b["tokens"].shape))
    logits = np.asarray(model.logits(h)[..., np.array(choice_tokens)], np.float64)
    rows, cols = np.nonzero(b["targets"])
    bits = lambda m: ((m[:, None] >> np.arange(9)) & 1).astype(bool)  # noqa: E731
    at = logits[rows, cols - 1]
    legal, best = bits(b["choices"][rows, cols]), bits(b["targets"][rows, cols])
    z = lambda keep: np.log(np.where(keep, np.exp(at), 0).sum(1))  # noqa: E731
    assert float(loss(jnp.asarray(b["targets"]))) == pytest.approx(float(np.mean(z(legal) - z(best))), rel=1e-4)
    several = best.sum(1) > 1
    assert several.any()  # some turns have several best moves, where the two targets differ
    assert float(loss(jnp.asarray(b["targets"]))) < float(loss(None))
    with pytest.raises(ValueError, match="needs constrained moves"):
        dataclasses.replace(games, constrained=False).batch(np.arange(2), width, best_set=True)
