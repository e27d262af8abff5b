"""The task protocol: what a multi-turn text task (a `gymnasium.Env`) must do, and the adapter the rollout steps.

A task is a `gymnasium.Env` with text observations and text actions:

    reset(seed=None, options=None) -> (observation: str, info: dict)
    step(answer: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info: dict)

The observation is appended to the model's context as environment tokens (never trained); the answer is the text
the model generated for the turn. Rewards may come on every turn; the trained return is their sum. The final step's
`info` says the task's own outcome: `success` (bool; without it, a positive return is a success) and `score`
(float; without it, the return); `invalid = True` when the episode ended on an answer that could not be read.
`expert_answer() -> str` (optional) is the answer an expert gives now: the SFT stage imitates it (`--sft.steps`).
Tools are a wrapper over a task (`earl_jax.tasks.tools.ToolUse`).

`TaskEnv` puts one episode behind the per-game interface the agent loop steps (`PerGameVectorEnv`): a success is
recorded as the agent's win, a forfeit as the opponent's, any other end as a draw (the rollout's outcome codes), and
each finished episode's record (success, score, turns, tool calls) goes to the `TaskLog` the job reports from.
With a chat template (`earl_jax/tasks/chat.py`) the observations it returns are the template's render of the turns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from earl_jax.tasks.chat import ChatConversation, ChatTemplate


@dataclasses.dataclass
class TaskLog:
    """Finished episodes of one env (training or evaluation) since the last `drain`."""

    records: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def drain(self, prefix: str) -> dict[str, float]:
        """Means over the episodes since the last call, as `{prefix}/success_rate`, `score`, `turns`, `tool_calls`,
        `tool_failures` (empty when none finished)."""
        recs, self.records = self.records, []
        if not recs:
            return {}
        return {f"{prefix}/{k}": float(np.mean([r[k] for r in recs])) for k in recs[0]}


class TaskEnv:
    """One task episode at a time behind the per-game env interface (see the module docstring)."""

    is_task = True
    num_actions = None  # free text: answers are any text, not move ids
    takes_stopped = True  # step(answer, stopped): a chat template closes a budget-cut answer's turn itself

    def __init__(self, env: Any, name: str, log: TaskLog | None = None, chat: ChatTemplate | None = None):
        self.env, self.name, self.log, self.chat = env, name, log, chat
        self._return, self._turns = 0.0, 0
        self._conversation: ChatConversation | None = None

    def reset(self, seed: int | None = None, options: dict | None = None):
        out = self.env.reset(seed=seed)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str) and isinstance(out[1], dict)):
            raise TypeError(f"task {self.name}: reset must return (observation: str, info: dict), got {_kind(out)}")
        self._return, self._turns = 0.0, 0
        if seed is not None and hasattr(getattr(self.env, "action_space", None), "seed"):
            self.env.action_space.seed(seed)  # format answers (--sft.answers format) follow the episode's seed
        obs, info = out
        if self.chat is not None:
            self._conversation = self.chat.conversation()
            obs = self._conversation.start(obs)
        return obs, {k: v for k, v in info.items() if k != "winner"}  # a winner at reset would end the episode

    def step(self, answer: str, stopped: bool = True):
        """The task's step; `stopped`: the answer ended on the stop token (what SFT demonstrations do)."""
        out = self.env.step(answer)
        if not (isinstance(out, tuple) and len(out) == 5 and isinstance(out[0], str) and isinstance(out[4], dict)):
            raise TypeError(f"task {self.name}: step must return (observation: str, reward, terminated, truncated, "
                            f"info: dict), got {_kind(out)}")
        obs, reward, terminated, truncated, info = out
        self._return += float(reward)
        self._turns += 1
        info = dict(info)
        if terminated or truncated:
            success = bool(info.get("success", self._return > 0))
            invalid = bool(info.get("invalid", False))
            info["winner"] = "agent" if success else ("opponent" if invalid and terminated else "draw")
            if truncated and not terminated:
                info["winner"] = None  # a truncated episode has no outcome, as a game cut at its turn limit
            if self.log is not None:
                self.log.records.append({
                    "success_rate": float(success), "score": float(info.get("score", self._return)),
                    "turns": float(self._turns), "tool_calls": float(info.get("tool_calls", 0)),
                    "tool_failures": float(info.get("tool_failures", 0))})
        else:
            info.pop("winner", None)
            if self._conversation is not None:  # a final observation is never appended: not rendered
                obs = self._conversation.turn(answer, stopped, obs)
        return obs, float(reward), bool(terminated), bool(truncated), info

    def format_answer(self) -> str:
        """An answer drawn from the task's `action_space` (seeded by the episode's reset): the format SFT answers."""
        space = getattr(self.env, "action_space", None)
        sample = getattr(space, "sample", None)
        answer = sample() if sample is not None else None
        if not isinstance(answer, str):
            raise ValueError(f"task {self.name}: --sft.answers format draws answers from a text action_space "
                             f"(gymnasium.spaces.Text); it has {type(space).__name__}")
        return answer

    def expert_answer(self) -> str:
        fn = getattr(self.env, "expert_answer", None)
        if fn is None:
            raise ValueError(f"task {self.name} has no expert_answer(): --sft.steps needs demonstrations (set 0)")
        return fn()


def _kind(out: Any) -> str:
    if isinstance(out, tuple):
        return "(" + ", ".join(type(x).__name__ for x in out) + ")"
    return type(out).__name__


Factory = Callable[..., Any]
