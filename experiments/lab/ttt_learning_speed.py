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

    python experiments/lab/ttt_learning_speed.py turns --lr 1e-3 --steps 60
    python experiments/lab/ttt_learning_speed.py synthetic --task set --lr 1e-3 --steps 150

Probes of the plateau (learning notes 16), each a change to the tiny model or its optimiser, monkeypatched here
(teacher-forced forward only): --qk-norm (RMSNorm on each head's q and k, as Qwen3), --attn-scale (attention logits
times this), --pos (rope; rope+abs: learned absolute positions added to the embeddings; abs: those without RoPE;
none), --logit-scale (output logits times this), --embed-mult (input embeddings times this), --model (overrides of
the tiny preset, e.g. num_hidden_layers=2,hidden_size=256), --init-scale (multiply the initial parameters of these
names, e.g. o_nhd=0,down_fd=0), --b2/--eps/--warmup/--embed-lr-mult (Adam), --seed.

    python experiments/lab/ttt_learning_speed.py synthetic --task set --lr 3e-4 --steps 150 --log-every 5 \
        --logit-scale 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # ttt_imitation_check.py beside it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from earl_jax.envs.vector import make_vector_env  # noqa: E402
from earl_jax.rl.algorithm.logprobs import token_logprobs  # noqa: E402
from earl_jax.rl.job.entry import parse_job  # noqa: E402
from earl_jax.rl.loop import trainer as trainer_mod  # noqa: E402
from earl_jax.rl.stages.experience_stage import pad_cols  # noqa: E402
from earl_jax.rl.supervised.warmup import random_legal_games  # noqa: E402


def make_trainer(games: int, untied: bool = False, model: dict | None = None, seed: int = 0):
    from earl_jax.models import config as model_config

    over = dict(model or {}, **({"tie_word_embeddings": False} if untied else {}))  # untied: own output matrix
    if over:
        tiny = model_config.ModelConfig.tiny
        model_config.PRESETS["tiny"] = lambda **kw: tiny(**kw).replace(**over)

    flags = ["--sft.steps", "1", "--sft.games", str(games), "--eval.games", "4", "--devices", "1", "--run-dir",
             "runs/ttt_learning_speed", "--run.wandb-mode", "disabled", "--run.progress", "false",
             "--run.checkpoint-every", "0", "--seed", str(seed)]
    cfg = parse_job(flags, ROOT / "experiments" / "configs" / "tictactoe").config  # tictactoe.py's default and these
    return trainer_mod.Trainer(cfg, log=False)


