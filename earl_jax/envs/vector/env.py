"""`VectorTextEnv`: N games of a registered game (envs/games/: Connect Four, Tic-Tac-Toe) stepped by one call.

Observationally identical to N `OpenSpielTextEnv(config)` reset with the same seeds and fed the same
answers: the same observation strings, rewards, flags and info fields, the same RNG streams. The
reference stays the definition; tests replay thousands of games through both.

Per game, what is left in Python is a seeded RNG draw for the opponent and gluing the observation
string from cached pieces; rules, win tests, legal masks, board text and the opponent's search
run over arrays of the whole batch. Everything game-specific comes from the game's GameSpec.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import numpy as np
from gymnasium.utils import seeding
from jaxtyping import Int

from earl_jax.envs.games import game_names, spec_for
from earl_jax.envs.openspiel_env import EnvConfig, OpenSpielTextEnv
from earl_jax.envs.outcomes import WINNERS
from earl_jax.envs.vector.batched_parser import parse_actions
from earl_jax.envs.vector.blunders import blunders
from earl_jax.envs.vector.per_game_opponents import any_opponent
from earl_jax.envs.vector.render import BoardRenderer
from earl_jax.envs.vector.step import NO_WINNER, VectorStep, check_answers, check_reset, check_rows

AGENT_WINS, OPPONENT_WINS, DRAW = (WINNERS.index(w) for w in ("agent", "opponent", "draw"))
_RESULTS = {AGENT_WINS: "win", OPPONENT_WINS: "loss", DRAW: "draw"}


@functools.lru_cache(maxsize=1 << 16)
def seed_draws(seed: int, draw_agent: bool) -> tuple[int | None, int, int]:
    """What OpenSpielTextEnv.reset(seed=seed) draws from gymnasium's np_random, in its order:
    (agent_player or None, opponent seed, chance seed). Cached: a GRPO group shares one seed, and
    building the Generator is most of a reset's cost (~20 us)."""
    rng, _ = seeding.np_random(seed)
    agent = int(rng.integers(2)) if draw_agent else None
    return agent, int(rng.integers(1 << 31)), int(rng.integers(1 << 31))


