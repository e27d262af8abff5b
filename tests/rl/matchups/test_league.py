"""Opponents that keep teaching: the curriculum (promotion, resume, bad input), the league of frozen snapshots,
and the trainer playing both."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np
import pytest

from earl_jax.cli import ConfigError
from earl_jax.rl.job import entry as job_cli
from earl_jax.rl.job.validate import check_job
from earl_jax.rl.loop.metrics import read_metrics
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.rl.matchups.curriculum import Curriculum, parse_ladder
from earl_jax.rl.matchups.league import League
from earl_jax.rl.stages.evaluation import Evaluator
from jobs import job, with_fields

SMALL = job(groups=4, group_size=2, run__steps=2, eval__every=1, eval__games=4, sft__steps=0, devices=2,
            checkpoint_every=1, max_turns=6, max_context=256, micro_batch_tokens=1024)
CONFIGS = Path(__file__).resolve().parents[3] / "experiments" / "configs"


# ---- curriculum ------------------------------------------------------------------------------------------
def test_ladders_parse_and_default_per_game():
    assert parse_ladder(" random , alphabeta:1 ", "connect_four") == ("random", "alphabeta:1")
    assert parse_ladder("", "connect_four")[-1] == "alphabeta:3"
    assert parse_ladder("", "tic_tac_toe")[-1] == "solver"


@pytest.mark.parametrize("kw, flag", [
    (dict(opponent="curriculum", curriculum__ladder="random,alphabeta:x"), "--curriculum.ladder"),
    # a solver budget of 0 nodes; a rung of one opponent twice
    (dict(opponent="curriculum", curriculum__ladder="random,solver:0"), "--curriculum.ladder"),
    (dict(opponent="curriculum", curriculum__ladder="random,alphabeta:1+alphabeta:1"), "--curriculum.ladder"),
    (dict(opponent="curriculum", curriculum__ladder="random,,curriculum"), "--curriculum.ladder"),
    (dict(opponent="curriculum", game="tic_tac_toe", curriculum__ladder="random,alphabeta:2"), "--curriculum.ladder"),
    # a ladder without the opponent
    (dict(opponent="random", curriculum__ladder="random,alphabeta:1"), "--curriculum.ladder"),
    (dict(opponent="curriculum", promote_at=0.0), "--curriculum.promote-at"),
    (dict(opponent="curriculum", promote_at=1.2), "--curriculum.promote-at"),
    (dict(opponent="curriculum", promote_on_stall=-1), "--curriculum.promote-on-stall"),
    (dict(opponent="random", promote_on_stall=2), "--curriculum.promote-on-stall"),  # no rung to leave
    (dict(opponent="curriculum", rung_max_iterations=-1), "--curriculum.rung-max-iterations"),
    (dict(opponent="random", rung_max_iterations=100), "--curriculum.rung-max-iterations"),
    (dict(mix_opponent="alphabeta:x"), "--curriculum.mix-opponent"),
    (dict(mix_opponent="random,solver", game="tic_tac_toe"), "--curriculum.mix-opponent"),  # one opponent
    (dict(mix_opponent="minimax:2"), "--curriculum.mix-opponent"),  # not an opponent here
    (dict(mix_opponent="alphabeta:1", league_size=2), "--curriculum.mix-opponent"),
    (dict(mix_opponent="alphabeta:1", mix_share=1.0), "--curriculum.mix-share"),
    (dict(mix_opponent="alphabeta:1", groups=1), "--curriculum.mix-opponent"),
    (dict(opponent="curriculum", rehearsal_share=1.0), "--curriculum.rehearsal-share"),
    (dict(opponent="curriculum", rehearsal_share=-0.1), "--curriculum.rehearsal-share"),
    (dict(opponent="random", rehearsal_share=0.25), "--curriculum.rehearsal-share"),  # no rungs to replay
    (dict(opponent="curriculum", rehearsal_share=0.25, groups=1), "--curriculum.rehearsal-share"),
    (dict(opponent="curriculum", rehearsal_share=0.25, mix_opponent="alphabeta:1"), "--curriculum.rehearsal-share"),
    # rehearsal and the league share a batch, but must leave the rung a group
    (dict(opponent="curriculum", rehearsal_share=0.5, league_size=2, league_share=0.5, groups=4),
     "--curriculum.rehearsal-share"),
    (dict(opponent="curriculum", per_game_share=0.0), "--curriculum.per-game-share"),
    (dict(league_share=0.0), "--curriculum.league-share"),
    (dict(league_every=0), "--curriculum.league-every"),
    (dict(league_size=-1), "--curriculum.league-size"),
])
def test_bad_curriculum_and_league_input_names_the_flag(kw, flag):
    """Refused when the config is made (one component, or across them) or by the job's checks at start (the ladder
    and opponents against the game's rules), as one line that starts with the flag."""
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        check_job(job(**kw))


