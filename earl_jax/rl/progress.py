"""A rich progress bar with the numbers people watch (win rate, return, context length)."""

from __future__ import annotations

from typing import Any, Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.enabled = enabled
        if enabled:
            self._bar = RichProgress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.description}"), console=Console(stderr=True))
            self._task = self._bar.add_task("starting", total=total)

    def __enter__(self):
        if self.enabled:
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._bar.stop()

    def status(self, text: str) -> None:
        if self.enabled:
            self._bar.update(self._task, description=text)

    def advance_to(self, step: int) -> None:
        if self.enabled:
            self._bar.update(self._task, completed=step)

    def update(self, step: int, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        what = "success" if "eval/success_rate" in record else "win"  # a task's held-out success, a game's wins
        win = record.get(f"eval/{what}_rate")
        text = (f"return {record['episode/return_mean']:+.2f}  "
                f"eval {what} {win if win is None else f'{win:.2f}'}  "
                f"ctx {record['rollout/context_len_mean']:.0f}  loss {record['train/loss']:+.3f}  "
                f"mesh {record.get('parallel/rollout_mesh', '')}")
        self._bar.update(self._task, completed=step, description=text)