class VectorTextEnv:
    """`num_games` games of one `EnvConfig` (a registered game with its default parameters; opponent random or
    one of the game's batched opponents: alphabeta:D for Connect Four, solver for Tic-Tac-Toe). Use
    `make_vector_env` for any config.

        env = VectorTextEnv(EnvConfig.connect_four(opponent="alphabeta:2"), 512)
        first = env.reset(seeds)                 # VectorStep for every game, first observations
        step = env.step(rows, answers)           # the games in `rows` (unique, still running)
        step = env.step(rows, moves=moves)       # or moves already parsed (-1: no move)
        step.obs, step.reward, step.terminated, step.winners, step.infos()

    A finished game stays finished (`live[i]` False) until it is reset; stepping it raises.
    """

    accepts_moves = True  # step(rows, moves=...) means the same as answering str(move)

    def __init__(self, config: EnvConfig, num_games: int, per_game_opponents: bool = False):
        """`per_game_opponents`: an opponent with no batched version (mcts:N) plays inside this env one game at a
        time (envs/vector/per_game_opponents.py) instead of being refused."""
        reference = OpenSpielTextEnv(config)  # validates the config and the opponent spec as the reference does
        self.config = cfg = reference.config
        self.text = reference.text
        self.spec = spec_for(reference.game)
        if self.spec is None:
            raise ValueError(f"VectorTextEnv plays standard {list(game_names())}, not {cfg.game!r}: "
                             "use make_vector_env")
        if num_games < 1:
            raise ValueError(f"num_games must be >= 1, got {num_games}")
        self.num_games = n = num_games
        self.rules = self.spec.rules
        self.num_actions = self.rules.num_actions
        self.opponent = any_opponent(cfg.opponent, self.spec.name, n, per_game_opponents, cfg.search_workers)
        self._others: list[tuple[Any, np.ndarray, str]] = []  # (opponent, its games, spec): assign_opponents
        # > 0: every agent move is judged for blunders at this depth even without --env.blunder-penalty (evaluation's
        # eval/<opponent>/blunder_rate); the reward is not changed
        self.judge_blunders = 0
        self.renderer = BoardRenderer(self.text, cfg.prompt_style)
        self._pyspiel_game = reference.game
        self._draw_agent = cfg.agent_player is None
        # Indexed by winner code: agent, opponent, draw, then NO_WINNER (-1): a game that goes on.
        self._rewards = np.array([cfg.win_reward, cfg.loss_reward, cfg.draw_reward, 0.0], np.float64)
        self.stones = np.zeros((n, 2), np.uint64)  # [:, p]: player p's stones (connect_four / tic_tac_toe layout)
        # The printed board (0 empty, 1 player 0, 2 player 1), kept up to date move by move: rendering reads it as is.
        self.cells = np.zeros((n, self.renderer.rows * self.renderer.cols), np.uint8)
        # The compact style's boards as text, kept up to date the same way (renderer.keeps_blocks): a turn's
        # observation is then copies of byte rows, no rendering. `_stone_chars[i, p]`: player p's character in game i.
        self._blocks = self._stone_chars = None
        if self.renderer.keeps_blocks:
            self._blocks = np.zeros((n, len(self.renderer.empty_block)), np.uint8)
            self._stone_chars = np.zeros((n, 2), np.uint8)
        self.agent_player = np.full(n, cfg.agent_player or 0, np.int64)
        self.turn = np.zeros(n, np.int64)
        self.retries_left = np.full(n, cfg.max_retries, np.int64)
        self.legal = np.zeros((n, self.num_actions), bool)
        self._legal_weights = 1 << np.arange(self.num_actions)  # legal @ this: the legal set's bits
        self.live = np.zeros(n, bool)  # reset and not finished
        # Per game, what gymnasium's np_random would be after the last reset: the seed (Generator not
        # built yet: see seed_draws), a Generator, or None (never reset). Only seed=None reads it.
        self._np_random: list[int | np.random.Generator | None] = [None] * n

    def assign_opponent(self, spec: str | None, games: Sequence[int] | np.ndarray | None = None) -> None:
        """Games `games` (indices or a boolean mask) play the scripted opponent `spec` instead of the config's from
        their next reset; None: every game plays the config's. Each game is then the reference env with
        `opponent=spec` for the same seed (its seat, opponent stream and chance draws do not depend on the
        opponent), so a batch can mix opponents without a second env."""
        self.assign_opponents([] if spec is None else [(spec, games)])

    def assign_opponents(self, assignments: Sequence[tuple[str, Sequence[int] | np.ndarray | None]]) -> None:
        """`assign_opponent` for several opponents at once, each on its own games (which may not overlap); an
        opponent with no batched version (mcts:N) plays its games one at a time (PerGameOpponents)."""
        others, taken = [], np.zeros(self.num_games, bool)
        # a per-game opponent is kept for its spec: its bots (and search workers) are reset per game, not rebuilt
        kept = {spec: opponent for opponent, _, spec in self._others if getattr(opponent, "per_game", False)}
        for spec, games in assignments:
            mask = np.zeros(self.num_games, bool)
            if games is not None:
                mask[np.asarray(games)] = True
            if (mask & taken).any():
                raise ValueError(f"assign_opponents: {spec!r}'s games overlap another opponent's")
            taken |= mask
            OpenSpielTextEnv(dataclasses.replace(self.config, opponent=spec))  # the reference's checks: a clear error
            opponent = kept.pop(spec, None) or any_opponent(spec, self.spec.name, self.num_games,
                                                            workers=self.config.search_workers)
            others.append((opponent, mask, spec))
        for opponent in kept.values():
            opponent.close()
        self._others = others

    @property
    def second_opponent(self) -> str | None:
        """The spec of the first opponent `assign_opponent(s)` gave games to, or None."""
        return self._others[0][2] if self._others else None

    @property
    def assigned_opponents(self) -> list[tuple[str, np.ndarray]]:
        """(spec, its games) of every opponent `assign_opponents` gave games to."""
        return [(spec, mask.copy()) for _, mask, spec in self._others]

    @property
    def second_opponent_games(self) -> np.ndarray:
        """Which games play an opponent of `assign_opponent(s)` (all False without one)."""
        out = np.zeros(self.num_games, bool)
        for _, mask, _ in self._others:
            out |= mask
        return out

    # ---- reset --------------------------------------------------------------------------------
    def reset(self, seeds: Sequence[int | None], rows: Sequence[int] | None = None,
              histories: Sequence[Sequence[int]] | None = None) -> VectorStep:
        """New games in `rows` (default: all), game rows[k] as OpenSpielTextEnv.reset(seed=seeds[k]).

        A seed None continues that game's own stream, as gymnasium does. `histories[k]`: moves to
        start from, as the reference's `options={"history": ...}`. Returns the first observations.
        Everything is checked before anything changes: a bad seed or history leaves the batch as it was.
        """
        rows = check_rows(np.arange(self.num_games) if rows is None else rows, self.num_games, self.live, False)
        check_reset(rows, seeds, histories)
        start = self._positions(histories) if histories is not None else None
        cfg = self.config
        if None not in seeds:  # the common case: drawn once per distinct seed (a GRPO group's)
            ints = list(map(int, seeds))  # per-game loops as C-level maps: a 512-game reset is ~0.1 ms less
            index = {seed: k for k, seed in enumerate(dict.fromkeys(ints))}  # in order of first appearance
            where = np.fromiter(map(index.__getitem__, ints), np.int64, len(ints))
            drawn = [seed_draws(seed, self._draw_agent) for seed in index]
            list(map(self._np_random.__setitem__, rows.tolist(), ints))
        else:
            drawn, where = [self._draws(i, seed) for i, seed in zip(rows.tolist(), seeds)], np.arange(len(rows))
        agents, opponent_seeds = (np.array([d[k] or 0 for d in drawn], np.int64)[where] for k in (0, 1))
        if self._draw_agent:
            self.agent_player[rows] = agents
        self.opponent.reset(rows, opponent_seeds)
        for other, _, _ in self._others:  # every stream from the same seeds: any opponent replays its game
            other.reset(rows, opponent_seeds)
        self.stones[rows], self.cells[rows] = start if start is not None else (0, 0)
        if self._blocks is not None:
            agent = self.agent_player[rows]
            self._stone_chars[rows] = self.renderer.stone_chars(agent)
            self._blocks[rows] = (self.renderer.empty_block if start is None
                                  else self.renderer.block_rows(start[1], agent))
        self.turn[rows] = 0
        self.retries_left[rows] = cfg.max_retries
        # The opponent opens where it is to move (the agent is player 1, or a history left it to move).
        s = self.stones[rows]
        waiting = ~_over(self.rules, s) & (_to_move(s) != self.agent_player[rows])
        opponent_action = np.full(len(rows), -1, np.int64)
        opponent_action[waiting] = self._opponent_moves(rows[waiting])
        winner = self._winner(rows)
        ended = winner != NO_WINNER
        self.live[rows] = ~ended
        self.legal[rows] = self.rules.legal_mask(self.stones[rows]) & ~ended[:, None]
        cells = self.cells[rows]
        agent = self.agent_player[rows]
        results = list(map(_RESULTS.get, winner.tolist()))
        obs = self.renderer.texts(cells, agent, self.legal[rows], opponent_action, results, first=True)
        return self._result(rows, obs, np.zeros(len(rows)), ended, np.zeros(len(rows), bool), winner,
                            np.full(len(rows), -1, np.int64), opponent_action, cells)

    def _draws(self, i: int, seed: int | None) -> tuple[int | None, int, int]:
        """Game i's (agent_player or None, opponent seed, chance seed), as the reference draws them."""
        if seed is not None:
            self._np_random[i] = int(seed)
            return seed_draws(int(seed), self._draw_agent)
        state = self._np_random[i]  # gymnasium: keep the current Generator (a fresh random one if none)
        if state is None:
            state = seeding.np_random(None)[0]
        elif not isinstance(state, np.random.Generator):  # rebuild it: the seed, then the last reset's draws
            state = seeding.np_random(state)[0]
            if self._draw_agent:
                state.integers(2)
            state.integers(1 << 31), state.integers(1 << 31)
        self._np_random[i] = state
        agent = int(state.integers(2)) if self._draw_agent else None
        return agent, int(state.integers(1 << 31)), int(state.integers(1 << 31))

    def _positions(self, histories) -> tuple[np.ndarray, np.ndarray]:
        """(stones, cells) after each history, checked like the reference: every move legal, none after
        the end (ValueError naming the move and the position)."""
        k = len(histories)
        stones = np.zeros((k, 2), np.uint64)
        cells = np.zeros((k, self.cells.shape[1]), np.uint8)
        for j, history in enumerate(histories):
            state = self._pyspiel_game.new_initial_state()  # for the error message only
            one = np.array([j])
            for a in history:
                s = stones[one]
                legal = (not _over(self.rules, s)[0] and isinstance(a, (int, np.integer)) and 0 <= a < self.num_actions
                         and bool(self.rules.legal_mask(s)[0, a]))
                if not legal:
                    raise ValueError(f"histories[{j}]: {a!r} is not legal in\n{state}")
                _play(self.rules, stones, cells, one, np.array([a]), _to_move(s))
                state.apply_action(int(a))
        return stones, cells

    # ---- step ---------------------------------------------------------------------------------
    def step(self, rows: Sequence[int], answers: Sequence[str] | None = None, *,
             moves: Int[np.ndarray, " r"] | None = None) -> VectorStep:
        """One agent answer per game in `rows` (then the opponent's reply), as OpenSpielTextEnv.step.

        `answers[k]` is game rows[k]'s text (parsed as parse_action does; non-str reads as no move), or
        `moves[k]` its parsed move (-1: none). Rows must be unique games that are still running.
        """
        rows = check_rows(rows, self.num_games, self.live, True)
        answers, moves = check_answers(rows, answers, moves)
        if answers is not None:
            moves = parse_actions(answers)
        cfg, r, rules = self.config, len(rows), self.rules
        in_range = (moves >= 0) & (moves < self.num_actions)
        ok = in_range & self.legal[rows, np.where(in_range, moves, 0)]
        all_ok = bool(ok.all())  # the common case (always with constrained moves): no retry, no forfeit
        winner = np.full(r, NO_WINNER, np.int8)
        opponent_action = np.full(r, -1, np.int64)
        if all_ok:
            retry = forfeit = np.zeros(r, bool)
            valid, v, mv = slice(None), rows, moves
        else:
            retry = ~ok & (self.retries_left[rows] > 0)
            forfeit = ~ok & ~retry
            winner[forfeit] = OPPONENT_WINS
            self.retries_left[rows[retry]] -= 1
            valid = np.flatnonzero(ok)
            v, mv = rows[valid], moves[valid]
        agent_all = self.agent_player[rows]
        judge = cfg.blunder_depth if cfg.blunder_penalty else self.judge_blunders
        blunder = np.full(r, -1, np.int64) if judge else None
        if len(v):
            agent = agent_all if all_ok else agent_all[valid]
            if judge:  # judged before the move is played
                blunder[valid] = blunders(self.spec.name, self.stones[v, agent], self.stones[v, 1 - agent],
                                          self.legal[v], mv, judge)
            self.retries_left[v] = cfg.max_retries
            self._play(v, mv, agent)
            self.turn[v] += 1
            # Only the player who just moved can have won.
            stones = self.stones[v]
            ar = np.arange(len(v))
            won = np.where(rules.is_win(stones[ar, agent]), AGENT_WINS,
                           np.where(rules.is_full(stones), DRAW, NO_WINNER)).astype(np.int8)
            going = won == NO_WINNER
            if going.all():
                opponent_action[valid] = self._opponent_moves(v, agent)
                stones = self.stones[v]
                won = np.where(rules.is_win(stones[ar, 1 - agent]), OPPONENT_WINS,
                               np.where(rules.is_full(stones), DRAW, NO_WINNER)).astype(np.int8)
            elif going.any():
                going = np.flatnonzero(going)
                g = v[going]
                opponent_action[going if all_ok else valid[going]] = self._opponent_moves(g, agent[going])
                s = self.stones[g]
                won[going] = np.where(rules.is_win(s[np.arange(len(g)), 1 - agent[going]]), OPPONENT_WINS,
                                      np.where(rules.is_full(s), DRAW, NO_WINNER))
            winner[valid] = won
        # The reward by outcome; invalid answers get theirs (a forfeit's winner is the opponent, its reward not).
        reward = self._rewards[winner]
        if not all_ok:
            reward[retry] = cfg.retry_reward
            reward[forfeit] = cfg.invalid_reward
        if cfg.blunder_penalty:
            reward -= cfg.blunder_penalty * np.maximum(blunder, 0)

        terminated = winner != NO_WINNER
        self.live[rows] = ~terminated
        legal = rules.legal_mask(self.stones[rows])
        legal &= ~terminated[:, None]
        self.legal[rows] = legal
        cells = self.cells[rows]
        blocks = None if self._blocks is None else self._blocks[rows]
        obs, obs_bytes = self._observations(rows, ok, retry, forfeit, terminated, winner, opponent_action, cells,
                                            agent_all, legal, blocks)
        result = self._result(rows, obs, reward, terminated, ~ok, winner, moves if all_ok else np.where(ok, moves, -1),
                              opponent_action, cells, agent_all, legal)
        result.blunder = blunder
        result._obs_bytes = obs_bytes
        return result

    def _observations(self, rows, ok, retry, forfeit, terminated, winner, opponent_action, cells, agent, legal,
                      blocks=None):
        """(a function that renders every entry's observation text, one that gives some entries' as bytes).
        `agent`, `legal`: the entries' seats and legal moves now; `blocks`: their boards as text, if kept.

        Nothing is rendered here: the agent loop asks only for the games that go on, as bytes."""
        code = legal @ self._legal_weights  # the legal set as bits: cached texts
        turn = ok & ~terminated
        all_ok = not retry.any()
        r = self.renderer

        def texts() -> list[str]:
            if turn.all():  # the common case: no scatter
                return r.turn_texts(cells, agent, opponent_action, code)
            obs: list[str | None] = [None] * len(rows)

            def put(where, texts):
                for k, t in zip(np.flatnonzero(where).tolist(), texts):
                    obs[k] = t

            put(turn, r.turn_texts(cells[turn], agent[turn], opponent_action[turn], code[turn]))
            put(retry, r.retry_obs(code[retry]))
            put(forfeit, [r.forfeit_text] * int(forfeit.sum()))
            end = ok & terminated
            results = [_RESULTS[w] for w in winner[end].tolist()]
            put(end, r.texts(cells[end], agent[end], legal[end], opponent_action[end], results, first=False))
            return obs

        def as_bytes(where):
            if (where & ~(turn | retry)).any():  # a finished game's text: only the reference's renderer has it
                return None
            t = where & turn
            if t.all():  # the common case: no copies
                return r.turn_bytes(cells, agent, opponent_action, code, blocks)
            if blocks is None:
                turn_rows = r.turn_bytes(cells[t], agent[t], opponent_action[t], code[t])
            else:  # the kept boards are all it reads
                turn_rows = r.turn_bytes(None, None, opponent_action[t], code[t], blocks[t])
            if all_ok or not (where & retry).any():
                return turn_rows
            return _merge(where, t, turn_rows, r.retry_bytes(code[where & retry]))

        return texts, as_bytes

    # ---- helpers ----------------------------------------------------------------------------
    def _play(self, rows, actions, players) -> None:
        where = _play(self.rules, self.stones, self.cells, rows, actions, players)
        if self._blocks is not None:
            self._blocks[rows, self.renderer.block_index[where]] = self._stone_chars[rows, players]

    def _opponent_moves(self, rows, agent=None) -> Int[np.ndarray, " r"]:
        """The opponent's replies in `rows` (the opponent is to move there), played on the boards. `agent`: the
        agent's seat in those games, if the caller has it."""
        if not len(rows):
            return np.zeros(0, np.int64)
        agent = self.agent_player[rows] if agent is None else agent
        stones = self.stones[rows]
        ar = np.arange(len(rows))
        me, opp = stones[ar, 1 - agent], stones[ar, agent]
        legal = self.rules.legal_mask(stones)
        if not self._others:
            actions = self.opponent.act(rows, me, opp, legal)
        else:
            actions = np.zeros(len(rows), np.int64)
            rest = np.ones(len(rows), bool)
            for opponent, games, _ in self._others:
                mine = games[rows]
                rest &= ~mine
                if mine.any():
                    actions[mine] = opponent.act(rows[mine], me[mine], opp[mine], legal[mine])
            if rest.any():
                actions[rest] = self.opponent.act(rows[rest], me[rest], opp[rest], legal[rest])
        self._play(rows, actions, 1 - agent)
        return actions

    def _winner(self, rows) -> np.ndarray:
        """WINNERS index from the agent's side, NO_WINNER while the game runs."""
        s = self.stones[rows]
        agent = self.agent_player[rows]
        ar = np.arange(len(rows))
        agent_won, opp_won = self.rules.is_win(s[ar, agent]), self.rules.is_win(s[ar, 1 - agent])
        return np.select([agent_won, opp_won, self.rules.is_full(s)], [AGENT_WINS, OPPONENT_WINS, DRAW],
                         NO_WINNER).astype(np.int8)

    def _result(self, rows, obs, reward, terminated, invalid, winner, action, opponent_action, cells, agent=None,
                legal=None) -> VectorStep:
        agent = self.agent_player[rows] if agent is None else agent
        return VectorStep(
            rows=rows, _obs=obs, reward=reward.astype(np.float64), terminated=terminated,
            truncated=np.zeros(len(rows), bool), invalid=invalid, winner=winner, action=action,
            opponent_action=opponent_action, turn=self.turn[rows], retries_left=self.retries_left[rows],
            agent_player=agent, legal=self.legal[rows] if legal is None else legal,
            _board=lambda: self.renderer.values(cells, agent),
        )


def _play(rules, stones, cells, rows, actions, players) -> np.ndarray:
    """Drop each row's stone: the bitboards and the printed board, in place. Returns the printed cells."""
    bits = rules.drop(stones[rows], actions)
    stones[rows, players] |= bits
    where = rules.print_index(bits)
    cells[rows, where] = players + 1
    return where


def _merge(where, first, first_rows, other_rows):
    """Byte rows of the entries `where`, in entry order: `first_rows` for those in `first`, `other_rows` the rest."""
    sel = first[where]
    width = max(first_rows[0].shape[1], other_rows[0].shape[1])
    out = np.zeros((len(sel), width), np.uint8)
    lengths = np.zeros(len(sel), np.int64)
    for mask, (rows, n) in ((sel, first_rows), (~sel, other_rows)):
        out[mask, :rows.shape[1]], lengths[mask] = rows, n
    return out, lengths


def _over(rules, stones) -> np.ndarray:
    return rules.is_win(stones[:, 0]) | rules.is_win(stones[:, 1]) | rules.is_full(stones)


def _to_move(stones) -> np.ndarray:
    """The player to move (0 or 1): stones alternate, player 0 first."""
    return np.bitwise_count(stones[:, 0] | stones[:, 1]).astype(np.int64) & 1
