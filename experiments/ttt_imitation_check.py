"""Can the Tic-Tac-Toe CPU default's model hold the game at all? Supervised steps on the solver's moves.

The RL runs of learning_notes.md (sections 8-11) plateau at a board-blind move order (non-loss ~0.78 against random,
~0.0-0.05 against the solver). This asks whether the limit is the model or the learning signal: the format
warm-up's machinery (teacher-forced supervised steps on games generated from the rules, no sampling), with the
agent's moves drawn uniformly among the SOLVER's best moves instead of among all legal moves (the control), the
same model, prompts and opponent as `python experiments/tictactoe.py`; then greedy games against random and the
solver. A diagnostic, not a training recipe: it imitates the solver, so it says nothing about what RL learns.

    python experiments/ttt_imitation_check.py --steps 30 150 --games 64 --eval-games 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from earl_jax.envs.vector import tic_tac_toe  # noqa: E402
from earl_jax.envs.vector.blunders import move_classes  # noqa: E402
from earl_jax.rl import trainer as trainer_mod  # noqa: E402
from earl_jax.rl.warmup import random_legal_games  # noqa: E402


def solver_moves(rng: np.random.Generator, env, rows: np.ndarray, legal: list[list[int]]) -> np.ndarray:
    """Uniform among the moves that keep the game's exact value (the solver's best set) for the side to move."""
    agent = env.agent_player[rows]
    me, opp = env.stones[rows, agent], env.stones[rows, 1 - agent]
    classes = move_classes("tic_tac_toe", me, opp, env.legal[rows])
    best = classes == classes.max(1, keepdims=True)
    return np.array([rng.choice(np.flatnonzero(b)) for b in best], np.int64)


def run(policy: str, steps: int, games: int, eval_games: int, run_dir: Path, model: str) -> dict:
    from tictactoe import DEFAULT

    cfg = dataclasses.replace(DEFAULT, model=model, format_warmup_steps=steps, format_warmup_games=games, eval_games=eval_games,
                              devices=1, run_dir=str(run_dir), wandb_mode="disabled", progress=False,
                              checkpoint_every=0)
    rng = np.random.default_rng(7)
    choose = partial(solver_moves, rng) if policy == "solver" else None
    original = trainer_mod.random_legal_games
    trainer_mod.random_legal_games = partial(random_legal_games, choose=choose)
    try:
        trainer = trainer_mod.Trainer(cfg, log=False)
        t0 = time.perf_counter()
        sft = trainer.format_warmup() if steps else {}
        seconds = time.perf_counter() - t0
    finally:
        trainer_mod.random_legal_games = original
    ev = trainer.evaluate(("random", "solver"))
    out = {"policy": policy, "model": model, "steps": steps, "games_per_step": games, "sft_seconds": round(seconds, 1),
           "sft_loss": sft.get("loss"),
           "vs_random_non_loss": ev["eval/win_rate"] + ev["eval/draw_rate"], "vs_random_win": ev["eval/win_rate"],
           "vs_solver_non_loss": ev["eval_solver/win_rate"] + ev["eval_solver/draw_rate"]}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[30, 150])
    p.add_argument("--games", type=int, default=64)
    p.add_argument("--eval-games", type=int, default=512)
    p.add_argument("--policies", nargs="+", default=["solver", "random"], choices=["solver", "random"])
    p.add_argument("--model", default="tiny", help="model preset (the CPU default's: tiny)")
    p.add_argument("--out", type=Path, default=Path("experiments/results/ttt_imitation_check_cpu.json"))
    args = p.parse_args()
    rows = [run(pol, n, args.games, args.eval_games, Path("runs/ttt_imitation") / f"{args.model}_{pol}_{n}", args.model)
            for n in args.steps for pol in args.policies]
    data = json.loads(args.out.read_text()) if args.out.exists() else {"what": __doc__.splitlines()[0],
                                                                       "machine": "2-core CPU", "runs": []}
    data["runs"].append({"command": " ".join(sys.argv), "rows": rows})  # one entry per invocation
    args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
