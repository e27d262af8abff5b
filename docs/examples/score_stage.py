"""A stage of your own in one file (docs/fork.md, "Adding a stage"): the policy's mean log-probability of each row's
scored tokens (to rank or filter episodes, say), computed under the layout the planner chose for it.

    import score_stage                                   # docs/examples on PYTHONPATH; registers "score"
    scores = score_stage.score_rows(trainer, tokens, loss_mask)

The registration below is all the planner needs: the selector prices the stage's meshes by its memory kind and picks
its mesh, micro-batch and log-prob chunk, `StagePlanner.run` hands them to it (with the out-of-memory fallback), and
the next metrics record logs them as parallel/score_*.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from earl_jax.distributed import global_to_host
from earl_jax.parallel.plan import ContextStats
from earl_jax.parallel.planner import StageRun
from earl_jax.rl.algorithm.packing import grouped_logprobs
from earl_jax.sharding.mesh import INFERENCE_RULES
from earl_jax.sharding.stage_registry import StageSpec, register_stage

# It only runs the model: the rollout's rules (weights over tensor, rows over data), priced like the experience
# stage (a forward pass of a micro-batch), planned when it runs rather than with every iteration's plan.
SPEC = register_stage(StageSpec("score", INFERENCE_RULES, memory="score", updates_weights=False, planned="when_run"))


def masked_mean(logp: Float[Array, "n t"], mask: Bool[Array, "n t"]) -> Float[Array, " n"]:
    return jnp.sum(jnp.where(mask, logp, 0.0), 1) / jnp.maximum(jnp.sum(mask, 1), 1)


def score_stage(run: StageRun, params: nnx.State, tokens: Int[np.ndarray, "n t"], mask: Bool[np.ndarray, "n t"], *,
                graphdef: nnx.GraphDef) -> Float[np.ndarray, " n"]:
    """The stage's body: its mesh, rules, row sharding, micro-batches and chunk all come from `run`; `params` are
    already on `run`'s layout."""
    x = run.put_rows({"tokens": tokens, "mask": mask})  # rows over the mesh's batch axes
    micro = run.micro_batches(len(tokens))  # the plan's micro-batch; grouped_logprobs uses the plan's chunk
    logp = grouped_logprobs(run, params, x["tokens"], [tokens.shape[1]] * micro.count, micro, graphdef=graphdef)
    return global_to_host(run.jit("masked_mean", masked_mean)(logp, x["mask"]))  # blocks: an OOM surfaces here


def score_rows(trainer, tokens: Int[np.ndarray, "n t"], mask: Bool[np.ndarray, "n t"]) -> Float[np.ndarray, " n"]:
    """Plans the stage for this batch and runs the trainer's policy there: its weights move to the stage's layout
    (cast for inference); an out-of-memory error reruns it on the next layout."""
    n, width = tokens.shape
    policy = trainer.policy
    policy.planner.plan_stage("score", ContextStats(float(width), width, n))
    return policy.planner.run("score", lambda run: score_stage(
        run, policy.weights.for_stage(run, trainer.state.params), tokens, mask, graphdef=policy.graphdef))
