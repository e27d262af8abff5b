"""The generic job: train an LLM policy by RL on any multi-turn text task (a Gymnasium env, earl_jax/tasks/).

    python experiments/train.py                                         # embedded default: guess-the-number, CPU
    python experiments/train.py --preset arithmetic                     # the calculator tool task
    python experiments/train.py --env.task my_tasks:make --env.task-args '{"level": 2}'
    python experiments/train.py --env.task earl_jax/GuessNumber-v0      # a registered Gymnasium id
    python experiments/train.py --help                                  # every field, grouped by component

A task is any `gymnasium.Env` with text observations and answers (earl_jax/tasks/protocol.py, docs/fork.md "Bring
your own task"). Evaluation plays the task's held-out split. The run folder (--run-dir) receives config.json,
metrics.jsonl, checkpoints/ and curves.png; experiments/evaluate_run.py evaluates it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed

CONFIGS = Path(__file__).resolve().parent / "configs" / "train"

if __name__ == "__main__":
    from earl_jax.rl.job.entry import main

    sys.exit(main(name="train", configs=CONFIGS, description=__doc__))