def test_bad_ladder_on_the_command_line_exits_naming_the_flag(capsys):
    argv = ["--opponent", "curriculum", "--curriculum.ladder", "random,alphabeta:0"]
    assert job_cli.main(argv, name="connect4", configs=CONFIGS / "connect4") == 2
    err = capsys.readouterr().err
    assert err.startswith("connect4: error: --curriculum.ladder: ") and err.count("\n") == 1, err


def test_curriculum_climbs_one_rung_at_a_time_and_stays_at_the_top():
    c = Curriculum(("random", "alphabeta:1", "alphabeta:2"), promote_at=0.8)
    assert c.observe(0.79, 1) is None and c.opponent == "random"
    assert "promoted at iteration 2 from random to alphabeta:1" in c.observe(0.8, 2)
    assert c.observe(1.0, 3) and c.opponent == "alphabeta:2" and c.at_top
    assert c.observe(1.0, 4) is None and c.rung == 2
    resumed = Curriculum(("random", "alphabeta:1", "alphabeta:2"), promote_at=0.8)
    resumed.load_state_dict(c.state_dict())
    assert resumed.rung == 2 and resumed.promotions == c.promotions
    with pytest.warns(UserWarning, match="--curriculum.ladder changed"):
        other = Curriculum(("random", "alphabeta:2", "alphabeta:3"), promote_at=0.8)
        other.load_state_dict(c.state_dict())
    assert other.opponent == "alphabeta:2"


def test_a_stalled_rung_is_left_only_when_asked_and_the_count_survives_resume():
    ladder = ("random", "alphabeta:1", "alphabeta:2")
    flat = Curriculum(ladder, promote_at=0.8)  # off: a flat curve below the bar never promotes
    assert all(flat.observe(0.7, s) is None for s in range(20)) and flat.rung == 0
    losing = Curriculum(ladder, promote_at=0.8, promote_on_stall=2)  # stuck while losing: stays (the floor)
    assert all(losing.observe(0.3, s) is None for s in range(10)) and losing.rung == 0 and losing.stalled == 9
    c = Curriculum(ladder, promote_at=0.8, promote_on_stall=3)
    # 0.5 sets the best; 0.51 is within STALL_DELTA (a stall); 0.6 a new best; then three stalls promote
    assert [c.observe(w, s) for s, w in enumerate([0.5, 0.51, 0.6, 0.6])] == [None] * 4
    assert c.stalled == 1 and c.best == 0.6
    resumed = Curriculum(ladder, promote_at=0.8, promote_on_stall=3)
    resumed.load_state_dict(c.state_dict())
    assert (resumed.best, resumed.stalled) == (0.6, 1)
    assert resumed.observe(0.55, 4) is None
    line = resumed.observe(0.61, 5)
    assert "from random to alphabeta:1" in line and "stalled: 3 evaluations" in line
    assert (resumed.best, resumed.stalled) == (-1.0, 0)  # the new rung starts its own count
    assert resumed.metrics()["curriculum/stalled_evals"] == 0
    assert resumed.observe(0.85, 6) and resumed.at_top  # the bar still promotes at once
    assert all(resumed.observe(0.1, s) is None for s in range(7, 12))  # nothing above the top


