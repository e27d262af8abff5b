"""A per-game opponent (OpenSpiel's MCTS, any `envs.opponents` spec) inside the batched env, one game at a time.

    opponents = PerGameOpponents("mcts:100", "connect_four", num_games)   # a BatchedOpponent like the others

Each game has its own `opponents.make_opponent(spec, game, seed)`, reset with the seed the batched env hands every
opponent, and asked for its move on an OpenSpiel state of the game's position: the state the per-game env would hold,
so a seeded game replays move for move (the search reads the position, never how it was reached). The state follows
the game move by move (the agent's stone is the one new bit since the last call); a position reached otherwise (a
game reset to a history) is rebuilt from its stones by replaying them in an order the rules allow.

Why: the slow search opponents (mcts:N: ~4.6 minutes for a 2048-game iteration at N=100 with OpenSpiel's Python bot,
~22 s with its C++ one, which envs/opponents.py now uses; all games per game) can then
take a bounded share of a batch's groups beside batched opponents (`VectorTextEnv.assign_opponents`), and evaluation
against them judges blunders as the batched env does.

`workers` W > 1 (`--env.search-workers`): the games are split over W worker processes (game i in worker i mod W, each
holding its games' bots and states), which search at once (processes, from when the bots were Python; the C++ bot
releases Python's lock while it searches, so threads would do as well: not changed). Every
game's moves are those of one process (its bot and state are the same objects' copies, reset with the same seeds).
The workers start on first use (spawned: the parent may hold JAX's threads) and stop with the opponent.
"""
from __future__ import annotations

import multiprocessing
import signal
import traceback
import weakref

import numpy as np

from earl_jax.envs.vector.batched_opponents import BatchedOpponent, make_vector_opponent


def any_opponent(spec: str, game: str, num_games: int, per_game: bool = True, workers: int = 0) -> BatchedOpponent:
    """`make_vector_opponent`, or for a spec with no batched version (mcts:N) in a registered game, with `per_game`,
    the per-game opponent stepped one game at a time (in `workers` processes when > 1)."""
    from earl_jax.envs.games import find_game

    try:
        return make_vector_opponent(spec, game, num_games)
    except ValueError:
        if not per_game or find_game(game) is None:
            raise
    if workers > 1:
        return WorkerOpponents(spec, game, num_games, workers)
    return PerGameOpponents(spec, game, num_games)


class PerGameOpponents(BatchedOpponent):
    per_game = True  # searches one game at a time: the curriculum gives it a bounded share of the groups

    def __init__(self, spec: str, game: str, num_games: int):
        import pyspiel

        from earl_jax.envs.games import get_game
        from earl_jax.envs.opponents import make_opponent

        super().__init__(num_games)
        self.spec, self.rules = spec, get_game(game).rules
        self.game = pyspiel.load_game(game)
        make_opponent(spec, self.game)  # a bad spec fails here, with the factory's message
        self._make = lambda seed: make_opponent(spec, self.game, seed)
        self.bots: list = [None] * num_games
        self.states: list = [None] * num_games  # (stones [2] as the state holds them, the OpenSpiel state)

    def reset(self, rows, seeds) -> None:
        super().reset(rows, seeds)
        for i, seed in zip(np.asarray(rows).tolist(), np.asarray(seeds).tolist()):
            if self.bots[i] is None:
                self.bots[i] = self._make(int(seed))
            else:
                self.bots[i].reset(int(seed))
            self.states[i] = None

    def act(self, rows, me, opp, legal):
        out = np.zeros(len(rows), np.int64)
        for k, i in enumerate(np.asarray(rows).tolist()):
            to_move = int(np.bitwise_count(me[k] | opp[k])) & 1  # player 0 moves at an even stone count
            stones = np.zeros(2, np.uint64)
            stones[to_move], stones[1 - to_move] = me[k], opp[k]
            state = self._state(i, stones)
            action = int(self.bots[i].act(state))
            state.apply_action(action)
            stones[to_move] |= self.rules.drop(stones[None], np.array([action]))[0]
            self.states[i] = (stones, state)
            out[k] = action
        return out

    def _state(self, i: int, stones: np.ndarray):
        """The OpenSpiel state of game i at `stones`: the kept one plus the agent's move, else rebuilt."""
        kept = self.states[i]
        if kept is not None:
            old, state = kept
            new = stones & ~old
            if int(np.bitwise_count(new).sum()) == 1 and not (old & ~stones).any():
                action = self._action(old, int(new.sum()))
                if action is not None:
                    state.apply_action(action)
                    return state
        return self._rebuild(stones)

    def _action(self, stones: np.ndarray, bit: int) -> int | None:
        lands = self.rules.drop(np.repeat(stones[None], self.rules.num_actions, 0), np.arange(self.rules.num_actions))
        hit = np.flatnonzero(lands == np.uint64(bit))
        return int(hit[0]) if len(hit) else None

    def _rebuild(self, target: np.ndarray):
        """A state with `target` on the board: the stones replayed in an order the rules allow (depth-first)."""
        n = self.rules.num_actions
        every = np.arange(n)

        def extend(stones: np.ndarray, moves: list[int]) -> list[int] | None:
            if (stones == target).all():
                return moves
            player = len(moves) & 1
            lands = self.rules.drop(np.repeat(stones[None], n, 0), every)
            for a in np.flatnonzero((lands != 0) & ((lands & target[player]) != 0)).tolist():
                nxt = stones.copy()
                nxt[player] |= lands[a]
                found = extend(nxt, moves + [a])
                if found is not None:
                    return found
            return None

        moves = extend(np.zeros(2, np.uint64), [])
        if moves is None:
            raise ValueError(f"opponent {self.spec!r}: the position {target.tolist()} is not reachable")
        state = self.game.new_initial_state()
        for a in moves:
            state.apply_action(a)
        return state


