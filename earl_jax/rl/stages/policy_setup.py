"""The policy bundle: a model and what any stage needs to run it, made in the order they need each other: the model's
shape, the planner (which sizes every stage's layout from it), then the model itself, created in the train layout's
shardings.

    policy, params = build_policy(cfg)                     # moves: None (free-text answers)
    policy = policy.with_moves(env.num_actions)            # --rollout.constrain-moves

The trainer, the format warm-up, the SFT stage (rl/supervised/sft.py) and a base's build (experiments/pretrain.py)
take it; the weights travel apart (`TrainState`), since every update replaces them.
"""

from __future__ import annotations

import dataclasses

import jax
import tokenizers
from flax import nnx

from earl_jax.envs.vector import ObservationCodec
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.setup import load_model, model_config
from earl_jax.models.tokenizer import TokenizerInfo, special_ids
from earl_jax.parallel.planner import StagePlanner
from earl_jax.parallel.shapes import ProgramShapes
from earl_jax.parallel.split import split_planners
from earl_jax.rl.stages.weights import WeightMover
from earl_jax.rollout.moves import MoveTokens
from earl_jax.rollout.sampler import geometric_cache_buckets


@dataclasses.dataclass(frozen=True)
class Policy:
    """The planner that lays every stage out, the model's structure (`graphdef`, merged with its weights in each
    stage), the weight mover (casts and dispatches between layouts), the tokenizer with its special ids and
    observation codec, the KV cache sizes the rollout grows through, and constrained moves' tokens."""

    planner: StagePlanner
    model_cfg: ModelConfig
    graphdef: nnx.GraphDef
    weights: WeightMover
    tokenizer: tokenizers.Tokenizer
    ids: TokenizerInfo
    codec: ObservationCodec
    cache_buckets: tuple[int, ...] | None = None  # --rollout.cache-growth's sizes; None: the sampler's default
    moves: MoveTokens | None = None  # each action's token (--rollout.constrain-moves); None: free-text answers
    # the rollout's own planner when it runs on devices apart from experience and train (parallel/split.py); None:
    # `planner` lays out every stage
    rollout_planner: StagePlanner | None = None

    @property
    def choice_tokens(self) -> tuple[int, ...]:
        """The static token tuple the experience, train and SFT stages score a constrained move over; () for free
        text (every token of the vocabulary)."""
        return self.moves.token_ids if self.moves else ()

    def with_moves(self, num_actions: int) -> Policy:
        """This policy answering with constrained moves: one token per action of the game."""
        return dataclasses.replace(self, moves=MoveTokens.build(self.tokenizer, num_actions, self.ids.eos_id))


def remat_mode(setting: str) -> str:
    """--planner.remat: auto = full per-layer rematerialization on accelerators, none on the CPU."""
    return setting if setting != "auto" else ("none" if jax.default_backend() == "cpu" else "full")


def build_policy(cfg, stages: tuple[str, ...] | None = None) -> tuple[Policy, nnx.State]:
    """(the policy of a JobConfig, free-text answers; its initial weights, float32 on the train layout). `stages`:
    plan only these (default: every stage of an iteration) and make the weights on the first one's layout, e.g.
    ("rollout",) for a rollout benchmark of a model whose train state would not fit."""
    model_cfg, tokenizer = model_config(cfg.model)
    remat = remat_mode(cfg.planner.remat)
    coarse = geometric_cache_buckets(cfg.rollout.cache_growth) if cfg.rollout.cache_growth else None
    kv_cache_bytes = 4 if cfg.rollout.cache_dtype == "float32" else 2
    # one program service for the job: both planners of a split share it (which widths, what compiles ahead, when)
    planner_kw = dict(remat=remat != "none", cache_buckets=coarse, kv_cache_bytes=kv_cache_bytes,
                      shapes=ProgramShapes.from_config(cfg.planner, cfg.rollout), decode_rows=cfg.rollout.slots,
                      max_context=cfg.rollout.max_context, draft_tokens=cfg.rollout.drafts,
                      kv_pages=cfg.rollout.kv_pages, page_size=cfg.rollout.page_size,
                      pipeline_groups=cfg.rollout.pipeline_groups)
    if cfg.rollout.max_staleness:  # rollout and training at once: on devices of their own where a split fits
        planner, rollout_planner = split_planners(cfg.planner, model_cfg, cfg.batch_size, **planner_kw)
    else:
        planner = StagePlanner.from_config(cfg.planner, model_cfg, cfg.batch_size, stages=stages, **planner_kw)
        rollout_planner = None
    home = planner.stage_run(stages[0] if stages else "train")
    model, loaded_tokenizer = load_model(cfg.model, model_cfg, home.mesh, home.rules, cfg.run.seed)
    model.remat = remat == "full"  # a static attribute: part of the graphdef the stages merge
    tokenizer = loaded_tokenizer or tokenizer
    graphdef, params = nnx.split(model)
    return Policy(planner, model_cfg, graphdef, WeightMover(cfg.model.compute_dtype()), tokenizer,
                  special_ids(tokenizer), ObservationCodec(tokenizer), coarse,
                  rollout_planner=rollout_planner), params
