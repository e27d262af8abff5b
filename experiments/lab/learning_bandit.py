"""The probe without the Trainer: a one-token contextual bandit on the tiny model, GRPO + Adam, milliseconds a step.

The context is "<bos>d k\\n> " with k drawn from 0 .. K-1 (one k per group of G); ONE token is sampled; reward +1 if
it is the digit k, `miss` for another digit, -1 for anything else. Used to sweep learning rate x batch x group
size quickly (docs/learning.md, "What limits the tiny model"); tests/rl/loop/test_learning.py runs the Trainer-level
probe.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 taskset -c 1 \\
        python experiments/lab/learning_bandit.py K=10 lr=1e-3 B=16 G=8 steps=300
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a clone: no install needed

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from earl_jax.models.model_config import get_config
from earl_jax.models.qwen2 import Qwen2
from earl_jax.models.tokenizer import game_tokenizer


def main(argv: list[str]) -> None:
    kw = dict(a.split("=") for a in argv)
    K, B, G = int(kw.get("K", 2)), int(kw.get("B", 8)), int(kw.get("G", 4))
    lr, steps, seed = float(kw.get("lr", 1e-3)), int(kw.get("steps", 200)), int(kw.get("seed", 0))
    miss, between = float(kw.get("miss", 0.0)), float(kw.get("between", 0.0))
    floor, floor_coef = float(kw.get("floor", 0.0)), float(kw.get("fcoef", 0.1))

    tok = game_tokenizer()
    graphdef, params = nnx.split(Qwen2(get_config("tiny", vocab_size=tok.get_vocab_size()), rngs=nnx.Rngs(seed),
                                       dtype=jnp.float32))
    contexts = jnp.array([[1] + tok.encode(f"d {d}\n> ").ids for d in range(10)], jnp.int32)
    digits = jnp.array([tok.token_to_id(str(k)) for k in range(10)])
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr, b1=0.9, b2=0.99))  # the Trainer's, no schedule
    opt_state = opt.init(params)

    def logp(params, ds):
        logits, _ = nnx.merge(graphdef, params)(contexts[ds])
        return jax.nn.log_softmax(logits[:, -1])

    @jax.jit
    def step(params, opt_state, key):
        k1, k2 = jax.random.split(key)
        ds = jnp.repeat(jax.random.randint(k1, (B,), 0, K), G)  # a group shares its digit (its "seed")
        a = jax.random.categorical(k2, logp(params, ds))
        r = jnp.where(a == digits[ds], 1.0, jnp.where(jnp.isin(a, digits), miss, -1.0))
        rg = r.reshape(B, G)
        adv = (rg - rg.mean(1, keepdims=True)) / (rg.std(1, ddof=1, keepdims=True) + 1e-6)  # GRPO
        if between:
            adv = adv + between * (rg.mean(1, keepdims=True) - r.mean()) / (r.std() + 1e-6)
        adv = adv.reshape(-1)

        def loss(p):
            lp = logp(p, ds)
            entropy = -(jnp.exp(lp) * lp).sum(-1).mean()
            return (-(adv * jnp.take_along_axis(lp, a[:, None], 1)[:, 0]).mean()
                    + floor_coef * jax.nn.relu(floor - entropy))

        updates, opt_state = opt.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, r.mean()

    @jax.jit
    def greedy(params):  # greedy accuracy over the K contexts, and the mean top probability (1 = collapsed)
        lp = logp(params, jnp.arange(K))
        return jnp.mean(jnp.argmax(lp, -1) == digits[:K]), jnp.exp(lp).max(-1).mean()

    key, first, t0 = jax.random.key(seed), None, time.time()
    for t in range(1, steps + 1):
        key, sub = jax.random.split(key)
        params, opt_state, reward = step(params, opt_state, sub)
        if t % 10 == 0:
            acc, top = greedy(params)
            first = t if first is None and float(acc) >= 0.9 else first
            print(f"{t} reward {float(reward):.2f} greedy {float(acc):.2f} top_p {float(top):.3f}", flush=True)
    print("RESULT", " ".join(argv), "first_greedy_ge_0.9", first, "final", float(acc), "top_p", round(float(top), 3),
          f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
