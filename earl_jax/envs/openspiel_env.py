"""Any two-player turn-based OpenSpiel game as a Gymnasium text environment.

OpenSpiel owns the rules (legal moves, terminal test, returns); this file only turns its state
into text, reads the agent's answer (`parser.parse_action`) and plays the opponent's replies.
One `step(answer)` = the agent's move, then the opponent's reply (or the end of the game).

The agent loop calls `reset(seed=s)` and `step(text)` per row, so both stay cheap: no deep
copies, no string work beyond one board translate and one join.
"""
from __future__ import annotations

import dataclasses
import random
import string
from typing import Any

import gymnasium as gym
import pyspiel

from earl_jax.envs.env_config import EnvConfig
from earl_jax.envs.opponents import make_opponent
from earl_jax.envs.parser import parse_action
from earl_jax.envs.text import format_observation, game_text, observation_alphabet

__all__ = ["EnvConfig", "OpenSpielTextEnv"]  # EnvConfig lives in envs/env_config.py (no OpenSpiel there)


class OpenSpielTextEnv(gym.Env):
    """Text in, text out. See `text.py` for the observation format and board conventions.

    info (every reset and step):
      legal_actions    list[int]: the agent's legal moves now ([] once the game is over)
      board            np.ndarray: +1 agent, -1 opponent, 0 empty, top row first; (6, 7)
                       Connect Four, (3, 3) Tic-Tac-Toe; other games: the agent's observation tensor
      opponent_action  int | None: the opponent's reply this step (None if it did not move)
      action           int | None: the agent's move this step (None if invalid, or on reset)
      winner           "agent" | "opponent" | "draw" | None (game not over). A forfeit: "opponent"
      invalid          bool: this step's answer was unparseable or illegal
      turn             int: agent moves made so far (the index of the move asked for next)
      agent_player     int: 0 if the agent moved first, else 1
      retries_left     int: invalid answers still allowed for this move
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, config: EnvConfig | None = None, render_mode: str | None = None, **overrides):
        cfg = dataclasses.replace(config or EnvConfig(), **overrides)  # EnvConfig checks its fields
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.config, self.render_mode = cfg, render_mode
        self.game = pyspiel.load_game(cfg.game)
        gtype = self.game.get_type()
        if self.game.num_players() != 2 or gtype.dynamics != pyspiel.GameType.Dynamics.SEQUENTIAL:
            raise ValueError(f"game {cfg.game!r} is not a two-player turn-based (sequential) game")
        self.text = game_text(self.game)
        self.opponent = make_opponent(cfg.opponent, self.game)
        self.num_actions = self.text.num_actions  # action vocabulary: answers 0 .. num_actions-1
        charset = (
            observation_alphabet(self.game, cfg.prompt_style) if self.text.is_preset else string.printable
        )
        self.observation_space = gym.spaces.Text(max_length=1 << 16, min_length=0, charset=charset)
        # Answers are free text; the space documents that, it does not restrict what step accepts.
        self.action_space = gym.spaces.Text(max_length=1 << 16, min_length=0, charset=string.printable)
        self._chance_rng = random.Random(0)
        self.state: pyspiel.State | None = None
        self.agent_player = cfg.agent_player if cfg.agent_player is not None else 0
        self._done = True

    # ---- gymnasium API ------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """New game. `options={"history": [actions]}` starts from the position those moves reach."""
        super().reset(seed=seed)
        rng = self.np_random
        cfg = self.config
        self.agent_player = int(rng.integers(2)) if cfg.agent_player is None else cfg.agent_player
        self.opponent.reset(int(rng.integers(1 << 31)))
        self._chance_rng.seed(int(rng.integers(1 << 31)))
        self.state = self.game.new_initial_state()
        for a in (options or {}).get("history", ()):  # start from a given position (tests, openings)
            if self.state.is_terminal() or a not in self.state.legal_actions():
                raise ValueError(f"options['history']: {a!r} is not legal in\n{self.state}")
            self.state.apply_action(a)
        self._turn, self._retries_left, self._done = 0, cfg.max_retries, False
        opponent_action = self._play_until_agent()
        if self.state.is_terminal():  # possible only in odd games where the agent never moves
            return self._finish(opponent_action, None, first=True)[0], self._info
        self._legal = self.state.legal_actions()
        board = self.text.board_text(self.state, self.agent_player)
        obs = self._format(board, self._legal, opponent_action, first=True)
        self._set_info(opponent_action, None, None, False)
        return obs, self._info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("step() after the game ended (or before reset()); call reset() first")
        move = parse_action(action)
        if move is None or move not in self._legal:
            return self._invalid()
        self._retries_left = self.config.max_retries
        self.state.apply_action(move)
        self._turn += 1
        if self.state.is_terminal():
            return self._finish(None, move)
        opponent_action = self._play_until_agent()
        if self.state.is_terminal():
            return self._finish(opponent_action, move)
        self._legal = self.state.legal_actions()
        board = self.text.board_text(self.state, self.agent_player)
        obs = self._format(board, self._legal, opponent_action)
        self._set_info(opponent_action, move, None, False)
        return obs, 0.0, False, False, self._info

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self.state is None:
            return None
        return self.text.render_board(self.text.board_text(self.state, self.agent_player), "chat") + "\n"

    # ---- helpers ------------------------------------------------------------------------------
    def canonical_action_text(self, action: int) -> str:
        """What a scripted policy answers to play `action` (its decimal id)."""
        return self.text.action_text(action)

    def _play_until_agent(self) -> int | None:
        """Chance outcomes and opponent moves until the agent is to move or the game ends."""
        state, last = self.state, None
        while not state.is_terminal() and state.current_player() != self.agent_player:
            if state.is_chance_node():
                outcomes, probs = zip(*state.chance_outcomes())
                state.apply_action(self._chance_rng.choices(outcomes, probs)[0])
            else:
                last = self.opponent.act(state)
                state.apply_action(last)
        return last

    def _invalid(self):
        if self._retries_left > 0:
            self._retries_left -= 1
            obs = self._format(None, self._legal, None, invalid=True)
            self._set_info(None, None, None, True)
            return obs, float(self.config.retry_reward), False, False, self._info
        self._done = True
        obs = self._format(None, None, None, invalid=True, result="loss")
        self._legal = []
        self._set_info(None, None, "opponent", True)
        return obs, float(self.config.invalid_reward), True, False, self._info

    def _finish(self, opponent_action, move, first=False):
        self._done = True
        ret = self.state.returns()[self.agent_player]
        cfg = self.config
        if ret > 0:
            winner, result, reward = "agent", "win", cfg.win_reward
        elif ret < 0:
            winner, result, reward = "opponent", "loss", cfg.loss_reward
        else:
            winner, result, reward = "draw", "draw", cfg.draw_reward
        self._legal = []
        board = self.text.board_text(self.state, self.agent_player)
        obs = self._format(board, None, opponent_action, result=result, first=first)
        self._set_info(opponent_action, move, winner, False)
        return obs, float(reward), True, False, self._info

    def _format(self, board, legal, opponent_action, *, invalid=False, result=None, first=False):
        return format_observation(
            self.text, self.config.prompt_style, board=board, legal_actions=legal,
            opponent_action=opponent_action, result=result, invalid=invalid, first=first,
            agent_player=self.agent_player, state=self.state,
        )

    def _set_info(self, opponent_action, move, winner, invalid):
        self._info = {
            "legal_actions": list(self._legal),
            "board": self.text.board_array(self.state, self.agent_player),
            "opponent_action": opponent_action,
            "action": move,
            "winner": winner,
            "invalid": invalid,
            "turn": self._turn,
            "agent_player": self.agent_player,
            "retries_left": self._retries_left,
        }
