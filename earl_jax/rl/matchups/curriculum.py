"""An opponent curriculum: a ladder of scripted opponents, climbed when the policy beats the current rung.

    --env.opponent curriculum --curriculum.ladder "random,alphabeta:1,alphabeta:2,alphabeta:3" \\
        --curriculum.promote-at 0.8

Decisions:
- Promotion reads the greedy evaluation against the current rung (the trainer adds the rung to every
  evaluation), not the sampled training games: the training win rate is lowered by exploration and would
  promote late and noisily. At or above the threshold moves one rung up; the last rung is kept for good.
- A rung may name several opponents of one strength joined by '+' (alphabeta:3+mcts:50): its groups are split among
  them and its measure is the lowest greedy win rate over them. Why: greedy play against one deterministic searcher
  can pass the bar by memorising lines that beat it (the GPU preset beat alphabeta:2 at 0.80 and lost to mcts:100 at
  0.13, docs/learning.md); lines that beat two searchers of different kinds are less likely to be such lines.
- A stalled rung is left too (`--curriculum.promote-on-stall N`, off by default): after N evaluations in a row that
  did not beat the rung's best evaluation by `STALL_DELTA`, if that best is at least `STALL_FLOOR` (a policy that loses
  most games to the rung would lose even more to the next: stuck is then better than promoted). On one GPU the
  preset sat at 0.77-0.78 against alphabeta:1 for ~300 iterations under the 0.8 bar, 91-98% of its games in
  constant groups (a near-deterministic policy against a deterministic opponent: no learning signal); the next
  rung, which it beats ~30% of the time, mixes wins and losses again (docs/learning.md).
- A rung may also be given a budget (`--curriculum.rung-max-iterations N`, off by default): the first evaluation at
  least N iterations after the rung began moves up whatever the win rate. The stall rule waits for a best of 0.5, and
  how long a run takes to get there varies: one GPU preset run reached it on alphabeta:1 at iteration 320 of its 451,
  left only ~70 iterations for alphabeta:2 and ended at 0.16 against it; the same seed with a budget of 180 left
  alphabeta:1 at 180 (winning 0.30 there) and ended at 0.56 against alphabeta:2 and 0.67 against alphabeta:1
  (docs/learning.md). The budget bounds the time a lower rung can take from the last.
  The rung's start is the last promotion's iteration (0 before any), so resume needs no more state.
  With a wall-time limit the budget is a share of it (`--curriculum.rung-max-share f`: the first evaluation after
  f x --run.max-minutes on the rung), since how many iterations fit in the time depends on the machine; the time
  a rung began at is kept in the checkpoint with its promotion, and the run's time continues across resumed parts.
- One rung at a time, never down: a demotion loop (promote, lose, demote) would spend evaluations on the
  same two rungs; the league (rl/matchups/league.py) is what keeps old skills in play.
- The state is the rung index and the ladder; it goes into the checkpoint's meta, so a resumed run plays
  the rung it had reached.
- Default ladders end at the strongest opponent the batched env plays: Connect Four alpha-beta depth 3
  (depth 4 costs ~10x a depth-3 turn at 512 games, envs/vector/__init__.py), Tic-Tac-Toe the perfect solver
  (there is no batched intermediate; `mcts:N` rungs can be given but run per game: ~1.3 ms a move at N=10
  on a 2-core CPU).
"""

from __future__ import annotations

import warnings
from typing import Any

from earl_jax.envs.games import find_game


def default_ladder(game: str) -> tuple[str, ...]:
    """The registered game's `GameSpec.ladder` (envs/games/)."""
    spec = find_game(game.split("(")[0].strip())
    if spec is None:
        raise ValueError(f"no default ladder for {game!r}: give the rungs, e.g. 'random,mcts:50,mcts:400'")
    return spec.ladder


def parse_ladder(text: str, game: str) -> tuple[str, ...]:
    """'random, alphabeta:1' -> ('random', 'alphabeta:1'), each rung checked against `game` by the same
    factory the environments use (a ValueError that names the bad rung); empty text: the game's default. A rung may
    name several opponents joined by '+' ('alphabeta:3+mcts:50'), each checked."""
    import pyspiel

    from earl_jax.envs.opponents import make_opponent

    rungs = tuple(s.strip().lower() for s in text.split(",") if s.strip()) if text.strip() else default_ladder(game)
    if "curriculum" in rungs:
        raise ValueError("a rung cannot be 'curriculum' itself")
    try:
        loaded = pyspiel.load_game(game)
    except Exception as e:  # pyspiel.SpielError is not a ValueError
        raise ValueError(f"game {game!r} does not load ({e})") from None
    for rung in rungs:
        members = [m.strip() for m in rung.split("+")]
        if "" in members or len(set(members)) < len(members):
            raise ValueError(f"rung {rung!r}: opponents joined by '+' must be distinct and non-empty")
        for member in members:
            try:
                make_opponent(member, loaded)
            except ValueError as e:
                raise ValueError(f"rung {rung!r}: {e}") from None
    return tuple("+".join(m.strip() for m in rung.split("+")) for rung in rungs)


STALL_DELTA = 0.02  # an evaluation must beat the rung's best by this to count as progress (128 games: SE ~0.035)
STALL_FLOOR = 0.5  # a stall promotes only a policy whose best evaluation on the rung wins at least this often