def test_a_rung_is_left_when_its_budget_is_spent_and_the_budget_survives_resume():
    ladder = ("random", "alphabeta:1", "alphabeta:2")
    c = Curriculum(ladder, promote_at=0.8, rung_max_iterations=100)
    assert [c.observe(0.1, s) for s in (0, 20, 99)] == [None] * 3  # losing, under budget: stays (no floor here)
    line = c.observe(0.1, 100)
    assert "from random to alphabeta:1" in line and "budget: 100 iterations" in line
    assert c.rung_start == 100 and c.metrics()["curriculum/rung_start"] == 100
    assert c.observe(0.3, 150) is None  # the new rung's budget counts from its own start
    resumed = Curriculum(ladder, promote_at=0.8, rung_max_iterations=100)
    resumed.load_state_dict(c.state_dict())
    assert resumed.rung_start == 100 and resumed.observe(0.3, 199) is None
    assert "budget: 120 iterations" in resumed.observe(0.3, 220) and resumed.at_top
    assert resumed.observe(0.0, 1000) is None  # the last rung has no budget: it keeps the rest of the run
    early = Curriculum(ladder, promote_at=0.8, rung_max_iterations=100)
    assert "win rate 0.85 >= 0.80" in early.observe(0.85, 10)  # the bar still promotes before the budget
    with pytest.raises(ValueError, match="rung_max_iterations"):
        Curriculum(ladder, promote_at=0.8, rung_max_iterations=-5)


def test_trainer_leaves_a_stalled_rung_from_the_flag(tmp_path, monkeypatch):
    cfg = with_fields(SMALL, opponent="curriculum", curriculum__ladder="random,alphabeta:1", promote_on_stall=1,
                      rung_max_iterations=50, run_dir=str(tmp_path / "run"))
    forced = iter([0.5, 0.5, 0.5])  # before iteration 1: the rung's best; after 1: no better, a stall: promote

    def evaluate(self, opponents=None):
        win = next(forced)
        return {"eval/win_rate": win, "eval/draw_rate": 0.0, "eval/loss_rate": 1 - win, "eval/invalid_rate": 0.0,
                "curriculum/eval_win_rate": win}

    monkeypatch.setattr(Evaluator, "__call__", evaluate)
    trainer = Trainer(cfg, log=False)
    assert trainer.matchmaker.curriculum.promote_on_stall == 1
    assert trainer.matchmaker.curriculum.rung_max_iterations == 50  # the flag reaches the rung that obeys it
    history = trainer.run()
    assert [r["curriculum/opponent"] for r in history] == ["random", "alphabeta:1"]


def test_trainer_promotes_on_a_forced_evaluation_and_the_rung_survives_resume(tmp_path, monkeypatch, caplog):
    cfg = with_fields(SMALL, opponent="curriculum", curriculum__ladder="random,alphabeta:1,alphabeta:2",
                      promote_at=0.75, run_dir=str(tmp_path / "run"))
    forced = iter([0.5, 0.9, 0.2])  # before iteration 1: stay; after 1: promote; after 2: stay

    def evaluate(self, opponents=None):
        win = next(forced)
        return {"eval/win_rate": win, "eval/draw_rate": 0.0, "eval/loss_rate": 1 - win, "eval/invalid_rate": 0.0,
                "curriculum/eval_win_rate": win}

    monkeypatch.setattr(Evaluator, "__call__", evaluate)
    trainer = Trainer(cfg)
    assert trainer.env.config.opponent == "random"
    with caplog.at_level(logging.INFO, logger="earl_jax"):
        history = trainer.run()
    # the rung each iteration trained on: promoted by the evaluation after iteration 1
    assert [r["curriculum/opponent"] for r in history] == ["random", "alphabeta:1"]
    assert [r["curriculum/promotions"] for r in history] == [0, 1]
    assert trainer.matchmaker.curriculum.rung == 1 and trainer.env.config.opponent == "alphabeta:1"
    assert any("promoted at iteration 1 from random to alphabeta:1" in r.message for r in caplog.records)
    logged = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["curriculum/rung"] for r in logged if r["step"] >= 1] == [0, 1]

    resumed = Trainer(with_fields(cfg, run__steps=3, resume="true"))
    assert resumed.step == 2 and resumed.matchmaker.curriculum.rung == 1
    assert resumed.env.config.opponent == "alphabeta:1"
    forced = iter([0.1])
    record = resumed.run()[-1]
    assert record["step"] == 3 and record["curriculum/opponent"] == "alphabeta:1"


