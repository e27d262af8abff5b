"""Multi-process (multi-host) launch: `jax.distributed` set-up and host <-> global array helpers.

JAX is multi-controller: every process runs this same program, `jax.devices()` lists the devices of
all processes, and a mesh over them is global. earl-jax keeps the host side identical on every
process (the same games with the same seeds: env stepping is cheap and deterministic), so a host
numpy batch is the same everywhere and each process only supplies the shards of its own devices.

Where the coordinator, process count and process id come from, first match per field:

1. arguments (the job's `--dist.coordinator`, `--dist.num-processes`, `--dist.process-id` flags);
2. EARL_COORDINATOR (host:port), EARL_NUM_PROCESSES, EARL_PROCESS_ID (what launch/local.py sets);
3. SLURM (inside `srun`): SLURM_NTASKS, SLURM_PROCID, coordinator = first node of the step:port;
4. EARL_DISTRIBUTED=auto, or a multi-host TPU VM (TPU_WORKER_HOSTNAMES lists several hosts):
   `jax.distributed.initialize()` with no arguments (JAX's own cluster detection: TPU pods, GKE, MPI).

One process (or nothing found) means no initialization: a single-host run is unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Sharding

__all__ = ["Launch", "resolve", "maybe_initialize", "host_to_global", "hosts_to_global", "global_to_host", "is_main",
           "process_count", "any_process", "gather_ints"]

DEFAULT_PORT = 1234  # for a coordinator given without a port


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins the job. `auto`: let JAX detect everything (TPU pods, GKE, MPI)."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    source: str  # "flags", "env", "slurm", "auto" (where the values came from, for the log line)
    local_device_ids: tuple[int, ...] | None = None
    auto: bool = False


def _int(v: Any) -> int | None:
    return None if v is None or str(v).strip() == "" else int(v)


def _first_slurm_host(nodelist: str) -> str:
    """'node[001-004,007],gpu2' -> 'node001' (the first host of a SLURM node list)."""
    m = re.match(r"([^,\[]+)(?:\[([^\],\-]+))?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read the first host of SLURM node list {nodelist!r}")
    return m.group(1) + (m.group(2) or "")


def _slurm(env: Mapping[str, str]) -> dict[str, Any]:
    """Coordinator / count / id from a SLURM step (srun), or {} outside one."""
    ntasks = _int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS"))
    if ntasks is None or "SLURM_PROCID" not in env:
        return {}
    out: dict[str, Any] = {"num_processes": ntasks, "process_id": int(env["SLURM_PROCID"])}
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodelist:
        port = env.get("EARL_COORDINATOR_PORT") or (int(env.get("SLURM_JOB_ID", "0")) % 4096 + 61440)
        out["coordinator"] = f"{_first_slurm_host(nodelist)}:{port}"
    nodes = _int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")) or 1
    if ntasks > nodes and "SLURM_LOCALID" in env:  # several tasks per node: one device each
        out["local_device_ids"] = (int(env["SLURM_LOCALID"]),)
    return out


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            env: Mapping[str, str] | None = None) -> Launch | None:
    """The launch this process is part of, or None for a single process. Pure: reads `env` only."""
    env = os.environ if env is None else env
    sources = [
        ("flags", {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}),
        ("env", {"coordinator": env.get("EARL_COORDINATOR") or None,
                 "num_processes": _int(env.get("EARL_NUM_PROCESSES")),
                 "process_id": _int(env.get("EARL_PROCESS_ID"))}),
        ("slurm", _slurm(env)),
    ]
    values: dict[str, Any] = {}
    used = []
    for name, found in sources:
        for k, v in found.items():
            if v is not None and k not in values:
                values[k] = v
                used.append(name)
    n = values.get("num_processes")
    if n is not None and n > 1:
        if values.get("coordinator") is None or values.get("process_id") is None:
            raise ValueError(f"{n} processes but no coordinator address or process id: set --dist.coordinator "
                             "HOST:PORT and --dist.process-id (or EARL_COORDINATOR / EARL_PROCESS_ID)")
        if not 0 <= values["process_id"] < n:
            raise ValueError(f"process id {values['process_id']} is outside [0, {n})")
        addr = values["coordinator"]
        if ":" not in addr:
            addr = f"{addr}:{DEFAULT_PORT}"
        ids = values.get("local_device_ids")
        if env.get("EARL_LOCAL_DEVICE_IDS"):
            ids = tuple(int(v) for v in env["EARL_LOCAL_DEVICE_IDS"].split(","))
        return Launch(addr, n, values["process_id"], "+".join(dict.fromkeys(used)), ids)
    if n is None:
        hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
        if env.get("EARL_DISTRIBUTED", "").lower() == "auto" or len(hosts) > 1:
            return Launch(None, None, None, "auto", auto=True)
    return None


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, cpu_devices: int | None = None,
                     timeout_s: int = 300, verbose: bool = True) -> bool:
    """Join the multi-process job if this process is part of one (see `resolve`); True if it did.

    Call before anything touches devices (jax.devices(), a jit): afterwards JAX's backends exist and
    cannot join a job. Safe to call twice. `cpu_devices` (or EARL_CPU_DEVICES) sets fake CPU devices
    per process for tests and CPU runs.
    """
    if jax.distributed.is_initialized():
        return True
    cpu_devices = cpu_devices or _int(os.environ.get("EARL_CPU_DEVICES"))
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    launch = resolve(coordinator, num_processes, process_id)
    if launch is None:
        return False
    # CPU processes talk through gloo (TCP); GPU and TPU use NCCL / ICI whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if launch.auto:
        jax.distributed.initialize(initialization_timeout=timeout_s)
    else:
        jax.distributed.initialize(
            coordinator_address=launch.coordinator, num_processes=launch.num_processes,
            process_id=launch.process_id,
            local_device_ids=list(launch.local_device_ids) if launch.local_device_ids else None,
            # everything is given: JAX's own SLURM detection would pin one GPU per process
            cluster_detection_method="deactivate", initialization_timeout=timeout_s)
    if verbose:
        print(f"[earl_jax.distributed] process {jax.process_index()}/{jax.process_count()} "
              f"({launch.source}): {jax.local_device_count()} local of {jax.device_count()} devices", flush=True)
    return True


def process_count() -> int:
    return jax.process_count()


def is_main() -> bool:
    """Process 0: the one that logs, prints and shows progress."""
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True if `flag` is True on any process (a collective: every process must call it). For decisions
    that must be the same everywhere, e.g. an out-of-memory retry on another layout: one process
    changing meshes alone would leave the others waiting in a collective forever."""
    return any(v for (v,) in gather_ints(int(bool(flag))))


