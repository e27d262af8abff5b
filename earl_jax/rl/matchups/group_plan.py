"""Which opponent each GRPO group of an iteration plays: the rung's opponents, the rung rehearsed, the mixed opponent
and the league, as whole groups (games compared in a group face the same opponent).

    plan = plan_groups(groups=16, rung=("alphabeta:3", "mcts:100"), per_game={"mcts:100": True}, anchor="alphabeta:2",
                       per_game_share=0.125, tail=4, rehearsal=("alphabeta:1", 4))
    plan.main          # the env's own opponent ("alphabeta:3"): the groups no one else takes
    plan.assigned      # (("mcts:100", (2, 3)), ("alphabeta:1", (8, 9, 10, 11))): VectorTextEnv.assign_opponents

Layout of the batch, from its end: the last `tail` groups (league snapshots or --curriculum.mix-opponent), then the
rehearsal's groups, then the rung's: split evenly among its opponents, except that an opponent which searches one game
at a time (mcts:N, Connect Four's solver) gets at most round(per_game_share x groups) of them (at least one); what such
an opponent leaves goes to the rung's batched opponents or, where it has none, to `anchor` (the strongest batched rung
below; the env's own opponent, with no groups, when the slow one leaves none and other groups need a batched env).
Why: a 2048-game iteration against mcts:100 took ~4.6 minutes on the host when every game played OpenSpiel's Python
MCTS (~22 s with the C++ bot it plays now).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    main: str  # the env's own opponent: every group not in `assigned` (nor in the tail) plays it
    assigned: tuple[tuple[str, tuple[int, ...]], ...]  # (opponent, its groups), the rehearsal's last
    rung_groups: int  # groups that play the rung's opponents (the anchor's not counted)
    rehearsed: str | None = None  # the rung the rehearsal's groups replay


def _even(total: int, parts: int) -> list[int]:
    return np.diff(np.linspace(0, total, parts + 1).round().astype(int)).tolist() if parts else []


def plan_groups(*, groups: int, rung: tuple[str, ...], per_game: Mapping[str, bool], anchor: str | None,
                per_game_share: float, tail: int = 0, rehearsal: tuple[str, int] | None = None) -> GroupPlan:
    """See the module docstring. `rung`: the current rung's opponents, its lead first; `per_game[o]`: whether o
    searches one game at a time; `rehearsal`: (the opponent replayed, its groups) or None."""
    cap = groups if per_game_share >= 1 else max(1, round(per_game_share * groups))
    rehearsed, replay = rehearsal if rehearsal else (None, 0)
    if rehearsed is not None and per_game.get(rehearsed, False):
        replay = min(replay, cap)  # a slow rung below is replayed on a bounded share too
    free = groups - tail - replay  # the rung's groups: 0 .. free - 1
    if free < 1 and not replay:  # the league plays every group: the env's own opponent plays none
        return GroupPlan(rung[0], (), 0)
    if free < 1:
        raise ValueError(f"{groups} groups leave none for the rung after {tail} (league or mix) and {replay} "
                         "(rehearsal): lower a share or raise --rollout.groups")
    slow = [o for o in rung if per_game.get(o, False)]
    fast = [o for o in rung if o not in slow]
    # the slow ones take at most `cap` groups each, unless no batched opponent could play the rest
    room = free if not fast and anchor is None else min(free, cap * len(slow))
    slow_sizes = _even(room, len(slow))
    rest = free - sum(slow_sizes)
    anchor_groups = 0 if fast else rest
    entries = ([(anchor, anchor_groups)] if anchor_groups else []) + list(zip(fast, _even(rest, len(fast)))) + \
        list(zip(slow, slow_sizes))
    if entries[0][0] in slow and anchor is not None and (len(entries) > 1 or replay):
        entries.insert(0, (anchor, 0))  # the env's own opponent must be batched to host the others' groups
    main, start = entries[0][0], entries[0][1]  # the env's own opponent plays the first groups
    assigned = []
    for opponent, size in entries[1:]:
        if size:
            assigned.append((opponent, tuple(range(start, start + size))))
        start += size
    if replay:
        assigned.append((rehearsed, tuple(range(free, free + replay))))
    return GroupPlan(main, tuple(assigned), free - anchor_groups, rehearsed if replay else None)