class Curriculum:
    def __init__(self, ladder: tuple[str, ...], promote_at: float, promote_on_stall: int = 0,
                 rung_max_iterations: int = 0, rung_max_share: float = 0.0):
        if not ladder:
            raise ValueError("a curriculum needs at least one rung")
        if not 0 < promote_at <= 1:
            raise ValueError(f"promote_at must be in (0, 1], got {promote_at}")
        if promote_on_stall < 0:
            raise ValueError(f"promote_on_stall must be >= 0 (0: off), got {promote_on_stall}")
        if rung_max_iterations < 0:
            raise ValueError(f"rung_max_iterations must be >= 0 (0: off), got {rung_max_iterations}")
        self.ladder, self.promote_at, self.promote_on_stall = tuple(ladder), promote_at, promote_on_stall
        if not 0 <= rung_max_share <= 1:
            raise ValueError(f"rung_max_share must be in [0, 1] (0: off), got {rung_max_share}")
        self.rung_max_iterations, self.rung_max_share = rung_max_iterations, rung_max_share
        self.rung = 0
        self.promotions: list[tuple[int, int]] = []  # (iteration, new rung)
        self.promoted_at: list[float] = []  # the share of the run's time spent at each promotion
        self.best, self.stalled = -1.0, 0  # on the current rung: best evaluation, evaluations since it last rose

    @property
    def opponent(self) -> str:
        return self.ladder[self.rung]

    @property
    def members(self) -> tuple[str, ...]:
        """The current rung's opponents (one, or several joined by '+'): promotion needs each beaten."""
        return tuple(self.opponent.split("+"))

    def lead_index(self, opponent: str) -> int:
        """The rung whose first opponent is `opponent` (what rehearsal replays of it)."""
        return [rung.split("+")[0] for rung in self.ladder].index(opponent)

    @property
    def rung_start(self) -> int:
        """The iteration the current rung began at (its promotion's; 0 for the first rung)."""
        return self.promotions[-1][0] if self.promotions else 0

    @property
    def rung_start_share(self) -> float:
        """The share of the run's time spent when the current rung began (0 for the first rung)."""
        return self.promoted_at[-1] if self.promoted_at else 0.0

    @property
    def at_top(self) -> bool:
        return self.rung == len(self.ladder) - 1

    def observe(self, win_rate: float, step: int, run_share: float = 0.0) -> str | None:
        """The greedy win rate against the current rung at iteration `step`, `run_share` of the run's time spent;
        returns the promotion's log line, or None."""
        if self.at_top:
            return None
        if win_rate >= self.best + STALL_DELTA:
            self.best, self.stalled = win_rate, 0
        else:
            self.stalled += 1
        if win_rate >= self.promote_at:
            why = f"greedy win rate {win_rate:.2f} >= {self.promote_at:.2f}"
        elif self.promote_on_stall and self.stalled >= self.promote_on_stall and self.best >= STALL_FLOOR:
            why = (f"stalled: {self.stalled} evaluations without beating the rung's best {self.best:.2f} by "
                   f"{STALL_DELTA}; greedy win rate {win_rate:.2f} < {self.promote_at:.2f}")
        elif self.rung_max_iterations and step - self.rung_start >= self.rung_max_iterations:
            why = (f"the rung's budget: {step - self.rung_start} iterations on it >= {self.rung_max_iterations}; "
                   f"greedy win rate {win_rate:.2f} < {self.promote_at:.2f}")
        elif self.rung_max_share and run_share - self.rung_start_share >= self.rung_max_share:
            why = (f"the rung's time: {run_share - self.rung_start_share:.2f} of the run's on it >= "
                   f"{self.rung_max_share:.2f}; greedy win rate {win_rate:.2f} < {self.promote_at:.2f}")
        else:
            return None
        old = self.opponent
        self.rung += 1
        self.promotions.append((step, self.rung))
        self.promoted_at.append(run_share)
        self.best, self.stalled = -1.0, 0
        return f"curriculum: promoted at iteration {step} from {old} to {self.opponent} (rung {self.rung + 1}/" \
               f"{len(self.ladder)}; {why})"

    def metrics(self) -> dict[str, Any]:
        return {"curriculum/rung": self.rung, "curriculum/opponent": self.opponent,
                "curriculum/promotions": len(self.promotions), "curriculum/stalled_evals": self.stalled,
                "curriculum/rung_start": self.rung_start}

    def state_dict(self) -> dict[str, Any]:
        return {"ladder": list(self.ladder), "rung": self.rung, "promotions": [list(p) for p in self.promotions],
                "promoted_at": list(self.promoted_at), "best": self.best, "stalled": self.stalled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved rung; if the ladder changed since, the saved opponent's place in the new ladder (or the
        same index, clipped), with a warning."""
        if not state:
            return
        saved, rung = tuple(state["ladder"]), int(state["rung"])
        self.promotions = [tuple(p) for p in state.get("promotions", [])]
        self.promoted_at = [float(f) for f in state.get("promoted_at", [0.0] * len(self.promotions))]
        if saved == self.ladder:
            self.rung = rung
            self.best, self.stalled = float(state.get("best", -1.0)), int(state.get("stalled", 0))
            return
        opponent = saved[rung] if rung < len(saved) else None
        self.rung = self.ladder.index(opponent) if opponent in self.ladder else min(rung, len(self.ladder) - 1)
        warnings.warn(f"resume: --curriculum.ladder changed from {','.join(saved)} to {','.join(self.ladder)}; "
                      f"continuing at rung {self.rung + 1} ({self.opponent})", stacklevel=2)
