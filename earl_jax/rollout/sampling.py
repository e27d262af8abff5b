"""Token sampling from float32 logits: greedy, temperature, top-k, top-p (nucleus).

The returned log-probability is always that of the *untruncated* tempered distribution,
log_softmax(logits / temperature) at the sampled token (top-k / top-p only decide which token is
drawn). This is the behaviour policy's log-prob as the trainer recomputes it from full logits; greedy
decoding reports log_softmax(logits / temperature) too (temperature <= 0 counts as 1 there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False

    def __post_init__(self):
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig: top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig: top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature <= 0.0


def truncate(scaled: Float[Array, "... v"], top_k: int, top_p: float) -> Float[Array, "... v"]:
    """Mask (to the dtype's lowest value) every token outside the top-k and outside the smallest nucleus of mass
    top_p, over the last axis."""
    neg = jnp.finfo(scaled.dtype).min
    if top_k > 0 and top_k < scaled.shape[-1]:
        sorted_desc, _ = jax.lax.top_k(scaled, top_k)  # b k, descending
    elif top_p < 1.0:
        sorted_desc = -jnp.sort(-scaled, axis=-1)  # full sort only when top-p alone is on
    else:
        return scaled
    if top_p < 1.0:
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p  # the first token is always kept
        sorted_desc = jnp.where(keep, sorted_desc, jnp.inf)
    threshold = jnp.min(sorted_desc, axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, neg)


def _num_chunks(v: int, cap: int = 128) -> int:
    """Largest power of two dividing v, at most cap (151936 = 128 x 1187)."""
    c = 1
    while c < cap and v % (2 * c) == 0:
        c *= 2
    return c


def _uniform_rows(rng: jax.Array, b: int) -> Float[Array, " b"]:
    """One uniform per row: from one key, or from each row's own key (then a row's draw does not depend on
    which other rows share its batch)."""
    if rng.ndim == 0:
        return jax.random.uniform(rng, (b,), jnp.float32)
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(rng)


def _sample_inverse_cdf(rng: jax.Array, scaled: Float[Array, "b v"]) -> tuple[Int[Array, " b"], Float[Array, " b"]]:
    """Exact categorical draw by inverting the CDF, two passes over the logits (max; per-chunk sums of
    exp) plus work on one chunk per row; one uniform per row instead of a Gumbel per vocab entry, and the
    log-normalizer comes out of the same sums. Returns tokens and logsumexp."""
    b, v = scaled.shape
    c = _num_chunks(v)
    cs = v // c
    m = jnp.max(scaled, axis=-1, keepdims=True)
    e = jnp.exp(scaled - m).reshape(b, c, cs)
    chunk = jnp.sum(e, axis=-1)  # b c
    cum = jnp.cumsum(chunk, axis=-1)
    total = cum[:, -1]
    u = _uniform_rows(rng, b) * total
    ci = jnp.minimum(jnp.sum(cum <= u[:, None], axis=-1), c - 1)  # chunk holding u
    before = jnp.where(ci > 0, jnp.take_along_axis(cum, jnp.maximum(ci - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    within = jnp.take_along_axis(e, ci[:, None, None], axis=1)[:, 0]  # b cs
    wcum = jnp.cumsum(within, axis=-1)
    wi = jnp.minimum(jnp.sum(wcum <= (u - before)[:, None], axis=-1), cs - 1)
    # Rounding can push the pick past the chunk's last nonzero entry; fall back to the chunk's mode.
    picked = jnp.take_along_axis(within, wi[:, None], axis=-1)[:, 0]
    wi = jnp.where(picked > 0, wi, jnp.argmax(within, axis=-1))
    return (ci * cs + wi).astype(jnp.int32), m[:, 0] + jnp.log(total)


def program_key(cfg: SamplingConfig) -> SamplingConfig:
    """What a compiled decode program depends on: top-k / top-p change its ops. Temperature and greedy are
    runtime values (`runtime_values`), so greedy evaluations and sampled rollouts share one program per shape
    (the CPU default's first iteration compiled its decode loops twice, once per mode)."""
    return SamplingConfig(top_k=cfg.top_k, top_p=cfg.top_p)


def runtime_values(cfg: SamplingConfig) -> tuple[np.float32, np.bool_]:
    """(temperature, greedy) as scalars for `sample_logits`; temperature <= 0 counts as 1 (greedy log-probs).
    numpy, not jnp: a jnp scalar is an eager device op (~0.3 ms on a GPU host), numpy ones ride the jit call."""
    return np.float32(cfg.temperature if cfg.temperature > 0 else 1.0), np.bool_(cfg.is_greedy)


def sample_logits(rng: jax.Array, logits: Float[Array, "b v"], cfg: SamplingConfig,
                  temperature: jax.Array | None = None, greedy: jax.Array | None = None
                  ) -> tuple[Int[Array, " b"], Float[Array, " b"]]:
    """One token per row and its log-prob under log_softmax(logits / temperature) (untruncated). `rng` is one
    key for the batch, or a key per row ([b]). Given `temperature` and `greedy` (traced values, see
    `runtime_values`), they replace cfg's and both modes run in the same program: the draw is made and, when
    greedy, replaced by the argmax."""
    logits = logits.astype(jnp.float32)
    if temperature is None:
        temperature = cfg.temperature if cfg.temperature > 0 else 1.0
        scaled = logits / temperature if temperature != 1.0 else logits
        greedy = cfg.is_greedy
    else:
        scaled = logits / temperature
    lse = None
    if greedy is True:
        tokens = jnp.argmax(scaled, axis=-1)
    elif cfg.top_k == 0 and cfg.top_p >= 1.0:
        tokens, lse = _sample_inverse_cdf(rng, scaled)
    else:
        masked = truncate(scaled, cfg.top_k, cfg.top_p)
        if rng.ndim == 0:
            tokens = jax.random.categorical(rng, masked, axis=-1)
        else:
            tokens = jax.vmap(lambda k, row: jax.random.categorical(k, row))(rng, masked)
    if greedy is not True and greedy is not False:  # a traced flag: one program for both modes
        tokens = jnp.where(greedy, jnp.argmax(scaled, axis=-1), tokens)
    tokens = tokens.astype(jnp.int32)
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    if lse is None:
        lse = jax.nn.logsumexp(scaled, axis=-1)
    return tokens, picked - lse


def row_keys(rng: jax.Array, row_ids: Int[Array, " b"] | Int[Array, "b 2"]) -> jax.Array:
    """Each row's own key: fold_in(rng, row_ids[r]) for ids [b]; for [b, 2] rows (turn, id), as a pool of games
    whose rows are at different turns passes them, fold_in(fold_in(rng, turn_r), id_r): the same key the
    lock-step loop's fold_in(turn key, id) gives, so what a game samples does not depend on when it started."""
    if row_ids.ndim == 1:
        return jax.vmap(lambda i: jax.random.fold_in(rng, i))(row_ids)
    return jax.vmap(lambda t, i: jax.random.fold_in(jax.random.fold_in(rng, t), i))(row_ids[:, 0], row_ids[:, 1])
