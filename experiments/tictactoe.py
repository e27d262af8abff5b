"""Train an LLM policy to play Tic-Tac-Toe by RL (same job as connect4.py, other game and presets).

    python experiments/tictactoe.py           # CPU, tiny model, random opponent
    python experiments/tictactoe.py --preset pod   # GPUs: the largest model that fits them
    python experiments/tictactoe.py --preset gpu   # one GPU, 15 minutes: 512 games, random -> solver curriculum
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed

from connect4 import main  # noqa: E402

from earl_jax.rl.config import RLConfig
from earl_jax.rl.gpu_preset import gpu_preset
from earl_jax.rl.pod import pod_preset_for_this_machine

# The board every turn (compact): it is 3 short rows, and in the minimal style the tiny model had to track
# occupied cells from the move history and forfeited every evaluation game (results/tictactoe_cpu_ablations).
# Constrained moves as in connect4.py; a turn discount of 0.6 (later moves, the blocks and wins, get more of the
# outcome's credit): non-loss against random 0.78 -> 0.88 after ~80 iterations (learning_notes.md, section 8).
DEFAULT = RLConfig(game="tic_tac_toe", run_dir="runs/tictactoe", max_turns=9, max_context=512, prompt_style="compact",
                   eval_opponents=("random", "solver"), constrain_moves=True, learning_rate=2e-3, entropy_coef=0.1,
                   entropy_floor=0.5, filter_constant_groups=False, turn_discount=0.6)
PRESETS = {
    "tiny-cpu": lambda: DEFAULT,
    "vs-solver": lambda: dataclasses.replace(DEFAULT, opponent="solver", run_dir="runs/tictactoe-solver"),
    "gpu": lambda: gpu_preset(DEFAULT, "runs/tictactoe-gpu"),  # one GPU, 15 minutes (earl_jax/rl/gpu_preset.py)
    "pod": lambda flags: pod_preset_for_this_machine(flags, DEFAULT),  # sized for this machine (earl_jax/rl/pod.py)
}

if __name__ == "__main__":
    main(sys.argv[1:], default=DEFAULT, presets=PRESETS, name="tictactoe")
