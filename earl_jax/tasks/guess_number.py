"""GuessNumber: find a secret number from higher / lower feedback; the context grows by one exchange a turn.

At reset the observation is the range, `guess 0-31\\n> `. Each answer's first integer is a guess: the secret ->
reward 1.0, success, the episode ends (observation ""); otherwise `higher\\n> ` or `lower\\n> ` (reward 0). An answer
without an integer gets `a number\\n> ` and -0.1, counts as a turn, and is marked `invalid_answer` in that step's info.
After `max_turns` turns without the secret the episode ends with success False (reward 0.0 on that turn). The score
is 1.0 on success, else 0.0. `expert_answer()` is the binary search over what the feedback has left, which always
succeeds when `high < 2 ** max_turns`.
`off_range_penalty` (default 0) is a per-turn reward of minus that much for a guess outside what the feedback has
left; the score and success do not change.

With `offsets > 1` each episode's range is shifted, `[lo, lo + high)` for `lo` drawn from `range(offsets)`, and
the held-out split is over the range: "test" when a hash of `lo` is 0 mod 4, so a test episode searches a range
never seen in training, for any secret in it. With the default single range the split is over the secret (a hash
of it), so the test secrets never occur in training: a policy trained by RL can learn to skip them (training success
0.78-0.88 while held-out success fell from 0.70 to 0.43-0.58, docs/learning.md), which is why the presets shift.
`reset(seed)` draws from the seed until the problem is in the env's split.
"""

from __future__ import annotations

import hashlib
import re

import gymnasium

from earl_jax.tasks.tools import CHARSET

__all__ = ["GuessNumber", "in_test_split", "make_guess_number"]

_INT = re.compile(r"-?\d+")
INVALID_REWARD = -0.1


def in_test_split(lo: int, secret: int, by_range: bool = False) -> bool:
    """Whether the problem (range start, secret) is held out: by its range start, or by the secret
    (deterministic across processes, unlike `hash`)."""
    key = f"range:{lo}" if by_range else f"{lo}:{secret}"
    return hashlib.sha256(key.encode()).digest()[0] % 4 == 0


class GuessNumber(gymnasium.Env):
    """A secret in `[lo, lo + high)`, found in at most `max_turns` guesses; see the module docstring."""

    def __init__(self, high: int = 32, max_turns: int = 6, split: str = "train", offsets: int = 1,
                 show_range: bool = False, off_range_penalty: float = 0.0):
        if split not in ("train", "test"):
            raise ValueError(f"split: 'train' or 'test' (got {split!r})")
        if high < 2 or max_turns < 1 or offsets < 1:
            raise ValueError(f"need high >= 2, max_turns >= 1, offsets >= 1 (got {high}, {max_turns}, {offsets})")
        self.high, self.max_turns, self.split, self.offsets = high, max_turns, split, offsets
        self.show_range = show_range  # feedback restates what is left ("higher 14-31"): no need to recall it
        # a guess outside what the feedback left costs this: a failed episode that kept to the range still ranks
        # above one that did not, so a group of failures has something to compare (the score is unchanged)
        self.off_range_penalty = off_range_penalty
        self.observation_space = gymnasium.spaces.Text(max_length=32, min_length=0, charset=CHARSET)
        self.action_space = gymnasium.spaces.Text(max_length=16, min_length=0, charset=CHARSET)
        self.lo = self.secret = self.turns = 0
        self.low, self.top = 0, high - 1  # what the feedback so far leaves possible (for the expert)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        for _ in range(10_000):
            lo = int(self.np_random.integers(self.offsets))
            secret = lo + int(self.np_random.integers(self.high))
            if in_test_split(lo, secret, by_range=self.offsets > 1) == (self.split == "test"):
                break
        else:
            raise RuntimeError(f"no {self.split} problem with high={self.high}, offsets={self.offsets}")
        self.lo, self.secret, self.turns = lo, secret, 0
        self.low, self.top = lo, lo + self.high - 1
        return f"guess {self.low}-{self.top}\n> ", {}

    def step(self, answer: str):
        self.turns += 1
        last = self.turns >= self.max_turns
        match = _INT.search(answer)
        if match is None:
            info = {"invalid_answer": True, **self._end(False, last)}
            return ("" if last else "a number\n> "), INVALID_REWARD, last, False, info
        guess = int(match.group())
        if guess == self.secret:
            return "", 1.0, True, False, {"invalid_answer": False, **self._end(True, True)}
        reward = 0.0 if self.low <= guess <= self.top else -self.off_range_penalty
        if guess < self.secret:
            self.low, feedback = max(self.low, guess + 1), "higher"
        else:
            self.top, feedback = min(self.top, guess - 1), "lower"
        info = {"invalid_answer": False, **self._end(False, last)}
        left = f" {self.low}-{self.top}" if self.show_range else ""
        return ("" if last else f"{feedback}{left}\n> "), reward, last, False, info

    def _end(self, success: bool, done: bool) -> dict:
        """The outcome keys of a final step's info (none before)."""
        return {"success": success, "score": float(success)} if done else {}

    def expert_answer(self) -> str:
        """The middle of what the feedback so far leaves possible."""
        return str((self.low + self.top) // 2)


def make_guess_number(**kw) -> gymnasium.Env:
    """`GuessNumber(**kw)`."""
    return GuessNumber(**kw)
