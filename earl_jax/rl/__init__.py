"""The RL job, by concern; a subpackage imports only those above it in this list (tests/test_layering.py):

    algorithm/   advantages, losses, log-probs, the optimizer, the micro-batch steps, packing: pure functions
    matchups/    who the policy plays: curriculum, league, matchmaking, group seeds and plans
    stages/      the rollout, experience and train stages, the policy bundle, weights between layouts, evaluation
    supervised/  the SFT stage, the format warm-up, expert games and their replay
    loop/        the job's typed config, the Trainer, overlap and partial rollouts, checkpoints, metrics
    job/         the command-line job: checks, the pod preset, plots, the selector's profile mode
"""
