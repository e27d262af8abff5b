"""Layout arithmetic for the Data Dispatcher: tile counts, safe intermediate layouts, aligned layouts.

Why this exists: XLA's SPMD partitioner reshards well when a move changes ONE thing (tile count of one
dimension, or moving tiles between dimensions at equal count), but when tiles move between dimensions
AND their count changes (e.g. fsdp=8 over rows -> tensor=4 over columns, the train -> rollout weight
move), it falls back to "Involuntary full rematerialization": gather the whole array on every device,
then slice. We split such a move in two inside one program: first an all-to-all into the target's
dimensions at the source's tile count (`mid_shardings`), then a plain gather/slice along those
dimensions. And jit refuses in/out shardings whose ordered device lists differ, so a move to another
device order or set first reshards on the source devices into a layout with the target's blocks
(`aligned_sharding`) and then copies whole blocks device to device.

Measured on CPU, 8 fake devices, jax 0.10.2 with Shardy (what the tests pin down):
- direct ``jit(identity, out_shardings=...)`` rematerializes for 865 of 10,000 (mesh, spec) pairs of
  a [64, 32] array; on the stage layouts for 53 of 656 moves, all of them weights between train
  (embed over fsdp) and rollout (heads / mlp / vocab over tensor) where the cut dimension moves and
  its count changes; batch moves ([B, T] over data or data+fsdp) never do;
- data x tensor 2x4 -> 4x2 built by make_mesh over the same device list keeps the flat device order,
  so jit accepts it and it does not rematerialize; a mesh over the same devices in another order is
  refused by jit outright ("incompatible devices"), hence two_step;
- with `mid_shardings`: no warning on any stage move, nor on 1,500 random pairs of those shardings.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding

Index = tuple[slice, ...]


def ordered_devices(s: Sharding) -> list[jax.Device]:
    """A sharding's devices in the order jit compares (in and out must match exactly)."""
    if isinstance(s, NamedSharding):
        return list(s.mesh.devices.flat)
    return list(s._device_assignment)  # noqa: SLF001  (other sharding kinds: private but long-stable)


def device_ids(s: Sharding) -> tuple[int, ...]:
    return tuple(d.id for d in ordered_devices(s))


