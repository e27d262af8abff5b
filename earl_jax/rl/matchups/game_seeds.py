"""The seeds an iteration's games are reset with: one per game, grouped by GRPO group.

`shared` (the default): a group's games share one seed, so they start in the same seat and face the same
opponent stream; they differ only where the policy's samples differ. Against a (nearly) deterministic opponent
a confident policy then plays the same game G times: a constant group, no advantage, no gradient (the GPU
preset's curriculum ended with 74% of its groups constant, README *Connect Four on one H100*).

`per_game`: game j > 0 of a group gets its own seed, drawn until the seat it gives is the group's (when the env
draws the seat from the seed), so the group still compares games from one seat, while the opponent's
tie-breaking and sampling streams differ game to game. Game 0 keeps the group's seed: a group of one is the
same in both modes.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

from earl_jax.envs.vector.env import seed_draws

GroupSeeds = Literal["shared", "per_game"]


def seat_of_seed(seed: int) -> int:
    """The seat OpenSpielTextEnv.reset(seed=seed) draws (0: the agent moves first) when its config leaves it
    to chance, as the vector env reproduces it (cached there: the env's reset finds the chosen seeds' draws)."""
    return seed_draws(int(seed), True)[0]


def game_seeds(group_seeds: Sequence[int], group_size: int, mode: GroupSeeds = "shared",
               seat_from_seed: bool = True) -> list[int]:
    """Seeds of len(group_seeds) * group_size games, group by group. `seat_from_seed`: the env draws the seat
    from the seed (EnvConfig.agent_player None), so per_game seeds are kept to the group's seat."""
    if mode == "shared":
        return [int(s) for s in group_seeds for _ in range(group_size)]
    if mode != "per_game":
        raise ValueError(f"group_seeds must be 'shared' or 'per_game', got {mode!r}")
    out: list[int] = []
    for s in map(int, group_seeds):
        out.append(s)
        seat = seat_of_seed(s) if seat_from_seed else None
        draw = 0
        for j in range(1, group_size):
            while True:  # half the candidates match the seat: ~2 draws a game
                draw += 1
                c = int(np.random.SeedSequence([s, j, draw]).generate_state(1)[0]) & 0x7FFFFFFF
                if seat is None or seat_of_seed(c) == seat:
                    break
            out.append(c)
    return out


def rollout_inputs(rollout, seed: int, step: int, seat_from_seed: bool):
    """Iteration `step`'s game seeds (by `rollout.group_seeds`), group ids and sampling key: everything random in a
    rollout derives from (seed, step), so a resumed run replays the iterations it missed exactly."""
    import jax

    seeds = game_seeds([(seed * 1_000_003 + step * rollout.groups + g) % (2**31) for g in range(rollout.groups)],
                       rollout.group_size, rollout.group_seeds, seat_from_seed=seat_from_seed)
    return seeds, np.repeat(np.arange(rollout.groups), rollout.group_size), jax.random.fold_in(jax.random.key(seed),
                                                                                               step)
