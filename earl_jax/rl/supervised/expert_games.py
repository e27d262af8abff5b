"""Expert games for a base policy: a strong scripted player's games, written as the agent loop writes a rollout.

    spec = ExpertSpec(games=4096, depth=4)                       # opponents, openings: the game's defaults
    games = expert_games(spec, env_cfg, tokenizer, eos_id=..., bos_id=..., constrained=True)
    train, held_out = split_games(dedup_games(games), held_out=0.1, seed=0)
    train.batch(rows, width)                                      # run_sft's batch (rl/supervised/sft.py)

The agent is the game's expert (`EXPERTS`): Connect Four's batched alpha-beta at `depth` plies
(envs/games/connect_four.best_moves), Tic-Tac-Toe's exact solver (the best set the solver opponent draws from);
among equally good moves it draws at random. It plays both seats (drawn per game from the seed, as in RL) against a
mix of opponents, an equal share of the games each: by default random, alpha-beta at every depth below its own and
itself (Connect Four), random and the solver (Tic-Tac-Toe). Openings are randomized: game i's first k_i plies
(k_i uniform in 0..opening_plies) are uniform random legal moves of both sides; the agent's random moves stay in the
transcript, as a rollout would have them, but outside the loss mask. Games are deduplicated by (seat, moves) and
split into train and held-out by game.

The games are played by the agent loop (`rollout.agent_loop.play_games`) with the expert as a host policy
(rollout/host_policies.py), so a transcript is what the loop records for any policy that plays the same moves
(tests/rl/supervised/test_expert_games.py compares both): the first observation (after the bos token, if any), then
per turn the answer and the next observation, truncated by `max_turns` / `max_context` as the loop truncates.
- constrained moves: an answer is [the move's token, the stop token]; the loss mask holds the move token of expert
  turns; `choices` holds the legal-move bitmask on every move token (random turns too, as the loop records it; a
  token outside the mask is never scored, so only the expert's count).
- free text: an answer is the move's text and the end token (the whole answer in the mask, expert turns only);
  `choices` is all zeros.
Per expert move token, `legal` and `best` hold the legal moves and the expert's equally best moves as bitmasks (0
elsewhere): held-out move accuracy counts the model's argmax over the legal moves as right when it is any best move.
`tactics` marks the expert turns whose right move reads off the board's lines (a win or a block due), `answers` every
token the agent wrote; `batch` can put only those turns, or the whole transcript, in the loss (experiments/pretrain.py
--tactics-steps, --transcript-steps).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tokenizers
from jaxtyping import Bool, Int, UInt64

from earl_jax.envs.outcomes import NO_WINNER, WINNERS
from earl_jax.envs.vector.codec import ObservationCodec
from earl_jax.rollout.agent_loop import PlayConfig, Turn, play_games
from earl_jax.rollout.host_policies import HostAnswers, HostPolicy
from earl_jax.rollout.moves import MoveTokens, legal_bits

# (me, opp, depth) -> the side to move's equally best moves, for a batch of positions
Expert = Callable[[UInt64[np.ndarray, " n"], UInt64[np.ndarray, " n"], int], Bool[np.ndarray, "n a"]]


def _connect_four_best(me, opp, depth: int):
    from earl_jax.envs.games.connect_four import best_moves

    return best_moves(me, opp, depth)[0]


def _tic_tac_toe_best(me, opp, depth: int):
    from earl_jax.envs.games.tic_tac_toe import NUM_ACTIONS, solver_best_moves

    me_first = (np.bitwise_count(me | opp) & 1) == 0  # the table is indexed by (player 0's cells, player 1's)
    x, o = np.where(me_first, me, opp), np.where(me_first, opp, me)
    masks = solver_best_moves(np.stack([x, o], 1)).astype(np.int64)
    return ((masks[:, None] >> np.arange(NUM_ACTIONS)) & 1).astype(bool)


EXPERTS: dict[str, Expert] = {"connect_four": _connect_four_best, "tic_tac_toe": _tic_tac_toe_best}
# Random plies that open a game, at most (drawn per game from 0..this): Tic-Tac-Toe lasts at most 9 plies, so a short
# opening leaves the expert most of the game
OPENING_PLIES = {"connect_four": 4, "tic_tac_toe": 2}


def default_opponents(game: str, depth: int) -> tuple[str, ...]:
    """The opponent mix: random, alpha-beta at each depth up to the expert's own (the last is itself), or the solver."""
    if game == "connect_four":
        return ("random",) + tuple(f"alphabeta:{d}" for d in range(1, depth + 1))
    if game == "tic_tac_toe":
        return ("random", "solver")
    raise ValueError(f"expert games: no expert for {game!r} (have {sorted(EXPERTS)})")


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """What to generate: `games` games (before deduplication), an equal share against each of `opponents` (empty: the
    game's `default_opponents`), the expert searching `depth` plies (Connect Four; Tic-Tac-Toe's solver is exact),
    each game's first 0..`opening_plies` plies random (None: the game's OPENING_PLIES), everything drawn from
    `seed`."""

    games: int
    depth: int = 4
    solver: int = 0  # Connect Four: > 0 makes the expert the near-exact solver, this many thousand nodes a move
    opponents: tuple[str, ...] = ()
    opening_plies: int | None = None  # None: the game's OPENING_PLIES
    seed: int = 0

    def __post_init__(self):
        for name, low in (("games", 1), ("depth", 1), ("opening_plies", 0), ("solver", 0)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ValueError(f"expert games: {name} must be >= {low}, got {getattr(self, name)}")


@dataclasses.dataclass
class ExpertGames:
    """Games as rows of right-padded [n, t] arrays (see the module docstring), with each game's seat, moves (both
    sides, in order), opponent (an index into `opponents`), winner (an index into WINNERS, -1: truncated), seed and
    opening length."""

    tokens: Int[np.ndarray, "n t"]
    loss_mask: Bool[np.ndarray, "n t"]
    lengths: Int[np.ndarray, " n"]
    choices: Int[np.ndarray, "n t"]
    legal: Int[np.ndarray, "n t"]
    best: Int[np.ndarray, "n t"]
    answers: Bool[np.ndarray, "n t"]  # every token the agent wrote, random turns too
    tactics: Int[np.ndarray, "n t"]  # per expert move: 1 = a move wins at once, 2 = the opponent threatens to (3: both)
    agent_player: Int[np.ndarray, " n"]
    opponent: Int[np.ndarray, " n"]
    winner: Int[np.ndarray, " n"]
    seeds: Int[np.ndarray, " n"]  # each game's reset seed (its seat and the opponent's stream)
    opening: Int[np.ndarray, " n"]  # plies of random moves it opened with
    moves: list[tuple[int, ...]]
    opponents: tuple[str, ...]
    constrained: bool

    def __len__(self) -> int:
        return len(self.lengths)

    def take(self, rows: Sequence[int] | np.ndarray) -> "ExpertGames":
        """Games `rows`, their arrays cut to the longest of them."""
        rows = np.asarray(rows, np.int64)
        width = max(int(self.lengths[rows].max(initial=1)), 1)
        cut = {k: getattr(self, k)[rows][:, :width] for k in TOKEN_FIELDS}
        return dataclasses.replace(self, **cut, lengths=self.lengths[rows], agent_player=self.agent_player[rows],
                                   opponent=self.opponent[rows], winner=self.winner[rows], seeds=self.seeds[rows],
                                   opening=self.opening[rows], moves=[self.moves[i] for i in rows.tolist()])

    def batch(self, rows: Sequence[int] | np.ndarray, width: int, transcript: bool = False,
              tactics_only: bool = False, best_set: bool = False) -> dict[str, np.ndarray]:
        """The SFT stage's batch (rl/supervised/sft.py run_sft) of games `rows` at `width` columns (a longer game is
        cut: it
        loses its last answers). `transcript`: the loss mask holds every token of the games but the random turns'
        answers (and the first token, which nothing predicts): the language of the game, observations included.
        `tactics_only`: only the answers of expert turns with a win or a block due (`tactics`). `best_set`
        (constrained moves): "targets", the expert's equally best moves, learned as a set instead of the move played."""
        rows = np.asarray(rows, np.int64)
        out = {k: _fit(getattr(self, k)[rows], width) for k in ("tokens", "loss_mask", "choices")}
        if tactics_only:  # an answer runs from its move token (where `tactics` sits) to the end of its mask run
            keep, move_at = _fit(self.tactics[rows], width) != 0, _fit(self.best[rows], width) != 0
            for k in range(1, width):
                keep[:, k] |= keep[:, k - 1] & out["loss_mask"][:, k] & ~move_at[:, k]
            out["loss_mask"] = out["loss_mask"] & keep
        if transcript:
            within = np.arange(width)[None, :] < self.lengths[rows, None]
            out["loss_mask"] = within & ~(_fit(self.answers[rows], width) & ~out["loss_mask"])
            out["loss_mask"][:, 0] = False
        if not self.constrained:
            if best_set:
                raise ValueError("expert games: a best-move set target needs constrained moves")
            out.pop("choices")
        elif best_set:
            out["targets"] = _fit(self.best[rows], width)
        return {**out, "lengths": np.minimum(self.lengths[rows], width)}

    def expert_turns(self) -> tuple[Int[np.ndarray, " m"], Int[np.ndarray, " m"]]:
        """(row, position) of every expert move token, row by row."""
        rows, cols = np.nonzero(self.best)
        return rows, cols

    def save(self, path, key: str = "") -> None:
        """All of it in one .npz file; `key` (any string, e.g. the settings that made it) is stored beside it."""
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if isinstance(getattr(self, f.name), np.ndarray)}
        flat = np.array([m for game in self.moves for m in game], np.int64)
        np.savez_compressed(path, **arrays, moves_flat=flat, moves_len=np.array([len(m) for m in self.moves]),
                            opponents=np.array(self.opponents), constrained=self.constrained, key=key)

    @classmethod
    def load(cls, path, key: str | None = None) -> "ExpertGames | None":
        """Games saved by `save`; None when `key` is given and differs from the stored one."""
        with np.load(path) as z:
            if key is not None and str(z["key"]) != key:
                return None
            arrays = {f.name: z[f.name] for f in dataclasses.fields(cls) if f.name in z.files and
                      f.name not in ("opponents", "constrained")}
            ends = np.cumsum(z["moves_len"])
            moves = [tuple(m.tolist()) for m in np.split(z["moves_flat"], ends[:-1])] if len(ends) else []
            return cls(**arrays, moves=moves, opponents=tuple(z["opponents"].tolist()),
                       constrained=bool(z["constrained"]))

    def stats(self) -> dict[str, Any]:
        """Games, expert moves and tokens, and the expert's results against each opponent."""
        out: dict[str, Any] = {"games": len(self), "expert_moves": int((self.best != 0).sum()),
                               "tokens": int(self.lengths.sum()), "length_mean": float(self.lengths.mean()),
                               "length_max": int(self.lengths.max())}
        for k, name in enumerate(self.opponents):
            w = self.winner[self.opponent == k]
            if len(w):
                out[f"expert_vs_{name}"] = {r: float(np.mean(w == WINNERS.index(r))) for r in ("agent", "draw",
                                                                                              "opponent")}
                out[f"expert_vs_{name}"]["games"] = int(len(w))
        return out


