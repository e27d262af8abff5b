"""The later-turn digit probe with constrained moves (learning_notes.md, section 8): greedy success every 10 iterations.

    python experiments/learning_probe_constrained.py plain              # constrained moves alone, lr 1e-3
    python experiments/learning_probe_constrained.py floor              # lr 2e-3, entropy floor, turn discount 0.5
    python experiments/learning_probe_constrained.py floor --hidden     # the control: the digit printed as "?"

2 choices, the digit on turn 2 after a free turn-1 answer, 8 x 8 games, 80 iterations, 50 evaluation games (CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from earl_jax.envs.probe import ShowDigitEnv
from earl_jax.rl.config import RLConfig
from earl_jax.rl.trainer import Trainer

BASE = RLConfig(groups=8, group_size=8, steps=80, format_warmup_steps=0, devices=1, eval_games=50, eval_every=0,
                checkpoint_every=0, max_turns=3, max_context=32, micro_batch_tokens=8192, progress=False,
                wandb_mode="disabled", constrain_moves=True)
SETTINGS = {
    "plain": dict(learning_rate=1e-3),
    "floor": dict(learning_rate=2e-3, entropy_coef=0.1, entropy_floor=0.5, filter_constant_groups=False,
                  turn_discount=0.5),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("setting", choices=sorted(SETTINGS))
    p.add_argument("--hidden", action="store_true")
    args = p.parse_args()
    cfg = dataclasses.replace(BASE, run_dir=f"runs/probe_{args.setting}_{args.hidden}", **SETTINGS[args.setting])
    trainer = Trainer(cfg, log=False, env_factory=functools.partial(
        ShowDigitEnv, choices=2, reveal_turn=1, hidden=args.hidden, warmup_moves=(0, 1)))
    start, curve = time.time(), []
    for i in range(cfg.steps):
        trainer.iteration()
        if (i + 1) % 10 == 0:
            curve.append((i + 1, trainer.evaluate()["eval/win_rate"]))
    print(args.setting, "hidden" if args.hidden else "shown", curve, f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
