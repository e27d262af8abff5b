"""The main job: train an LLM policy to play Connect Four by RL.

    python experiments/connect4.py                          # embedded default: CPU, tiny base, curriculum
    python experiments/connect4.py --help                   # every field, grouped by component
    python experiments/connect4.py --preset gpu             # one GPU, 15 minutes (configs/connect4/gpu.toml)
    python experiments/connect4.py --preset pod             # GPUs: the largest model that fits them (rl/job/pod.py)
    python experiments/connect4.py --preset qwen0.5b --model.hf-checkpoint /path/to/Qwen2.5-0.5B-Instruct
    python experiments/connect4.py --config my.toml --rollout.temperature 0.7

The run folder (--run-dir) receives config.json, metrics.jsonl, checkpoints/ and curves.png.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed

CONFIGS = Path(__file__).resolve().parent / "configs" / "connect4"

if __name__ == "__main__":
    from earl_jax.rl.job.entry import main

    sys.exit(main(name="connect4", configs=CONFIGS, description=__doc__))
