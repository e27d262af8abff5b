"""Checkpoints with orbax: everything resuming needs (params, optimizer state, RNG, step, selector state, the KL
term's reference weights and, with rollouts overlapping training, the batches sampled for the next iterations).

Orbax writes each step into a temporary folder and renames it when complete, so a crash mid-save never
replaces the last good checkpoint. `restore_latest` resumes from the newest checkpoint that reads back:
an unreadable newer one is moved aside (to `<run>/corrupt_checkpoints/<step>`, nothing is deleted) with
one warning line naming it; when none reads back, `CheckpointError` names the folder.

`keep=0` writes nothing (no folder either): benchmark runs whose weights are thrown away would otherwise
write the fp32 weights and both AdamW moments at the end (16 bytes a parameter: ~45 GB for a 3B model).
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from earl_jax.errors import CheckpointError

__all__ = ["CheckpointError", "Checkpointer", "has_checkpoint"]

log = logging.getLogger("earl_jax.checkpoint")


def checkpoint_state(state, planner, seed: int) -> dict[str, Any]:
    """What a training checkpoint holds as arrays: the weights, the optimizer state and the run's RNG key, the latter
    a global (replicated) array on the train mesh (orbax cannot save a single-device array over several processes)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from earl_jax.distributed import host_to_global

    mesh = planner.stage_run("train").mesh
    return {"params": state.params, "opt_state": state.opt_state,
            "rng": host_to_global(jax.random.key_data(jax.random.key(seed)), NamedSharding(mesh, PartitionSpec()))}


def save_trainer(trainer) -> None:
    """A `Trainer`'s checkpoint at its step: weights, optimizer state, RNG; the planners' and matchmaker's state, the
    run's time so far; with rollouts overlapping training, the sampled batches of the next iterations
    (rl/loop/overlap.py); with partial rollouts, the groups carried into the next iteration (rl/loop/partial.py)."""
    t = trainer
    meta = {"step": t.step, "planner": t.policy.planner.state_dict(), "matchmaker": t.matchmaker.state_dict(),
            "run_elapsed_s": t.run_elapsed_s}
    pending = None
    if t.overlap is not None:
        pending, meta["pending"] = t.overlap.checkpoint(t.step)
    if t.policy.rollout_planner is not None:
        meta["rollout_planner"] = t.policy.rollout_planner.state_dict()
    if t.partial is not None:  # the groups carried into the first batch the checkpoint does not hold
        meta["carried"] = t.partial.state_dict(t.step + len(meta.get("pending", [])))
    t.checkpointer.save(t.step, checkpoint_state(t.state, t.policy.planner, t.cfg.run.seed), meta, pending or None,
                        reference=t.state.ref_params)