def _serve(conn, spec: str, game: str, num_games: int) -> None:
    """A worker: a PerGameOpponents of its own, answering ("reset", rows, seeds) and ("act", rows, me, opp, legal).
    A stop signal is its parent's to handle (Ctrl-C and `timeout` signal the whole process group): the job ends its
    iteration and checkpoints with the workers' help, then stops them; a parent that dies closes the pipe (EOF)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    opponent = None
    while (msg := _receive(conn)) is not None:
        try:
            opponent = opponent or PerGameOpponents(spec, game, num_games)
            op, *args = msg
            conn.send(("ok", opponent.reset(*args) if op == "reset" else opponent.act(*args)))
        except Exception:  # noqa: BLE001 - the parent re-raises it with the worker's traceback
            conn.send(("error", traceback.format_exc()))


def _receive(conn):
    try:
        return conn.recv()
    except EOFError:  # the parent is gone
        return None


def _stop(conns: list, procs: list) -> None:
    for conn in conns:
        try:
            conn.send(None)
            conn.close()
        except (OSError, BrokenPipeError):
            pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()


class WorkerOpponents(BatchedOpponent):
    """PerGameOpponents over `workers` processes (the module docstring); the same moves as one process."""

    per_game = True

    def __init__(self, spec: str, game: str, num_games: int, workers: int):
        PerGameOpponents(spec, game, 1)  # a bad spec fails here, in this process, with the factory's message
        super().__init__(num_games)
        self.spec, self.game, self.num_games, self.workers = spec, game, num_games, min(int(workers), num_games)
        self._conns: list = []

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        procs = []
        for _ in range(self.workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, self.spec, self.game, self.num_games), daemon=True,
                               name=f"search-{self.spec}")
            proc.start()
            child.close()
            self._conns.append(parent)
            procs.append(proc)
        self._procs = procs
        self._finalizer = weakref.finalize(self, _stop, list(self._conns), procs)

    def close(self) -> None:
        if self._conns:
            self._finalizer()
            self._conns = []

    def _call(self, op: str, rows: np.ndarray, *columns: np.ndarray) -> list:
        """Send each worker its games' share of `columns`, then gather: (worker's positions in rows, its result)."""
        if not self._conns:
            self._start()
        rows = np.asarray(rows)
        parts = [np.flatnonzero(rows % self.workers == w) for w in range(self.workers)]
        busy = [w for w, at in enumerate(parts) if len(at)]
        for w in busy:
            try:
                self._conns[w].send((op, rows[parts[w]], *(np.asarray(c)[parts[w]] for c in columns)))
            except OSError:  # a broken pipe: the worker is gone, which its recv below says
                pass
        out, errors = [], []
        for w in busy:  # every reply is read, so a failure leaves no answer behind in another worker's pipe
            try:
                status, value = self._conns[w].recv()
            except (EOFError, OSError):
                self._procs[w].join(timeout=1)
                status, value = "error", f"the process exited (code {self._procs[w].exitcode})"
            if status == "error":
                errors.append(f"opponent {self.spec!r}, search worker {w}:\n{value}")
            out.append((parts[w], value))
        if errors:
            raise RuntimeError(errors[0])
        return out

    def reset(self, rows, seeds) -> None:
        super().reset(rows, seeds)
        self._call("reset", rows, np.asarray(seeds, dtype=object))

    def act(self, rows, me, opp, legal):
        out = np.zeros(len(rows), np.int64)
        for at, actions in self._call("act", rows, me, opp, legal):
            out[at] = actions
        return out

