"""The configurations test_golden.py runs: the main jobs' embedded defaults, shortened to a few iterations."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

CASES = ("connect4", "tictactoe", "connect4_free_text")


def golden_config(case: str, run_dir: str):
    import connect4
    import tictactoe

    quiet = dict(run_dir=run_dir, progress=False, wandb_mode="disabled", keep_checkpoints=0)
    if case == "connect4":
        return dataclasses.replace(connect4.DEFAULT, steps=3, **quiet)
    if case == "tictactoe":
        return dataclasses.replace(tictactoe.DEFAULT, steps=3, **quiet)
    if case == "connect4_free_text":  # the decode loop and the format warm-up's supervised steps
        return dataclasses.replace(connect4.DEFAULT, steps=2, constrain_moves=False, format_warmup_steps=2,
                                   groups=8, eval_games=16, **quiet)
    raise ValueError(case)