def test_mixed_opponents_reach_the_training_env_as_whole_groups(tmp_path):
    cfg = with_fields(SMALL, mix_opponent="alphabeta:1", mix_share=0.5, run_dir=str(tmp_path / "run"),
                      eval__every=0)
    trainer = Trainer(cfg, log=False)
    mixed = trainer.env.second_opponent_games  # groups of 2: the last two of four groups
    assert mixed.tolist() == [False] * 4 + [True] * 4
    record = trainer.iteration()
    assert record["mix/games_frac"] == 0.5 and 0 <= record["mix/win_rate"] <= 1
    assert trainer.env.second_opponent_games.tolist() == mixed.tolist()  # still assigned after the rollout
    assert Trainer(with_fields(cfg, mix_opponent="", run_dir=str(tmp_path / "plain")),
                   log=False).env.second_opponent_games.sum() == 0
    # mcts:5 has no batched version: it plays its groups one game at a time inside the batched env
    mcts = Trainer(with_fields(cfg, mix_opponent="mcts:5", run_dir=str(tmp_path / "mcts")), log=False)
    assert mcts.env.second_opponent == "mcts:5" and mcts.env.second_opponent_games.tolist() == mixed.tolist()


def test_rehearsal_replays_the_rungs_below_in_turn_in_the_last_groups(tmp_path, monkeypatch):
    """What the matchmaker decides is what the rollout's env plays: nothing on rung 0, then the rungs below the
    current one in turn, in whole groups at the batch's end, with the outcomes logged apart."""
    cfg = with_fields(SMALL, opponent="curriculum", curriculum__ladder="random,alphabeta:1,alphabeta:2",
                      rehearsal_share=0.5, run__steps=4, eval__every=0, run_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, log=False)
    assert trainer.env.second_opponent is None and trainer.matchmaker.mix_games() is None  # rung 0: none below
    played = []
    real_play = Trainer.play

    def rollout(self, env, *a, **kw):  # what the iteration's env holds when its games are played
        played.append((env.config.opponent, env.second_opponent, env.second_opponent_games.tolist()))
        return real_play(self, env, *a, **kw)

    monkeypatch.setattr(Trainer, "play", rollout)
    record = trainer.iteration()
    assert record["rehearsal/rung"] == -1 and "mix/games_frac" not in record
    trainer.matchmaker.curriculum.rung = 2
    records = [trainer.iteration() for _ in range(3)]  # iterations 1, 2, 3: rung 1 % 2, 2 % 2, 3 % 2
    last_two_groups = [False] * 4 + [True] * 4  # 4 groups of 2, share 0.5
    assert played == [("random", None, [False] * 8)] + [
        ("alphabeta:2", rung, last_two_groups) for rung in ("alphabeta:1", "random", "alphabeta:1")]
    assert [r["rehearsal/rung"] for r in records] == [1, 0, 1]
    assert all(r["mix/games_frac"] == 0.5 and 0 <= r["mix/win_rate"] <= 1 for r in records)


def test_evaluation_plays_the_current_rung(tmp_path):
    cfg = with_fields(SMALL, opponent="curriculum", curriculum__ladder="random,alphabeta:1", eval__games=2,
                      run_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, log=False)
    trainer.matchmaker.curriculum.rung = 1
    out = trainer.evaluate()
    assert set(trainer.evaluate.envs) == {"random", "alphabeta:1"}
    assert out["curriculum/eval_win_rate"] == out["eval_alphabeta:1/win_rate"] and "eval/win_rate" in out
    # no evaluation opponents of its own: the rung is still played (it decides promotions)
    bare = Trainer(with_fields(cfg, eval__opponents=(), run_dir=str(tmp_path / "bare")), log=False)
    bare.matchmaker.curriculum.rung = 1
    assert set(bare.evaluate()) == {f"eval_alphabeta:1/{k}_rate" for k in ("win", "draw", "loss", "invalid")} | {
        "curriculum/eval_win_rate"}


# ---- league ----------------------------------------------------------------------------------------------
def test_league_keeps_at_most_k_snapshots_on_a_schedule_and_samples_them_all():
    league = League(size=2, every=3)
    params = {"w": np.zeros(3, np.float32)}
    added = [league.maybe_add(s, {"w": params["w"] + s}) for s in range(10)]
    assert added == [s % 3 == 0 for s in range(10)]
    assert league.steps == [6, 9] and len(league) == 2
    assert league.snapshots[0][1]["w"][0] == 6  # the snapshot holds that step's values
    drawn = {league.sample(0, step)[0] for step in range(20)}
    assert drawn == {6, 9}
    assert league.sample(0, 5)[0] == league.sample(0, 5)[0]  # deterministic per (seed, step)
    empty = League(size=2, every=100)
    assert empty.maybe_add(7, params)  # an empty league (a resumed run) takes a snapshot at once