def restore_trainer(trainer) -> None:
    """A `Trainer` back at its newest readable checkpoint (its train env: the curriculum's rung there)."""
    t = trainer
    step, state, meta = t.checkpointer.restore_latest(checkpoint_state(t.state, t.policy.planner, t.cfg.run.seed),
                                                      t.state.ref_params)
    t.state.params, t.state.opt_state, t.step = state["params"], state["opt_state"], step
    if "reference" in meta:
        t.state.ref_params = meta.pop("reference")
    elif t.state.ref_params is not None:
        logging.getLogger("earl_jax.rl.loop.trainer").warning(
            "resume: the checkpoint holds no KL reference (written before references were saved): the KL term "
            "compares with the run's initial weights, not those after its warm-up")
    t.policy.planner.load_state_dict(meta.get("planner", {}))
    if t.policy.rollout_planner is not None:
        t.policy.rollout_planner.load_state_dict(meta.get("rollout_planner", {}))
    if t.overlap is not None:
        t.overlap.restore(step, meta.get("pending_arrays", {}), meta.get("pending", []))
    elif meta.get("pending"):
        logging.getLogger("earl_jax.rl.loop.trainer").info(
            "resume: the checkpoint's sampled batches are not used (--rollout.max-staleness 0 samples every batch "
            "with the current weights)")
    if t.partial is not None:
        t.partial.load_state_dict(meta.get("carried"), step)
    elif meta.get("carried"):
        logging.getLogger("earl_jax.rl.loop.trainer").info(
            "resume: the checkpoint's carried groups are not played (--rollout.token-budget 0 starts every group new)")
    t.matchmaker.load_state_dict(meta.get("matchmaker") or {})  # the curriculum's rung
    t.elapsed_before_s = float(meta.get("run_elapsed_s", 0.0))  # --run.max-minutes counts the run's parts together
    t.env = t.matchmaker.train_env()
    logging.getLogger("earl_jax.rl.loop.trainer").info("resumed from step %d (checkpoint %s)", step,
                                                  t.checkpointer.directory / str(step))


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether a run folder holds a finished checkpoint (a numbered folder orbax committed)."""
    ckpt = Path(run_dir) / "checkpoints"
    return ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())


def _quiet_closed_loop_errors() -> None:
    """After a read fails, orbax closes its event loop while TensorStore still completes the other reads, and each
    completion raises "Event loop is closed" through sys.unraisablehook: one traceback per array (hundreds for a
    model), burying the one line that matters. Those, and only those, are dropped."""
    if getattr(sys.unraisablehook, "_earl_quiet", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
            return
        previous(unraisable)

    hook._earl_quiet = True
    sys.unraisablehook = hook
    # the other reads' tasks that failed with the first one, collected later: "Task exception was never retrieved"
    # and a traceback each, logged by asyncio when the GC finds them (timing-dependent, so it shows under load)
    logging.getLogger("asyncio").addFilter(
        lambda record: not str(record.msg).startswith("Task exception was never retrieved"))


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory).absolute()
        self.manager = None if keep == 0 else ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def resumes(self, resume: str, run_dir: Path) -> bool:
        """Whether a run resumes (--run.resume true, or auto with a checkpoint here); ValueError for a fresh run
        (--run.resume false) into a folder that already holds checkpoints: a run is never overwritten."""
        latest = self.latest_step()
        if resume == "true" or (resume == "auto" and latest is not None):
            return True
        if latest is not None:
            raise ValueError(f"--run.run-dir {run_dir} already holds checkpoints: pass --resume to continue it, "
                             "or choose a new --run-dir (refusing to overwrite a run)")
        return False

    def latest_step(self) -> int | None:
        return None if self.manager is None else self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any], pending: dict[str, Any] | None = None,
             reference: Any | None = None) -> None:
        """`pending`: host arrays (numpy, none empty) saved beside the state as they are; restored into
        meta["pending_arrays"]. `reference`: the KL term's frozen weights, restored into meta["reference"]."""
        if self.manager is None:  # keep=0: checkpoints are off
            return
        items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if pending:
            items["pending"] = ocp.args.StandardSave(pending)
        if reference is not None:
            items["reference"] = ocp.args.StandardSave(reference)
        self.manager.save(step, args=ocp.args.Composite(**items))
        self.manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int, abstract_reference: Any | None = None
                ) -> tuple[int, Any, dict[str, Any]]:
        """Restore `step` into the structure, dtypes and shardings of `abstract_state` (e.g. the fresh state); the
        KL reference too where the checkpoint has one and `abstract_reference` is given."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        items = dict(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        if abstract_reference is not None and (self.directory / str(step) / "reference").is_dir():
            items["reference"] = ocp.args.StandardRestore(
                jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_reference))
        if (self.directory / str(step) / "pending").is_dir():
            items["pending"] = ocp.args.StandardRestore()
        _quiet_closed_loop_errors()
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            detail = " ".join(str(e).split())[:300]
            raise CheckpointError(f"checkpoint {self.directory / str(step)} is unreadable or does not match "
                                  f"this run's model/optimizer ({type(e).__name__}: {detail})") from e
        meta = dict(out.meta)
        if "pending" in items:
            meta["pending_arrays"] = out.pending
        if "reference" in items:
            meta["reference"] = out.reference
        return step, out.state, meta

    def restore_latest(self, abstract_state: Any, abstract_reference: Any | None = None
                       ) -> tuple[int, Any, dict[str, Any]]:
        """The newest checkpoint that reads back; newer unreadable ones are moved aside with a warning."""
        steps = [] if self.manager is None else sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise CheckpointError(f"--resume: no checkpoint in {self.directory}")
        errors = []
        for step in steps:
            try:
                out = self.restore(abstract_state, step, abstract_reference)
            except CheckpointError as e:
                errors.append(e)
                continue
            for bad, error in zip(steps, errors):
                self._move_aside(bad, error)
            return out
        raise CheckpointError(f"--resume: no checkpoint in {self.directory} reads back; the newest failed with: "
                              f"{errors[0]}") from errors[0]

    def _move_aside(self, step: int, error: CheckpointError) -> None:
        """Keep the unreadable checkpoint for inspection, out of the manager's way (its step gets rewritten)."""
        dest = self.directory.parent / "corrupt_checkpoints" / str(step)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            shutil.move(str(self.directory / str(step)), str(dest))
        if jax.process_count() > 1:  # the others must not list the folder before it has moved
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"earl_jax_checkpoint_moved_{step}")
        self.manager.reload()
        why = " ".join(str(error.__cause__ or error).split())[:160]
        log.warning("resume: checkpoint %s is unreadable; moved to %s, resuming from an older one (%s)",
                    self.directory / str(step), dest, why)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
