"""Policy versions, the staleness bound, and a sampled batch as the loop and its checkpoints hold it.

The policy version is the number of train iterations the weights have had: the weights that train in iteration k
(`Trainer.step` = k before it) are version k. A batch's staleness is the train iteration's version minus the version
of the weights that sampled it, per scored token (`RolloutBatch.versions`). `--rollout.max-staleness K` bounds it:
`check_bound` refuses a batch with a token more than K versions old before any stage computes on it, so a bug or a
resume cannot train on older data than the run allows.

    done = Sampled(step, version, traj, ...)        # a rollout's result, waiting for its iteration
    check_bound(done.batch(constrained), step, K)   # StalenessError when a scored token is too old
    record.update(staleness_metrics(done.batch(constrained), step))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jaxtyping import Int

from earl_jax.parallel.plan import StageLayout
from earl_jax.rl.stages.experience_stage import RolloutBatch, pad_cols, rollout_batch
from earl_jax.rollout.episodes import RolloutStats, Trajectories
from earl_jax.sharding.mesh import MeshShape


class StalenessError(RuntimeError):
    """A batch holds tokens sampled by weights older than --rollout.max-staleness allows."""


@dataclasses.dataclass
class Sampled:
    """A rollout's result as the loop consumes it: the batch of iteration `step`, sampled by weights of `version`.

    `mix_games` (the rows that played the second opponent) is read when the batch's env was made, since later
    batches' envs change it; `layout` and `devices` are where the rollout ran."""

    step: int
    version: int
    traj: Trajectories
    weights_s: float = 0.0  # the weights' cast and dispatch to the rollout's layout
    league: tuple | None = None
    mix_games: np.ndarray | None = None
    layout: StageLayout | None = None
    devices: tuple[int, ...] = ()
    wait_s: float = 0.0  # how long the loop waited for it (0: it ran in the iteration's own thread)
    # partial rollouts (rl/loop/partial.py): each token's version where episodes were carried between rollouts (None:
    # every token's is `version`), and what the iteration's record adds (rollout/carried_over, ...)
    versions: Int[np.ndarray, "n t"] | None = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    def batch(self, constrained: bool) -> RolloutBatch:
        batch = rollout_batch(self.traj, constrained, self.version)
        if self.versions is None:
            return batch
        versions = pad_cols(self.versions, batch.tokens.shape[1])
        return dataclasses.replace(batch, versions=np.where(batch.loss_mask, versions, -1).astype(np.int32))


def staleness(batch: RolloutBatch, step: int) -> np.ndarray:
    """Versions behind `step` of the batch's scored tokens."""
    if batch.versions is None:
        raise StalenessError("the batch records no policy versions (RolloutBatch.versions)")
    return step - batch.versions[batch.loss_mask].astype(np.int64)


def check_bound(batch: RolloutBatch, step: int, max_staleness: int, newest: bool = False) -> None:
    """StalenessError unless every scored token was sampled by a version in [step - max_staleness, step]; `newest`:
    only the tokens of the rollout that finished the batch (partial rollouts: a carried episode's earlier tokens are
    older by the rollouts it waited, as at --rollout.max-staleness 0)."""
    behind = staleness(batch, step)
    if newest and behind.size:
        behind = behind.min(keepdims=True)
    if behind.size and (behind.max() > max_staleness or behind.min() < 0):
        raise StalenessError(f"iteration {step + 1}: a batch holds tokens sampled {int(behind.max())} policy "
                             f"version(s) before it trains (--rollout.max-staleness {max_staleness}) or from a version "
                             f"not trained yet ({int(behind.min())})")


def staleness_metrics(batch: RolloutBatch, step: int) -> dict[str, float]:
    """rollout/staleness_max and _mean over the batch's scored tokens, in policy versions."""
    behind = staleness(batch, step)
    return {"rollout/staleness_max": float(behind.max(initial=0)),
            "rollout/staleness_mean": float(behind.mean()) if behind.size else 0.0}


# ---------------------------------------------------------------------------------------------------- checkpoints
def to_checkpoint(pending: list[Sampled]) -> tuple[dict[str, dict[str, np.ndarray]], list[dict[str, Any]]]:
    """Batches waiting for their iterations as (arrays by step, for orbax; everything else, for the JSON meta)."""
    arrays, meta = {}, []
    for s in pending:
        traj = s.traj
        if traj.local_rows is not None:
            raise ValueError("a rollout split by process is not checkpointed while it waits (one process only)")
        cols = {f.name: v for f in dataclasses.fields(traj) if isinstance(v := getattr(traj, f.name), np.ndarray)}
        if s.mix_games is not None:
            cols["mix_games"] = s.mix_games
        if s.versions is not None:
            cols["token_versions"] = s.versions
        arrays[str(s.step)] = cols
        meta.append({"step": s.step, "version": s.version, "weights_s": s.weights_s, "devices": list(s.devices),
                     "metrics": s.metrics,
                     "layout": None if s.layout is None else str(s.layout.mesh),
                     "winners": list(traj.winners), "turn_context_lens": [list(map(int, t))
                                                                          for t in traj.turn_context_lens],
                     "stats": dataclasses.asdict(traj.stats)})
    return arrays, meta


def from_checkpoint(arrays: dict[str, dict[str, np.ndarray]], meta: list[dict[str, Any]]) -> list[Sampled]:
    """The inverse of `to_checkpoint`."""
    out = []
    for m in meta:
        cols = dict(arrays[str(m["step"])])
        mix, versions = cols.pop("mix_games", None), cols.pop("token_versions", None)
        stats = {**m["stats"], "process_rollout_s": tuple(m["stats"]["process_rollout_s"])}
        traj = Trajectories(**cols, winners=list(m["winners"]), turn_context_lens=m["turn_context_lens"],
                            stats=RolloutStats(**stats))
        layout = None if m["layout"] is None else StageLayout(MeshShape.parse(m["layout"]))
        out.append(Sampled(m["step"], m["version"], traj, m["weights_s"], None, mix, layout, tuple(m["devices"]),
                           versions=versions, metrics=m.get("metrics", {})))
    return out
