"""`EnvConfig`: one text environment's game, opponent, prompt and rewards (the job's `env` component).

It checks only what needs no game loaded: the game string and the opponent spec are checked where the env is
built (OpenSpielTextEnv, make_vector_env), and the job may name an opponent the env never sees ("curriculum").
A bad value raises ValueError "field: why (got x)", which the command line turns into the flag's name.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Literal

from earl_jax.envs.text import PROMPT_STYLES


def parse_task_args(text: str) -> dict:
    """`--env.task-args`: a JSON object of keyword arguments ("" is none)."""
    try:
        args = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"task_args: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(args, dict):
        raise ValueError(f"task_args: must be a JSON object of keyword arguments, e.g. '{{\"high\": 32}}' "
                         f"(got {text!r})")
    return args


def _f(default, help):
    """A field with the help text the command line shows (earl_jax/cli.py reads metadata["help"]; a function: the
    text when it is shown)."""
    return dataclasses.field(default=default, metadata={"help": help})


def opponent_help() -> str:
    """--env.opponent's help from the games' registry: which game adds which opponent, which refuses the solver."""
    from earl_jax.envs.games import find_game, game_names

    specs = {name: find_game(name) for name in game_names()}
    own_solver = [name for name, spec in specs.items() if "solver" in spec.opponents]
    refuse = [name for name, spec in specs.items() if "solver" in spec.refused_opponents and name not in own_solver]
    own = [f"{kind}:N ({name} only)" for name, spec in specs.items() for kind in spec.opponents]
    notes = [f"{name} plays its own search" for name in own_solver]
    if refuse:
        notes.append(f"{', '.join(refuse)} {'refuses' if len(refuse) == 1 else 'refuse'} it")
    solver = "solver (exact play: small games" + (f"; {'; '.join(notes)})" if notes else ")")
    return (f"opponent: random, mcts:N, {solver}, {', '.join(own)}; the job also takes curriculum (the ladder of "
            "--curriculum.ladder)")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """env: the game, the opponent, the observation text and the rewards"""

    task: str = _f("", "a text task instead of a game: a registered Gymnasium id (earl_jax/GuessNumber-v0, "
                         "earl_jax/Arithmetic-v0) or module:factory (earl_jax/tasks/protocol.py says what it returns); "
                         "empty: the game")
    task_args: str = _f("{}", "the task factory's keyword arguments, a JSON object, e.g. '{\"high\": 32}'")
    chat_template: Literal["auto", "on", "off"] = _f(
        "auto", "a text task's turns through the --model.hf-checkpoint's chat template (observations as user turns, "
                "answers as assistant turns; earl_jax/tasks/chat.py): auto = when it has one, on = it must, "
                "off = plain text")
    step_workers: int = _f(1, "a task's episodes stepped by this many threads at once, so tool calls that wait "
                              "(a search, a sandbox) overlap; 1 = one after another; the task's env objects must "
                              "not share state")
    search_workers: int = _f(0, "processes that search for a per-game opponent (mcts:N) at once, each for its share "
                                "of the games (the same moves as one process); 0 = in the job's process")
    game: str = _f("connect_four", "OpenSpiel game: connect_four, tic_tac_toe (batched: envs/games/), or any "
                                   "two-player turn-based game string, e.g. breakthrough(rows=6)")
    opponent: str = _f("random", opponent_help)
    agent_player: int | None = _f(None, "0 = the agent moves first, 1 = second, none = drawn per game from its seed")
    prompt_style: Literal["compact", "minimal", "chat", "labeled"] = _f(
        "compact", "observation text: compact (board every turn), minimal (board once, then the opponent's replies: "
                   "short contexts), labeled (compact, the cell each legal move fills shows the move's id), chat "
                   "(English, for a pretrained LLM)")
    max_retries: int = _f(0, "invalid answers allowed per move (the observation says so) before the game is forfeit")
    win_reward: float = _f(1.0, "reward for a win")
    loss_reward: float = _f(-1.0, "reward for a loss")
    draw_reward: float = _f(0.0, "reward for a draw")
    invalid_reward: float = _f(-1.0, "reward for the forfeit after an invalid answer (the opponent wins)")
    retry_reward: float = _f(0.0, "reward for an invalid answer that still has a retry left")
    blunder_penalty: float = _f(
        0.0, "minus this x the outcome classes (win / open / loss) a move gives away, on that move's reward: a missed "
             "win or block costs even when a weak opponent does not punish it (batched games only: Tic-Tac-Toe exact, "
             "Connect Four --env.blunder-depth plies; envs/vector/blunders.py). 0: the outcome alone")
    blunder_depth: int = _f(1, "Connect Four: plies searched to judge a move for the blunder penalty (1: immediate "
                               "wins and blocks; each ply ~7x the cost)")

    def __post_init__(self):
        def need(ok: bool, field: str, why: str):
            if not ok:
                raise ValueError(f"{field}: {why} (got {getattr(self, field)!r})")

        parse_task_args(self.task_args)  # its ValueError names the field
        need(self.prompt_style in PROMPT_STYLES, "prompt_style", f"must be one of {', '.join(PROMPT_STYLES)}")
        need(self.chat_template in ("auto", "on", "off"), "chat_template", "must be auto, on or off")
        need(self.step_workers >= 1, "step_workers", "must be >= 1")
        need(self.search_workers >= 0, "search_workers", "must be >= 0")
        need(self.agent_player in (0, 1, None), "agent_player", "must be 0, 1 or none")
        need(self.max_retries >= 0, "max_retries", "must be >= 0")
        need(self.blunder_penalty >= 0, "blunder_penalty", "must be >= 0")
        need(self.blunder_depth >= 1, "blunder_depth", "must be >= 1")

    @classmethod
    def connect_four(cls, **kw) -> "EnvConfig":
        return cls(game="connect_four", **kw)

    @classmethod
    def tic_tac_toe(cls, **kw) -> "EnvConfig":
        return cls(game="tic_tac_toe", **kw)
