"""The Parallelism Selector's profile mode on real hardware: tokens per device per second (TGS) of each stage, measured
on the same code the trainer runs (the Sampler; the experience and train stages through `StageRun`, so a
measured layout is split into micro-batches and chunks exactly as the trainer would).

    measure = RealMeasure(get_config("qwen2.5-0.5b"))
    table = profile_rows(memory, measure, contexts=[1024, 8192], responses=[8, 32], stages=("rollout",),
                         num_devices=2, device_kind=jax.devices()[0].device_kind, save=Path("profile.json"))

`profile_rows` measures one context row at a time in the given order and saves the table after each, so a
call cut short by its time budget (or a timeout) still leaves a usable table.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from earl_jax.models.model_config import ModelConfig
from earl_jax.parallel.memory import MemoryModel, candidate_meshes
from earl_jax.parallel.plan import StageLayout
from earl_jax.parallel.planner import ProgramCache, StageRun
from earl_jax.parallel.profile import ProfileTable, run_profile
from earl_jax.rl.algorithm.losses import LossConfig
from earl_jax.sharding.mesh import MeshShape, logical_sharding, make_mesh
from earl_jax.sharding.stage_registry import STAGE_RULES

LOSS = LossConfig(filter_constant_groups=False)  # GRPO and PPO-clip, the job's default loss


class RealMeasure:
    """Measures TGS (tokens per device per second) on the real code, random weights in bf16:

    * rollout: a `Sampler` on the candidate mesh; the state's KV cache is filled directly with random
      keys/values for `context_len - decode_steps` tokens in each of `num_responses` rows (no prefill), then
      `generate` of `decode_steps` new tokens (ending at `context_len`, so the cache is `context_len`'s
      bucket), stop tokens ignored; TGS = rows x decode_steps / seconds / devices.
    * experience: the trainer's `experience_stage` (old-policy log-probs by micro-batches and vocabulary chunks
      as the layout says, advantages) over `num_responses` x `context_len` random tokens; TGS = tokens / seconds /
      devices.
    * train: one call of the trainer's `train_stage` (float32 masters, bf16 compute, per-layer remat, AdamW,
      GRPO and PPO-clip), micro-batched as the layout says.
    Each is the median of `repeats` after a warm-up (compile) call. Models are cached per mesh, one
    stage's models at a time (one model for train)."""

    def __init__(self, cfg: ModelConfig, *, decode_steps: int = 16, repeats: int = 2, seed: int = 0):
        self.cfg, self.decode_steps, self.repeats, self.seed = cfg, decode_steps, repeats, seed
        self._models: dict = {}
        self.programs = ProgramCache()

    def _run(self, stage: str, layout: StageLayout) -> tuple[StageRun, nnx.GraphDef, nnx.State]:
        from earl_jax.models.init import init_sharded

        key = (stage, layout.mesh)
        if key not in self._models:
            # one stage's models at a time, and one train model: its float32 masters (12 GiB per device for a
            # replicated 3B) are outside what the memory model gives the next mesh's cell (Fig. 3's 3B train stage
            # ran out of memory in the cell after d4f1t1 with ~98% of the GPU in use)
            for k in [k for k in self._models if k[0] != stage or stage == "train"]:
                del self._models[k]
            mesh = make_mesh(layout.mesh, jax.devices()[:layout.mesh.size])
            # train holds float32 masters (bf16 compute, per-layer remat as the memory model assumes)
            kw = dict(param_dtype=jnp.float32, remat=True) if stage == "train" else dict(param_dtype=jnp.bfloat16)
            model = init_sharded(self.cfg, mesh, STAGE_RULES[stage], seed=self.seed, dtype=jnp.bfloat16, **kw)
            graphdef, params = nnx.split(model)
            self._models[key] = (mesh, graphdef, params)
        mesh, graphdef, params = self._models[key]
        return StageRun(stage, layout, mesh, STAGE_RULES[stage], self.programs), graphdef, params

    def __call__(self, stage: str, mesh: MeshShape, context_len: int, num_responses: int,
                 layout: StageLayout | None = None) -> float:
        layout = layout or StageLayout(mesh, None if stage == "rollout" else 1, None if stage == "rollout" else 1024)
        if stage == "rollout":
            return self.rollout(layout, context_len, num_responses)
        if stage == "experience":
            return self.experience(layout, context_len, num_responses)
        if stage == "train":
            return self.train(layout, context_len, num_responses)
        raise ValueError(f"unknown stage {stage!r}")

    def _timed(self, fn) -> float:
        """Median seconds of `fn()` over `repeats` calls after one warm-up call."""
        times = []
        for _ in range(self.repeats + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def _random_rows(self, run: StageRun, n: int, t: int, key: int):
        sharding = logical_sharding(run.mesh, run.rules, ("batch", "length"), (n, t))
        return jax.device_put(jax.random.randint(jax.random.key(key), (n, t), 0, self.cfg.vocab_size), sharding)

    def _batch(self, context_len: int, num_responses: int):
        """A host batch as the rollout hands it to the experience stage: random tokens, every position scored, groups
        of 2 (GRPO needs a group), random rewards; and each row's scored span (the whole row)."""
        from earl_jax.rl.stages.experience_stage import RolloutBatch

        rng = np.random.default_rng(self.seed)
        shape = (num_responses, context_len)
        batch = RolloutBatch(tokens=rng.integers(0, self.cfg.vocab_size, shape).astype(np.int32),
                             loss_mask=np.ones(shape, bool), rewards=rng.standard_normal(shape).astype(np.float32),
                             group_ids=(np.arange(num_responses) // 2).astype(np.int32))
        return batch, np.full(num_responses, context_len)

    def _experience(self, run: StageRun, graphdef, params, batch, spans):
        """The trainer's experience stage; its micro-batches at their own widths, as the plan splits them (the
        ProgramCache's default program service: nothing compiled ahead)."""
        from earl_jax.rl.stages.experience_stage import experience_stage

        return experience_stage(run, params, None, batch, spans, graphdef=graphdef, loss=LOSS,
                                num_groups=-(-len(spans) // 2))

    def train(self, layout: StageLayout, context_len: int, num_responses: int) -> float:
        """One `train_stage` call (the trainer's: length-grouped micro-batches, PPO-clip, AdamW) on an experience
        batch made by `experience_stage` on the same layout (not timed)."""
        from earl_jax.parallel.dispatch import Dispatcher
        from earl_jax.rl.algorithm.optim import make_optimizer
        from earl_jax.rl.stages.train_stage import train_stage

        run, graphdef, params = self._run("train", layout)
        optimizer = make_optimizer(1e-6, 10, 1000, 0.0, 1.0)
        batch, spans = self._batch(context_len, num_responses)
        experience = self._experience(run, graphdef, params, batch, spans)  # on the train layout
        dispatcher = Dispatcher()
        # The step donates the weights it updates: the cached ones go in and the updated ones come back to the cache,
        # so the cell holds one float32 copy as the trainer does (a copy kept beside them is memory the memory model
        # does not count: a replicated 3B's 12 GiB per device).
        del self._models[("train", layout.mesh)]
        state = [params, jax.jit(optimizer.init)(params)]
        del params

        def once():
            state[0], state[1], metrics = train_stage(run, state[0], state[1], experience, dispatcher,
                                                      graphdef=graphdef, loss=LOSS, optimizer=optimizer,
                                                      epochs=1, mini_batches=1)
            return metrics["loss"]

        seconds = self._timed(once)
        self._models[("train", layout.mesh)] = (run.mesh, graphdef, state[0])
        state.clear()  # its weights (not `del`: `once` still closes over the list)
        return num_responses * context_len / seconds / layout.mesh.size

    def experience(self, layout: StageLayout, context_len: int, num_responses: int) -> float:
        """One `experience_stage` call (the trainer's) on a host batch of random tokens."""
        run, graphdef, params = self._run("experience", layout)
        batch, spans = self._batch(context_len, num_responses)
        seconds = self._timed(lambda: self._experience(run, graphdef, params, batch, spans).batch.advantages)
        return num_responses * context_len / seconds / layout.mesh.size

    def rollout(self, layout: StageLayout, context_len: int, num_responses: int) -> float:
        from earl_jax.rollout.sampler import Sampler, SamplerState

        run, graphdef, params = self._run("rollout", layout)
        sampler = Sampler(graphdef, self.cfg, mesh=run.mesh, rules=run.rules)
        # Rows hold context_len - steps tokens and end at context_len, so the cache stays in context_len's
        # bucket (1K + 16 would round a 1K cache up to 1.5K; 32K + 16 to 64K).
        steps = min(self.decode_steps, max(1, context_len // 2))
        filled = context_len - steps
        state = sampler.init_state(num_responses, context_len)
        shardings = jax.tree.map(lambda x: x.sharding, state)

        def random_like(key, x):
            # Random keys/values (never zeros), one short block tiled over rows and slots: a full-size draw per
            # leaf (48 x 24 GiB at 32K x 128 rows) made XLA's compile of this fill take minutes.
            b, k, s, h = x.shape
            block = jax.random.normal(key, (1, k, min(s, 256), h), x.dtype)
            return jnp.broadcast_to(jnp.tile(block, (1, 1, -(-s // block.shape[2]), 1))[:, :, :s], x.shape)

        def fill(state: SamplerState, key) -> SamplerState:
            leaves, treedef = jax.tree.flatten(state.cache)
            keys = jax.random.split(key, len(leaves) + 1)
            cache = jax.tree.unflatten(treedef, [random_like(k, x) if jnp.issubdtype(x.dtype, jnp.floating) else x
                                                 for k, x in zip(keys, leaves)])
            lengths = jnp.full(state.lengths.shape, filled, jnp.int32)
            logits = jax.random.normal(keys[-1], state.next_logits.shape, jnp.float32)
            return dataclasses.replace(state, cache=cache, lengths=lengths, next_logits=logits)

        def reset(state: SamplerState) -> SamplerState:
            return dataclasses.replace(state, lengths=jnp.full(state.lengths.shape, filled, jnp.int32))

        fill = jax.jit(fill, donate_argnums=(0,), out_shardings=shardings)
        reset = jax.jit(reset, donate_argnums=(0,), out_shardings=shardings)
        holder = [fill(state, jax.random.key(self.seed))]
        rng = jax.random.key(self.seed + 1)
        calls = [0]

        def once():
            state, gen = sampler.generate(params, holder[0], jax.random.fold_in(rng, calls[0]), max_new_tokens=steps,
                                          budget=steps, stop_tokens=())
            calls[0] += 1
            jax.block_until_ready(gen.tokens)
            if int(gen.num_tokens.min()) != steps:
                raise RuntimeError(f"rollout measure: expected {steps} tokens per row, got {gen.num_tokens}")
            holder[0] = reset(state)
            return gen.tokens

        seconds = self._timed(once)
        holder.clear()  # its sampler state (not `del`: `once` still closes over the list)
        return num_responses * steps / seconds / layout.mesh.size


def profile_rows(memory: MemoryModel, measure: RealMeasure, *, contexts: Sequence[int], responses: Sequence[int],
                 stages: Sequence[str], num_devices: int, device_kind: str, tensors: Sequence[int] | None = None,
                 table: ProfileTable | None = None, save: Path | None = None, time_budget: float | None = None,
                 progress: bool = True, cell_timeout_s: float | None = None) -> ProfileTable:
    """Profile with `measure`, one context row at a time (in the given order), the table saved after each cell
    (`run_profile`'s `save`: a cell that hangs is recorded "hung" by the next run on the saved table, and
    `cell_timeout_s` ends a process stuck in one); rows not started within `time_budget` seconds are left out
    (table.meta["contexts_cut"]); cells a saved table already has are not measured again."""
    meshes = {st: [m for m in candidate_meshes(memory.cfg, num_devices, st) if tensors is None or m.tensor in tensors]
              for st in stages}
    start = time.perf_counter()
    done = list(table.meta.get("contexts_measured", [])) if table is not None else []
    cut = []
    for ctx in contexts:  # in the given order: put the rows that matter most first
        if time_budget is not None and time.perf_counter() - start > time_budget:
            cut.append(ctx)
            continue
        table = run_profile(memory, measure, num_devices=num_devices, context_lens=[ctx], response_counts=responses,
                            stages=stages, meshes=meshes, device_kind=device_kind, table=table, progress=progress,
                            save=save, cell_timeout_s=cell_timeout_s)
        done = [c for c in done if c != ctx] + [ctx]
        table.meta.update(measure="RealMeasure", decode_steps=measure.decode_steps, contexts_measured=done,
                          contexts_cut=cut, seconds=round(time.perf_counter() - start, 1))
        if save is not None:
            table.save(save)
    if table is None:
        table = ProfileTable(device_kind, num_devices, memory.cfg.name)
    table.meta.update(contexts_cut=cut)
    if save is not None:
        table.save(save)
    return table
