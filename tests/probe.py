"""Probe games whose only rewarded answer depends on what the observation shows.

They check that RL learns *conditioned on the observation* (the issue-14 failure: one-move habits
whatever the board says). Same reset/step interface as `OpenSpielTextEnv`, so the Trainer takes them
through `env_factory`:

    Trainer(cfg, env_factory=functools.partial(ShowDigitEnv, reveal_turn=1))

ShowDigitEnv: a digit d < `choices` is drawn from the reset seed. Turns before `reveal_turn` show "say\\n> " and accept
any answer (reward 0); turn `reveal_turn` shows "d 7\\n> " and the game ends: the answer whose first
number is (d + shift) % 10 wins (+1), another number draws (0), no number forfeits (-1). With
`hidden=True` the digit is printed as "?" (the reward still depends on it): the control that shows a
learner cannot reach the target without reading the observation (at best 1 in 10 by luck).
`info["legal_actions"]` lists the answers the format warm-up draws from: every digit, or `warmup_moves`
(a test narrows it to (0,) to teach one constant answer and so force a collapse).
"""

from __future__ import annotations

import numpy as np

from earl_jax.envs.parser import parse_action


class ShowDigitEnv:
    def __init__(self, cfg=None, *, reveal_turn: int = 0, shift: int = 0, hidden: bool = False, choices: int = 10,
                 miss_reward: float = 0.0, warmup_moves: tuple[int, ...] = tuple(range(10))):
        self.legal = list(warmup_moves)
        self.num_actions = 10  # answers 0..9 (constrained moves draw among `legal`)
        self.reveal_turn, self.shift, self.hidden, self.choices = reveal_turn, shift, hidden, choices
        self.miss_reward = miss_reward

    def _show(self) -> str:
        return f"d {'?' if self.hidden else self.digit}\n> "

    def reset(self, seed=None, options=None):
        self.digit = int(np.random.default_rng(seed).integers(self.choices))
        self.turn = 0
        info = {"digit": self.digit, "legal_actions": self.legal}
        return (self._show() if self.reveal_turn == 0 else "say\n> "), info

    def step(self, text):
        move = parse_action(text)
        self.turn += 1
        if self.turn <= self.reveal_turn:  # an earlier turn: any answer is fine, the game goes on
            shown = self._show() if self.turn == self.reveal_turn else "say\n> "
            return shown, 0.0, False, False, {"legal_actions": self.legal}
        if move is None:
            winner = "opponent"
        else:
            winner = "agent" if move == (self.digit + self.shift) % 10 else "draw"
        reward = {"agent": 1.0, "draw": self.miss_reward, "opponent": -1.0}[winner]
        return "", reward, True, False, {"winner": winner, "invalid": move is None}