@pytest.mark.parametrize("constrain", [False, True])
def test_league_iterations_play_frozen_snapshots_that_do_not_train(tmp_path, constrain):
    """With constrained moves the frozen snapshot draws among its legal moves too: it never needs the fallback."""
    cfg = with_fields(SMALL, run__steps=3, eval__every=0, checkpoint_every=0, league_size=2, league_every=1,
                      league_share=0.5, run_dir=str(tmp_path / "run"), constrain_moves=constrain)
    trainer = Trainer(cfg, log=False)
    before = [np.array(x) for x in jax.tree.leaves(trainer.state.params)]
    history = trainer.run()
    league = trainer.matchmaker.league
    assert league.steps == [1, 2]  # at most K = 2, one per iteration
    r = history[-1]
    assert r["league/games_frac"] == 0.5 and r["league/size"] == 2 and r["league/snapshot_step"] in (1, 2)
    assert 0 <= r["league/win_rate"] <= 1 and 0 <= r["league/opponent_fallback_rate"] <= 1
    if constrain:
        assert trainer.env.policy_moves > 0 and r["league/opponent_fallback_rate"] == 0.0
    # snapshot 1 holds the weights after iteration 1, and training on does not touch it
    snap1 = jax.tree.leaves(league.snapshots[0][1])
    now = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]
    assert all(isinstance(x, np.ndarray) for x in snap1)
    assert any(not np.array_equal(a, b) for a, b in zip(snap1, now))
    assert any(not np.array_equal(a, b) for a, b in zip(snap1, before))
    copy = [x.copy() for x in snap1]
    trainer.iteration()
    assert all(np.array_equal(a, b) for a, b in zip(copy, snap1))


def test_league_refuses_an_env_without_the_batched_path():
    with pytest.raises(ValueError, match="--curriculum.league-size"):
        Trainer(with_fields(SMALL, league_size=2, opponent="mcts:5"), log=False)


# ---- the GPU preset --------------------------------------------------------------------------------------
@pytest.mark.parametrize("script, last_rung", [("connect4", "alphabeta:3+mcts:50"), ("tictactoe", "solver")])
def test_gpu_preset_parses_validates_and_yields_to_flags(script, last_rung):
    """`--preset gpu` is experiments/configs/<script>/gpu.toml over the script's default; flags typed after it win."""
    configs = CONFIGS / script
    default = job_cli.parse_job([], configs).config
    cfg = job_cli.parse_job(["--preset", "gpu"], configs).config
    check_job(cfg)
    r, c = cfg.rollout, cfg.curriculum
    assert cfg.batch_size == 2048 and r.group_size == 8
    assert cfg.env.prompt_style == ("minimal" if script == "connect4" else "compact")  # Connect Four: its base's
    assert cfg.env.opponent == "curriculum" and parse_ladder(c.ladder, cfg.env.game)[-1] == last_rung
    assert cfg.env.game == default.env.game and cfg.run.run_dir.endswith("-gpu")
    assert cfg.run.max_minutes == 15
    assert (cfg.optim.learning_rate, cfg.eval.games, cfg.sft.steps, cfg.sft.games) == (5e-4, 128, 30, 256)
    if script == "connect4":  # the fields measured on Connect Four only
        assert (cfg.optim.ppo_mini_batches, r.group_seeds, c.promote_on_stall, c.rehearsal_share,
                c.rung_max_share, c.per_game_share) == (8, "per_game", 3, 0.5, 0.25, 0.25)
    else:
        assert (cfg.optim.ppo_mini_batches, c.rehearsal_share, c.rung_max_iterations) == (1, 0.0, 0)
    flags = ["--preset", "gpu", "--curriculum.promote-at", "0.9", "--curriculum.rehearsal-share", "0",
             "--curriculum.league-size", "4"]
    cfg = job_cli.parse_job(flags, configs).config
    assert cfg.curriculum.promote_at == 0.9 and cfg.curriculum.league_size == 4 and cfg.batch_size == 2048
    with pytest.raises(ConfigError, match="^--curriculum.promote-at: "):
        job_cli.parse_job(["--preset", "gpu", "--curriculum.promote-at", "1.5"], configs)


def test_league_refuses_a_ladder_with_a_per_game_rung_at_start():
    cfg = with_fields(SMALL, game="tic_tac_toe", opponent="curriculum", curriculum__ladder="random,mcts:5,solver",
                      league_size=2)
    with pytest.raises(ValueError, match="--curriculum.league-size.*mcts:5"):
        Trainer(cfg, log=False)
