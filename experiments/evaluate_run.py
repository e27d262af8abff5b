"""Greedy evaluation of a run's newest checkpoint against a list of opponents (the ladder, the solver, MCTS).

    python experiments/evaluate_run.py runs/connect4-gpu --opponents random,alphabeta:1,alphabeta:2,mcts:100
    python experiments/evaluate_run.py runs/tictactoe --opponents random,solver --games 128

The run's own config.json rebuilds the model, tokenizer and game; the checkpoint gives the weights (and the
curriculum's rung, which is evaluated too). Games use the trainer's fixed evaluation seeds, so two runs are
compared on the same openings. Prints a table and writes <run-dir>/evaluation.json (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed


def load_run_config(run_dir: Path, **overrides):
    """The RLConfig a run was started with (config.json), JSON lists back to tuples, with `overrides`."""
    from earl_jax.rl.config import RLConfig

    path = run_dir / "config.json"
    if not path.exists():
        raise SystemExit(f"{run_dir}: no config.json (not a run folder)")
    raw = json.loads(path.read_text())
    hints = typing.get_type_hints(RLConfig)
    known = {f.name for f in dataclasses.fields(RLConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SystemExit(f"{path}: fields this version does not know: {', '.join(unknown)}")
    fields = {k: tuple(v) if isinstance(v, list) and "tuple" in str(hints[k]) else v for k, v in raw.items()}
    return dataclasses.replace(RLConfig(**fields), **overrides)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--opponents", default="random", help="comma-separated: random, alphabeta:D, mcts:N, solver")
    p.add_argument("--games", type=int, default=64, help="greedy games per opponent")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: <run-dir>/evaluation.json)")
    args = p.parse_args(argv)

    from earl_jax.compile_cache import enable_compile_cache
    from earl_jax.rl.trainer import Trainer

    opponents = tuple(o.strip() for o in args.opponents.split(",") if o.strip())
    cfg = load_run_config(args.run_dir, resume=True, eval_opponents=opponents, eval_games=args.games,
                          wandb_mode="disabled", progress=False)
    enable_compile_cache(cfg.compile_cache or None)
    trainer = Trainer(cfg, log=False)  # restores the newest readable checkpoint; writes nothing to the run
    rows = {}
    for name in trainer.matchmaker.eval_opponents():
        t0 = time.perf_counter()
        prefix = "eval/" if name == opponents[0] else f"eval_{name}/"
        r = trainer.evaluate((name,))
        rows[name] = {k[len(prefix):]: float(v) for k, v in r.items() if k.startswith(prefix)}
        rows[name]["seconds"] = time.perf_counter() - t0
        print(f"{name:>14}: win {rows[name]['win_rate']:.3f}  draw {rows[name]['draw_rate']:.3f}  "
              f"loss {rows[name]['loss_rate']:.3f}  invalid {rows[name]['invalid_rate']:.3f}  "
              f"({rows[name]['seconds']:.0f} s)", flush=True)
    result = {"run_dir": str(args.run_dir), "step": trainer.step, "game": cfg.game, "games": args.games,
              "greedy": True, "opponents": rows}
    out = args.out or args.run_dir / "evaluation.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"step {trainer.step}: wrote {out}")
    return result


if __name__ == "__main__":
    main()