TOKEN_FIELDS = ("tokens", "loss_mask", "choices", "legal", "best", "answers", "tactics")  # the [n, t] arrays


def _fit(x: np.ndarray, width: int) -> np.ndarray:
    """x's first `width` columns, zero-padded when it is narrower."""
    out = np.zeros((x.shape[0], width), x.dtype)
    w = min(width, x.shape[1])
    out[:, :w] = x[:, :w]
    return out


def dedup_games(games: ExpertGames) -> ExpertGames:
    """The first game of every distinct (seat, move sequence): the same moves make the same transcript."""
    seen, keep = set(), []
    for i, key in enumerate(zip(games.agent_player.tolist(), games.moves)):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return games.take(keep)


def split_games(games: ExpertGames, held_out: float, seed: int) -> tuple[ExpertGames, ExpertGames]:
    """(train, held-out) by game: a seeded shuffle, the first `held_out` share of it held out (at least one game)."""
    if not 0 < held_out < 1:
        raise ValueError(f"expert games: held_out must be in (0, 1), got {held_out}")
    if len(games) < 2:
        raise ValueError(f"expert games: {len(games)} game(s) cannot be split into train and held-out")
    order = np.random.default_rng(seed).permutation(len(games))
    k = min(max(1, round(held_out * len(games))), len(games) - 1)
    return games.take(np.sort(order[k:])), games.take(np.sort(order[:k]))


