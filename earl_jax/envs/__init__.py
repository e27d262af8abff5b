"""OpenSpiel two-player games as Gymnasium text environments, with opponents and an action parser.

`import earl_jax` registers three Gymnasium ids:

    gymnasium.make("earl_jax/ConnectFour-v0", opponent="alphabeta:4")
    gymnasium.make("earl_jax/TicTacToe-v0", opponent="solver", agent_player=1)
    gymnasium.make("earl_jax/OpenSpiel-v0", game="breakthrough(rows=6,columns=6)")

Keywords are `EnvConfig` fields. See text.py for the observation format and alphabet.
`earl_jax.envs.vector` steps a whole batch of games in one call (make_vector_env), with the same
observations, rewards and infos as these per-game envs.
"""
from earl_jax import ENV_IDS
from earl_jax.envs.opponents import Opponent, make_opponent
from earl_jax.envs.openspiel_env import EnvConfig, OpenSpielTextEnv
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

__all__ = [
    "COMPACT_ALPHABET", "ENV_IDS", "EnvConfig", "GameText", "OpenSpielTextEnv", "Opponent", "PROMPT_STYLES",
    "canonical_action_text", "format_observation", "game_text", "make_opponent",
    "observation_alphabet", "parse_action", "render_board",
]
