"""Can the Tic-Tac-Toe CPU default's model hold the game at all? Supervised steps on the solver's moves.

The RL runs of docs/learning.md plateau at a board-blind move order (non-loss ~0.78 against random,
~0.0-0.05 against the solver). This asks whether the limit is the model or the learning signal: the format
warm-up's machinery (teacher-forced supervised steps on games generated from the rules, no sampling), with the
agent's moves drawn uniformly among the SOLVER's best moves instead of among all legal moves (the control), the
same model, prompts and opponent as `python experiments/tictactoe.py`; then greedy games against random and the
solver. A diagnostic, not a training recipe: it imitates the solver, so it says nothing about what RL learns.

    python experiments/lab/ttt_imitation_check.py --steps 30 150 --games 64 --eval-games 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from earl_jax.envs.vector import make_vector_env  # noqa: E402
from earl_jax.envs.vector.blunders import move_classes  # noqa: E402
from earl_jax.rl.algorithm import optim as optim_mod  # noqa: E402
from earl_jax.rl.job.entry import parse_job  # noqa: E402
from earl_jax.rl.loop import trainer as trainer_mod  # noqa: E402
from earl_jax.rl.stages.experience_stage import pad_cols  # noqa: E402
from earl_jax.rl.supervised import warmup as warmup_mod  # noqa: E402
from earl_jax.rl.supervised.warmup import random_legal_games  # noqa: E402


def solver_moves(rng: np.random.Generator, env, rows: np.ndarray, legal: list[list[int]]) -> np.ndarray:
    """Uniform among the moves that keep the game's exact value (the solver's best set) for the side to move."""
    best, _ = best_and_legal(env, rows)
    return np.array([rng.choice(np.flatnonzero(b)) for b in best], np.int64)


def best_and_legal(env, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The solver's best set and the legal moves of games `rows`, for the side to move (the agent)."""
    agent = env.agent_player[rows]
    me, opp = env.stones[rows, agent], env.stones[rows, 1 - agent]
    classes = move_classes("tic_tac_toe", me, opp, env.legal[rows])
    return classes == classes.max(1, keepdims=True), env.legal[rows].copy()


