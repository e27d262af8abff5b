"""OpenSpiel two-player games as Gymnasium text environments, with opponents and an action parser.

`import earl_jax` registers three Gymnasium ids:

    gymnasium.make("earl_jax/ConnectFour-v0", opponent="alphabeta:4")
    gymnasium.make("earl_jax/TicTacToe-v0", opponent="solver", agent_player=1)
    gymnasium.make("earl_jax/OpenSpiel-v0", game="breakthrough(rows=6,columns=6)")

Keywords are `EnvConfig` fields. See text.py for the observation format and alphabet.
`earl_jax.envs.vector` steps a whole batch of games in one call (make_vector_env), with the same
observations, rewards and infos as these per-game envs; `earl_jax.envs.games` holds one `GameSpec` per
batched game (docs/fork.md: adding a game).

The names below load on first use (PEP 562), so importing a module of this package that needs no game
(`envs.parser`, `envs.outcomes`, `envs.env_config`: what the sampler, the agent loop and the job's config read) does
not load OpenSpiel.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from earl_jax import ENV_IDS

_LAZY = {
    "EnvConfig": "env_config", "OpenSpielTextEnv": "openspiel_env",
    "Opponent": "opponents", "make_opponent": "opponents",
    "canonical_action_text": "parser", "parse_action": "parser",
    "COMPACT_ALPHABET": "text", "PROMPT_STYLES": "text", "GameText": "games.game_text", "format_observation": "text",
    "game_text": "text", "observation_alphabet": "text", "render_board": "text",
}

__all__ = ["ENV_IDS", *sorted(_LAZY)]

if TYPE_CHECKING:
    from earl_jax.envs.env_config import EnvConfig
    from earl_jax.envs.games.game_text import GameText
    from earl_jax.envs.openspiel_env import OpenSpielTextEnv
    from earl_jax.envs.opponents import Opponent, make_opponent
    from earl_jax.envs.parser import canonical_action_text, parse_action
    from earl_jax.envs.text import (
        COMPACT_ALPHABET,
        PROMPT_STYLES,
        format_observation,
        game_text,
        observation_alphabet,
        render_board,
    )


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
