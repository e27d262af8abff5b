"""OpenSpiel two-player games as Gymnasium text environments, with opponents and an action parser.

Importing this package registers three Gymnasium ids:

    gymnasium.make("earl_jax/ConnectFour-v0", opponent="alphabeta:4")
    gymnasium.make("earl_jax/TicTacToe-v0", opponent="solver", agent_player=1)
    gymnasium.make("earl_jax/OpenSpiel-v0", game="breakthrough(rows=6,columns=6)")

Keywords are `EnvConfig` fields. See text.py for the observation format and alphabet.
`earl_jax.envs.vector` steps a whole batch of games in one call (make_vector_env), with the same
observations, rewards and infos as these per-game envs.
"""
import gymnasium

from earl_jax.envs.batch import EnvBatch
from earl_jax.envs.opponents import Opponent, make_opponent
from earl_jax.envs.openspiel_env import EnvConfig, OpenSpielTextEnv, make_envs
from earl_jax.envs.parser import canonical_action_text, parse_action
from earl_jax.envs.text import (
    COMPACT_ALPHABET,
    PROMPT_STYLES,
    GameText,
    format_observation,
    game_text,
    observation_alphabet,
    render_board,
)

_ENTRY = "earl_jax.envs.openspiel_env:OpenSpielTextEnv"
ENV_IDS = {
    "earl_jax/ConnectFour-v0": {"game": "connect_four"},
    "earl_jax/TicTacToe-v0": {"game": "tic_tac_toe"},
    "earl_jax/OpenSpiel-v0": {},
}

for _id, _kwargs in ENV_IDS.items():
    if _id not in gymnasium.registry:  # importing twice (reload, subprocess) must not re-register
        gymnasium.register(id=_id, entry_point=_ENTRY, kwargs=_kwargs)

__all__ = [
    "COMPACT_ALPHABET", "ENV_IDS", "EnvBatch", "EnvConfig", "GameText", "OpenSpielTextEnv", "Opponent", "PROMPT_STYLES",
    "canonical_action_text", "format_observation", "game_text", "make_envs", "make_opponent",
    "observation_alphabet", "parse_action", "render_board",
]
