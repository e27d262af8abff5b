"""How fast does the Tic-Tac-Toe CPU default's tiny model learn from context? Plain supervised loops, no trainer.

Two checks beside experiments/ttt_imitation_check.py (which runs the format warm-up's own machinery):

    turns:     the same solver-imitation games (agent: uniform among the solver's best moves, random opponent,
               compact prompts), plain teacher-forced cross-entropy on the answer tokens with optax.adam at a
               constant learning rate and an own jitted step: if this plateaus too, the trainer's machinery
               (micro-batches, clipping, schedule) is not the cause. --single trains each turn as its own
               sequence (<bos> + that turn's observation + answer): is the multi-turn context the obstacle?
    synthetic: <bos> d1 ' ' d2 ... d5 '\\n' '>' ' ' -> answer, with five distinct digits; --task fixed: the answer
               is d1 (read one fixed position), --task set: any of the five, uniformly (best loss ln 5 = 1.61,
               the kind of target the solver's best set gives).

    python experiments/ttt_learning_speed.py turns --lr 1e-3 --steps 60
    python experiments/ttt_learning_speed.py synthetic --task set --lr 1e-3 --steps 150
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from earl_jax.envs.vector import make_vector_env  # noqa: E402
from earl_jax.rl import trainer as trainer_mod  # noqa: E402
from earl_jax.rl.logprobs import token_logprobs  # noqa: E402
from earl_jax.rl.warmup import random_legal_games  # noqa: E402


def make_trainer(games: int, untied: bool = False):
    from tictactoe import DEFAULT

    from earl_jax.models import config as model_config

    if untied:  # the tiny preset with its own output matrix: output gradients no longer move the input embeddings
        tiny = model_config.ModelConfig.tiny
        model_config.PRESETS["tiny"] = lambda **kw: tiny(**kw).replace(tie_word_embeddings=False)

    cfg = dataclasses.replace(DEFAULT, format_warmup_steps=1, format_warmup_games=games, eval_games=4, devices=1,
                              run_dir="runs/ttt_learning_speed", wandb_mode="disabled", progress=False,
                              checkpoint_every=0)
    return trainer_mod.Trainer(cfg, log=False)


def single_turns(tok: np.ndarray, mask: np.ndarray, eos: int, bos: int) -> tuple[np.ndarray, np.ndarray]:
    """Each answer with its own turn's observation only, as rows of 64 tokens (rows padded to a multiple of 64)."""
    rows = []
    for r in range(len(tok)):
        ends = np.flatnonzero(mask[r] & (tok[r] == eos)) + 1
        for a, b in zip(np.concatenate([[1], ends[:-1]]), ends):  # turn k: after answer k-1's eos up to its own
            rows.append((np.concatenate([[bos], tok[r, a:b]]), np.concatenate([[False], mask[r, a:b]])))
    n = -(-len(rows) // 64) * 64
    t, m = np.zeros((n, 64), np.int32), np.zeros((n, 64), bool)
    for k, (a, b) in enumerate(rows):
        t[k, :len(a)], m[k, :len(b)] = a, b
    return t, m


def digit_cosine(params, digits: list[int]) -> float:
    """Mean pairwise cosine of the digit tokens' embedding rows: near 1, the input cannot tell digits apart."""
    e = np.asarray(params["embed_vd"][...])[digits]
    e = e / np.linalg.norm(e, axis=1, keepdims=True)
    c = e @ e.T
    return float((c.sum() - len(digits)) / (len(digits) * (len(digits) - 1)))


def train(trainer, batches, steps: int, lr: float, eos: int, embed_std: float = 0.0, check=None,
          check_every: int = 0) -> list[dict]:
    digits = [trainer.tokenizer.token_to_id(c) for c in "012345678"]
    if embed_std:  # the same directions, a larger scale: Adam's first steps (~lr per entry) no longer drown them
        e = trainer.params["embed_vd"]
        e.value = e.value * (embed_std / float(jnp.std(e.value)))
    opt = optax.adam(lr)
    params, log = trainer.params, []
    state = opt.init(params)

    @jax.jit
    def step(params, state, tokens, mask):
        def loss_fn(p):
            lp, _ = token_logprobs(nnx.merge(trainer.graphdef, p), tokens)
            m, move = mask.astype(jnp.float32), (mask & (tokens != eos)).astype(jnp.float32)
            return -(lp * m).sum() / m.sum(), -(lp * move).sum() / move.sum()

        (loss, move_loss), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss, move_loss

    t0 = time.perf_counter()
    for i in range(steps):
        tokens, mask = batches(i)
        params, state, loss, move_loss = step(params, state, jnp.asarray(tokens), jnp.asarray(mask))
        if i % 10 == 0 or i == steps - 1:
            log.append({"step": i, "loss": float(loss), "move_loss": float(move_loss),
                        "digit_cosine": round(digit_cosine(params, digits), 3),
                        "seconds": round(time.perf_counter() - t0, 1)})
            if check_every and i and i % check_every == 0:  # the per-move check on the weights so far
                trainer.params = params
                log[-1]["moves"] = check(trainer)
            print(json.dumps(log[-1]), flush=True)
    trainer.params = params
    return log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=["turns", "synthetic"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--games", type=int, default=64, help="turns: games a step")
    p.add_argument("--check-every", type=int, default=0, help="turns: the per-move check every this many steps "
                                                                  "(a multiple of 10; 0: at the end only)")
    p.add_argument("--single", action="store_true", help="turns: each turn its own sequence")
    p.add_argument("--batch", type=int, default=256, help="synthetic: sequences a step")
    p.add_argument("--untied", action="store_true", help="the tiny model with untied input/output embeddings")
    p.add_argument("--embed-std", type=float, default=0.0, help="rescale the initial embeddings to this std "
                                                                     "(0: the preset's 0.02)")
    p.add_argument("--task", choices=["fixed", "set"], default="set", help="synthetic: which listed digit answers")
    p.add_argument("--position", type=int, default=0, help="synthetic fixed: the listed digit (0-4) that answers")
    args = p.parse_args()
    trainer = make_trainer(args.games, args.untied)
    eos, bos = trainer.ids.eos_id, trainer.ids.bos_id
    rng = np.random.default_rng(7)
    if args.check == "turns":
        from ttt_imitation_check import move_accuracy, solver_moves

        env = make_vector_env(trainer.env_cfg, args.games, None)

        def batches(i):
            seeds = [10_000_000 + i * args.games + j for j in range(args.games)]
            tok, mask, _ = random_legal_games(env, trainer.tokenizer, seeds, rng, eos_id=eos, bos_id=bos,
                                              max_context=512, max_turns=9, codec=trainer.codec,
                                              choose=partial(solver_moves, rng))
            if args.single:
                return single_turns(tok, mask, eos, bos)
            return trainer_mod._pad_cols(tok, 192), trainer_mod._pad_cols(mask, 192)  # games are <= 190 tokens
    else:
        ids = [trainer.tokenizer.token_to_id(c) for c in "012345678"]
        sp, nl, gt = (trainer.tokenizer.token_to_id(c) for c in " \n>")

        def batches(i, n=args.batch):
            rows = []
            for d in (rng.permutation(9)[:5] for _ in range(n)):
                answer = d[args.position] if args.task == "fixed" else d[rng.integers(5)]
                listed = [t for x in d for t in (ids[x], sp)][:-1]
                rows.append([bos, *listed, nl, gt, sp, ids[answer], eos])
            tok = np.array(rows, np.int32)
            mask = np.zeros_like(tok, bool)
            mask[:, -2:] = True
            return tok, mask
    check = None
    if args.check == "turns" and not args.single:
        from ttt_imitation_check import move_accuracy as check
    log = train(trainer, batches, args.steps, args.lr, eos, args.embed_std, check, args.check_every)
    out = {"check": args.check, "lr": args.lr, "steps": args.steps, "single": args.single, "task": args.task, "position": args.position,
           "untied": args.untied, "embed_std": args.embed_std,
           "batch": args.batch if args.check == "synthetic" else args.games,
           "log": log}
    if args.check == "turns" and not args.single:
        out["moves"] = move_accuracy(trainer)
        out["moves_solver_positions"] = move_accuracy(trainer, agent="solver")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
