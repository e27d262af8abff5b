"""Tools for text tasks: a call parser registry, the `ToolUse` wrapper that runs calls, and a safe `calculator`.

An answer the parser reads as a call (`[calc 417*83]` with the built-in "bracket" parser) never reaches the wrapped
task: `ToolUse` runs the tool under its time limit and answers with the observation `= RESULT\\n> ` (reward 0). A call
that fails (malformed, unknown tool, the tool raised, the tool timed out) gets `failure_reward` and a short `! ...`
observation; the episode goes on. More than `max_calls` calls truncate the episode. Any other answer is the task's.

A wrapped task may define `on_tool(name, args, result)`: `ToolUse` calls it (on the unwrapped env) after each
successful call, so the task's `expert_answer()` can depend on what the tools have answered.
"""

from __future__ import annotations

import ast
import operator
import re
import string
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import gymnasium

__all__ = ["CALL_PARSERS", "CHARSET", "RESULT_CHARS", "MalformedCall", "Tool", "ToolCall", "ToolUse", "calculator",
           "parse_bracket", "register_call_parser"]

CHARSET = string.digits + string.ascii_letters + string.punctuation + " \n\t"  # what the char tokenizer covers
RESULT_CHARS = 64  # a tool result longer than this is cut (the context budget)


@dataclass(frozen=True)
class Tool:
    """A named function from argument text to result text, with a time limit in seconds."""

    name: str
    fn: Callable[[str], str]
    description: str = ""
    timeout_s: float = 2.0


@dataclass(frozen=True)
class ToolCall:
    """An answer read as a call of tool `name` with argument text `args`."""

    name: str
    args: str


@dataclass(frozen=True)
class MalformedCall:
    """An answer that looks like a call but does not parse; `why` says what is wrong in a few words."""

    why: str


CallParser = Callable[[str], "ToolCall | MalformedCall | None"]
CALL_PARSERS: dict[str, CallParser] = {}


def register_call_parser(name: str) -> Callable[[CallParser], CallParser]:
    """Decorator registering a parser (answer -> ToolCall, MalformedCall, or None for "not a call") under `name`."""

    def register(fn: CallParser) -> CallParser:
        if name in CALL_PARSERS:
            raise ValueError(f"call parser {name!r} is already registered")
        CALL_PARSERS[name] = fn
        return fn

    return register


_NAME = re.compile(r"[a-z_][a-z0-9_]*")


@register_call_parser("bracket")
def parse_bracket(answer: str) -> ToolCall | MalformedCall | None:
    """`[name args]` is a call; text starting with "[" that does not parse is malformed; anything else is None."""
    text = answer.strip()
    if not text.startswith("["):
        return None
    close = text.find("]")
    if close < 0:
        return MalformedCall("no ]")
    if text[close + 1:].strip():
        return MalformedCall("text after ]")
    name, _, args = text[1:close].strip().partition(" ")
    if not _NAME.fullmatch(name):
        return MalformedCall("bad name")
    return ToolCall(name, args.strip())


class ToolUse(gymnasium.Wrapper):
    """Runs the tool calls in a task's answers (see the module docstring); counts calls and failures per episode.

    Every returned info has `tool_calls`, `tool_failures` and `tool_failure_kinds` (kind -> count; kinds are
    "malformed", "unknown", "error", "timeout", "max_calls"); a step that was a call also has `tool` (the name, or
    None when malformed) and `tool_error` (the failure kind, or None).
    """

    def __init__(self, env: gymnasium.Env, tools: Sequence[Tool], *, parser: str = "bracket", max_calls: int = 4,
                 failure_reward: float = -0.1):
        super().__init__(env)
        if parser not in CALL_PARSERS:
            raise ValueError(f"unknown call parser {parser!r}; registered: {sorted(CALL_PARSERS)}")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tool names in {names}")
        self.tools = {t.name: t for t in tools}
        self.parse = CALL_PARSERS[parser]
        self.max_calls, self.failure_reward = max_calls, float(failure_reward)
        self._clear()

    def _clear(self) -> None:
        self.tool_calls, self.tool_failures, self.tool_failure_kinds = 0, 0, {}
        self._return = 0.0

    def _counts(self) -> dict[str, Any]:
        return {"tool_calls": self.tool_calls, "tool_failures": self.tool_failures,
                "tool_failure_kinds": dict(self.tool_failure_kinds)}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self._clear()
        obs, info = self.env.reset(seed=seed, options=options)
        return obs, {**info, **self._counts()}

    def step(self, answer: str):
        call = self.parse(answer)
        if call is None:
            obs, reward, terminated, truncated, info = self.env.step(answer)
            self._return += float(reward)
            return obs, reward, terminated, truncated, {**info, **self._counts()}
        self.tool_calls += 1
        name = call.name if isinstance(call, ToolCall) else None
        if self.tool_calls > self.max_calls:
            self._fail("max_calls")
            info = {"success": False, "score": self._return, "tool": name, "tool_error": "max_calls"}
            return "", self.failure_reward, False, True, {**info, **self._counts()}
        if isinstance(call, MalformedCall):
            return self._failed("malformed", "! bad call\n> ", None)
        tool = self.tools.get(call.name)
        if tool is None:
            return self._failed("unknown", f"! no tool {call.name[:16]}\n> ", call.name)
        ok, result = _run(tool, call.args)
        if not ok:
            return self._failed(result, f"! {result}\n> ", call.name)
        result = str(result)[:RESULT_CHARS]
        hook = getattr(self.env.unwrapped, "on_tool", None)
        if hook is not None:
            hook(call.name, call.args, result)
        return f"= {result}\n> ", 0.0, False, False, {"tool": call.name, "tool_error": None, **self._counts()}

    def _fail(self, kind: str) -> None:
        self.tool_failures += 1
        self.tool_failure_kinds[kind] = self.tool_failure_kinds.get(kind, 0) + 1
        self._return += self.failure_reward

    def _failed(self, kind: str, obs: str, name: str | None):
        self._fail(kind)
        return obs, self.failure_reward, False, False, {"tool": name, "tool_error": kind, **self._counts()}

    @property
    def expert_answer(self) -> Callable[[], str]:
        """The inner task's `expert_answer` (an AttributeError when it has none, so `hasattr` tells)."""
        fn = getattr(self.env, "expert_answer", None) or getattr(self.env.unwrapped, "expert_answer", None)
        if fn is None:
            raise AttributeError(f"{type(self.env.unwrapped).__name__} has no expert_answer")
        return fn


def _run(tool: Tool, args: str) -> tuple[bool, str]:
    """(True, result) or (False, "error" / "timeout"): the tool in a daemon thread, joined with its time limit."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = tool.fn(args)
        except Exception:  # noqa: BLE001 (any failure of the tool is the model's feedback, never the job's crash)
            return

    thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(tool.timeout_s)
    if thread.is_alive():
        return False, "timeout"  # the hung thread is left behind: a daemon, it cannot keep the process alive
    if "result" not in box:  # raised (or exited the thread)
        return False, "error"
    return True, box["result"]


_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_MAX_EXPR = 200  # without powers, results stay about as long as the expression


def calculator(expr: str) -> str:
    """Integers with + - * / // % and parentheses, evaluated over the `ast` (no names, calls or other syntax).

    Exact (fractions): an integral result prints as an int, another as a float. Bad syntax, anything but those
    operators over integer literals, and division by zero raise ValueError.
    """
    if len(expr) > _MAX_EXPR:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"bad syntax: {expr!r}") from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is an int subclass: refused
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return Fraction(_OPS[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not allowed: {type(node).__name__}")