def gather_ints(*values: int) -> list[tuple[int, ...]]:
    """Every process's `values` (small ints, int32), in process order: one tiny all-gather, a collective
    (every process must call it with as many values). On one process: no collective, [values]."""
    if jax.process_count() == 1:
        return [tuple(int(v) for v in values)]
    from jax.experimental import multihost_utils

    rows = np.asarray(multihost_utils.process_allgather(np.asarray(values, dtype=np.int32)))
    return [tuple(int(v) for v in row) for row in rows.reshape(jax.process_count(), len(values))]


def host_to_global(x: Any, sharding: Sharding) -> jax.Array:
    """A host array that is the same on every process -> a global array in `sharding`.

    Each process puts only the blocks of its own devices (no cross-process check or transfer), the
    multi-process replacement for `jax.device_put(host_array, sharding)`. On one process the two are
    the same thing.
    """
    x = np.asarray(x)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx], dtype=x.dtype)


def hosts_to_global(xs: Sequence[Any], shardings: Sequence[Sharding]) -> list[jax.Array]:
    """`host_to_global` for several arrays: one `jax.device_put` call on one process (each call costs ~0.3 ms of
    host time on a GPU machine, and the rollout makes several a turn)."""
    xs = [np.asarray(x) for x in xs]
    if all(s.is_fully_addressable for s in shardings):
        return jax.device_put(xs, list(shardings))
    return [host_to_global(x, s) for x, s in zip(xs, shardings)]


def global_to_host(x: Any) -> Any:
    """A (pytree of) global array(s) -> numpy with the full value on every process.

    `jax.device_get` cannot read blocks held by other processes; those arrays are all-gathered first,
    all in one collective (every process must call this with the same arrays, in the same order, and
    each array must have a device on every process). On one process this is `jax.device_get`.
    """
    leaves, treedef = jax.tree.flatten(x)
    spread = [i for i, a in enumerate(leaves)
              if isinstance(a, jax.Array) and not a.is_fully_addressable and not a.is_fully_replicated]
    out = [np.asarray(a.addressable_data(0)) if isinstance(a, jax.Array) and not a.is_fully_addressable
           and a.is_fully_replicated else a for a in leaves]
    if spread:
        from jax.experimental import multihost_utils

        gathered = multihost_utils.process_allgather([leaves[i] for i in spread], tiled=True)
        for i, g in zip(spread, gathered):
            out[i] = np.asarray(g)
    rest = [i for i, a in enumerate(out) if isinstance(a, jax.Array)]
    for i, v in zip(rest, jax.device_get([out[i] for i in rest])):
        out[i] = np.asarray(v)
    return jax.tree.unflatten(treedef, out)
