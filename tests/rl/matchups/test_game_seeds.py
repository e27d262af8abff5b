"""--rollout.group-seeds: per-game seeds keep a group's seat and give its games their own opponent streams."""
import numpy as np
import pytest

from earl_jax.envs import EnvConfig
from earl_jax.envs.vector import make_vector_env
from earl_jax.rl.matchups.game_seeds import game_seeds, seat_of_seed


def test_shared_repeats_each_group_seed():
    assert game_seeds([5, 9], 3) == [5, 5, 5, 9, 9, 9]


def test_per_game_seeds_distinct_and_game_zero_keeps_the_group_seed():
    seeds = game_seeds(range(40), 8, "per_game")
    assert len(set(seeds)) == len(seeds) == 320
    assert seeds[::8] == list(range(40))
    assert game_seeds([7], 1, "per_game") == game_seeds([7], 1)
    with pytest.raises(ValueError, match="group_seeds"):
        game_seeds([1], 2, "per_group")


def test_per_game_seeds_keep_the_seat_and_vary_the_opponent():
    """The env's own seat draw equals the group's in every game; and a scripted agent that always plays the same
    column meets different random replies within a group (under shared seeds it meets the same ones)."""
    groups, size = 16, 4
    env = make_vector_env(EnvConfig(game="connect_four", opponent="random", prompt_style="compact"), groups * size)
    replies = {}
    for mode in ("shared", "per_game"):
        seeds = game_seeds(range(100, 100 + groups), size, mode)
        first = env.reset(seeds)
        seats = env.agent_player.reshape(groups, size)
        assert (seats == seats[:, :1]).all(), mode
        assert [seat_of_seed(s) for s in seeds[::size]] == seats[:, 0].tolist()
        # the agent plays column 3 twice (legal in any opening); record the opponent's replies
        live = np.flatnonzero(~first.terminated)
        steps = [env.step(live, moves=np.full(len(live), 3)) for _ in range(1)]
        replies[mode] = steps[0].opponent_action.reshape(groups, size)
    same = lambda r: (r == r[:, :1]).all(axis=1)  # noqa: E731
    assert same(replies["shared"]).all()
    assert not same(replies["per_game"]).all()  # 16 groups of 4 random replies among 7 columns: some differ


def test_trainer_rollout_inputs_follow_the_flag():
    from earl_jax.rl.loop.trainer import Trainer
    from jobs import job

    class T:  # rollout_inputs reads cfg and step only
        rollout_inputs = Trainer.rollout_inputs

    for mode in ("shared", "per_game"):
        t = T()
        t.cfg, t.step = job(groups=3, group_size=4, group_seeds=mode), 2
        seeds, gids, _ = t.rollout_inputs()
        assert len(seeds) == 12 and gids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
        assert (len(set(seeds)) == 3) == (mode == "shared")
