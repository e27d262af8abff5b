"""The RL loop: the Trainer (plan -> rollout -> experience -> train -> evaluate -> log), its stages, the policy's
weights moved between layouts, overlap and partial rollouts, checkpoints, evaluation and metrics."""