@jax.jit
def _answer_logits(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    h, _ = model.hidden(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
    return model.logits(h)


def move_accuracy(trainer, games: int = 256, seed: int = 30_000_000, agent: str = "random") -> dict:
    """Per-move check on held-out positions: games against the random opponent where the agent plays random legal
    moves (`agent="random"`) or the solver's (`"solver"`: the positions the imitation trains on), teacher-forced,
    so each answer's logits see exactly the context the rollout would give at that turn. Returns the fraction of agent
    turns where the full-vocabulary argmax is a legal move, and where the argmax among the legal moves (what the
    constrained greedy rollout plays) is in the solver's best set; the latter's chance level beside it."""
    env = make_vector_env(dataclasses.replace(trainer.cfg.env, opponent="random"), games, None)
    turns: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rows, best, legal) per agent turn, in order
    rng = np.random.default_rng(seed)

    def record(env, rows, legal):
        best, lg = best_and_legal(env, rows)
        turns.append((rows.copy(), best, lg))
        pick = best if agent == "solver" else lg
        return np.array([rng.choice(np.flatnonzero(b)) for b in pick], np.int64)

    cfg = trainer.cfg
    tokens, mask, _ = random_legal_games(env, trainer.policy.tokenizer, list(range(seed, seed + games)), rng,
                                         eos_id=trainer.policy.ids.eos_id, bos_id=trainer.policy.ids.bos_id,
                                         max_context=cfg.rollout.max_context, max_turns=cfg.rollout.max_turns,
                                         codec=trainer.policy.codec,
                                         choose=record)
    width = -(-tokens.shape[1] // 64) * 64  # few shapes: one compile
    logits = np.asarray(_answer_logits(trainer.policy.graphdef, trainer.state.params,
                                       jnp.asarray(pad_cols(tokens, width))))
    move_ids = np.array([trainer.policy.tokenizer.token_to_id(str(a)) for a in range(9)])
    first = mask & ~np.pad(mask, ((0, 0), (1, 0)))[:, :-1]  # an answer's first token: the move
    turn_of_row = np.zeros(games, np.int64)
    legal_hit, best_hit, chance, legal_chance = [], [], [], []
    for rows, best, legal in turns:
        for r, b, lg in zip(rows, best, legal):
            pos = np.flatnonzero(first[r])[turn_of_row[r]]
            turn_of_row[r] += 1
            assert tokens[r, pos] in move_ids[lg]  # the answer lines up with this turn's record
            row = logits[r, pos - 1]  # the hidden state before the answer predicts it
            top = int(np.argmax(row))
            legal_hit.append(top in move_ids[lg])
            masked = np.where(lg, row[move_ids], -np.inf)
            best_hit.append(b[int(np.argmax(masked))])
            chance.append(b.sum() / lg.sum())
            legal_chance.append(lg.sum() / len(lg))  # a uniform digit 0-8 is legal this often
    best_hit, chance = np.array(best_hit), np.array(chance)
    decisive = chance < 1  # positions where some legal move is worse than the best (a wrong move exists)
    return {"positions": len(best_hit), "argmax_legal": float(np.mean(legal_hit)),
            "legal_by_chance": float(np.mean(legal_chance)),
            "legal_argmax_best": float(best_hit.mean()), "best_by_chance": float(chance.mean()),
            "decisive_positions": int(decisive.sum()), "decisive_best": float(best_hit[decisive].mean()),
            "decisive_best_by_chance": float(chance[decisive].mean())}


def run(policy: str, steps: int, games: int, eval_games: int, run_dir: Path, model: str, lr: float = 3e-3,
        warmup: int = 5, schedule: str = "cosine", every: int = 0) -> dict:
    flags = ["--model", model, "--sft.steps", str(steps), "--sft.games", str(games), "--eval.games",
             str(eval_games), "--devices", "1", "--run-dir", str(run_dir), "--run.wandb-mode", "disabled",
             "--run.progress", "false", "--run.checkpoint-every", "0"]
    cfg = parse_job(flags, ROOT / "experiments" / "configs" / "tictactoe").config  # tictactoe.py's default and these
    rng = np.random.default_rng(7)
    choose = partial(solver_moves, rng) if policy == "solver" else None
    trainer = trainer_mod.Trainer(cfg, log=False)
    # the warm-up's optimizer at this check's settings ("constant": a cosine too long to decay within the run)
    total = max(steps, warmup + 1) if schedule == "cosine" else 1000 * max(steps, 1)
    make_optimizer = optim_mod.make_optimizer
    optimizer = make_optimizer(lr, warmup, total, 0.0, cfg.optim.grad_clip)
    curve = []

    def data(*args, **kw):  # runs before each step: the per-move check every `every` steps, on the weights so far
        if every and data.calls and data.calls % every == 0:
            curve.append({"step": data.calls, **move_accuracy(trainer)})
            print(json.dumps(curve[-1]), flush=True)
        data.calls += 1
        return random_legal_games(*args, choose=choose, **kw)

    data.calls = 0
    original = warmup_mod.random_legal_games
    warmup_mod.random_legal_games = data
    optim_mod.make_optimizer = lambda *a, **k: optimizer  # what the format warm-up builds its optimizer with
    kept = trainer.policy
    trainer.policy = dataclasses.replace(kept, moves=None)  # supervised over the whole vocabulary
    try:
        t0 = time.perf_counter()
        sft = trainer.format_warmup() if steps else {}
        seconds = time.perf_counter() - t0
    finally:
        warmup_mod.random_legal_games = original
        optim_mod.make_optimizer = make_optimizer
        trainer.policy = kept
    ev = trainer.evaluate(("random", "solver"))
    out = {"policy": policy, "model": model, "steps": steps, "games_per_step": games, "lr": lr, "warmup": warmup,
           "schedule": schedule, "sft_seconds": round(seconds, 1), "sft_loss": sft.get("loss"),
           "vs_random_non_loss": ev["eval/win_rate"] + ev["eval/draw_rate"], "vs_random_win": ev["eval/win_rate"],
           "vs_solver_non_loss": ev["eval_solver/win_rate"] + ev["eval_solver/draw_rate"],
           "moves": move_accuracy(trainer), "moves_solver_positions": move_accuracy(trainer, agent="solver"),
           "curve": curve}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[30, 150])
    p.add_argument("--games", type=int, default=64)
    p.add_argument("--eval-games", type=int, default=512)
    p.add_argument("--policies", nargs="+", default=["solver", "random"], choices=["solver", "random"])
    p.add_argument("--model", default="tiny", help="model preset (the CPU default's: tiny)")
    p.add_argument("--lr", type=float, nargs="+", default=[3e-3], help="peak learning rates (one run each)")
    p.add_argument("--warmup", type=int, default=5, help="linear warm-up steps of the schedule")
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--every", type=int, default=0, help="per-move check every this many steps (0: at the end only)")
    p.add_argument("--out", type=Path, default=Path("experiments/results/ttt_imitation_check_cpu.json"))
    args = p.parse_args()
    rows = [run(pol, n, args.games, args.eval_games, Path("runs/ttt_imitation") / f"{args.model}_{pol}_{n}", args.model,
                lr, args.warmup, args.schedule, args.every)
            for n in args.steps for lr in args.lr for pol in args.policies]
    data = json.loads(args.out.read_text()) if args.out.exists() else {"what": __doc__.splitlines()[0],
                                                                       "machine": "2-core CPU", "runs": []}
    data["runs"].append({"command": " ".join(sys.argv), "rows": rows})  # one entry per invocation
    args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
