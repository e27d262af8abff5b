"""How a game ended, seen from the agent: the names every floor reads (rollout statistics, the process split,
the batched envs) without loading a game or OpenSpiel."""

WINNERS = ("agent", "opponent", "draw")
"""A finished game's winner; a forfeit (an invalid answer with no retry left) is the opponent's win."""

NO_WINNER = -1
"""Winner code of a game still running; any other code is an index into WINNERS."""
