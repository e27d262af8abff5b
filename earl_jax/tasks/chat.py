"""A checkpoint's chat template, rendering a text task's turns: observations as user turns, answers as assistant turns.

A Hugging Face checkpoint may ship a Jinja chat template (`chat_template.jinja`, or `chat_template` in
`tokenizer_config.json`). With one (and `--env.chat-template auto`, the default, or `on`), a task's first observation
becomes the render of `[user: observation]` with the generation prompt, and each later observation the text that the
render of the conversation so far (answers as assistant turns) adds after the model's answer:

    start(obs0)                      -> render([u0], prompt)
    turn(answer0, stopped, obs1)     -> render([u0, a0, u1], prompt)  minus  render([u0], prompt) + answer0

so the context is, token for token, the sampled answers and these suffixes each encoded alone (the history is never
re-rendered nor re-tokenized), and its text is the template's render of the whole conversation. Decisions:
- the model's stop token must be what the template closes an assistant turn with (ChatML's `<|im_end|>`): an answer
  that ended on it already holds that text, so the suffix starts after it; an answer cut at the token budget gets it
  from the environment (an environment token, not trained). A template that closes the turn otherwise is refused.
- a template that is not prefix-stable (rendering turn k+1 changes the text of turns <= k: a turn counter, reasoning
  dropped from earlier turns as Qwen3's does) is refused: once at construction on a probe conversation, and on any
  turn of a real episode where it happens (an answer the template rewrites).
- `bos_token` renders as "": the agent loop writes the tokenizer's BOS itself. The other special tokens are the
  config's (eos_token defaults to the stop token). `strftime_now` is not defined, so renders never depend on the date.
- tool results (`ToolUse`) are observations like any other: user turns (the calls are the task's own text format,
  not the template's tool-calling one).
- answers are the text the task reads (decoded, special tokens skipped). Each turn re-renders the conversation:
  quadratic in turns, negligible for a task's few turns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatConversation", "ChatTemplate", "ChatTemplateError", "read_chat_template", "task_chat"]

_PROBE_ANSWER = "<think>\nB\n</think>\n\nB"  # reasoning tags: templates that drop earlier turns' reasoning show it
_SPECIALS = ("eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """A chat template that cannot render a task's turns (see the module docstring)."""


def read_chat_template(folder: str | Path) -> tuple[str, dict[str, str]] | None:
    """(template source, its special-token variables) from a checkpoint folder, or None when it has no template."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    variables = {k: v.get("content", "") if isinstance(v, dict) else v for k in _SPECIALS
                 if isinstance(v := config.get(k), (str, dict))}
    if (folder / "chat_template.jinja").is_file():  # newer transformers save it beside the config
        return (folder / "chat_template.jinja").read_text(), variables
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one renders conversations
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if source is None:
            raise ChatTemplateError(f"{config_file}: chat_template lists no template named 'default'")
    return (source, variables) if source else None


def _raise(message: str):
    raise ChatTemplateError(f"the template raised: {message}")


class ChatTemplate:
    """A prefix-stable chat template; `conversation()` renders one episode's turns (see the module docstring)."""

    def __init__(self, source: str, end_of_turn: str, variables: Mapping[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: not valid Jinja ({e})") from None
        self.end_of_turn = end_of_turn
        self.variables = {"eos_token": end_of_turn, **(variables or {}), "bos_token": ""}
        probe = self.conversation()
        probe.start("A")
        for obs in ("C", "E"):
            probe.turn(_PROBE_ANSWER, True, obs)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **self.variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: fails on a user/assistant conversation ({e})") from None

    def conversation(self) -> ChatConversation:
        return ChatConversation(self)


class ChatConversation:
    """One episode's turns through a template: each call returns the text to append to the context."""

    def __init__(self, template: ChatTemplate):
        self.template, self.messages, self.text = template, [], ""

    def start(self, observation: str) -> str:
        """The first observation as the conversation's first user turn, with the generation prompt."""
        self.messages = [{"role": "user", "content": observation}]
        self.text = self.template.render(self.messages)
        return self.text

    def turn(self, answer: str, stopped: bool, observation: str) -> str:
        """After the model's `answer` (`stopped`: it ended on the stop token), the next observation's text."""
        self.messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": observation}]
        text, before = self.template.render(self.messages), self.text + answer
        if not text.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, text)) if a != b), min(len(before), len(text)))
            raise ChatTemplateError(
                f"chat template: not prefix-stable: rendering turn {len(self.messages) // 2 + 1} rewrote the text of "
                f"the turns before it (at character {at}, {before[at:at + 24]!r} became {text[at:at + 24]!r}); the "
                "context is never re-rendered (--env.chat-template off renders turns as plain text)")
        suffix, self.text = text[len(before):], text
        if stopped:
            if not suffix.startswith(self.template.end_of_turn):
                raise ChatTemplateError(
                    f"chat template: an assistant turn does not end with the model's stop token "
                    f"{self.template.end_of_turn!r} (it is followed by {suffix[:24]!r}); --env.chat-template off "
                    "renders turns as plain text")
            suffix = suffix[len(self.template.end_of_turn):]  # the sampled stop token already wrote it
        return suffix


def task_chat(setting: str, folder: str | None, stop_token: str) -> ChatTemplate | None:
    """The template a task job renders its turns through: `--env.chat-template` auto (the checkpoint's, if any), on
    (the checkpoint's, required) or off (none: plain text). `stop_token`: the text of the sampler's stop token."""
    if setting == "off":
        return None
    found = read_chat_template(folder) if folder else None
    if found is None:
        if setting == "on":
            where = f"{folder} has no chat_template" if folder else "the built-in tokenizer has none"
            raise ChatTemplateError(f"--env.chat-template on: {where} (tokenizer_config.json's chat_template or "
                                    "chat_template.jinja in --model.hf-checkpoint)")
        return None
    source, variables = found
    return ChatTemplate(source, stop_token, variables)