def unseen_turns(train: ExpertGames, held: ExpertGames) -> Bool[np.ndarray, " m"]:
    """Per expert turn of `held` (`expert_turns` order): True when no train game reaches the same transcript before
    its move (a position the model never saw in training, with its history)."""
    seen = {train.tokens[r, :c].tobytes() for r, c in zip(*train.expert_turns())}
    return np.array([held.tokens[r, :c].tobytes() not in seen for r, c in zip(*held.expert_turns())], bool)


class _Opening:
    """An env's opponent that plays uniform random legal moves while game i has fewer than `plies[i]` stones on the
    board, then its own moves (a batched opponent: reset(rows, seeds), act(rows, me, opp, legal))."""

    def __init__(self, inner, plies: Int[np.ndarray, " n"]):
        from earl_jax.envs.vector.batched_opponents import RandomOpponents

        self.inner, self.plies, self.random = inner, plies, RandomOpponents(len(plies))

    def reset(self, rows, seeds) -> None:
        self.inner.reset(rows, seeds)
        self.random.reset(rows, [int(s) ^ 0x5EED for s in seeds])  # a stream of its own

    def act(self, rows, me, opp, legal):
        early = np.bitwise_count(me | opp) < self.plies[rows]
        out = np.zeros(len(rows), np.int64)
        for mine, who in ((early, self.random), (~early, self.inner)):
            if mine.any():
                out[mine] = who.act(rows[mine], me[mine], opp[mine], legal[mine])
        return out


