"""The configurations test_golden.py runs: the main jobs' embedded defaults, shortened to a few iterations."""

from __future__ import annotations

from pathlib import Path

from earl_jax.rl.job.entry import parse_job

# Connect Four with constrained moves and with free text: the two decode paths and the warm-up; Tic-Tac-Toe's rules
# and the trainer's other paths have their own tests.
CASES = ("connect4", "connect4_free_text")
CONFIGS = Path(__file__).resolve().parents[1] / "experiments" / "configs"


def golden_config(case: str, run_dir: str):
    # random weights against random at 2e-3 in groups of 4, as recorded (the default starts from a shipped base up a
    # curriculum, in groups of 8, since)
    quiet = ["--model.hf-checkpoint", "", "--opponent", "random", "--optim.learning-rate", "2e-3",
             "--rollout.group-size", "4", "--run-dir", run_dir,
             "--run.progress", "false", "--run.wandb-mode", "disabled",
             "--run.keep-checkpoints", "0"]
    if case == "connect4":
        return parse_job(["--steps", "2", *quiet], CONFIGS / "connect4").config
    if case == "connect4_free_text":  # the decode loop and the format warm-up's supervised steps
        return parse_job(["--steps", "2", "--rollout.constrain-moves", "false", "--sft.steps", "2",
                          "--rollout.groups", "4", "--eval.games", "8", *quiet], CONFIGS / "connect4").config
    raise ValueError(case)
