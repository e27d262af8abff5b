"""Policies without a model, for the agent loop (`play_games`): the answers are chosen on the host.

One loop plays every game the project writes: the RL rollout (the model, `rollout/policy.py`), the format warm-up's
games of random legal moves (`random_legal`, a text task's `env_answers`) and the expert games
(rl/supervised/expert_games.py).
A `HostPolicy` writes each answer as the model would write it (constrained: the move's token and the stop token; free
text: the answer's tokens and the stop token, cut by the turn budget) and tells the loop what each answer says (the
move, the text), so the env reads exactly what was written without parsing it. What a caller records beside the
transcript (an expert's best-move sets) goes in `HostAnswers.notes`, which the loop's turn hook sees.

    policy = HostPolicy(random_legal(np.random.default_rng(0)), tokenizer, eos_id)
    traj = play_games(policy, env, tokenizer, PlayConfig(...), None, seeds)   # no JAX key: nothing is sampled
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tokenizers
from jaxtyping import Bool, Int

from earl_jax.envs.parser import parse_action
from earl_jax.rollout.episodes import Decoded
from earl_jax.rollout.moves import MoveTokens, legal_bits


@dataclasses.dataclass(frozen=True)
class HostAnswers:
    """One turn's answers for games `games` (in their order): moves or texts."""

    moves: Int[np.ndarray, " k"] | None = None  # action ids (written as their token, or their decimal text)
    texts: Sequence[str] | None = None  # free-text answers (a text task's)
    own: Bool[np.ndarray, " k"] | None = None  # False: written, but not the policy's choice (outside the loss mask)
    notes: dict[str, np.ndarray] | None = None  # per game: what the loop's turn hook reads (`Decoded.notes`)


# (games, their legal moves: None for a policy that reads none) -> their answers
Choose = Callable[[Int[np.ndarray, " k"], Bool[np.ndarray, "k a"] | None], HostAnswers]


