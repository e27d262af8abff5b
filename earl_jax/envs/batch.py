"""A list of text environments stepped in lock-step, for the agent loop's batch of games."""
from __future__ import annotations

from typing import Any

from earl_jax.envs.openspiel_env import EnvConfig, OpenSpielTextEnv


class EnvBatch:
    """Row i is one game. Finished rows stay finished (step skips them) until the next reset.

    Plain Python lists on purpose: observations are strings, and the per-row cost is the
    OpenSpiel step plus one board translate, a few microseconds.
    """

    def __init__(self, n: int, config: EnvConfig | None = None, **overrides):
        self.envs = [OpenSpielTextEnv(config, **overrides) for _ in range(n)]
        self.done = [True] * n

    def __len__(self) -> int:
        return len(self.envs)

    def reset(self, seed: int) -> tuple[list[str], list[dict[str, Any]]]:
        """Row i is reset with seed + i."""
        out = [env.reset(seed=seed + i) for i, env in enumerate(self.envs)]
        self.done = [False] * len(self.envs)
        return [o for o, _ in out], [info for _, info in out]

    def step(self, answers: list[str]):
        """(observations, rewards, terminated, infos); finished rows give "", 0.0, True, {}."""
        if len(answers) != len(self.envs):
            raise ValueError(f"{len(answers)} answers for {len(self.envs)} games")
        obs, rewards, terminated, infos = [], [], [], []
        for i, (env, answer) in enumerate(zip(self.envs, answers)):
            if self.done[i]:
                obs.append(""), rewards.append(0.0), terminated.append(True), infos.append({})
                continue
            o, r, term, trunc, info = env.step(answer)
            self.done[i] = term or trunc
            obs.append(o), rewards.append(r), terminated.append(self.done[i]), infos.append(info)
        return obs, rewards, terminated, infos
