"""How a game reads as text: board rendering, observation templates, the observation alphabet.

Everything the environment says goes through `render_board` and `format_observation`, so the
set of characters an observation can contain is known in advance (`observation_alphabet`) and a
tiny character-level tokenizer can cover it exactly.

Conventions (both preset games, both prompt styles):
- the agent is always `X`, the opponent always `O`, an empty cell `.`; whoever moves first.
- `board` arrays: int8, +1 agent, -1 opponent, 0 empty, row 0 = the top row as printed.
  Connect Four (6, 7); Tic-Tac-Toe (3, 3). Other games: the agent's OpenSpiel observation
  tensor (float32, `game.observation_tensor_shape()`), and the board text is the agent's
  `observation_string` (or `str(state)` when the game has none).
- actions are written as their decimal id (`canonical_action_text`): Connect Four column
  0..6 left to right, Tic-Tac-Toe cell 0..8 row-major from the top left.

Compact style (default, for the tiny model) - a turn, a final position, an invalid answer:

    opp 3          <- only when the opponent has just moved
    .......
    ...O...
    ..XXO..
    moves: 0 1 2 3 4 5 6
    >                           ("> " then the agent answers)

    <board>
    result: win                 (win | loss | draw)

    invalid move
    moves: 0 1 2 3 4 5 6        (retry; or "result: loss" when no retries are left)
    >

Labeled style: compact, but the cell each legal move would fill shows the move's id instead of `.`
(Tic-Tac-Toe: every empty cell its number; Connect Four: the lowest empty cell of a column its column), so the
answer is a character of the board and a tiny model can find it by looking, not by counting positions:

    X1O          .......
    3X5          ..234..
    6O8          01XOO56

Chat style (for a pretrained LLM): full English rules in the first observation, labelled board,
"Legal moves: 0, 1, 2" and "Answer with the column number."
"""
from __future__ import annotations

import functools
import string
from typing import TYPE_CHECKING

from earl_jax.envs.games import game_names, spec_for
from earl_jax.envs.games.game_text import AGENT, EMPTY, OPPONENT, GameText

if TYPE_CHECKING:
    import pyspiel

PROMPT_STYLES = ("compact", "minimal", "chat", "labeled")
COMPACT_ALPHABET = "\n .0123456789:>OXadeilmnoprstuvw"
"""Every character a compact observation of Connect Four or Tic-Tac-Toe can contain (31).

Agent answers need only the digits plus whatever terminator the sampler stops at ("\n").
`observation_alphabet(game, style)` derives it from the templates; a test keeps both equal.
"""
RESULTS = ("win", "loss", "draw")
def game_text(game: pyspiel.Game) -> GameText:
    """The text conventions for a loaded OpenSpiel game (a preset or the generic fallback)."""
    spec = spec_for(game)
    if spec is not None:
        return spec.text
    # Registered games with non-default parameters (other board sizes) use the generic fallback, too.
    return GameText(
        name=str(game),
        num_actions=game.num_distinct_actions(),
        board_shape=None,
        move_noun="action",
        rules=(
            f"We play the game {game.get_type().long_name}. You are player {{agent}}. "
            "Each turn, answer with the number of one of the legal actions."
        ),
    )


def render_board(state: pyspiel.State, agent_player: int = 0, prompt_style: str = "compact") -> str:
    """The board of `state` as the observation prints it (agent X, opponent O, '.' empty)."""
    gt = game_text(state.get_game())
    return gt.render_board(gt.board_text(state, agent_player), prompt_style)


