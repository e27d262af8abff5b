"""One process of the multi-process tests (tests/rl/loop/test_multiprocess.py starts two of these).

    python tests/mp_worker.py dispatch OUT.json     # EARL_COORDINATOR / EARL_NUM_PROCESSES / EARL_PROCESS_ID set
    python tests/mp_worker.py oom_fallback OUT      # each process writes OUT.<process index>.json

dispatch: every process checks its own results and exits non-zero on a mismatch; process 0 writes
OUT.json (the routes each move took, and what was compared). oom_fallback: every process records what
the OOM fallback did when only one process fails; the test compares the processes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from earl_jax import distributed  # noqa: E402  (jax must not touch a device before initialize)


def dispatch_round_trip(out_path: str) -> None:
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from earl_jax.distributed import global_to_host, host_to_global
    from earl_jax.models.init import init_sharded
    from earl_jax.models.model_config import get_config
    from earl_jax.parallel.dispatch import Dispatcher
    from earl_jax.sharding.mesh import MeshShape, make_mesh, state_shardings
    from earl_jax.sharding.stage_registry import STAGE_RULES

    assert jax.process_count() == int(os.environ["EARL_NUM_PROCESSES"]) > 1, jax.process_count()
    d = Dispatcher()
    report: dict = {"processes": jax.process_count(), "devices": jax.device_count(),
                    "local_devices": jax.local_device_count()}

    def holds(y, value) -> bool:
        """Each process checks the blocks it holds (an array on some processes only has none elsewhere)."""
        return all(np.array_equal(np.asarray(b.data), value[b.index]) for b in y.addressable_shards)

    def same(a, b) -> bool:
        return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(global_to_host(a)),
                                                        jax.tree.leaves(global_to_host(b))))

    # (1) weights: train layout (d2f2t2, embed over fsdp) -> rollout layout (d4f1t2, heads over tensor)
    train, rollout = make_mesh(MeshShape(2, 2, 2)), make_mesh(MeshShape(4, 1, 2))
    _, params = nnx.split(init_sharded(get_config("tiny", vocab_size=128), train, STAGE_RULES["train"], seed=3))
    moved = d(params, state_shardings(params, rollout, STAGE_RULES["rollout"]), sync=True)
    assert not jax.tree.leaves(params)[0].is_fully_addressable  # really spread over both processes
    report["weights"] = {"routes": d.last.routes, "bytes": d.last.bytes, "equal": same(params, moved),
                         "on_target": all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(
                             jax.tree.leaves(moved), jax.tree.leaves(state_shardings(params, rollout,
                                                                                     STAGE_RULES["rollout"]))))}

    # (2) a batch: experience layout (rows over data=8) -> train layout (rows over data x fsdp)
    host = np.arange(16 * 64, dtype=np.int32).reshape(16, 64)
    experience = make_mesh(MeshShape(8, 1, 1))
    x = host_to_global(host, NamedSharding(experience, P("data")))
    y = d({"tokens": x}, t := NamedSharding(train, P(("data", "fsdp"))), sync=True)["tokens"]
    report["batch"] = {"routes": d.last.routes, "equal": holds(y, host), "on_target": y.sharding == t}

    # (3) to another device set whose blocks sit on the other process: two_step_global
    devs = jax.devices()
    half = len(devs) // 2
    other = Mesh(np.asarray(devs[half:half + 2] + devs[:2], dtype=object), ("data",))
    y = d(x, t := NamedSharding(other, P("data")), sync=True)
    report["cross_set"] = {"routes": d.last.routes, "equal": holds(y, host), "on_target": y.sharding == t}

    # (4) the same devices in another order, from a source that is not process-major: reorder
    mixed = [devs[i // 2 + (i % 2) * half] for i in range(len(devs))]  # p0, p1, p0, p1, ...
    xm = host_to_global(host, NamedSharding(Mesh(np.asarray(mixed, dtype=object), ("data",)), P("data")))
    y = d(xm, t := NamedSharding(Mesh(np.asarray(devs[::-1], dtype=object), ("data",)), P("data")), sync=True)
    report["reorder"] = {"routes": d.last.routes, "equal": holds(y, host), "on_target": y.sharding == t}

    # (5) neither (uneven source, other devices): host_gather, still correct
    src = [devs[0], devs[1], devs[2], devs[half]]
    xs = host_to_global(host, NamedSharding(Mesh(np.asarray(src, dtype=object), ("data",)), P("data")))
    t = NamedSharding(Mesh(np.asarray(devs[half + 1:half + 3], dtype=object), ("data",)), P("data"))
    y = d(xs, t, sync=True)
    report["host_gather"] = {"routes": d.last.routes, "equal": holds(y, host), "on_target": y.sharding == t}

    # (6) a split rollout's rows, placed by the process that holds them (StageRun.process_rows / put_process_rows),
    # or all-gathered on the hosts where a layout's rows do not split by process (a tensor axis across processes)
    from earl_jax.parallel.plan import StageLayout
    from earl_jax.parallel.planner import ProgramCache, StageRun
    from earl_jax.rollout.process_split import allgather_rows

    me, share = jax.process_index(), len(host) // jax.process_count()
    mine = host[me * share:(me + 1) * share]
    split = {}
    for shape in (MeshShape(8, 1, 1), MeshShape(4, 1, 2), MeshShape(1, 1, 8)):
        run = StageRun("experience", StageLayout(shape, 1, 64), make_mesh(shape), STAGE_RULES["experience"],
                       ProgramCache())
        held = run.process_rows(len(host))
        placed = run.put_process_rows({"t": mine}, len(host))["t"] if held is not None else None
        split[str(shape)] = (None if held is None else (held.start, held.stop), placed is None or holds(placed, host))
    want = (me * share, (me + 1) * share)
    report["process_rows"] = {"equal": split == {"d8f1t1": (want, True), "d4f1t2": (want, True), "d1f1t8": (None, True)}
                              and np.array_equal(allgather_rows({"t": mine})["t"], host), "split": str(split)}

    # a decision every process must share: True on one process only -> True everywhere
    report["any_process"] = {"equal": distributed.any_process(jax.process_index() == 1) is True
                             and distributed.any_process(False) is False}

    bad = [k for k, v in report.items() if isinstance(v, dict) and not (v["equal"] and v.get("on_target", True))]
    if distributed.is_main():
        Path(out_path).write_text(json.dumps(report, indent=1))
    if bad:
        raise SystemExit(f"process {jax.process_index()}: values differ after {bad}: {report}")


def oom_fallback(out_prefix: str) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from earl_jax.distributed import global_to_host, host_to_global
    from earl_jax.models.model_config import get_config
    from earl_jax.parallel.memory import GiB, MemoryConfig
    from earl_jax.parallel.plan import ContextStats
    from earl_jax.parallel.planner import run_with_oom_fallback
    from earl_jax.parallel.selector import ParallelismSelector
    from earl_jax.parallel.selector_config import SMALL_BUCKET_EDGES, SelectorConfig
    from earl_jax.sharding.mesh import make_mesh

    me = jax.process_index()
    host = np.arange(256 * 4, dtype=np.float32).reshape(256, 4)
    local_sum = jax.jit(lambda a: (a * a).sum())

    def scenario(stage: str, fail: dict[tuple[int, int], Callable[[], Exception]], **kw) -> dict:
        """Run `stage` under the fallback; attempt a on process p raises fail[a, p]()."""
        sel = ParallelismSelector(get_config("tiny"), jax.device_count(), memory=MemoryConfig(budget_bytes=4 * GiB),
                                  config=SelectorConfig(bucket_edges=SMALL_BUCKET_EDGES, smoothing="none"))
        plan = sel.plan(ContextStats(100, 100, 256))
        tried = []

        def fn(layout):
            tried.append(layout.describe())
            if (len(tried) - 1, me) in fail:
                raise fail[len(tried) - 1, me]()
            # process-local work only: a cross-process collective here would wait for the failed process
            return float(local_sum(host[: layout.micro_batch]))

        rec = {"first": plan[stage].describe(), "tried": tried}
        try:
            result, plan = run_with_oom_fallback(stage, fn, plan, sel, **kw)
        except Exception as e:  # noqa: BLE001  (recorded, then the next scenario runs on both processes)
            return {**rec, "error": f"{type(e).__name__}: {e}"}
        # the same global program on the final layout on both processes: they agree, or this would hang
        x = host_to_global(host, NamedSharding(make_mesh(plan[stage].mesh), P(("data", "fsdp"))))
        state = sel.state_dict()
        return {**rec, "final": plan[stage].describe(), "result": result, "global_sum": float(global_to_host(
            local_sum(x))), "oom_marks": state["oom_marks"], "micro_batch_caps": state["micro_batch_caps"]}

    def oom():
        return RuntimeError("RESOURCE_EXHAUSTED: injected")

    def bug():
        return ValueError("injected bug")

    report = {
        "process": me,
        "oom_on_1": scenario("train", {(0, 1): oom}),  # only process 1 runs out of memory
        "shrink_1_then_0": scenario("experience", {(0, 1): oom, (1, 0): oom}, shrink_first=True),
        "no_rerun": scenario("train", {(0, 1): oom}, rerun_after_success=False),  # the trainer's train stage
        "bug_on_1": scenario("train", {(0, 1): bug}),
        "bug_on_1_oom_on_0": scenario("train", {(0, 1): bug, (0, 0): oom}),
    }
    Path(f"{out_prefix}.{me}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    assert distributed.maybe_initialize(timeout_s=120), "not launched as one of several processes"
    {"dispatch": dispatch_round_trip, "oom_fallback": oom_fallback}[mode](out)
