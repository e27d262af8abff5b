"""Multi-turn text tasks (with tools) as Gymnasium environments, beside the board games.

A job plays a task by `--env.task ID` (a registered Gymnasium id, e.g. `earl_jax/GuessNumber-v0`) or
`--env.task module:factory` (any importable callable returning the env), with keyword arguments from
`--env.task-args` as JSON. The protocol a task meets is in `protocol.py`; tools in `tools.py`; the shipped tasks are
`guess_number.py` (feedback over turns) and `arithmetic.py` (a calculator tool). Evaluation plays the held-out split:
a factory that takes `split` gets `split="test"` there and `split="train"` in training. With a checkpoint's chat
template (`chat.py`, `--env.chat-template`) the turns are rendered through it.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from earl_jax.envs.env_config import parse_task_args
from earl_jax.tasks.chat import ChatTemplate
from earl_jax.tasks.protocol import TaskEnv, TaskLog

__all__ = ["TaskEnv", "TaskEnvs", "TaskLog", "check_task", "load_task", "task_env_factory"]


def load_task(spec: str) -> Callable[..., Any]:
    """The factory `spec` names: `module:factory` imported, or a registered Gymnasium id's own creator (the shipped
    ids are registered by `import earl_jax`)."""
    if not spec:
        raise ValueError("task: empty (--env.task ID or module:factory)")
    if ":" in spec and "/" not in spec.split(":")[0]:
        module, _, attr = spec.partition(":")
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"task: cannot import {module!r} ({e})") from None
        factory = getattr(mod, attr, None)
        if not callable(factory):
            raise ValueError(f"task: {module!r} has no callable {attr!r}")
        return factory
    import gymnasium

    import earl_jax.envs  # noqa: F401  (registers the project's ids)

    if spec not in gymnasium.registry:
        raise ValueError(f"task: {spec!r} is neither module:factory nor a registered Gymnasium id")
    # the id's own creator, without gymnasium.make's wrappers: they hide the task's wrappers' attributes (tools)
    env_spec = gymnasium.spec(spec)
    entry = env_spec.entry_point
    creator = entry if callable(entry) else gymnasium.envs.registration.load_env_creator(entry)
    return lambda **kw: creator(**{**env_spec.kwargs, **kw})


def _takes(factory: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def task_env_factory(spec: str, args_text: str, *, split: str, log: TaskLog | None = None,
                     chat: ChatTemplate | None = None) -> Callable[[Any], TaskEnv]:
    """`env_factory(env_config) -> TaskEnv` for the trainer: one task episode per game row. `split` ("train" or
    "test") is passed where the factory takes it; `chat`: the template the turns are rendered through."""
    factory, args = load_task(spec), parse_task_args(args_text)
    if _takes(factory, "split") and "split" not in args:
        args = {**args, "split": split}

    def make(_env_cfg=None) -> TaskEnv:
        return TaskEnv(factory(**args), spec, log, chat)

    return make


def check_task(spec: str, args_text: str) -> None:
    """Load the task and play its reset once: a bad spec, bad arguments or a broken reset fail here, in one line."""
    env = task_env_factory(spec, args_text, split="train")()
    try:
        env.reset(seed=0)
    except TypeError as e:
        raise ValueError(f"task: {e}") from None


class TaskEnvs:
    """A job's task envs: training episodes from the "train" split, evaluation from "test", each with its log, both
    rendered through `chat` when given."""

    def __init__(self, spec: str, args_text: str, chat: ChatTemplate | None = None):
        self.train_log, self.eval_log = TaskLog(), TaskLog()
        self.train_factory = task_env_factory(spec, args_text, split="train", log=self.train_log, chat=chat)
        self.eval_factory = task_env_factory(spec, args_text, split="test", log=self.eval_log, chat=chat)
