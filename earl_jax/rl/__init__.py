"""The RL job, by concern (each subpackage may use those listed before it, never one after):

    algorithm/   advantages, losses, log-probs, the optimizer, the micro-batch steps, packing: pure functions
    supervised/  the SFT stage, the format warm-up, expert games and their replay
    matchups/    who the policy plays: curriculum, league, matchmaking, group seeds and plans
    loop/        the RL loop and its stages (rollout, experience, train), weights, checkpoints, metrics
    job/         the command-line job: its config, checks, presets, plots and the selector's profile mode
"""
