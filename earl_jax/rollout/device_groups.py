"""Device groups: a data-parallel rollout as one game group per device, decoded concurrently.

On a data-parallel rollout mesh (weights replicated, rows split over the devices) one SPMD decode program
runs every device in lock-step: each turn all devices wait for the host to step *all* games, and the
per-step cost of a small model (launches, loop checks, small kernels) does not shrink with the rows a
device holds. So 4 GPUs decoded 2048 games no faster than one (4353 vs 4427 games/s, one process;
experiments/results/NOTES.md, issue 13).

Here each device instead decodes its own share of the games as an agent-loop pipeline group
(`play_games` with one policy per device): the decode calls are asynchronous and land on different
devices, so while the host steps the games of the group whose answers came back, the other devices are
still decoding theirs. Each device runs single-device programs (on one GPU the sampler's fused decode
kernel), reading its own replica of the weights the dispatcher already put there: no copy is made.

Measured (4 x H100, tiny model, 2048 compact games, experiments/run_agent_loop_gpu4.sh): rollout 0.60 s as
device groups against 0.48 s as one SPMD decode and 0.40 s on one GPU, so it is off by default
(`--rollout-device-groups`). A small model's decode step is latency-bound: a device holding a quarter of the
rows takes about as long per step as one holding all of them, and the host's share is then the same work
done by one thread for four groups. It stays for larger models and forks to measure.

What a game plays does not depend on its group (every game samples from fold_in(rng, turn, game id)), so
the games are the ones the SPMD rollout plays, up to the numerics of the decode kernels (the same kernels
on CPU: tests compare the trajectories exactly). A mesh that spans processes keeps the SPMD program (the
collective fetch needs every process in each call); a multi-process job splits its games by process first
(rollout/process_split.py), and each process's block may then run as device groups.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh


def device_meshes(mesh: Mesh, params: Any, games: int) -> list[Mesh] | None:
    """One single-device mesh (the same axis names) per device of `mesh`, when the rollout can run as device
    groups: a mesh within one process (a process's block of a split rollout qualifies), several devices, every
    weight replicated on all of them, `games` divisible by the device count. None otherwise (the SPMD rollout)."""
    n = mesh.devices.size
    if n < 2 or mesh.is_multi_process or games % n:
        return None
    if not all(isinstance(x, jax.Array) and x.sharding.is_fully_replicated and len(x.sharding.device_set) == n
               for x in jax.tree.leaves(params)):
        return None
    shape = (1,) * len(mesh.axis_names)
    return [Mesh(np.array([d]).reshape(shape), mesh.axis_names) for d in mesh.devices.flat]


def device_view(params: Any, device: jax.Device) -> Any:
    """Every (replicated) leaf's copy on `device`, as a single-device array: the same buffer, no transfer."""
    def one(x: jax.Array) -> jax.Array:
        for shard in x.addressable_shards:
            if shard.device == device:
                return shard.data
        raise ValueError(f"device_view: no replica on {device} (devices {sorted(x.sharding.device_set, key=str)})")
    return jax.tree.map(one, params)
