"""How many devices roll out and how many learn (experience and train) while both run at once.

With `--rollout.max-staleness K >= 1` the next rollout runs while the current batch trains (rl/loop/overlap.py). On
devices of their own the two never queue behind each other on a device (Libra's split of the GPUs between rollout and
training); each side keeps EARL's selector for its own layouts:

    learn, rollout = split_planners(cfg.planner, model_cfg, batch_size)   # rollout None: the stages share devices

A split gives the rollout the first n of the N devices and experience and train the other N - n. A candidate n needs
a rollout mesh over n devices and experience and train meshes over N - n that the batch's rows divide, and layouts
the memory model accepts on each side (the rollout's side holds no train state). Among the candidates the planner
takes the one that minimises the time of an iteration whose two sides run at once, max(rollout cost / n, learn cost /
(N - n)), each cost in device-seconds; with no measured costs they count as equal, so the most even split wins (a tie
gives the rollout the larger share). `--planner.rollout-devices n` chooses n; N shares the devices (interleaved).
"""

from __future__ import annotations

import logging

import jax

from earl_jax.models.model_config import ModelConfig
from earl_jax.parallel.memory import candidate_meshes
from earl_jax.parallel.planner import StagePlanner
from earl_jax.parallel.planner_config import PlannerConfig
from earl_jax.parallel.selector import NoFeasibleLayoutError

log = logging.getLogger(__name__)
LEARN_STAGES = ("experience", "train")


def split_candidates(model_cfg: ModelConfig, num_devices: int, batch_size: int) -> list[int]:
    """The rollout device counts n in [1, N) with a rollout mesh over n devices and experience and train meshes over
    the other N - n whose batch axes divide the batch."""
    def meshes(stage: str, n: int) -> bool:
        return any(batch_size % (m.data * m.fsdp) == 0 for m in candidate_meshes(model_cfg, n, stage))

    return [n for n in range(1, num_devices)
            if meshes("rollout", n) and all(meshes(s, num_devices - n) for s in LEARN_STAGES)]


def rank_splits(candidates: list[int], num_devices: int, rollout_cost: float = 1.0, learn_cost: float = 1.0
                ) -> list[int]:
    """`candidates` best first: the shortest overlapped iteration max(rollout_cost / n, learn_cost / (N - n)), then the
    larger rollout share."""
    return sorted(candidates, key=lambda n: (max(rollout_cost / n, learn_cost / (num_devices - n)), -n))


def split_planners(cfg: PlannerConfig, model_cfg: ModelConfig, batch_size: int, **planner_kw
                   ) -> tuple[StagePlanner, StagePlanner | None]:
    """(the planner of experience and train, and of the stages between iterations; the rollout's own planner, or
    None when the rollout shares the devices), by `cfg.rollout_devices` or the best split that fits."""
    devices = jax.devices()[: cfg.devices or None]
    total, forced = len(devices), cfg.rollout_devices
    if forced > total:
        raise ValueError(f"--planner.rollout-devices: {forced} is more than the job's {total} devices")
    candidates = split_candidates(model_cfg, total, batch_size)
    if forced and forced < total and forced not in candidates:
        raise ValueError(f"--planner.rollout-devices: {forced} of {total} devices leaves no rollout mesh or no "
                         f"experience / train mesh the batch of {batch_size} rows splits over; valid: "
                         f"{', '.join(map(str, candidates)) or 'none'} (or {total}: shared)")
    order = [] if forced == total else [forced] if forced else rank_splits(candidates, total)
    for n in order:
        try:
            learn = StagePlanner.from_config(cfg, model_cfg, batch_size, devices=devices[n:], stages=LEARN_STAGES,
                                             **planner_kw)
            rollout = StagePlanner.from_config(cfg, model_cfg, batch_size, devices=devices[:n], stages=("rollout",),
                                               **planner_kw)
        except (NoFeasibleLayoutError, ValueError) as e:
            if forced:
                raise ValueError(f"--planner.rollout-devices {n}: {e}") from None
            continue
        log.info("rollout on %d device(s), experience and train on the other %d", n, total - n)
        return learn, rollout
    if not forced and total > 1:
        log.info("no split of the %d devices fits the rollout and training apart: they share the devices", total)
    return StagePlanner.from_config(cfg, model_cfg, batch_size, devices=devices, **planner_kw), None