def expert_games(spec: ExpertSpec, env_cfg, tokenizer: tokenizers.Tokenizer, *, eos_id: int, bos_id: int | None,
                 constrained: bool, max_context: int = 2048, max_turns: int = 32, max_turn_tokens: int = 4,
                 progress: Callable[[int], None] | None = None) -> ExpertGames:
    """`spec.games` expert games of `env_cfg`'s game in its prompt style (its opponent is replaced by the mix), as
    the agent loop would record them with these rollout settings. `progress(k)`: called as k more games finish."""
    from earl_jax.envs.vector import VectorTextEnv

    game = env_cfg.game
    if game not in EXPERTS:
        raise ValueError(f"expert games: no expert for {game!r} (have {sorted(EXPERTS)})")
    opponents = spec.opponents or default_opponents(game, spec.depth)
    opening_plies = OPENING_PLIES[game] if spec.opening_plies is None else spec.opening_plies
    rng = np.random.default_rng(spec.seed)
    codec = ObservationCodec(tokenizer)
    parts, shares = [], np.diff(np.linspace(0, spec.games, len(opponents) + 1).round().astype(int))
    for k, (name, n) in enumerate(zip(opponents, shares.tolist())):
        if n == 0:
            continue
        env = VectorTextEnv(dataclasses.replace(env_cfg, opponent=name, blunder_penalty=0.0), n)
        moves = MoveTokens.build(tokenizer, env.num_actions, eos_id) if constrained else None
        plies = rng.integers(0, opening_plies + 1, n)
        env.opponent = _Opening(env.opponent, plies)
        seeds = [int(s) for s in rng.integers(0, 2**31 - 1, n)]
        part = _play(env, _expert_choice(*expert_of(spec, game), rng), codec, tokenizer, moves, eos_id, bos_id,
                     seeds, plies, max_context, max_turns, max_turn_tokens)
        parts.append(dataclasses.replace(part, opponent=np.full(n, k, np.int64), opponents=tuple(opponents)))
        if progress is not None:
            progress(n)
    return concat_games(parts)


