"""The contract between the Parallelism Selector and the stages: `StagePlan`, `StageLayout`, `ContextStats`.

The selector writes a `StagePlan` (one `StageLayout` per registered stage, sharding/stage_registry.py);
`planner.StagePlanner.run` hands each stage its layout, and every field below is read by the stage it describes
(tests/parallel/test_plan_contract.py fails for a field no stage reads):

- `mesh`            every stage: the data x fsdp x tensor mesh its program is compiled for;
- `micro_batch`     score and update stages (experience, train, sft): rows per batch shard in one micro-batch (a
                    batch shard is one slice of the rules table's "batch" axes: data, or data x fsdp in training).
                    The one conversion to a micro-batch count is `StageRun.micro_batches` (planner.py);
- `logprob_chunk`   score and update stages: sequence positions per vocabulary chunk of the log-probs.

A decode stage (rollout) decodes all of a shard's games at once and computes log-probs of sampled tokens only, so
its micro-batch and chunk are None.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from earl_jax.sharding.mesh import MeshShape
from earl_jax.sharding.stage_registry import stage_names, stage_spec


@dataclasses.dataclass(frozen=True)
class StageLayout:
    mesh: MeshShape
    micro_batch: int | None = None  # rows per batch shard in one micro-batch (score and update stages)
    logprob_chunk: int | None = None  # sequence positions per vocabulary chunk (score and update stages)

    def __post_init__(self):
        for name in ("micro_batch", "logprob_chunk"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"StageLayout.{name} must be >= 1 or None, got {v}")

    def __str__(self) -> str:
        return str(self.mesh)

    def describe(self) -> str:
        out = str(self.mesh)
        if self.micro_batch is not None:
            out += f" mb{self.micro_batch}"
        if self.logprob_chunk is not None:
            out += f" chunk{self.logprob_chunk}"
        return out


_CONTEXT_FIELDS = ("context_bucket", "smoothed_context_len")


@dataclasses.dataclass(frozen=True, init=False)
class StagePlan:
    """A layout per registered stage (sharding/stage_registry.py) for one context bucket. `plan["train"]` and
    `plan.train`
    are a stage's layout, None when this plan leaves it out (a stage planned when it runs, before it is)."""

    layouts: Mapping[str, StageLayout]  # registered stage -> its layout, in registration order
    context_bucket: int = 0  # upper edge of the current context bucket
    smoothed_context_len: float = 0.0

    def __init__(self, layouts: Mapping[str, StageLayout | None] | None = None, *, context_bucket: int = 0,
                 smoothed_context_len: float = 0.0, **stage_layouts: StageLayout | None):
        given = {**(layouts or {}), **stage_layouts}
        for stage in given:
            stage_spec(stage)  # an unknown stage is an error, not a silent extra
        ordered = {s: given[s] for s in stage_names() if given.get(s) is not None}
        object.__setattr__(self, "layouts", ordered)
        object.__setattr__(self, "context_bucket", context_bucket)
        object.__setattr__(self, "smoothed_context_len", smoothed_context_len)

    def __getitem__(self, stage: str) -> StageLayout | None:
        stage_spec(stage)
        return self.layouts.get(stage)

    def __getattr__(self, stage: str) -> StageLayout | None:
        layouts = self.__dict__.get("layouts")
        if layouts is None or stage not in stage_names():
            raise AttributeError(stage)
        return layouts.get(stage)

    def __hash__(self) -> int:
        return hash((tuple(self.layouts.items()), self.context_bucket, self.smoothed_context_len))

    def replace(self, **kw: Any) -> "StagePlan":
        """A copy with other layouts (by stage name; None drops one) or another context bucket."""
        layouts = {**self.layouts, **{k: v for k, v in kw.items() if k not in _CONTEXT_FIELDS}}
        context = {k: kw.get(k, getattr(self, k)) for k in _CONTEXT_FIELDS}
        return StagePlan(layouts, **context)

    def __str__(self) -> str:
        return " ".join(f"{s}={lay}" for s, lay in self.layouts.items())

    def log_dict(self, prefix: str = "parallel/") -> dict[str, Any]:
        """Flat metrics for wandb / the console: parallel/rollout_mesh = 'd4f1t2', ..."""
        out: dict[str, Any] = {f"{prefix}context_bucket": self.context_bucket,
                               f"{prefix}smoothed_context_len": self.smoothed_context_len}
        for s, lay in self.layouts.items():
            out[f"{prefix}{s}_mesh"] = str(lay.mesh)
            out[f"{prefix}{s}_tensor"] = lay.mesh.tensor
            out[f"{prefix}{s}_fsdp"] = lay.mesh.fsdp
            if lay.micro_batch is not None:
                out[f"{prefix}{s}_micro_batch"] = lay.micro_batch
            if lay.logprob_chunk is not None:
                out[f"{prefix}{s}_logprob_chunk"] = lay.logprob_chunk
        return out


@dataclasses.dataclass(frozen=True)
class RolloutExtends:
    """What a rollout's extends looked like (the agent loop measures it): the prompt's width and the cache
    it was written into, and the widest later extend (a turn's observation). Widths are rounded up to the
    sampler's power-of-two length buckets here."""

    prompt_tokens: int
    first_cache_len: int
    observation_tokens: int  # 0: no later extend seen

    def attention(self, context_len: int) -> list[tuple[int, int]]:
        """(query width, key length) of the largest extend attentions at `context_len`."""
        out = [(_pow2_up(self.prompt_tokens), _pow2_up(self.first_cache_len))]
        if self.observation_tokens:
            out.append((_pow2_up(self.observation_tokens), context_len))
        return out


def _pow2_up(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class ContextStats:
    """What the trainer observed: the rollout's context lengths, or the batch a stage is about to process."""

    mean_context_len: float  # mean context length when a turn's decoding starts (what the selector smooths)
    max_context_len: int  # longest sequence the stage processes (memory is checked against it)
    num_responses: int  # sequences (games x samples)
    # the rollout's extends (0: not measured; the memory model then assumes `prefill_len`-token chunks)
    prompt_tokens: int = 0  # widest first extend (the prompt)
    first_cache_len: int = 0  # the cache it was written into
    observation_tokens: int = 0  # widest later extend (a turn's observation)

    @property
    def extends(self) -> RolloutExtends | None:
        if not self.prompt_tokens:
            return None
        return RolloutExtends(self.prompt_tokens, self.first_cache_len, self.observation_tokens)
