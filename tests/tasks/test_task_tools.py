"""earl_jax.tasks.tools: the bracket parser, the parser registry, the ToolUse wrapper and the calculator."""

import time

import gymnasium
import pytest

from earl_jax.tasks.tools import (
    CALL_PARSERS,
    CHARSET,
    MalformedCall,
    Tool,
    ToolCall,
    ToolUse,
    calculator,
    parse_bracket,
    register_call_parser,
)


class Echo(gymnasium.Env):
    """A task that ends on any answer it reads, with reward 1.0 for "yes"; its expert says "yes"."""

    def __init__(self):
        self.observation_space = gymnasium.spaces.Text(max_length=128, min_length=0, charset=CHARSET)
        self.action_space = gymnasium.spaces.Text(max_length=64, min_length=0, charset=CHARSET)
        self.tool_results = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.tool_results = []
        return "say\n> ", {}

    def step(self, answer):
        ok = answer.strip() == "yes"
        return "", float(ok), True, False, {"success": ok, "score": float(ok)}

    def on_tool(self, name, args, result):
        self.tool_results.append((name, args, result))

    def expert_answer(self):
        return "yes"


def _raise(args):
    raise RuntimeError("boom")


def _hang(args):
    time.sleep(1.0)
    return "late"


def make(**kw):
    tools = [Tool("echo", lambda a: a), Tool("up", str.upper), Tool("boom", _raise),
             Tool("hang", _hang, timeout_s=0.2), Tool("long", lambda a: "x" * 500)]
    return ToolUse(Echo(), tools, **kw)


def test_bracket_parser():
    assert parse_bracket("[calc 1+2]") == ToolCall("calc", "1+2")
    assert parse_bracket("  [calc   4 * 5 ]  ") == ToolCall("calc", "4 * 5")
    assert parse_bracket("[now]") == ToolCall("now", "")
    assert parse_bracket("42") is None
    assert parse_bracket("the [calc 1] later") is None
    assert parse_bracket("[calc 1+2") == MalformedCall("no ]")
    assert parse_bracket("[calc 1] 3") == MalformedCall("text after ]")
    assert parse_bracket("[Calc 1]") == MalformedCall("bad name")
    assert parse_bracket("[9x 1]") == MalformedCall("bad name")
    assert parse_bracket("[]") == MalformedCall("bad name")


def test_registry_custom_parser_and_duplicate():
    @register_call_parser("at_test")
    def at(answer):
        return ToolCall("echo", answer[1:]) if answer.startswith("@") else None

    try:
        env = make(parser="at_test")
        env.reset(seed=0)
        assert env.step("@hi")[0] == "= hi\n> "
        assert env.step("[echo hi]")[1] == 0.0  # not a call for this parser: the task reads it
        with pytest.raises(ValueError, match="already registered"):
            register_call_parser("at_test")(at)
        with pytest.raises(ValueError, match="already registered"):
            register_call_parser("bracket")(at)
    finally:
        del CALL_PARSERS["at_test"]
    with pytest.raises(ValueError, match="bracket"):
        make(parser="nope")
    with pytest.raises(ValueError, match="duplicate"):
        ToolUse(Echo(), [Tool("a", str), Tool("a", str)])


def test_good_call_then_task_answer():
    env = make()
    obs, info = env.reset(seed=0)
    assert obs == "say\n> " and info["tool_calls"] == 0
    obs, reward, terminated, truncated, info = env.step("[up abc]")
    assert (obs, reward, terminated, truncated) == ("= ABC\n> ", 0.0, False, False)
    assert info["tool"] == "up" and info["tool_error"] is None
    assert info["tool_calls"] == 1 and info["tool_failures"] == 0
    assert env.unwrapped.tool_results == [("up", "abc", "ABC")]
    assert env.observation_space.contains(obs)
    obs, reward, terminated, truncated, info = env.step("yes")
    assert (reward, terminated, info["success"], info["tool_calls"]) == (1.0, True, True, 1)
    assert env.expert_answer() == "yes" and hasattr(env, "expert_answer")


def test_long_result_is_cut():
    env = make()
    env.reset()
    assert env.step("[long]")[0] == "= " + "x" * 64 + "\n> "


@pytest.mark.parametrize("answer,kind,obs", [
    ("[echo 1", "malformed", "! bad call\n> "),
    ("[nope 1]", "unknown", "! no tool nope\n> "),
    ("[boom 1]", "error", "! error\n> "),
    ("[hang 1]", "timeout", "! timeout\n> "),
])
def test_failures(answer, kind, obs):
    env = make(failure_reward=-0.5)
    env.reset(seed=0)
    start = time.monotonic()
    got, reward, terminated, truncated, info = env.step(answer)
    assert time.monotonic() - start < 0.9  # a hung tool costs its time limit, not its whole run
    assert (got, reward, terminated, truncated) == (obs, -0.5, False, False)
    assert info["tool_error"] == kind and info["tool_failure_kinds"] == {kind: 1}
    assert info["tool_calls"] == 1 and info["tool_failures"] == 1
    assert env.observation_space.contains(got)
    assert env.step("yes")[1] == 1.0  # the episode goes on


def test_max_calls_truncates_and_reset_clears():
    env = make(max_calls=2, failure_reward=-0.1)
    env.reset(seed=0)
    env.step("[echo a]")
    env.step("[nope]")
    obs, reward, terminated, truncated, info = env.step("[echo b]")
    assert reward == -0.1
    assert (obs, terminated, truncated, info["success"]) == ("", False, True, False)
    assert info["score"] == pytest.approx(-0.2) and info["tool_calls"] == 3
    assert info["tool_failure_kinds"] == {"unknown": 1, "max_calls": 1}
    _, info = env.reset(seed=1)
    assert (info["tool_calls"], info["tool_failures"], info["tool_failure_kinds"]) == (0, 0, {})
    assert env.step("[echo a]")[4]["tool_calls"] == 1


def test_no_expert_without_inner():
    class Bare(Echo):
        expert_answer = None

    env = ToolUse(Bare(), [])
    assert not hasattr(env, "expert_answer")


def test_calculator():
    assert calculator("417*83") == "34611"
    assert calculator(" (2+3)*-4 ") == "-20"
    assert calculator("7//2") == "3" and calculator("7%3") == "1" and calculator("8/2") == "4"
    assert calculator("7/2") == "3.5"
    for bad in ["1/0", "5%0", "2**3", "__import__('os')", "x+1", "abs(-1)", "1.5+1", "True+1", "", "1+", "'a'",
                "[1]", "1 if 1 else 2", "a" * 300]:
        with pytest.raises(ValueError):
            calculator(bad)