def expert_of(spec: ExpertSpec, game: str) -> tuple[Expert, int]:
    """The expert and the strength it plays at: Connect Four's solver at `spec.solver` thousand nodes a move when set
    (envs/connect_four_solver.py), else the game's EXPERTS entry at `spec.depth`."""
    if not spec.solver:
        return EXPERTS[game], spec.depth
    if game != "connect_four":
        raise ValueError(f"expert games: solver is Connect Four's expert, not {game!r}'s")
    from earl_jax.envs.connect_four_solver import best_moves

    return best_moves, spec.solver * 1000


# (rows, me, opp, legal, opening) -> (each row's move, the equally best moves of the rows not in their opening)
Choice = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _expert_choice(expert: Expert, depth: int, rng: np.random.Generator) -> Choice:
    """The expert's move past the opening (uniform among its best), a uniform legal move in it."""
    def choose(rows, me, opp, legal, opening):
        pick = legal.copy()
        best = np.zeros((0, legal.shape[1]), bool)
        if (~opening).any():
            best = expert(me[~opening], opp[~opening], depth) & legal[~opening]
            pick[~opening] = best
        return _draw(pick, rng), best
    return choose


def _play(env, choose: Choice, codec: ObservationCodec, tokenizer, moves: MoveTokens | None, eos_id: int,
          bos_id: int | None, seeds: list[int], plies: np.ndarray, max_context: int, max_turns: int,
          max_turn_tokens: int) -> ExpertGames:
    """One batch of games of `env`, the agent's moves from `choose`, played by the agent loop with a host policy; its
    turn hook records what the transcript does not hold (see the module docstring)."""
    n = env.num_games
    history: list[list[int]] = [[] for _ in range(n)]  # both sides' moves
    expert_at: list[tuple[np.ndarray, ...]] = []  # (rows, positions, legal, best, tactics)
    answer_at: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rows, first positions, counts)

    def answer(games, legal):
        agent = env.agent_player[games]
        me, opp = env.stones[games, agent], env.stones[games, 1 - agent]
        opening = np.bitwise_count(me | opp) < plies[games]
        move, best = choose(games, me, opp, legal, opening)
        best_bits, tactics = np.zeros(len(games), np.int32), np.zeros(len(games), np.int32)
        if (~opening).any():
            best_bits[~opening] = legal_bits(best)
            tactics[~opening] = _tactics(env.rules, me[~opening], opp[~opening], legal[~opening])
        return HostAnswers(moves=move, own=~opening, notes={"expert": ~opening, "best": best_bits, "tactics": tactics})

    def record(turn: Turn) -> None:
        if turn.answers is None:  # the reset: the opponent's first move, when it has the first seat
            for r, o in zip(turn.games.tolist(), turn.step.opponent_action.tolist()):
                history[r] += [o] if o >= 0 else []
            return
        for r, a, o in zip(turn.games.tolist(), turn.answers.moves.tolist(), turn.step.opponent_action.tolist()):
            history[r] += [a] if o < 0 else [a, o]
        notes, ex = turn.answers.notes, turn.answers.notes["expert"]
        if ex.any():
            expert_at.append((turn.games[ex], turn.start[ex], legal_bits(turn.legal[ex]), notes["best"][ex],
                              notes["tactics"][ex]))
        answer_at.append((turn.games, turn.start, turn.answers.counts))

    cfg = PlayConfig(max_turn_tokens=max_turn_tokens, max_turns=max_turns, max_context=max_context,
                     constrain_moves=moves is not None)
    try:
        traj = play_games(HostPolicy(answer, tokenizer, eos_id, moves), env, tokenizer, cfg, None, seeds,
                          bos_id=bos_id, codec=codec, hook=record)
    except ValueError as e:
        raise ValueError(f"expert games: {e}") from None
    lengths = traj.lengths.astype(np.int64)
    legal_at, best_at, tactics = (np.zeros(traj.tokens.shape, np.int32) for _ in range(3))
    for rows, pos, lb, bb, tb in expert_at:
        ok = pos < lengths[rows]  # the move token was written (room for it)
        legal_at[rows[ok], pos[ok]], best_at[rows[ok], pos[ok]], tactics[rows[ok], pos[ok]] = lb[ok], bb[ok], tb[ok]
    answered = np.zeros(traj.tokens.shape, bool)
    for rows, pos, count in answer_at:
        cols = pos[:, None] + np.arange(count.max(initial=0))[None, :]
        ok = cols < (pos + count)[:, None]
        answered[np.broadcast_to(rows[:, None], cols.shape)[ok], cols[ok]] = True
    winner = np.array([NO_WINNER if w is None else WINNERS.index(w) for w in traj.winners], np.int64)
    return ExpertGames(tokens=traj.tokens, loss_mask=traj.loss_mask, lengths=lengths, choices=traj.choices,
                       legal=legal_at, best=best_at, answers=answered, tactics=tactics,
                       agent_player=env.agent_player.copy(),
                       opponent=np.zeros(n, np.int64), winner=winner, seeds=np.asarray(seeds, np.int64),
                       opening=np.asarray(plies, np.int64), moves=[tuple(h) for h in history], opponents=(),
                       constrained=moves is not None)


