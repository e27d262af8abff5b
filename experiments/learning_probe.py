"""How fast the real Trainer learns an answer that depends on the observation (earl_jax/envs/probe.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=1 taskset -c 1 \\
        python experiments/learning_probe.py --reveal-turn 1 --steps 40 --learning-rate 3e-3

Prints one line per evaluation (greedy success on fixed seeds) and a JSON summary; every RLConfig field
is a flag, plus --reveal-turn, --shift, --hidden for the probe game.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed

from earl_jax.rl.config import RLConfig

# A small probe run: 8 groups of 4 one-digit games, no format warm-up (the probe teaches its own format).
PROBE = RLConfig(groups=8, group_size=4, steps=40, eval_every=5, eval_games=50, format_warmup_steps=0, devices=1,
                 max_turn_tokens=2, max_turns=4, max_context=64, micro_batch_tokens=4096, checkpoint_every=0,
                 progress=False, wandb_mode="disabled", learning_rate=3e-3)


def run_probe(cfg: RLConfig, reveal_turn: int = 0, shift: int = 0, hidden: bool = False, choices: int = 10,
              miss_reward: float = 0.0, verbose: bool = True) -> dict:
    from earl_jax.envs.probe import ShowDigitEnv
    from earl_jax.rl.trainer import Trainer

    t0 = time.perf_counter()
    env = functools.partial(ShowDigitEnv, reveal_turn=reveal_turn, shift=shift, hidden=hidden, choices=choices,
                            miss_reward=miss_reward)
    trainer = Trainer(cfg, log=False, env_factory=env)
    if cfg.format_warmup_steps:
        trainer.format_warmup()
    curve = [(0, trainer.evaluate()["eval/win_rate"])]
    records = []
    while trainer.step < cfg.steps:
        records.append(trainer.iteration())
        if trainer.step % cfg.eval_every == 0 or trainer.step == cfg.steps:
            curve.append((trainer.step, trainer.evaluate()["eval/win_rate"]))
            r = records[-1]
            if verbose:
                print(f"step {trainer.step:3d} greedy {curve[-1][1]:.2f} sampled {r['episode/win_rate']:.2f} "
                      f"invalid {r['episode/invalid_rate']:.2f} entropy {r['train/entropy']:.3f} "
                      f"filtered {r['train/filtered_frac']:.2f} grad {r['train/grad_norm']:.3f} "
                      f"t {time.perf_counter() - t0:.0f}s", flush=True)
    first90 = next((s for s, w in curve if w >= 0.9), None)
    return {"curve": curve, "first_step_greedy_ge_0.9": first90, "wall_s": time.perf_counter() - t0,
            "sampled_win_last5": sum(r["episode/win_rate"] for r in records[-5:]) / max(len(records[-5:]), 1)}


def main(argv=None):
    from earl_jax.cli import parse_config

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--reveal-turn", type=int, default=0)
    p.add_argument("--shift", type=int, default=0)
    p.add_argument("--hidden", action="store_true")
    p.add_argument("--miss-reward", type=float, default=0.0, help="reward of a number that is not the answer")
    p.add_argument("--choices", type=int, default=10, help="the digit shown is one of 0 .. choices-1")
    p.add_argument("--warmup-digits", action="store_true",
                   help="the format warm-up answers a uniformly random digit (the games' warm-up: random legal moves)")
    p.add_argument("--out", default=None, help="append the JSON summary to this file")
    probe, rest = p.parse_known_args(argv)
    if probe.warmup_digits:
        import earl_jax.rl.trainer as trainer_module

        trainer_module._random_legal_answer = lambda rng: lambda context: str(rng.integers(10))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_config(RLConfig, rest, base=dataclasses.replace(PROBE, run_dir=tmp))
        out = run_probe(cfg, probe.reveal_turn, probe.shift, probe.hidden, probe.choices, probe.miss_reward)
    out = {"probe": vars(probe) | {"out": None}, "argv": rest, **out}
    print(json.dumps(out))
    if probe.out:
        with open(probe.out, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