def patch_model(qk_norm: bool, attn_scale: float, pos: str, logit_scale: float = 1.0, embed_mult: float = 1.0,
                max_pos: int = 512) -> None:
    """Monkeypatch the Qwen2 classes before the trainer builds its model (a probe, not the real option)."""
    from earl_jax.models import qwen2

    if logit_scale != 1.0:  # the output logits times a constant (a fixed inverse temperature)
        logits = qwen2.Qwen2.logits
        qwen2.Qwen2.logits = lambda self, h: logits(self, h) * logit_scale
    if embed_mult != 1.0 or pos in ("rope+abs", "abs"):  # Qwen2.hidden with the input changed
        model_init = qwen2.Qwen2.__init__

        def init_model(self, cfg, *, rngs, **kw):
            model_init(self, cfg, rngs=rngs, **kw)
            if pos in ("rope+abs", "abs"):  # learned absolute positions, added to the token embeddings
                self.pos_pd = qwen2._param(rngs, (max_pos, cfg.hidden_size), (None, "embed"), jnp.float32)

        def hidden(self, tokens, positions, cache=None):
            assert cache is None, "probe patches cover the teacher-forced forward only"
            x = jnp.take(self.embed_vd[...], tokens, axis=0) * embed_mult  # Gemma scales by sqrt(d)
            if pos in ("rope+abs", "abs"):
                x = x + jnp.take(self.pos_pd[...], positions, axis=0)
            x = x.astype(self.dtype)
            for layer in self.layers:
                x, _ = qwen2._apply_layer(layer, x, positions, None, getattr(self, "remat", False))
            return self.final_norm(x), None

        qwen2.Qwen2.__init__, qwen2.Qwen2.hidden = init_model, hidden
    if not qk_norm and attn_scale == 1.0 and pos == "rope":
        return
    from earl_jax.sharding.context import constrain

    def head_norm(x, scale, eps):  # RMSNorm over head_dim, statistics in float32
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (scale[...].astype(jnp.float32) * x32).astype(x.dtype)

    attn_init = qwen2.Attention.__init__

    def init(self, cfg, *, dtype, param_dtype, rngs):
        attn_init(self, cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if qk_norm:
            h = cfg.dim_per_head
            self.q_norm = qwen2._param(rngs, (h,), ("head_dim",), param_dtype, init="ones")
            self.k_norm = qwen2._param(rngs, (h,), ("head_dim",), param_dtype, init="ones")

    def call(self, x, positions, cache):
        cfg = self.cfg
        bias = (lambda name: getattr(self, name)) if cfg.attention_bias else (lambda name: None)
        q = self._proj(x, self.q_dnh, bias("q_bias"), ("batch", "length", "act_heads", None))
        k = self._proj(x, self.k_dkh, bias("k_bias"), ("batch", "length", "act_kv_heads", None))
        v = self._proj(x, self.v_dkh, bias("v_bias"), ("batch", "length", "act_kv_heads", None))
        if qk_norm:
            q, k = head_norm(q, self.q_norm, cfg.rms_norm_eps), head_norm(k, self.k_norm, cfg.rms_norm_eps)
        q = q * attn_scale
        if pos in ("rope", "rope+abs"):
            q, k = qwen2.rope(q, positions, cfg.rope_theta), qwen2.rope(k, positions, cfg.rope_theta)
        assert cache is None, "probe patches cover the teacher-forced forward only"
        out = constrain(qwen2.causal_attention(q, k, v), ("batch", "length", "act_heads", None))
        return jnp.einsum("btnh,nhd->btd", out, self.o_nhd[...].astype(self.dtype)), cache

    qwen2.Attention.__init__, qwen2.Attention.__call__ = init, call


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


def rescale_init(params, factors: dict[str, float]) -> None:
    """Multiply every initial parameter named by a key of `factors` (e.g. {"o_nhd": 0.0}: all layers' o)."""
    for path, var in nnx.to_flat_state(params):
        name = str(path[-1])
        if name in factors:
            var.set_value(var.get_value() * factors[name])


def make_opt(lr: float, b2: float = 0.999, eps: float = 1e-8, warmup: int = 0, embed_lr_mult: float = 1.0):
    """Adam at a constant lr (a linear warm-up over `warmup` steps if given); the embedding's updates times
    `embed_lr_mult`."""
    sched = optax.linear_schedule(0.0, lr, warmup) if warmup else lr
    opt = optax.adam(sched, b2=b2, eps=eps)
    if embed_lr_mult == 1.0:
        return opt
    labels = lambda p: jax.tree.map_with_path(  # noqa: E731
        lambda kp, _: "embed" if "embed_vd" in jax.tree_util.keystr(kp) else "rest", p)
    return optax.chain(opt, optax.multi_transform({"embed": optax.scale(embed_lr_mult), "rest": optax.identity()},
                                                  labels))


def train(trainer, batches, steps: int, lr: float, eos: int, embed_std: float = 0.0, check=None,
          check_every: int = 0, opt=None, init_scale: dict | None = None, log_every: int = 10) -> list[dict]:
    digits = [trainer.policy.tokenizer.token_to_id(c) for c in "012345678"]
    if embed_std:  # the same directions, a larger scale: Adam's first steps (~lr per entry) no longer drown them
        e = trainer.state.params["embed_vd"]
        e.value = e.value * (embed_std / float(jnp.std(e.value)))
    if init_scale:
        rescale_init(trainer.state.params, init_scale)
    opt = opt or optax.adam(lr)
    params, log = trainer.state.params, []
    state = opt.init(params)

    @jax.jit
    def step(params, state, tokens, mask):
        def loss_fn(p):
            lp, _ = token_logprobs(nnx.merge(trainer.policy.graphdef, p), tokens)
            m, move = mask.astype(jnp.float32), (mask & (tokens != eos)).astype(jnp.float32)
            return -(lp * m).sum() / m.sum(), -(lp * move).sum() / move.sum()

        (loss, move_loss), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss, move_loss

    t0 = time.perf_counter()
    for i in range(steps):
        tokens, mask = batches(i)
        params, state, loss, move_loss = step(params, state, jnp.asarray(tokens), jnp.asarray(mask))
        if i % log_every == 0 or i == steps - 1:
            log.append({"step": i, "loss": float(loss), "move_loss": float(move_loss),
                        "digit_cosine": round(digit_cosine(params, digits), 3),
                        "seconds": round(time.perf_counter() - t0, 1)})
            if check_every and i and i % check_every == 0:  # the per-move check on the weights so far
                trainer.state.params = params
                log[-1]["moves"] = check(trainer)
            print(json.dumps(log[-1]), flush=True)
    trainer.state.params = params
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
    p.add_argument("--seed", type=int, default=0, help="model init seed (the data's stream is seed + 7)")
    p.add_argument("--log-every", type=int, default=10)
    probes = p.add_argument_group("plateau probes (learning notes 16)")
    probes.add_argument("--qk-norm", action="store_true", help="RMSNorm (learned scale) on each head's q and k")
    probes.add_argument("--attn-scale", type=float, default=1.0, help="attention logits times this")
    probes.add_argument("--pos", choices=["rope", "rope+abs", "abs", "none"], default="rope",
                        help="abs: learned absolute position embeddings added to the token embeddings")
    probes.add_argument("--logit-scale", type=float, default=1.0, help="output logits times this")
    probes.add_argument("--embed-mult", type=float, default=1.0, help="input embeddings times this")
    probes.add_argument("--model", default="", help="tiny preset overrides, e.g. num_hidden_layers=2,hidden_size=256")
    probes.add_argument("--init-scale", default="", help="multiply initial params by name, e.g. o_nhd=0,down_fd=0.35")
    probes.add_argument("--b2", type=float, default=0.999)
    probes.add_argument("--eps", type=float, default=1e-8)
    probes.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps")
    probes.add_argument("--embed-lr-mult", type=float, default=1.0)
    args = p.parse_args()
    kv = lambda text, cast: {k: cast(v) for k, v in (x.split("=") for x in text.split(",") if x)}  # noqa: E731
    model, init_scale = kv(args.model, int), kv(args.init_scale, float)
    patch_model(args.qk_norm, args.attn_scale, args.pos, args.logit_scale, args.embed_mult)
    trainer = make_trainer(args.games, args.untied, model, args.seed)
    eos, bos = trainer.policy.ids.eos_id, trainer.policy.ids.bos_id
    rng = np.random.default_rng(7 + args.seed)
    if args.check == "turns":
        from ttt_imitation_check import move_accuracy, solver_moves

        env = make_vector_env(trainer.cfg.env, args.games, None)

        def batches(i):
            seeds = [10_000_000 + i * args.games + j for j in range(args.games)]
            tok, mask, _ = random_legal_games(env, trainer.policy.tokenizer, seeds, rng, eos_id=eos, bos_id=bos,
                                              max_context=512, max_turns=9, codec=trainer.policy.codec,
                                              choose=partial(solver_moves, rng))
            if args.single:
                return single_turns(tok, mask, eos, bos)
            return pad_cols(tok, 192), pad_cols(mask, 192)  # games are <= 190 tokens
    else:
        ids = [trainer.policy.tokenizer.token_to_id(c) for c in "012345678"]
        sp, nl, gt = (trainer.policy.tokenizer.token_to_id(c) for c in " \n>")

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
    opt = make_opt(args.lr, args.b2, args.eps, args.warmup, args.embed_lr_mult)
    log = train(trainer, batches, args.steps, args.lr, eos, args.embed_std, check, args.check_every, opt, init_scale,
                args.log_every)
    out = {"check": args.check, "lr": args.lr, "steps": args.steps, "single": args.single, "task": args.task,
           "position": args.position,
           "untied": args.untied, "embed_std": args.embed_std,
           "batch": args.batch if args.check == "synthetic" else args.games}
    probe = {"seed": args.seed, "qk_norm": args.qk_norm, "attn_scale": args.attn_scale, "pos": args.pos,
             "logit_scale": args.logit_scale, "embed_mult": args.embed_mult, "model": model,
             "init_scale": init_scale, "b2": args.b2, "eps": args.eps, "warmup": args.warmup,
             "embed_lr_mult": args.embed_lr_mult}
    defaults = {"seed": 0, "qk_norm": False, "attn_scale": 1.0, "pos": "rope", "logit_scale": 1.0, "embed_mult": 1.0,
                "model": {}, "init_scale": {},
                "b2": 0.999, "eps": 1e-8, "warmup": 0, "embed_lr_mult": 1.0}
    out.update({k: v for k, v in probe.items() if v != defaults[k]}, log=log)  # only what differs from the default
    if args.check == "turns" and not args.single:
        out["moves"] = move_accuracy(trainer)
        out["moves_solver_positions"] = move_accuracy(trainer, agent="solver")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