class HostPolicy:
    """An agent-loop `Policy` whose answers `choose` names on the host. `moves` (MoveTokens): constrained moves, each
    answer the move's token and the stop token (the move scored, its legal set in `choices`); None: free text, the
    answer's tokens and `stop_id`. `reads_legal`: the loop hands `choose` each game's legal moves. Slots are told
    apart by their row ids, the games' ids (play_games with game_offset 0)."""

    def __init__(self, choose: Choose, tokenizer: tokenizers.Tokenizer, stop_id: int, moves: MoveTokens | None = None,
                 reads_legal: bool = True):
        self.choose, self.tokenizer, self.stop_id, self.moves = choose, tokenizer, int(stop_id), moves
        self.reads_legal = reads_legal
        self._text_ids: dict[str, list[int]] = {}  # a move's text -> its answer ids (moves repeat)

    def reset(self, batch: int, max_len: int) -> None:
        pass

    def extend(self, tokens, counts) -> None:
        pass

    def reset_rows(self, rows) -> None:
        pass

    def take_rows(self, rows, batch: int) -> None:
        pass

    def generate(self, budgets, rng, row_ids, legal=None) -> Callable[[], Decoded]:
        budgets, ids = np.asarray(budgets), np.asarray(row_ids)
        slots = np.flatnonzero(budgets > 0)
        games = (ids[:, -1] if ids.ndim == 2 else ids)[slots].astype(np.int64)  # [b, 2] rows: (turn, id)
        if self.reads_legal and legal is None:
            raise ValueError("HostPolicy: choose reads legal moves, and the loop gave none")
        mine = None if legal is None else np.asarray(legal, bool)[slots]
        got = self.choose(games, mine)
        out = (self._constrained(got, mine, budgets, slots) if self.moves is not None
               else self._free_text(got, budgets, slots))
        return lambda: out

    def _constrained(self, got: HostAnswers, legal, budgets, slots) -> Decoded:
        if got.moves is None or legal is None:
            raise ValueError("HostPolicy: constrained moves need moves chosen among the legal ones")
        b = len(budgets)
        tokens = np.zeros((b, 2), np.int32)
        tokens[slots, 0] = np.asarray(self.moves.token_ids, np.int32)[got.moves]
        tokens[:, 1] = self.moves.stop_id
        counts = np.zeros(b, np.int32)
        counts[slots] = np.minimum(budgets[slots], 2)
        scored = np.zeros((b, 2), bool)
        scored[slots, 0] = True if got.own is None else got.own  # the move is the choice; the stop token is not
        choices = np.zeros((b, 2), np.int32)
        choices[slots, 0] = legal_bits(legal)
        moves = np.full(b, -1, np.int64)
        moves[slots] = got.moves
        return Decoded(tokens, np.zeros((b, 2), np.float32), counts, counts == 2, scored=scored, choices=choices,
                       moves=moves, notes=_per_slot(got.notes, b, slots))

    def _free_text(self, got: HostAnswers, budgets, slots) -> Decoded:
        b = len(budgets)
        if got.moves is not None:
            texts = [str(m) for m in np.asarray(got.moves).tolist()]
            answers = [self._answer(t) for t in texts]
        else:
            texts = list(got.texts)
            answers = [e.ids + [self.stop_id] for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        lengths = np.array([len(a) for a in answers], np.int64)
        width = max(int(lengths.max(initial=1)), 1)
        tokens = np.zeros((b, width), np.int32)
        tokens[slots] = [a + [0] * (width - len(a)) for a in answers]
        counts = np.zeros(b, np.int32)
        counts[slots] = np.minimum(budgets[slots], lengths)
        stopped = np.zeros(b, bool)
        stopped[slots] = lengths <= budgets[slots]  # the whole answer, up to its stop token
        scored = None
        if got.own is not None:
            scored = np.zeros((b, width), bool)
            scored[slots] = np.asarray(got.own, bool)[:, None]
        said = [None] * b  # what each slot's answer says: the text chosen, or what its cut tokens read
        moves = None if got.moves is None else np.full(b, -1, np.int64)
        for k, (s, text) in enumerate(zip(slots.tolist(), texts)):
            if counts[s] < lengths[k] - 1:  # cut before its last character: the env reads what was written
                text = self.tokenizer.decode(tokens[s, :counts[s]].tolist(), skip_special_tokens=True)
            said[s] = text
            if moves is not None:
                move = parse_action(text) if counts[s] < lengths[k] - 1 else int(got.moves[k])
                moves[s] = -1 if move is None else move
        return Decoded(tokens, np.zeros(tokens.shape, np.float32), counts, stopped, scored=scored, moves=moves,
                       texts=said, notes=_per_slot(got.notes, b, slots))

    def _answer(self, text: str) -> list[int]:
        if text not in self._text_ids:
            self._text_ids[text] = self.tokenizer.encode(text, add_special_tokens=False).ids + [self.stop_id]
        return self._text_ids[text]


def _per_slot(notes: dict[str, np.ndarray] | None, b: int, slots: np.ndarray) -> dict[str, np.ndarray] | None:
    """Per-game notes laid out per slot (zeros in the others)."""
    if notes is None:
        return None
    out = {}
    for name, values in notes.items():
        values = np.asarray(values)
        out[name] = np.zeros((b,) + values.shape[1:], values.dtype)
        out[name][slots] = values
    return out


def random_legal(rng: np.random.Generator, refusal: str = "no legal moves to draw from") -> Choose:
    """Uniform among each game's legal moves: one `rng.integers(number of legal moves)` per game, in the games'
    order. A game to move with no legal move raises ValueError(`refusal`)."""
    def choose(games, legal):
        moves = np.zeros(len(games), np.int64)
        for k, row in enumerate(legal):
            options = np.flatnonzero(row)
            if not len(options):
                raise ValueError(refusal)
            moves[k] = options[int(rng.integers(len(options)))]
        return HostAnswers(moves=moves)
    return choose


def env_answers(envs: Sequence[Any], method: str) -> Choose:
    """Each game's env answers for itself: `envs[game].<method>()` (a text task's `expert_answer`, `format_answer`)."""
    def choose(games, legal):
        return HostAnswers(texts=[getattr(envs[g], method)() for g in games.tolist()])
    return choose


class ScriptedPolicy:
    """A policy without a model: `answer(context_text) -> answer text`, for tests and baselines."""

    def __init__(self, answer: Callable[[str], str], tokenizer: tokenizers.Tokenizer, stop_id: int):
        self.answer, self.tokenizer, self.stop_id = answer, tokenizer, stop_id

    def reset(self, batch: int, max_len: int) -> None:
        self.context: list[list[int]] = [[] for _ in range(batch)]

    def extend(self, tokens, counts) -> None:
        for row, toks, c in zip(self.context, np.asarray(tokens).tolist(), np.asarray(counts).tolist()):
            row.extend(toks[:c])

    def generate(self, budgets, rng, row_ids, legal=None) -> Callable[[], Decoded]:
        if legal is not None:
            raise ValueError("ScriptedPolicy answers in free text: it cannot play constrained moves")
        width = max(1, int(np.max(budgets, initial=0)))
        b = len(self.context)
        tokens, counts = np.zeros((b, width), np.int32), np.zeros(b, np.int32)
        stopped = np.zeros(b, bool)
        for r, (row, budget) in enumerate(zip(self.context, np.asarray(budgets).tolist())):
            if budget <= 0:
                continue
            text = self.tokenizer.decode(row, skip_special_tokens=True)
            toks = (self.tokenizer.encode(self.answer(text), add_special_tokens=False).ids + [self.stop_id])[:budget]
            row.extend(toks)
            tokens[r, :len(toks)], counts[r], stopped[r] = toks, len(toks), toks[-1] == self.stop_id
        out = Decoded(tokens, np.zeros(tokens.shape, np.float32), counts, stopped)
        return lambda: out

    def reset_rows(self, rows) -> None:
        for r in np.asarray(rows).tolist():
            self.context[r] = []

    def take_rows(self, rows, batch: int) -> None:
        self.context = [self.context[r] for r in rows] + [[] for _ in range(batch - len(rows))]
