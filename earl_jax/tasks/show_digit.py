"""ShowDigit: the learning probe as a task. The observation shows a digit; the answer must say it.

`d 7\\n> ` at reset (a digit drawn from the seed, below `choices`); one answer ends the episode: its first integer
equal to the digit -> +1 (success), another integer -> 0, no integer -> -1 (invalid). With `hidden=True` the digit is
printed as `?` while the reward still depends on it: the control that shows a learner cannot pass without reading
the observation (a constant answer succeeds 1 time in `choices`). It is the free-text twin of `tests/probe.py`'s
`ShowDigitEnv`, runnable from the stock command line:

    python experiments/train.py --env.task earl_jax/ShowDigit-v0 --sft.answers format

`--sft.answers format` warms the format up on uniformly random digits (the action_space), which never show the
answer; the default (expert) SFT would.
"""

from __future__ import annotations

import re

import gymnasium

from earl_jax.tasks.tools import CHARSET

__all__ = ["ShowDigit", "make_show_digit"]

_INT = re.compile(r"-?\d+")


class ShowDigit(gymnasium.Env):
    """One turn: say the digit shown (see the module docstring). `split` is accepted and ignored (no held-out set:
    every problem is one of `choices` digits)."""

    def __init__(self, choices: int = 10, hidden: bool = False, split: str = "train"):
        if not 2 <= choices <= 10:
            raise ValueError(f"choices: 2..10 (got {choices})")
        self.choices, self.hidden = choices, hidden
        self.observation_space = gymnasium.spaces.Text(max_length=8, min_length=0, charset=CHARSET)
        # the answer's format: --sft.answers format imitates draws from it (uniform digits, never the one shown)
        self.action_space = gymnasium.spaces.Text(max_length=1, min_length=1, charset="0123456789")
        self.digit = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.digit = int(self.np_random.integers(self.choices))
        return f"d {'?' if self.hidden else self.digit}\n> ", {}

    def step(self, answer: str):
        match = _INT.search(answer)
        if match is None:
            return "", -1.0, True, False, {"invalid": True, "success": False, "score": -1.0}
        hit = int(match.group()) == self.digit
        return "", float(hit), True, False, {"invalid": False, "success": hit, "score": float(hit)}

    def expert_answer(self) -> str:
        return str(self.digit)


def make_show_digit(**kw) -> gymnasium.Env:
    """`ShowDigit(**kw)`."""
    return ShowDigit(**kw)
