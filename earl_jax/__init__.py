"""earl-jax: agentic reinforcement learning of language models in JAX, after EARL (arXiv 2510.05943).

Importing the package registers the Gymnasium ids (cheap: the entry points load OpenSpiel only on make):

    import gymnasium, earl_jax
    env = gymnasium.make("earl_jax/ConnectFour-v0", opponent="alphabeta:2")
"""

__version__ = "0.1.0"

ENV_IDS = {
    "earl_jax/ConnectFour-v0": {"game": "connect_four"},
    "earl_jax/TicTacToe-v0": {"game": "tic_tac_toe"},
    "earl_jax/OpenSpiel-v0": {},
}
_ENTRY = "earl_jax.envs.openspiel_env:OpenSpielTextEnv"
# The shipped text tasks (earl_jax/tasks/): gymnasium.make(id, **kwargs) gives the task itself.
TASK_IDS = {"earl_jax/GuessNumber-v0": "earl_jax.tasks.guess_number:make_guess_number",
            "earl_jax/Arithmetic-v0": "earl_jax.tasks.arithmetic:make_arithmetic",
            "earl_jax/ShowDigit-v0": "earl_jax.tasks.show_digit:make_show_digit"}


def _register_gymnasium_ids() -> None:
    try:
        import gymnasium
    except ImportError:  # a requirement, but the model / sharding / selector code runs without it
        return

    for env_id, kwargs in ENV_IDS.items():
        if env_id not in gymnasium.registry:  # importing twice (reload, subprocess) must not re-register
            gymnasium.register(id=env_id, entry_point=_ENTRY, kwargs=kwargs)
    for env_id, entry in TASK_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry, disable_env_checker=True)


_register_gymnasium_ids()