def _tactics(rules, me: UInt64[np.ndarray, " r"], opp: UInt64[np.ndarray, " r"], legal: Bool[np.ndarray, "r a"]
             ) -> Int[np.ndarray, " r"]:
    """1 where a legal move wins at once, + 2 where the opponent would win by taking a cell the side to move can
    take now (a block is due): the positions whose right move reads straight off the board's lines."""
    r, a = legal.shape
    stones = np.repeat(np.stack([me, opp], 1), a, 0)
    bits = rules.drop(stones, np.tile(np.arange(a), r)).reshape(r, a)  # the cell each move fills (0: illegal)
    wins = rules.is_win((me[:, None] | bits).reshape(-1)).reshape(r, a) & legal
    threats = rules.is_win((opp[:, None] | bits).reshape(-1)).reshape(r, a) & legal
    return wins.any(1).astype(np.int32) + 2 * threats.any(1)


def _draw(pick: Bool[np.ndarray, "r a"], rng: np.random.Generator) -> Int[np.ndarray, " r"]:
    """A uniform True column of each row."""
    k = (rng.random(len(pick)) * pick.sum(1)).astype(np.int64)
    return (np.cumsum(pick, 1) > k[:, None]).argmax(1)


def _answers(move, legal, opening, moves: MoveTokens | None, tokenizer, eos_id: int):
    """(answer ids padded with -1, scored [r, w], choices [r, w] or None) as the policy would write them."""
    if moves is not None:  # constrained: the move token and the stop token; only the move is the policy's choice
        answers = np.stack([np.asarray(moves.token_ids)[move], np.full(len(move), moves.stop_id)], 1)
        scored = np.zeros(answers.shape, bool)
        scored[:, 0] = ~opening
        choices = np.zeros(answers.shape, np.int32)
        choices[:, 0] = legal_bits(legal)
        return answers, scored, choices
    texts = [e.ids + [eos_id] for e in tokenizer.encode_batch([str(m) for m in move.tolist()],
                                                              add_special_tokens=False)]
    width = max(map(len, texts))
    answers = np.array([t + [-1] * (width - len(t)) for t in texts], np.int64)
    return answers, (answers != -1) & ~opening[:, None], None


def concat_games(parts: list[ExpertGames]) -> ExpertGames:
    width = max(p.tokens.shape[1] for p in parts)
    cat = {k: np.concatenate([_fit(getattr(p, k), width) for p in parts])
           for k in TOKEN_FIELDS}
    vec = {k: np.concatenate([getattr(p, k) for p in parts])
           for k in ("lengths", "agent_player", "opponent", "winner", "seeds", "opening")}
    return ExpertGames(**cat, **vec, moves=[m for p in parts for m in p.moves], opponents=parts[0].opponents,
                       constrained=parts[0].constrained)
