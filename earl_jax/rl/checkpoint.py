"""Checkpoints with orbax: everything resuming needs (params, optimizer state, RNG, step, selector state).

Orbax writes each step into a temporary folder and renames it when complete, so a crash mid-save never
replaces the last good checkpoint. A missing or corrupt checkpoint raises `CheckpointError` naming the
folder instead of starting silently from scratch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    pass


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict[str, Any]]:
        """Restore into the structure, dtypes and shardings of `abstract_state` (e.g. the fresh state)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"--resume: no checkpoint in {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                     meta=ocp.args.JsonRestore()))
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} is unreadable or does not match "
                                  f"this run's model/optimizer ({type(e).__name__}: {e})") from e
        return step, out.state, dict(out.meta)

    def close(self) -> None:
        self.manager.close()