# ---- observation templates ------------------------------------------------------------------
def format_observation(
    gt: GameText,
    prompt_style: str,
    *,
    board: str | None,
    legal_actions: list[int] | None,
    opponent_action: int | None = None,
    result: str | None = None,
    invalid: bool = False,
    first: bool = False,
    agent_player: int = 0,
    state: pyspiel.State | None = None,
) -> str:
    """One observation. `result` in RESULTS ends the game; `legal_actions` is shown otherwise.

    `invalid` prefixes the invalid-answer line (a retry when `result` is None, else the forfeit;
    `board` may be None then). `state` is only read by the generic chat style, to name moves.
    """
    if prompt_style == "minimal" and not first and result is None:
        # The board and legal moves once, then only the opponent's reply: the policy tracks the game
        # from its own context, which stays ~8 tokens a turn instead of ~80 (the CPU default's budget).
        # After an invalid answer the legal moves again: without them the greedy policy kept repeating a
        # full column until it forfeited (eval/invalid 0.28 in results/connect4_cpu_default).
        if invalid:
            return "invalid move\n" + _moves_line(gt, prompt_style, tuple(legal_actions))
        return (f"opp {gt.action_text(opponent_action)}\n" if opponent_action is not None else "") + "> "
    if prompt_style in ("compact", "minimal", "labeled"):
        parts = []
        if invalid:
            parts.append("invalid move\n")
        if opponent_action is not None:
            parts.append(f"opp {gt.action_text(opponent_action)}\n")
        if board is not None:
            parts.append(gt.render_board(board, prompt_style) + "\n")
        if result is not None:
            parts.append(f"result: {result}\n")
        else:
            parts.append(_moves_line(gt, prompt_style, tuple(legal_actions)))
        return "".join(parts)

    parts = []
    if first:
        parts.append(gt.rules.replace("{agent}", str(agent_player)) + "\n")
    if invalid:
        parts.append("That answer is not a legal move.\n")
    if opponent_action is not None:
        parts.append(f"Your opponent played {gt.move_noun} {gt.action_text(opponent_action)}.\n")
    if board is not None:
        parts.append(gt.render_board(board, prompt_style) + "\n")
    if result is not None:
        parts.append(_CHAT_RESULT[result] + "\n")
    else:
        if gt.is_preset or state is None:
            parts.append(_moves_line(gt, "chat", tuple(legal_actions)))
        else:  # name each action too: ids alone mean nothing in, say, chess
            moves = ", ".join(
                f"{a} ({state.action_to_string(state.current_player(), a)})" for a in legal_actions
            )
            parts.append(f"Legal moves: {moves}\nAnswer with the {gt.move_noun} number.\n")
    return "".join(parts)


@functools.lru_cache(maxsize=8192)
def _moves_line(gt: GameText, prompt_style: str, legal_actions: tuple[int, ...]) -> str:
    """Cached: a preset has few distinct legal sets (Connect Four 127, Tic-Tac-Toe 511)."""
    if prompt_style in ("compact", "minimal", "labeled"):
        return "moves: " + " ".join(map(gt.action_text, legal_actions)) + "\n> "
    moves = ", ".join(map(gt.action_text, legal_actions))
    return f"Legal moves: {moves}\nAnswer with the {gt.move_noun} number.\n"


_CHAT_RESULT = {"win": "You win.", "loss": "You lose.", "draw": "The game is a draw."}


def observation_alphabet(game: str | pyspiel.Game, prompt_style: str = "compact") -> str:
    """Every character any observation of a preset game can contain, sorted, as one string.

    Built by rendering every template branch with every action and every board symbol, so it
    follows the templates above; tests check it against observations of many random games.
    Compact style, both presets: `\\n`, space, `.`, `:`, `>`, the digits, `O`, `X`, and the
    letters of "opp moves result win loss draw invalid".
    """
    if isinstance(game, str):
        import pyspiel  # here: the text conventions load without OpenSpiel

        game = pyspiel.load_game(game)
    gt = game_text(game)
    if not gt.is_preset:
        raise ValueError(
            f"observation_alphabet is defined for the preset games {list(game_names())}, not {gt.name!r}: "
            "other games print str(state), whose characters OpenSpiel decides"
        )
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
    rows, cols = gt.board_shape
    row = (AGENT + OPPONENT + EMPTY) * cols
    board = "\n".join([row[:cols]] * rows)
    actions = list(range(gt.num_actions))
    chars = set(string.digits) | set(gt.render_board(board, prompt_style)) | {AGENT, OPPONENT, EMPTY}
    for first in (False, True):
        for invalid in (False, True):
            for result in (None, *RESULTS):
                text = format_observation(
                    gt, prompt_style, board=board, legal_actions=actions, opponent_action=0,
                    result=result, invalid=invalid, first=first,
                )
                chars.update(text)
    return "".join(sorted(chars))
