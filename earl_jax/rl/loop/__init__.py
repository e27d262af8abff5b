"""The RL loop: the job's typed config, the Trainer (plan -> rollout -> experience -> train -> evaluate -> log), the
run control around it (stop signals, progress), overlapped and partial rollouts, checkpoints, metrics."""
