"""The planner's settings: devices, the Parallelism Selector's buckets and thresholds, the memory model's bounds."""

from __future__ import annotations

import dataclasses
from typing import Literal

from earl_jax.cli import field_help as _f


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """planner: each stage's mesh and micro-batch (Parallelism Selector, memory model)"""

    devices: int = _f(0, "devices to use (0: all)")
    rollout_devices: int = _f(0, "while rollout and training run at once (--rollout.max-staleness >= 1): devices the "
                                 "rollout gets to itself, experience and train the others (0: the planner chooses; "
                                 "all the devices: shared, the stages interleaved)")
    mode: Literal["auto", "static"] = _f(
        "auto", "auto: each stage's layout follows the context (selector, OOM fallback); static: the first "
                "iteration's layouts for the whole run, no fallback (a baseline)")
    edges: tuple[int, ...] = _f((), "context-length bucket edges (empty: 1K..32K, or 32..1K for the tiny model)")
    margin: float = _f(0.10, "hysteresis: pass a bucket edge by this fraction before switching layouts")
    ema: float = _f(0.5, "weight of the newest context length in the moving average")
    rollout_thresholds: str = _f("", "direct rollout layouts, e.g. '0:d8f1t1,1024:d4f1t2' "
                                     "(context:mesh; empty: select)")
    experience_thresholds: str = _f("", "direct experience layouts, same format")
    train_thresholds: str = _f("", "direct train layouts, same format (meshes dAfBtC)")
    table: str | None = _f(None, "profile table JSON (experiments/benchmarks/profile_selector.py) to select by")
    memory_budget_gib: float = _f(0.0, "per-device memory budget for the memory model (0: the device's; CPU 4 GiB)")
    micro_batch_tokens: int = _f(32768, "cap on tokens per batch shard in one experience / train micro-batch; the "
                                        "selector picks the micro-batch below it from the memory model")
    logprob_chunk: int = _f(256, "cap on the sequence positions per vocabulary chunk of the log-probs")
    remat: Literal["auto", "none", "full"] = _f(
        "auto", "per-layer rematerialization in training (the memory model assumes the same): auto = full on "
                "accelerators, none on CPU")
    length_split: bool = _f(True, "experience / train: split a batch into more (length-grouped) micro-batches than "
                                  "the memory bound asks when that cuts the padded tokens by more than "
                                  "packing.SPLIT_GAIN")
    new_widths_per_iteration: int = _f(1, "experience / train: at most this many micro-batch widths not compiled yet "
                                          "per stage and iteration; the others run padded to a wider one; 0: no limit")

    def __post_init__(self):
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        need(self.devices >= 0, "devices", "must be >= 0")
        need(self.rollout_devices >= 0, "rollout_devices", "must be >= 0 (0: the planner chooses)")
        need(self.memory_budget_gib >= 0, "memory_budget_gib", "must be >= 0")
        need(0 <= self.margin < 1, "margin", "must be in [0, 1)")
        need(0 < self.ema <= 1, "ema", "must be in (0, 1]")
        need(self.micro_batch_tokens > 0, "micro_batch_tokens", "must be positive")
        need(self.logprob_chunk > 0, "logprob_chunk", "must be positive")
        need(self.new_widths_per_iteration >= 0, "new_widths_per_iteration", "must be >= 0")
        need(all(e > 0 for e in self.edges) and list(self.edges) == sorted(set(self.edges)), "edges",
             "must be positive context lengths in ascending order")
        from earl_jax.parallel.thresholds import parse_thresholds  # the syntax only; the model and job check later

        for name in [f.name for f in dataclasses.fields(self) if f.name.endswith("_thresholds")]:
            try:
                parse_thresholds(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None

    def thresholds(self, stage: str) -> str:
        """`--planner.<stage>-thresholds` ("" for a stage without that flag: it is selected)."""
        return getattr(self, f"{stage}_thresholds", "")
