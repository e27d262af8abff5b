"""Experience and train on real tokens: every micro-batch holds rows of similar length, cut to its own width.

Games end at very different lengths, and a batch padded to the longest spends most of its compute on
padding (CPU default: mean ~165 tokens, rows of 512). Instead of packing several games into one row
(segment ids through every attention kernel), rows are *grouped by length*:

1. `length_order` sorts the rows by length (longest first) and deals them round-robin over the batch
   shards, so that `split_rows`' micro-batch j (the j-th slice of every shard's block) holds the
   consecutive ranks j*m*D .. (j+1)*m*D - 1: rows of similar length, spread over every device;
2. `micro_batch_widths` gives each micro-batch the width bucket of its longest row (a row's length up to its last
   scored token, `scored_spans`: the result text that ends a game is never computed) (`WIDTH_BUCKETS`: powers of
   two and the 1.5x steps between), and `length_split` splits the batch into more micro-batches than the plan's
   memory bound asks for when that cuts the padded tokens by more than `SPLIT_GAIN` (the plan's micro-batch is a
   cap: a smaller one needs less memory);
3. `micro_batch_plan` asks the planner's program service (parallel/shapes.py) which width each micro-batch runs at
   (few new widths compile per iteration; the rest run wider, and compiling ahead the narrower ones compile in the
   background); `grouped_logprobs` / `grouped_update` run the model's program once per micro-batch shape (rows,
   width bucket). Cutting a micro-batch out and writing its log-probs back are separate small programs, so the
   model's programs do not depend on the batch's own padded width or split (on a GPU each new one cost 4-8 s for
   the tiny model, in most of a run's first dozen iterations). Columns past a
   row's length are padding and, with causal attention, change no log-prob before them, so the results equal the
   padded computation (tests/rl/algorithm/test_packing.py).

The number of model programs is bounded by the width buckets times the micro-batch row counts (the rows per
shard over its divisors). The memory model plans for the widest micro-batch
(the batch's width), which bounds the peak; the throughput metrics count real tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Int

from earl_jax.parallel.planner import MicroBatches, StageRun
from earl_jax.rl.algorithm import micro_steps as stages
from earl_jax.rl.algorithm.losses import LossConfig
from earl_jax.rollout.buckets import DEFAULT_LENGTH_BUCKETS, bucket, scored_spans  # noqa: F401 (re-exported)
from earl_jax.rollout.compile_ahead import spec_of
from earl_jax.sharding.context import constrain

# the narrowest experience / train width: short games (probes, the first turns) are not padded to 64 tokens
# (a probe's 9-token games trained 3x faster at 16; widths stay a bounded set of buckets)
MIN_WIDTH = 16
# Micro-batch widths: powers of two and, from 192 up, the 1.5x steps between (multiples of 64 for GPU kernels):
# a long micro-batch pays at most 1.5x its longest row; short ones keep few programs (the suite from a cold
# compile cache grew 170 s with 1.5x steps from 48 and SPLIT_GAIN 0.15, 139 s with these: not yet found where).
WIDTH_BUCKETS = tuple(sorted({MIN_WIDTH, 32, 64, 128, *(1 << p for p in range(8, 18)),
                              *(3 << p for p in range(6, 17))}))
MIN_SPLIT_ROWS = 8  # rows per batch shard below which length_split does not go (tiny matmuls, more launches)
SPLIT_GAIN = 0.25  # a finer split must cut the padded tokens by more than this share to be worth its programs


def batch_width(t: int) -> int:
    """The padded width of a batch whose longest row has t tokens (a bounded set of shapes)."""
    return max(MIN_WIDTH, bucket(t, DEFAULT_LENGTH_BUCKETS))


def mini_batch_rows(n: int, count: int, shards: int) -> list[Int[np.ndarray, " m"]]:
    """The rows of each of `count` PPO mini-batches of an n-row batch: contiguous equal slices, so whole GRPO groups
    when `count` divides the groups (games are laid out group after group); each must split over the batch shards."""
    if n % count or (n // count) % shards:
        raise ValueError(f"--optim.ppo-mini-batches {count}: {n} rows do not make {count} mini-batches of whole "
                         f"batch shards ({shards} here); use a count that divides the games into multiples of "
                         f"{shards}")
    return list(np.arange(n).reshape(count, n // count))


def length_order(lengths: Int[np.ndarray, " n"], shards: int) -> Int[np.ndarray, " n"]:
    """perm: row i of the arranged batch is row perm[i] of the original. Rank k (k-th longest) goes to shard
    k % shards, position k // shards of its block."""
    n = len(lengths)
    if n % shards:
        raise ValueError(f"{n} rows do not split over {shards} batch shards")
    ranks = np.argsort(-np.asarray(lengths), kind="stable")
    k = np.arange(n)
    perm = np.empty(n, np.int64)
    perm[(k % shards) * (n // shards) + k // shards] = ranks
    return perm


def micro_batch_widths(arranged_lengths: Int[np.ndarray, " n"], micro: MicroBatches, full_width: int) -> list[int]:
    """Each micro-batch's width: the WIDTH_BUCKETS bucket of its longest row (at most the batch's width)."""
    split = arranged_lengths.reshape(micro.shards, micro.count, -1).swapaxes(0, 1).reshape(micro.count, -1)
    return [min(full_width, max(MIN_WIDTH, bucket(int(m), WIDTH_BUCKETS))) for m in split.max(axis=1)]


def length_split(run: StageRun, arranged_lengths: Int[np.ndarray, " n"], full_width: int, enabled: bool = True
                 ) -> tuple[MicroBatches, list[int]]:
    """The micro-batches (and their widths) a stage computes a length-arranged batch in: the plan's split
    (`run.micro_batches`, the fewest its memory allows) or, when `enabled`, a finer one: among the splits into
    as many or more micro-batches with at least MIN_SPLIT_ROWS rows per shard, the coarsest whose padded tokens
    are within SPLIT_GAIN of the finest's (one long game no longer widens every row; equal lengths stay one
    micro-batch)."""
    n = len(arranged_lengths)
    plan = run.micro_batches(n)
    if not enabled:
        return plan, micro_batch_widths(arranged_lengths, plan, full_width)
    per_shard = n // plan.shards
    counts = [k for k in range(plan.count, per_shard + 1)
              if per_shard % k == 0 and (k == plan.count or per_shard // k >= MIN_SPLIT_ROWS)]
    options = []
    for k in counts:
        micro = MicroBatches(k, n // k, plan.shards)
        widths = micro_batch_widths(arranged_lengths, micro, full_width)
        options.append((micro, widths, micro.rows * sum(widths)))
    finest = min(padded for *_, padded in options)
    micro, widths, _ = next(o for o in options if o[2] <= finest * (1 + SPLIT_GAIN))
    return micro, widths


def micro_batch_plan(run: StageRun, arranged_lengths: Int[np.ndarray, " n"], full_width: int
                     ) -> tuple[MicroBatches, list[int], list[int]]:
    """(the micro-batches a stage computes a length-arranged batch in, the width each runs at, the widths put off,
    now compiling in the background): `length_split`'s, finer than the plan only where the planner's program service
    allows it, at the widths the service chooses (parallel/shapes.py)."""
    micro, wanted = length_split(run, arranged_lengths, full_width, run.shapes.finer_split)
    program = (run.stage, str(run.layout.mesh), micro.rows, micro.shards, run.layout.logprob_chunk)
    return (micro, *run.shapes.widths(program, wanted))


def _zeros_like_rows(x):
    return constrain(jnp.zeros(x.shape, jnp.float32), ("batch", None))


def grouped_logprobs(run: StageRun, params: nnx.State, tokens: jax.Array, widths: list[int], micro: MicroBatches, *,
                     graphdef: nnx.GraphDef, choices: jax.Array | None = None, choice_tokens: tuple[int, ...] = (),
                     deferred: Sequence[int] = ()) -> jax.Array:
    """log p of every token, micro-batch j computed at widths[j]: the model's program is compiled per micro-batch
    shape (rows, width), whatever the batch's own width and split; cutting and writing back are cheap programs.
    `deferred`: widths whose programs compile ahead, in the background (`micro_batch_plan`: the next iterations')."""
    split = dict(micro_batches=micro.count, shards=micro.shards)
    out = run.jit("zeros", _zeros_like_rows)(tokens)
    model = run.jit("logprobs", stages.micro_logprobs, graphdef=graphdef, chunk=run.layout.logprob_chunk,
                    choice_tokens=choice_tokens)
    put = run.jit("put_logprobs", stages.put_micro, donate=(0,), **split)
    for j, width in enumerate(widths):
        tok, ch = run.jit("micro_tokens", stages.micro_batch, **split, width=width)((tokens, choices), j)
        logp = model(params, tok, ch)
        if j == 0 and deferred:
            for w in deferred:
                run.ahead(model, params, spec_of(tok, w), _maybe_spec(ch, w))
            # and the small programs that cut a micro-batch at those widths and write its log-probs back: else
            # they compile on the critical path when the width is first used (0.3-0.5 s an iteration on one H100)
            for w in deferred:  # one cutting program per width (its width is static)
                run.ahead(run.jit("micro_tokens", stages.micro_batch, **split, width=w), (tokens, choices), 0)
            for w in deferred:
                run.ahead(put, out, spec_of(logp, w), 0)
        out = put(out, logp, j)
    return out


def _maybe_spec(x, width: int | None = None):
    return None if x is None else spec_of(x, width)


def grouped_update(run: StageRun, params: nnx.State, opt_state: Any, batch: stages.ExperienceBatch,
                   widths: list[int], micro: MicroBatches, *, graphdef: nnx.GraphDef, loss: str,
                   loss_cfg: LossConfig | None, optimizer: optax.GradientTransformation, token_weighted: bool,
                   choice_tokens: tuple[int, ...] = (), deferred: Sequence[int] | None = None
                   ) -> tuple[nnx.State, Any, dict[str, jax.Array]]:
    """One optimizer step: gradients accumulated over the micro-batches, each at its width, then applied
    (skipped when not finite). Donates `params` and `opt_state`. `deferred`: as in `grouped_logprobs`, and the update
    compiles ahead beside the first gradient; None: nothing ahead (the SFT stage's few steps)."""
    chunk = run.layout.logprob_chunk
    acc = run.jit(f"{loss}_zero", stages.zero_acc, graphdef=graphdef, loss=loss, loss_cfg=loss_cfg,
                  chunk=chunk, choice_tokens=choice_tokens)(params, batch)
    # zero_acc's outputs depend on no input, so jit leaves them uncommitted on one device; placed as the gradient
    # will be (the weights' shardings, scalars replicated) and committed, the grad program always sees one layout
    # (and a program compiled ahead for these specs is the one the call finds)
    replicated = NamedSharding(run.mesh, PartitionSpec())
    acc = jax.device_put(acc, (jax.tree.map(lambda p: p.sharding, params),
                               *jax.tree.map(lambda _: replicated, tuple(acc[1:]))))
    model = run.jit(f"{loss}_grad", stages.micro_grad, donate=(1,), graphdef=graphdef, loss=loss, loss_cfg=loss_cfg,
                    chunk=chunk, choice_tokens=choice_tokens)
    apply = run.jit(f"{loss}_apply", stages.apply_step, donate=(0, 1), optimizer=optimizer)
    if deferred is not None:  # compiles beside the first gradient program
        run.ahead(apply, params, opt_state, acc)

    def take(width: int):
        return run.jit("micro_batch", stages.take_micro, micro_batches=micro.count, shards=micro.shards, width=width,
                       token_weighted=token_weighted)

    for j, width in enumerate(widths):  # the grad program per micro-batch shape, as in grouped_logprobs
        mb, w = take(width)(batch, j)
        if j == 0 and deferred:  # specs before the call: it donates the accumulator
            for v in deferred:
                run.ahead(model, params, acc, jax.tree.map(lambda x: spec_of(x, v), mb), w, output_as_arg=1)
            for v in deferred:  # the cut at those widths too (as in grouped_logprobs)
                run.ahead(take(v), batch, 0)
        acc = model(params, acc, mb, w)
    return apply(params, opt_state, acc)


def _take_rows(batch, index):
    return jax.tree.map(lambda x: constrain(jnp.take(x, index, axis=0), ("batch",) + (None,) * (x.ndim - 1)), batch)


def rearrange(run: StageRun, batch: Any, index: Int[np.ndarray, " n"]) -> Any:
    """Rows `index` of every leaf (row i <- row index[i]), in the stage's row sharding; nothing when identity."""
    if np.array_equal(index, np.arange(len(index))):
        return batch
    return run.jit("rearrange", _take_rows)(batch, run.put_rows({"i": index.astype(np.int32)})["i"])
