"""The stages a job runs, each registered once: what the mesh, the plan, the memory model, the selector, the planner,
its out-of-memory fallback, the metrics and the plots know about a stage.

    SPEC = register_stage(StageSpec("score", INFERENCE_RULES, memory="score"))

A stage's layout is planned by `parallel/selector.py` and handed to it by `parallel/planner.py`; its body is a
function of the `StageRun` it receives. The built-in stages register below, through the same call; a fork's stage
registers in its own module (docs/fork.md, "Adding a stage").
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Literal, Mapping

from earl_jax.sharding.mesh import INFERENCE_RULES, TRAIN_RULES, Rules

# What the memory model prices for a stage (parallel/memory.py, MemoryModel.estimate):
#   decode  the weights, a KV cache and one extend (rollout); its layout is a mesh only
#   score   `experience_models` copies of the weights and one forward pass of a micro-batch (experience)
#   update  the train state (weights, gradients, AdamW moments) and a remat forward + backward of a micro-batch
MEMORY_KINDS = ("decode", "score", "update")
PLANNED = ("each_iteration", "when_run")  # with every iteration's plan (StagePlanner.plan), or by plan_stage


class UnknownStageError(KeyError, ValueError):
    """A stage name that no module registered (a KeyError to `plan[stage]`, a ValueError to the rest)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class StageSpec:
    name: str
    rules: Rules  # logical axis -> mesh axes: how the weights and rows lie on its mesh ("batch": the row axes)
    memory: Literal["decode", "score", "update"]
    updates_weights: bool = False  # fsdp meshes are candidates; its train state is not resident beside it
    planned: Literal["each_iteration", "when_run"] = "when_run"

    def __post_init__(self):
        def need(ok: bool, why: str):
            if not ok:
                raise ValueError(f"StageSpec({self.name!r}): {why}")

        need(self.name.isidentifier(), "the name must be an identifier: it names metrics (parallel/<name>_mesh)")
        need(self.memory in MEMORY_KINDS, f"memory must be one of {', '.join(MEMORY_KINDS)}, got {self.memory!r}")
        need(self.planned in PLANNED, f"planned must be one of {', '.join(PLANNED)}, got {self.planned!r}")
        need(self.updates_weights == (self.memory == "update"),
             "a stage that updates weights is priced as an update step: updates_weights=True goes with "
             "memory='update', and only with it")
        need("batch" in self.rules, "its rules must map 'batch' (the mesh axes rows are split over)")


_REGISTRY: dict[str, StageSpec] = {}


def register_stage(spec: StageSpec) -> StageSpec:
    """Adds `spec` under `spec.name` (at import of the stage's module); a different spec under a registered name is
    refused, the same one again is kept."""
    if not isinstance(spec, StageSpec):
        raise ValueError(f"register_stage takes a StageSpec, got {type(spec).__name__}")
    if _REGISTRY.get(spec.name, spec) != spec:
        raise ValueError(f"stage {spec.name!r} is registered already, as {_REGISTRY[spec.name]}")
    _REGISTRY[spec.name] = spec
    return spec


def stage_spec(name: str) -> StageSpec:
    if name not in _REGISTRY:
        raise UnknownStageError(f"unknown stage {name!r}; registered: {', '.join(_REGISTRY)} (register_stage "
                                "in the stage's module, imported before the job is built)")
    return _REGISTRY[name]


def stage_names(planned: str | None = None) -> tuple[str, ...]:
    """Registered stages in registration order (`planned`: only those planned so)."""
    return tuple(n for n, s in _REGISTRY.items() if planned is None or s.planned == planned)


def names_of(stages) -> str:
    """'train and sft', 'rollout, experience and score': stage names in a sentence."""
    stages = list(stages)
    return " and ".join([", ".join(stages[:-1]), stages[-1]] if len(stages) > 1 else stages)


class _RulesOfStages(Mapping[str, Rules]):
    def __getitem__(self, stage: str) -> Rules:
        return stage_spec(stage).rules

    def __iter__(self) -> Iterator[str]:
        return iter(_REGISTRY)

    def __len__(self) -> int:
        return len(_REGISTRY)


STAGE_RULES: Mapping[str, Rules] = _RulesOfStages()  # every registered stage's logical-axis rules

# The built-in stages. rollout, experience and train run every iteration; sft (supervised steps on transcripts: the
# format warm-up, a base policy's training) runs on its own before them.
register_stage(StageSpec("rollout", INFERENCE_RULES, memory="decode", planned="each_iteration"))
register_stage(StageSpec("experience", INFERENCE_RULES, memory="score", planned="each_iteration"))
register_stage(StageSpec("train", TRAIN_RULES, memory="update", updates_weights=True, planned="each_iteration"))
register_stage(StageSpec("sft", TRAIN_RULES, memory="update", updates_weights=True, planned="when_run"))
