"""Train an LLM policy to play Tic-Tac-Toe by RL (the job of connect4.py, with Tic-Tac-Toe's presets).

    python experiments/tictactoe.py                    # CPU, tiny model, random opponent
    python experiments/tictactoe.py --preset vs-solver # against the perfect solver from the start
    python experiments/tictactoe.py --preset gpu       # one GPU, 15 minutes: random -> solver curriculum
    python experiments/tictactoe.py --preset pod       # GPUs: the largest model that fits them
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed

CONFIGS = Path(__file__).resolve().parent / "configs" / "tictactoe"

if __name__ == "__main__":
    from earl_jax.rl.job.entry import main

    sys.exit(main(name="tictactoe", configs=CONFIGS, description=__doc__))
