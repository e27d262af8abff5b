"""The Parallelism Selector's settings and its view of the context: the context buckets (default edges by model
size), the smoothing of the observed context length, and the hysteresis that keeps a bucket from flapping at an edge
(`parallel/selector.py` plans with them).

    cfg = SelectorConfig(bucket_edges=default_bucket_edges(model_cfg), margin=0.1, smoothing="ema")
    SelectorConfig.from_dict({"bucket_edges": "1K,2K,4K", "thresholds": {"rollout": [[0, "d4f1t2"]]}})
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Literal, Mapping, Sequence

from earl_jax.models.model_config import ModelConfig
from earl_jax.sharding.mesh import MeshShape
from earl_jax.sharding.stage_registry import stage_names, stage_spec

DEFAULT_BUCKET_EDGES = (1024, 2048, 4096, 8192, 16384, 32768)
SMALL_BUCKET_EDGES = (32, 64, 128, 256, 512, 1024)  # tiny CPU runs
SMALL_MODEL_PARAMS = 100e6  # below this, a model gets the small context buckets


def default_bucket_edges(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The context buckets without --planner.edges: a small model plays short games, so buckets from 32 tokens (the
    tiny preset, or a small base built from it)."""
    return SMALL_BUCKET_EDGES if model_cfg.num_params() < SMALL_MODEL_PARAMS else DEFAULT_BUCKET_EDGES


Thresholds = Mapping[str, Sequence[tuple[int, MeshShape]]]


@dataclasses.dataclass(frozen=True)
class SelectorConfig:
    bucket_edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES  # upper edges; above the last -> last bucket
    margin: float = 0.10  # hysteresis: pass an edge by this fraction before switching
    smoothing: Literal["ema", "window", "none"] = "ema"
    ema_alpha: float = 0.5  # weight of the newest observation
    window: int = 4
    thresholds: Thresholds | None = None  # per stage [(context threshold, mesh)]; stages left out select
    # stages plan() plans (None: every registered stage planned "each_iteration"); the others are None in the
    # StagePlan until select() plans them
    stages: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.stages is not None:
            object.__setattr__(self, "stages", tuple(self.stages))
            if not self.stages:
                raise ValueError("stages must name at least one registered stage (None: those planned each iteration)")
            for stage in self.stages:
                stage_spec(stage)
        edges = tuple(int(e) for e in self.bucket_edges)
        if not edges or list(edges) != sorted(set(edges)) or edges[0] <= 0:
            raise ValueError(f"bucket_edges must be positive and strictly ascending, got {self.bucket_edges}")
        object.__setattr__(self, "bucket_edges", edges)
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.smoothing not in ("ema", "window", "none"):
            raise ValueError(f"smoothing must be ema, window or none, got {self.smoothing!r}")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.thresholds:
            th = {}
            for stage, entries in self.thresholds.items():
                if stage not in stage_names():
                    raise ValueError(f"thresholds: unknown stage {stage!r}")
                norm = sorted(((int(c), m if isinstance(m, MeshShape) else MeshShape.parse(m)) for c, m in entries),
                              key=lambda e: e[0])
                if not norm:
                    raise ValueError(f"thresholds[{stage!r}] is empty")
                th[stage] = tuple(norm)
            object.__setattr__(self, "thresholds", th)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SelectorConfig":
        """From a flat config (wandb sweep, YAML): bucket_edges may be "1K,2K,4K" or a list; thresholds
        {stage: [[context, "d4f1t2"], ...]}; unknown keys are an error."""
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown selector settings {sorted(unknown)}")
        edges = d.get("bucket_edges")
        if isinstance(edges, str):
            d["bucket_edges"] = tuple(_parse_len(v) for v in edges.split(",") if v.strip())
        elif edges is not None:
            d["bucket_edges"] = tuple(_parse_len(v) for v in edges)
        if "stages" in d and isinstance(d["stages"], str):
            d["stages"] = tuple(v.strip() for v in d["stages"].split(",") if v.strip())
        return cls(**d)


def _parse_len(v: Any) -> int:
    """1024, "1024", "1K", "1.5k" -> tokens."""
    if isinstance(v, str):
        v = v.strip().lower()
        return int(float(v[:-1]) * 1024) if v.endswith("k") else int(v)
    return int(v)


class HysteresisLevel:
    """Index of the level a value is in, given ascending lower bounds; moves only when the value is past
    a bound by `margin` (relative), so values oscillating around a bound do not flap."""

    def __init__(self, lower_bounds: Sequence[float], margin: float, inclusive: bool = True):
        self.bounds = list(lower_bounds)
        self.margin = margin
        self.inclusive = inclusive  # level j starts at bounds[j] (True) or just above it (False)
        self.index: int | None = None

    def _raw(self, x: float) -> int:
        i = 0
        for j, b in enumerate(self.bounds):
            if x >= b if self.inclusive else x > b:
                i = j
        return i

    def update(self, x: float) -> int:
        if self.index is None:
            self.index = self._raw(x)
            return self.index
        i = self.index
        up = self._raw(x / (1 + self.margin))
        if up > i:
            self.index = up
        elif i > 0 and x < self.bounds[i] * (1 - self.margin):
            self.index = min(i - 1, self._raw(x / (1 - self.margin)))
        return self.index


class Smoother:
    def __init__(self, kind: str, alpha: float, window: int):
        self.kind, self.alpha = kind, alpha
        self.values: collections.deque = collections.deque(maxlen=max(1, window))
        self.ema: float | None = None

    def update(self, x: float) -> float:
        x = float(x)
        if self.kind == "none":
            self.ema = x
        elif self.kind == "ema":
            self.ema = x if self.ema is None else self.alpha * x + (1 - self.alpha) * self.ema
        else:
            self.values.append(x)
            self.ema = sum(self.values) / len(self.values)
        return self.ema

    @property
    def value(self) -> float | None:
        return self.ema
