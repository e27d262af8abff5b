"""An opponent curriculum: a ladder of scripted opponents, climbed when the policy beats the current rung.

    --opponent curriculum --curriculum "random,alphabeta:1,alphabeta:2,alphabeta:3" --promote-at 0.8

Decisions:
- Promotion reads the greedy evaluation against the current rung (the trainer adds the rung to every
  evaluation), not the sampled training games: the training win rate is lowered by exploration and would
  promote late and noisily. At or above the threshold moves one rung up; the last rung is kept for good.
- One rung at a time, never down: a demotion loop (promote, lose, demote) would spend evaluations on the
  same two rungs; the league (rl/league.py) is what keeps old skills in play.
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

DEFAULT_LADDERS = {
    "connect_four": ("random", "alphabeta:1", "alphabeta:2", "alphabeta:3"),
    "tic_tac_toe": ("random", "solver"),
}


def default_ladder(game: str) -> tuple[str, ...]:
    short = game.split("(")[0].strip()
    if short not in DEFAULT_LADDERS:
        raise ValueError(f"no default ladder for {game!r}: give the rungs, e.g. 'random,mcts:50,mcts:400'")
    return DEFAULT_LADDERS[short]


def parse_ladder(text: str, game: str) -> tuple[str, ...]:
    """'random, alphabeta:1' -> ('random', 'alphabeta:1'), each rung checked against `game` by the same
    factory the environments use (a ValueError that names the bad rung); empty text: the game's default."""
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
        try:
            make_opponent(rung, loaded)
        except ValueError as e:
            raise ValueError(f"rung {rung!r}: {e}") from None
    return rungs


class Curriculum:
    def __init__(self, ladder: tuple[str, ...], promote_at: float):
        if not ladder:
            raise ValueError("a curriculum needs at least one rung")
        if not 0 < promote_at <= 1:
            raise ValueError(f"promote_at must be in (0, 1], got {promote_at}")
        self.ladder, self.promote_at = tuple(ladder), promote_at
        self.rung = 0
        self.promotions: list[tuple[int, int]] = []  # (iteration, new rung)

    @property
    def opponent(self) -> str:
        return self.ladder[self.rung]

    @property
    def at_top(self) -> bool:
        return self.rung == len(self.ladder) - 1

    def observe(self, win_rate: float, step: int) -> str | None:
        """The greedy win rate against the current rung; returns the promotion's log line, or None."""
        if self.at_top or win_rate < self.promote_at:
            return None
        old = self.opponent
        self.rung += 1
        self.promotions.append((step, self.rung))
        return (f"curriculum: promoted at iteration {step} from {old} to {self.opponent} (rung {self.rung + 1}/"
                f"{len(self.ladder)}; greedy win rate {win_rate:.2f} >= {self.promote_at:.2f})")

    def metrics(self) -> dict[str, Any]:
        return {"curriculum/rung": self.rung, "curriculum/opponent": self.opponent,
                "curriculum/promotions": len(self.promotions)}

    def state_dict(self) -> dict[str, Any]:
        return {"ladder": list(self.ladder), "rung": self.rung, "promotions": [list(p) for p in self.promotions]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved rung; if the ladder changed since, the saved opponent's place in the new ladder (or the
        same index, clipped), with a warning."""
        if not state:
            return
        saved, rung = tuple(state["ladder"]), int(state["rung"])
        self.promotions = [tuple(p) for p in state.get("promotions", [])]
        if saved == self.ladder:
            self.rung = rung
            return
        opponent = saved[rung] if rung < len(saved) else None
        self.rung = self.ladder.index(opponent) if opponent in self.ladder else min(rung, len(self.ladder) - 1)
        warnings.warn(f"resume: --curriculum changed from {','.join(saved)} to {','.join(self.ladder)}; "
                      f"continuing at rung {self.rung + 1} ({self.opponent})", stacklevel=2)
