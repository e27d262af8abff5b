"""A complete text task in one file (docs/fork.md, "Bring your own task"): say the word shown, backwards.

    python experiments/train.py --env.task my_task:make --env.task-args '{"length": 3}'   # docs/examples on PYTHONPATH

Any `gymnasium.Env` with text observations and answers works; earl_jax/tasks/protocol.py has the contract.
"""

from __future__ import annotations

import string

import gymnasium
import numpy as np

LETTERS = "abcdefgh"


class ReverseWord(gymnasium.Env):
    """One turn: the observation is a word, the answer is it reversed (+1), anything else 0."""

    def __init__(self, length: int = 3, split: str = "train"):
        self.length, self.split = length, split
        self.observation_space = gymnasium.spaces.Text(16, charset=string.printable)
        self.action_space = gymnasium.spaces.Text(16, charset=string.printable)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        rng = np.random.default_rng(seed)
        while True:  # held-out words: those whose letters sum to an odd number
            self.word = "".join(rng.choice(list(LETTERS), self.length))
            if (sum(map(ord, self.word)) % 2 == 1) == (self.split == "test"):
                break
        return f"{self.word}\n> ", {}

    def step(self, answer: str):
        success = answer.strip() == self.word[::-1]
        return "", float(success), True, False, {"success": success, "score": float(success)}

    def expert_answer(self) -> str:  # what the SFT stage imitates (--sft.steps)
        return self.word[::-1]


def make(**kwargs) -> ReverseWord:
    return ReverseWord(**kwargs)
