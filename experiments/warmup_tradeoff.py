"""What the format warm-up teaches against what it costs: greedy invalid rate after S steps of G games.

    python experiments/warmup_tradeoff.py                       # the settings below, Connect Four CPU default
    python experiments/warmup_tradeoff.py --settings 60x64,20x16 --game tic_tac_toe

For each setting a fresh trainer (same seed, same initial weights) runs the warm-up and then the greedy
evaluation the trainer runs before RL (64 games against random); the JSON records the wall time of both
(compiles included: each setting is a fresh process state only for the trainer's own programs, the JAX
persistent cache is off), the invalid rate, win rate and the warm-up's last SFT loss, with the machine
and its load average named. Wall times on a shared machine are noisy; invalid rates are deterministic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = "0x0,60x64,30x16,20x16,12x16,20x8"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default=SETTINGS, help="STEPSxGAMES,... (0x0: no warm-up)")
    ap.add_argument("--game", default="connect_four")
    ap.add_argument("--out", default="experiments/results/warmup_tradeoff_cpu.json")
    args = ap.parse_args(argv)

    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    from connect4 import DEFAULT as C4
    from tictactoe import DEFAULT as TTT
    from earl_jax.rl.trainer import Trainer

    base = {"connect_four": C4, "tic_tac_toe": TTT}[args.game]
    rows = []
    for setting in args.settings.split(","):
        steps, games = (int(x) for x in setting.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            cfg = dataclasses.replace(base, format_warmup_steps=steps, format_warmup_games=games, run_dir=tmp,
                                      constrain_moves=False,  # the warm-up teaches the free-text answer format
                                      wandb_mode="disabled", progress=False)
            trainer = Trainer(cfg, log=False)
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            warm = trainer.format_warmup() if steps else {}
            t1 = time.perf_counter()
            ev = trainer.evaluate()
            t2 = time.perf_counter()
        row = {"steps": steps, "games": games, "warmup_s": t1 - t0, "eval_s": t2 - t1, "load_avg_1m": load0,
               "sft_loss": warm.get("loss"), **{k: v for k, v in ev.items() if k.startswith("eval/")}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"game": args.game, "machine": f"{platform.node()} {os.cpu_count()} CPUs ({platform.processor() or 'cpu'})",
           "jax": jax.__version__, "note": "greedy evaluation: 64 games vs random, the trainer's pre-RL evaluation",
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
