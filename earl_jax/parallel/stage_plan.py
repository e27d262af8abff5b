"""The trainer's view of the Parallelism Selector: a plan per iteration and a Mesh per stage.

Builds the selector from an RLConfig (thresholds given directly, a profile table, or the memory model
alone), keeps one `Mesh` object per mesh shape (so jit caches stay warm across iterations), and feeds
each iteration's context statistics back into the selector.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from earl_jax.models.config import ModelConfig
from earl_jax.parallel.memory import MemoryConfig
from earl_jax.parallel.mesh import STAGES, MeshShape, make_mesh
from earl_jax.parallel.profile import ProfileTable
from earl_jax.parallel.selector import (SMALL_BUCKET_EDGES, ContextStats, ParallelismSelector, SelectorConfig,
                                        StageLayout, StagePlan)


def parse_thresholds(text: str) -> list[tuple[int, MeshShape]]:
    """'0:d8f1t1,1024:d4f1t2' -> [(0, d8f1t1), (1024, d4f1t2)]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            ctx, mesh = item.split(":")
            out.append((int(ctx), MeshShape.parse(mesh)))
        except ValueError as e:
            raise ValueError(f"threshold {item!r}: expected CONTEXT:MESH such as 1024:d4f1t2 ({e})") from e
    return out


class StagePlanner:
    def __init__(self, selector: ParallelismSelector, devices: list[jax.Device], num_responses: int,
                 first_context_len: int = 64, static: bool = False):
        """`static`: keep the first plan for the whole run (the baseline the selector is measured against)."""
        self.selector, self.devices, self.static = selector, devices, static
        self.num_responses = num_responses
        self._meshes: dict[MeshShape, Mesh] = {}
        self._stats = ContextStats(first_context_len, first_context_len, num_responses)
        self._fresh = False  # whether _stats holds an observation the selector has not seen yet
        self.current: StagePlan = selector.plan(self._stats)

    @classmethod
    def from_config(cls, cfg, model_cfg: ModelConfig, remat: bool = True) -> "StagePlanner":
        devices = jax.devices()[: cfg.devices or None]
        thresholds = {s: parse_thresholds(getattr(cfg, f"{s}_thresholds")) for s in STAGES}
        thresholds = {s: v for s, v in thresholds.items() if v}
        edges = cfg.selector_edges or (SMALL_BUCKET_EDGES if cfg.model == "tiny" else None)
        sel_cfg = SelectorConfig(**({"bucket_edges": edges} if edges else {}), margin=cfg.selector_margin,
                                 ema_alpha=cfg.selector_ema, thresholds=thresholds or None)
        budget = int(cfg.memory_budget_gib * 2**30) or None
        table = ProfileTable.load(cfg.selector_table) if cfg.selector_table else None
        selector = ParallelismSelector(model_cfg, len(devices), memory=MemoryConfig(budget_bytes=budget, remat=remat),
                                       config=sel_cfg, table=table, device_kind=devices[0].device_kind)
        # Rows shard over data (x fsdp in training): only meshes whose batch axes divide the batch qualify.
        for stage, cands in selector.candidates.items():
            ok = [m for m in cands if cfg.batch_size % (m.data * m.fsdp) == 0]
            if not ok:
                raise ValueError(f"--groups x --group-size = {cfg.batch_size} games do not split over any {stage} "
                                 f"mesh of {len(devices)} devices: use a multiple of the device count")
            selector.candidates[stage] = ok
        return cls(selector, devices, cfg.batch_size, static=cfg.selector_mode == "static")

    def mesh(self, stage: str) -> Mesh:
        return self.mesh_of(self.current[stage].mesh)

    def mesh_of(self, shape: MeshShape) -> Mesh:
        """One Mesh object per shape, so compiled programs keyed on it are reused."""
        if shape not in self._meshes:
            self._meshes[shape] = make_mesh(shape, self.devices)
        return self._meshes[shape]

    def layout(self, stage: str) -> StageLayout:
        return self.current[stage]

    def plan(self) -> StagePlan:
        if self.static:
            return self.current
        self.current = self.selector.plan(self._stats, update=self._fresh)
        self._fresh = False
        return self.current

    def observe(self, mean_context_len: float, max_context_len: float, num_responses: int,
                prompt_tokens: int = 0, first_cache_len: int = 0, observation_tokens: int = 0) -> None:
        """The statistics the next plan() reacts to (smoothed inside the selector); the rollout's extend
        widths (agent-loop stats) tighten its memory estimate."""
        self._stats = ContextStats(float(mean_context_len), int(max_context_len), int(num_responses),
                                   int(prompt_tokens), int(first_cache_len), int(observation_tokens))
        self._fresh = True

    def state_dict(self) -> dict[str, Any]:
        return {"selector": self.selector.state_dict(), "stats": list(self._stats.__dict__.values())}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d:
            self.selector.load_state_dict(d["selector"])
            self._stats = ContextStats(*d["stats"])
            if not self.static:
                self.current = self.selector.plan(self._stats, update=False)
