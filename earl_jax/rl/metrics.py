"""Metrics every iteration to a JSONL file, to wandb (when available) and to a rich progress display."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

# The names every iteration's record carries (the end-to-end test checks them all).
REQUIRED_METRICS = (
    "step", "episode/return_mean", "eval/win_rate", "eval/draw_rate", "eval/loss_rate", "eval/invalid_rate",
    "rollout/context_len_mean", "rollout/context_len_max", "rollout/tokens", "time/rollout_s",
    "time/experience_s", "time/train_s", "time/dispatch_s", "train/loss", "train/kl", "train/entropy",
    "train/grad_norm", "parallel/rollout_mesh", "parallel/experience_mesh", "parallel/train_mesh",
    "time/gc_pause_s", "time/gc_s", "compile/programs", "compile/lowered", "time/compile_s",
    "compile/ahead", "time/compile_ahead_s", "compile/ahead_failed",
)


def _plain(v: Any) -> Any:
    if isinstance(v, (str, bool)) or v is None:
        return v
    if isinstance(v, (int, np.integer)):
        return int(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else None  # JSON has no NaN; a missing value is explicit


class MetricsLogger:
    """Writes `metrics.jsonl` in the run folder; wandb mode auto/online/offline/disabled.

    `auto` is online when WANDB_API_KEY is set and offline otherwise. wandb missing or failing to start
    never stops a run: the JSONL file is the record, and the failure is reported once.

    Resuming (`resume_step` = the restored checkpoint's step): records past that step were written by
    iterations the checkpoint does not hold, and the resumed run writes them again, so they are dropped
    first; the file then holds each step once. wandb resumes the same run (its id is kept in the run
    folder); wandb itself ignores a step it has already seen, so there the first record of a replayed
    step stays.
    """

    def __init__(self, run_dir: str | Path, config: Mapping[str, Any], *, wandb_mode: str = "auto",
                 project: str = "earl-jax", resume_step: int | None = None, enabled: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.path)
        self._file = open(self.path, "a" if resume_step is not None else "w")
        mode = wandb_mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if mode != "disabled":
            try:
                import wandb

                id_file = Path(run_dir) / "wandb_run_id"
                run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else None
                self._wandb = wandb.init(project=project, config=dict(config), mode=mode, dir=str(run_dir),
                                         name=Path(run_dir).name, id=run_id,
                                         resume="allow" if run_id else None)
                id_file.write_text(self._wandb.id)
            except Exception as e:  # a logging backend must not take the run down with it
                warnings.warn(f"wandb disabled for this run ({type(e).__name__}: {e}); metrics go to {self.path}")

    def log(self, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None}, step=int(record["step"]))

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
