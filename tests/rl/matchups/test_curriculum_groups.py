"""Who plays which groups: several opponents per rung, a bounded share for opponents that search one game at a time,
rehearsal beside the league, a promotion measure over a rung's opponents, and a default rehearsal that a typed
--opponent leaves behind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from earl_jax.cli import ConfigError
from earl_jax.envs import EnvConfig
from earl_jax.envs.vector import make_vector_env
from earl_jax.rl.job import entry as job_cli
from earl_jax.rl.job.validate import check_job
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rl.matchups.group_plan import plan_groups
from earl_jax.rl.stages.evaluation import Evaluator
from env_replay import replay
from jobs import job, with_fields

SMALL = job(groups=4, group_size=2, run__steps=2, eval__every=0, eval__games=4, sft__steps=0, devices=2,
            checkpoint_every=1, max_turns=6, max_context=256, micro_batch_tokens=1024)
CONFIGS = Path(__file__).resolve().parents[3] / "experiments" / "configs"


def test_a_slow_opponent_gets_a_bounded_share_and_the_rest_plays_the_strongest_batched_rung_below():
    slow = {"mcts:100": True}
    # 16 groups: the last 4 the league's, the 4 before them rehearsal's, the rung's first 8 split
    plan = plan_groups(groups=16, rung=("alphabeta:3", "mcts:100"), per_game=slow, anchor="alphabeta:2",
                       per_game_share=0.125, tail=4, rehearsal=("alphabeta:1", 4))
    assert plan.main == "alphabeta:3" and plan.rung_groups == 8
    assert plan.assigned == (("mcts:100", (6, 7)), ("alphabeta:1", (8, 9, 10, 11)))  # 0.125 x 16: 2 groups
    plan = plan_groups(groups=16, rung=("mcts:100",), per_game=slow, anchor="alphabeta:2", per_game_share=0.125)
    assert plan.main == "alphabeta:2" and plan.assigned == (("mcts:100", (14, 15)),) and plan.rung_groups == 2
    # nothing batched below it: the slow rung takes every group; share 1 is the old behaviour
    alone = plan_groups(groups=16, rung=("mcts:100",), per_game=slow, anchor=None, per_game_share=0.125)
    assert alone.rung_groups == 16
    assert plan_groups(groups=16, rung=("mcts:100",), per_game=slow, anchor="alphabeta:2",
                       per_game_share=1.0).main == "mcts:100"
    # a slow rung rehearsed is bounded as well
    plan = plan_groups(groups=16, rung=("alphabeta:3",), per_game=slow, anchor=None, per_game_share=0.125,
                       rehearsal=("mcts:100", 8))
    assert plan.assigned == (("mcts:100", (14, 15)),)
    with pytest.raises(ValueError, match="leave none for the rung"):
        plan_groups(groups=4, rung=("random",), per_game={}, anchor=None, per_game_share=1, tail=2,
                    rehearsal=("random", 2))


def test_a_batch_with_a_per_game_mcts_and_another_opponent_replays_each_games_reference():
    """mcts:N inside the batched env, beside another scripted opponent: every game the reference env's, move for move
    (finished games reset mid-batch rebuild nothing: their opponents reset)."""
    cfg = EnvConfig(game="connect_four", opponent="random", prompt_style="compact", agent_player=None, max_retries=1)
    second = (np.arange(16) >= 8) & (np.arange(16) < 12), (np.arange(16) >= 12)
    seen = replay(cfg, 16, seed=5, second=[("mcts:5", second[0]), ("alphabeta:1", second[1])])
    assert seen["games"] >= 20 and "opponent" in seen["winners"]
    env = make_vector_env(cfg, 4)
    with pytest.raises(ValueError, match="overlap"):
        env.assign_opponents([("mcts:5", [1, 2]), ("alphabeta:1", [2])])


def test_the_per_game_opponent_rebuilds_a_position_reached_from_a_history():
    from earl_jax.envs.vector.per_game_opponents import PerGameOpponents

    cfg = EnvConfig(game="connect_four", opponent="mcts:5", prompt_style="compact", agent_player=1)
    env = make_vector_env(cfg, 2, per_game_opponents=True)
    reference = make_vector_env(cfg, 2)  # the per-game path
    assert isinstance(env.opponent, PerGameOpponents) and type(reference).__name__ == "PerGameVectorEnv"
    histories = [[3, 3, 2, 4], [0, 1, 0, 1, 6, 6]]
    a = env.reset([7, 8], histories=histories)
    b = reference.reset([7, 8], histories=histories)
    assert a.obs == b.obs  # the opponent's opening reply, searched on the rebuilt state


def test_rehearsal_and_the_league_share_a_batch(tmp_path):
    cfg = with_fields(SMALL, groups=8, opponent="curriculum", curriculum__ladder="random,alphabeta:1,alphabeta:2",
                      rehearsal_share=0.25, league_size=2, league_every=1, league_share=0.25,
                      run_dir=str(tmp_path / "run"))
    check_job(cfg)
    trainer = Trainer(cfg, log=False)
    trainer.matchmaker.curriculum.rung = 2
    env = trainer.matchmaker.train_env(1)
    mask, _, _ = trainer.matchmaker.league_games(1, trainer.state.params)
    rehearsed = env.second_opponent_games
    assert env.second_opponent == "alphabeta:1"  # iteration 1 on rung 2: rung 1 % 2
    assert rehearsed.tolist() == [False] * 8 + [True] * 4 + [False] * 4  # the 2 groups before the league's 2
    assert mask.tolist() == [False] * 12 + [True] * 4 and not (mask & rehearsed).any()
    record = trainer.iteration()
    assert record["league/size"] >= 1 and record["rehearsal/rung"] in (0, 1) and record["mix/games_frac"] == 0.25


def test_a_rung_of_two_opponents_splits_its_groups_and_is_passed_on_the_lower_win_rate(tmp_path, monkeypatch):
    cfg = with_fields(SMALL, opponent="curriculum", curriculum__ladder="random,alphabeta:1+mcts:5,alphabeta:2",
                      per_game_share=0.25, promote_at=0.7, eval__games=2, run_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, log=False)
    c = trainer.matchmaker.curriculum
    c.rung = 1
    env = trainer.matchmaker.train_env(0)
    assert env.config.opponent == "alphabeta:1" and env.second_opponent == "mcts:5"
    assert env.second_opponent_games.tolist() == [False] * 6 + [True] * 2  # one group of four: 0.25 x 4
    assert trainer.matchmaker.eval_opponents() == ("random", "alphabeta:1", "mcts:5")
    assert trainer.matchmaker.metrics()["curriculum/rung_games_frac"] == 1.0
    rates = {"random": 1.0, "alphabeta:1": 0.9, "mcts:5": 0.5}

    def play(env, seeds, group_ids, rng, sampling, training=True):
        class Stats:
            win_rate, draw_rate, invalid_rate, blunder_rate = rates[env.config.opponent], 0.0, 0.0, None
            loss_rate = 1 - win_rate

        return type("Traj", (), {"stats": Stats})()

    evaluator = Evaluator(cfg.eval, cfg.env, trainer.matchmaker, play)
    assert evaluator()["curriculum/eval_win_rate"] == 0.5  # the lower of the rung's two decides
    assert evaluator.logged(3) == evaluator() and c.rung == 1  # 0.5 < 0.7: stays
    rates["mcts:5"] = 0.75
    evaluator.logged(4)
    assert c.rung == 2


def test_a_typed_opponent_leaves_the_default_presets_rehearsal_behind(tmp_path, capsys):
    configs = CONFIGS / "connect4"
    default = job_cli.parse_job([], configs).config
    assert default.curriculum.rehearsal_share == 0.5 and default.env.opponent == "curriculum"
    cfg = job_cli.parse_job(["--opponent", "random"], configs).config
    assert cfg.curriculum.rehearsal_share == 0.0 and cfg.env.opponent == "random"
    check_job(cfg)
    # typed together, the two are refused in one line naming the flag
    typed = job_cli.parse_job(["--opponent", "random", "--curriculum.rehearsal-share", "0.3"], configs).config
    with pytest.raises(ConfigError, match="^--curriculum.rehearsal-share: needs --env.opponent curriculum"):
        check_job(typed)
    argv = ["--opponent", "random", "--curriculum.rehearsal-share", "0.3", "--run-dir", str(tmp_path / "r")]
    assert job_cli.main(argv, name="connect4", configs=configs) == 2
    assert capsys.readouterr().err.startswith("connect4: error: --curriculum.rehearsal-share: needs")


def test_evaluation_reports_the_blunder_rate_of_every_opponent_mcts_included(tmp_path):
    cfg = with_fields(SMALL, constrain_moves=True, eval__opponents=("random", "mcts:5"), eval__games=4,
                      run_dir=str(tmp_path / "run"))
    out = Trainer(cfg, log=False).evaluate()
    for prefix in ("eval", "eval_mcts:5"):
        assert 0 <= out[f"{prefix}/blunder_rate"] <= 1 and out[f"{prefix}/invalid_rate"] == 0


@pytest.mark.parametrize("second", [dict(rehearsal_share=0.5), dict(mix_opponent="random", mix_share=0.5)])
def test_a_per_game_rung_that_cannot_host_other_groups_is_refused_before_the_job_starts(second):
    """A rung whose env plays one game at a time (mcts:N as the env's own opponent) cannot give groups to the rehearsal
    or the mixed opponent: refused when the job is set up, naming the fix, not at the promotion that would reach it;
    with --curriculum.per-game-share below 1 the rung plays inside the batched env and the job starts."""
    cfg = with_fields(SMALL, opponent="curriculum", curriculum__ladder="random,mcts:5", **second)
    with pytest.raises(ValueError, match="plays one game at a time.*--curriculum.per-game-share below 1"):
        Trainer(cfg, log=False)
    trainer = Trainer(with_fields(cfg, per_game_share=0.5), log=False)
    assert trainer.matchmaker.plan(0, 1).main == "random"  # the anchor hosts the mcts groups


def test_a_slow_rung_that_takes_every_rung_group_leaves_the_env_to_the_anchor():
    """When the per-game opponent's share covers all of the rung's groups and the rehearsal takes the rest, the env's
    own opponent is the batched anchor with no groups of its own, so the env can host both."""
    plan = plan_groups(groups=4, rung=("mcts:5",), per_game={"mcts:5": True}, anchor="random", per_game_share=0.5,
                       rehearsal=("random", 2))
    assert plan.main == "random" and plan.assigned == (("mcts:5", (0, 1)), ("random", (2, 3)))
    alone = plan_groups(groups=4, rung=("mcts:5",), per_game={"mcts:5": True}, anchor="random", per_game_share=1.0)
    assert alone.main == "mcts:5" and alone.assigned == ()  # nothing to host: the per-game env plays every group
