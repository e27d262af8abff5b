"""Arithmetic: a product to answer, with a calculator tool (`make_arithmetic`, the job's `--env.task`).

The observation at reset is the problem, `417*83\\n> ` (a `digits`-digit number times a `digits - 1`-digit one). The
task reads the first integer of the answer: the product -> reward 1.0, success; another number -> 0.0; no number ->
-1.0, invalid. Every answer ends the episode; the calls before it are `ToolUse`'s (`[calc 417*83]` -> `= 34611\\n> `).

The expert calls the calculator first and answers its result next: `ToolUse` tells the task each successful call
through `Arithmetic.on_tool`, and `expert_answer()` reads that flag.

The held-out split: a problem `a*b` is "test" when a hash of its text is 0 mod 5 (a fifth), else "train";
`reset(seed)` draws from the seed until the problem is in the env's split. With `balance_lengths`, the train split
draws each length of product equally often (3-digit times 2-digit: 4 and 5 digits, naturally 1 in 5 and 4 in 5), so
demonstrations and training do not teach where the digits of the most common length sit; "test" keeps the natural mix.
"""

from __future__ import annotations

import hashlib
import re

import gymnasium

from earl_jax.tasks.tools import CHARSET, Tool, ToolUse, calculator

__all__ = ["Arithmetic", "in_test_split", "make_arithmetic"]

_INT = re.compile(r"-?\d+")


def in_test_split(problem: str) -> bool:
    """Whether the problem text is held out (deterministic across processes, unlike `hash`)."""
    return hashlib.sha256(problem.encode()).digest()[0] % 5 == 0


class Arithmetic(gymnasium.Env):
    """One product per episode; see the module docstring. `max_calls` is for the `ToolUse` around it;
    `balance_lengths` evens the train split's product lengths."""

    def __init__(self, digits: int = 3, split: str = "train", max_calls: int = 2, balance_lengths: bool = False):
        if split not in ("train", "test"):
            raise ValueError(f"split: 'train' or 'test' (got {split!r})")
        if digits < 1:
            raise ValueError(f"digits: at least 1 (got {digits})")
        if not isinstance(balance_lengths, bool):  # JSON's "false" would be a true string
            raise ValueError(f"balance_lengths: true or false (got {balance_lengths!r})")
        self.digits, self.split, self.max_calls = digits, split, max_calls
        self.balance_lengths = balance_lengths and split == "train"
        self.observation_space = gymnasium.spaces.Text(max_length=128, min_length=0, charset=CHARSET)
        self.action_space = gymnasium.spaces.Text(max_length=64, min_length=0, charset=CHARSET)
        self.problem, self.answer, self.tool_answered = "", 0, False

    def _draw(self) -> tuple[int, int]:
        def number(d: int) -> int:
            return int(self.np_random.integers(10 ** (d - 1), 10 ** d))

        other = max(1, self.digits - 1)  # the second factor's digits; a product has digits + other (- 1) digits
        length = (int(self.np_random.integers(self.digits + other - 1, self.digits + other + 1))
                  if self.balance_lengths else None)
        for _ in range(10_000):
            a, b = number(self.digits), number(other)
            if length is not None and len(str(a * b)) != length:
                continue
            if in_test_split(f"{a}*{b}") == (self.split == "test"):
                return a, b
        raise RuntimeError(f"no {self.split} problem with digits={self.digits} in 10000 draws")

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        a, b = self._draw()
        self.problem, self.answer, self.tool_answered = f"{a}*{b}", a * b, False
        return f"{self.problem}\n> ", {"problem": self.problem}

    def step(self, answer: str):
        match = _INT.search(answer)
        if match is None:
            return "", -1.0, True, False, {"success": False, "score": -1.0, "invalid": True}
        right = int(match.group()) == self.answer
        reward = 1.0 if right else 0.0
        return "", reward, True, False, {"success": right, "score": reward, "invalid": False}

    def on_tool(self, name: str, args: str, result: str) -> None:
        """`ToolUse` reports a successful call: the expert answers next."""
        self.tool_answered = True

    def expert_answer(self) -> str:
        """`[calc A*B]` until a tool has answered, then the product."""
        return str(self.answer) if self.tool_answered else f"[calc {self.problem}]"


def make_arithmetic(**kw) -> gymnasium.Env:
    """`Arithmetic(**kw)` with the calculator as tool `calc`, at most `max_calls` calls an episode."""
    return ToolUse(Arithmetic(**kw), [Tool("calc", calculator, "integer + - * / // % ( )")],
                   max_calls=kw.get("max_calls", 2))