def tile_counts(shape: Sequence[int], s: Sharding) -> tuple[int, ...]:
    """How many blocks each dimension is cut into."""
    return tuple(n // b if b else 1 for n, b in zip(shape, s.shard_shape(tuple(shape))))


def _block_mesh_sharding(devices: Sequence[jax.Device], counts: Sequence[int]) -> NamedSharding:
    """Blocks `counts` (row-major) over `devices` in their given order, each block replicated on
    len(devices)/prod(counts) consecutive devices. Keeps the device order, so jit accepts it."""
    names = tuple(f"b{i}" for i in range(len(counts))) + ("rep",)
    rep = len(devices) // math.prod(counts)
    mesh = Mesh(np.asarray(devices, dtype=object).reshape(*counts, rep), names)
    return NamedSharding(mesh, P(*[names[i] if c > 1 else None for i, c in enumerate(counts)]))


def mid_shardings(shape: Sequence[int], src: Sharding, dst: Sharding) -> list[NamedSharding]:
    """Intermediate layouts on src's devices that avoid XLA's full rematerialization: empty when the
    direct reshard is fine (at most one dimension changes its tile count).

    Each step changes what XLA's partitioner does well: first all-to-alls, each moving a factor of
    the tile count from a dimension that has too many tiles to one that needs more (two dimensions
    change, the total stays), then single-dimension gathers, then single-dimension slices. The last
    step is the target itself (reached through jit's out_shardings), so it is not listed.
    """
    ts, td = tile_counts(shape, src), tile_counts(shape, dst)
    if sum(a != b for a, b in zip(ts, td)) < 2:
        return []
    n = len(ordered_devices(src))
    cur, steps = list(ts), []
    for i in range(len(cur)):  # all-to-alls
        for j in range(len(cur)):
            if i == j or td[i] % cur[i] or cur[j] % td[j]:
                continue
            g = math.gcd(td[i] // cur[i], cur[j] // td[j])
            if g > 1:
                cur[i] *= g
                cur[j] //= g
                steps.append(tuple(cur))
    for grow in (False, True):  # gathers (fewer tiles) first, then slices (more tiles)
        for i in range(len(cur)):
            if (td[i] > cur[i]) == grow and td[i] != cur[i]:
                cur[i] = td[i]
                steps.append(tuple(cur))
    steps = [c for c in steps[:-1] if n % math.prod(c) == 0 and all(m % k == 0 for m, k in zip(shape, c))]
    devs = ordered_devices(src)
    return [_block_mesh_sharding(devs, c) for c in steps]


def aligned_sharding(shape: Sequence[int], src: Sharding, dst: Sharding) -> NamedSharding:
    """A layout on src's devices whose blocks are dst's blocks (or unions of a few of them, when dst
    has more blocks than src has devices), so the second step copies whole blocks device to device."""
    devs = ordered_devices(src)
    counts = list(tile_counts(shape, dst))
    while len(devs) % math.prod(counts):
        # coarsen the most-cut dimension by its smallest prime factor until the blocks fit the devices
        i = max(range(len(counts)), key=lambda k: counts[k])
        p = next(q for q in range(2, counts[i] + 1) if counts[i] % q == 0)
        counts[i] //= p
    return _block_mesh_sharding(devs, counts)


def process_replicated_sharding(shape: Sequence[int], src: Sharding, dst: Sharding) -> NamedSharding | None:
    """Like `aligned_sharding`, but every process's share of src's devices holds ALL of dst's blocks
    (each process one full copy), so the second step's copies stay inside each process. For moves
    between device sets that span processes; the reshard into it is an all-gather across processes
    (device collectives, no host). None when src's devices are not process-major in equal counts."""
    devs = ordered_devices(src)
    procs = [d.process_index for d in devs]
    order = list(dict.fromkeys(procs))
    per = len(devs) // len(order)
    if len(devs) % len(order) or procs != [p for p in order for _ in range(per)]:
        return None
    counts = list(tile_counts(shape, dst))
    while per % math.prod(counts):
        i = max(range(len(counts)), key=lambda k: counts[k])
        p = next(q for q in range(2, counts[i] + 1) if counts[i] % q == 0)
        counts[i] //= p
    names = ("proc",) + tuple(f"b{i}" for i in range(len(counts))) + ("rep",)
    mesh = Mesh(np.asarray(devs, dtype=object).reshape(len(order), *counts, per // math.prod(counts)), names)
    return NamedSharding(mesh, P(*[names[i + 1] if c > 1 else None for i, c in enumerate(counts)]))


def blocks_within_processes(shape: Sequence[int], held: Sharding, dst: Sharding) -> bool:
    """Whether each of dst's blocks is covered by a block of `held` on a device of the same process
    (then the copies of the dispatcher's second step never leave a process)."""
    shape = tuple(shape)
    have = held.devices_indices_map(shape)
    for dev, blk in dst.devices_indices_map(shape).items():
        if not any(d.process_index == dev.process_index and contains(b, blk, shape) for d, b in have.items()):
            return False
    return True


def contains(outer: Index, inner: Index, shape: Sequence[int]) -> bool:
    """Whether block `outer` covers block `inner` (both as tuples of slices over `shape`)."""
    for o, i, n in zip(outer, inner, shape):
        o0, o1, _ = o.indices(n)
        i0, i1, _ = i.indices(n)
        if not (o0 <= i0 and i1 <= o1):
            return False
    return True


def relative(outer: Index, inner: Index, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Start and limit of `inner` inside the block `outer` (for lax.slice)."""
    starts, limits = [], []
    for o, i, n in zip(outer, inner, shape):
        o0 = o.indices(n)[0]
        i0, i1, _ = i.indices(n)
        starts.append(i0 - o0)
        limits.append(i1 - o0)
    return tuple(starts), tuple(limits)


# result shape of a collective: "%all-gather.3 = f32[64,32]{0,1} all-gather(...)"
_HLO_COLLECTIVE = re.compile(r"=\s*(?:pred|bf16|[suf]\d+|c\d+|f8\w*)\[([0-9,]*)\]\S*\s+"
                             r"(?:all-gather|all-reduce|all-to-all|collective-permute)\b")


def rematerialized(hlo_text: str, shapes: Sequence[Sequence[int]], srcs: Sequence[Sharding],
                   dsts: Sequence[Sharding]) -> list[int]:
    """Leaves whose whole global array is the result of a collective in a compiled program although
    neither their source nor their target block is the whole array: the signature of XLA's full
    rematerialization. With several leaves one leaf's block can have another's global shape, so a
    hit is a suspect to confirm on a one-leaf program."""
    seen = {tuple(int(v) for v in m.split(",") if v) for m in _HLO_COLLECTIVE.findall(hlo_text)}
    out = []
    for k, (shape, s, d) in enumerate(zip(shapes, srcs, dsts)):
        shape = tuple(shape)
        if shape in seen and s.shard_shape(shape) != shape and d.shard_shape(shape) != shape:
            out.append(k)
    return out
