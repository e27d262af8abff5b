"""A profile cell that never finishes (one GPU out of memory, the others waiting in a collective) is left by its
process and recorded "hung" by the next one, which goes on; the selector never picks it."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from earl_jax.models.model_config import get_config
from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel
from earl_jax.parallel.plan import ContextStats
from earl_jax.parallel.profile import HUNG, HUNG_EXIT, OK, ProfileTable, run_profile
from earl_jax.parallel.selector import ParallelismSelector
from earl_jax.parallel.selector_config import SelectorConfig
from earl_jax.sharding.mesh import MeshShape

ROOT = Path(__file__).resolve().parents[2]
STUCK = MeshShape(8, 1, 1)  # the layout whose cell "hangs" in the child process


def _memory():
    return MemoryModel(get_config("tiny"), MemoryConfig(budget_bytes=4 * GiB))


def test_a_stuck_cell_ends_its_process_and_the_next_run_records_it_hung(tmp_path):
    path = tmp_path / "table.json"
    child = textwrap.dedent(f"""
        import time
        from earl_jax.models.model_config import get_config
        from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel
        from earl_jax.parallel.profile import run_profile
        from earl_jax.sharding.mesh import MeshShape

        def measure(stage, mesh, ctx, n):
            if mesh == MeshShape.parse("{STUCK}"):
                time.sleep(600)  # a hang: only the watchdog ends it
            return 100.0

        mm = MemoryModel(get_config("tiny"), MemoryConfig(budget_bytes=4 * GiB))
        run_profile(mm, measure, num_devices=8, context_lens=[64], response_counts=[8], stages=["rollout"],
                    device_kind="cpu", progress=False, save="{path}", cell_timeout_s=2.0)
    """)
    done = subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == HUNG_EXIT, done.stderr[-2000:]
    assert re.search(r"profile cell rollout d8f1t1 ctx 64 n 8 made no progress for \d+ s", done.stderr)
    saved = ProfileTable.load(path)
    assert saved.meta["pending"] == ["rollout", str(STUCK), 64, 8]  # named on disk before the cell started
    assert saved.meta["timed_out"] == saved.meta["pending"]  # and marked by the watchdog as it left

    calls = []
    table = run_profile(_memory(), lambda s, m, c, n: calls.append(m) or 100.0, num_devices=8, context_lens=[64],
                        response_counts=[8], stages=["rollout"], device_kind="cpu", progress=False, table=saved,
                        save=path)
    assert table.get("rollout", STUCK, 64, 8).status == HUNG and STUCK not in calls  # recorded, not run again
    assert "pending" not in ProfileTable.load(path).meta and ProfileTable.load(path).meta["hung"]
    others = [e for (st, m, *_), e in table.entries.items() if m != STUCK]
    assert others and all(e.status == OK for e in others)  # the rest of the row was measured

    selector = ParallelismSelector(get_config("tiny"), 8, memory=_memory(), table=table, device_kind="cpu",
                                   config=SelectorConfig(stages=("rollout",), bucket_edges=(64,), smoothing="none"))
    ranked = [layout.mesh for layout, _ in selector.ranked_layouts("rollout", 64, ContextStats(60, 60, 8))]
    assert ranked and STUCK not in ranked  # not even as the last fallback after out-of-memory errors elsewhere


def test_without_save_nothing_is_written_and_no_watchdog_runs(tmp_path):
    table = run_profile(_memory(), lambda *a: 1.0, num_devices=8, context_lens=[64], response_counts=[8],
                        stages=["rollout"], device_kind="cpu", progress=False, cell_timeout_s=0.001)
    assert all(e.status == OK for e in table.entries.values()) and "pending" not in table.meta
    assert not list(tmp_path.iterdir())


def test_a_cell_cut_from_outside_is_measured_again_once_then_recorded_hung(tmp_path):
    """A process killed by something else than its cell watchdog (a call's time limit) says nothing about the cell:
    it gets one more try; a cell that ends its process twice is hung."""
    path = tmp_path / "table.json"
    cell = ["rollout", str(STUCK), 64, 8]
    cut = ProfileTable("cpu", 8, "tiny")
    cut.meta["pending"] = cell  # what a killed process leaves: pending, no timed_out mark
    calls = []
    table = run_profile(_memory(), lambda s, m, c, n: calls.append(m) or 100.0, num_devices=8, context_lens=[64],
                        response_counts=[8], stages=["rollout"], device_kind="cpu", progress=False, table=cut,
                        save=path)
    assert STUCK in calls and table.get("rollout", STUCK, 64, 8).status == OK  # measured again
    assert ProfileTable.load(path).meta["cut"] == [cell] and "hung" not in table.meta

    again = ProfileTable("cpu", 8, "tiny")
    again.meta.update(pending=cell, cut=[cell])  # cut a second time in the same cell
    calls.clear()
    table = run_profile(_memory(), lambda s, m, c, n: calls.append(m) or 100.0, num_devices=8, context_lens=[64],
                        response_counts=[8], stages=["rollout"], device_kind="cpu", progress=False, table=again,
                        save=path)
    assert STUCK not in calls and table.get("rollout", STUCK, 64, 8).status == HUNG


def test_forget_drops_hung_cells_so_they_are_measured_again_and_never_a_measured_one():
    table = ProfileTable("cpu", 8, "tiny")
    run_profile(_memory(), lambda s, m, c, n: 100.0, num_devices=8, context_lens=[64], response_counts=[8],
                stages=["rollout"], device_kind="cpu", progress=False, table=table)
    table.add(dataclasses.replace(table.get("rollout", STUCK, 64, 8), tgs=None, status=HUNG))
    table.meta["hung"] = [["rollout", str(STUCK), 64, 8]]
    assert table.forget(HUNG) == 1 and table.get("rollout", STUCK, 64, 8) is None and "hung" not in table.meta
    calls = []
    run_profile(_memory(), lambda s, m, c, n: calls.append(m) or 100.0, num_devices=8, context_lens=[64],
                response_counts=[8], stages=["rollout"], device_kind="cpu", progress=False, table=table)
    assert calls == [STUCK] and table.get("rollout", STUCK, 64, 8).status == OK
    with pytest.raises(ValueError, match="not measured ones"):
        table.forget(OK)
