"""Drafts from history: earlier rollouts' answers as model-free drafts for speculative decoding (`--rollout.drafts K`).

RhymeRL's HistoSpec observation: in RL the policy changes little from one iteration to the next, so its answers to
the same context repeat across adjacent iterations. A `DraftIndex` remembers, for the last `keep` training rollouts
(default 2), which answer followed each context tail: key = the last `n` tokens of the context before an answer
(default 8: the observation's tail), value = the answer's tokens (up to its stop token). For a key the answer seen
most often in those rollouts wins, the most recent on a tie. `propose` looks the decode rows' tails up and returns
a draft per row (length 0 where the tail was never seen); rollout/speculate.py verifies them in one forward pass of
the model, with the exact sampling rule, so a draft only changes how fast an answer is decoded, never its
distribution.

Host-side numpy, fed after every training rollout from its `Trajectories` (`turn_context_lens` say where each answer
starts, the loss mask where it ends). It is not checkpointed: a resumed run starts with an empty index, so its
rollouts draw other samples (from the same distribution) than those of the run that never stopped; with drafts off
(the default) a resume is bit-exact as before.
"""

from __future__ import annotations

import collections
from typing import Iterator

import numpy as np
from jaxtyping import Int

NO_TOKEN = -1  # a tail shorter than `n` (the first tokens of a context) is left-padded with this


class DraftIndex:
    """Answers that followed each context tail in the last `keep` rollouts; drafts of at most `width` tokens."""

    def __init__(self, width: int, n: int = 8, keep: int = 2):
        if width < 1 or n < 1 or keep < 1:
            raise ValueError(f"DraftIndex: width, n and keep must be >= 1, got {width}, {n}, {keep}")
        self.width, self.n = width, n
        self._rollouts: collections.deque[dict[bytes, collections.Counter]] = collections.deque(maxlen=keep)
        self._best: dict[bytes, np.ndarray] = {}

    def __len__(self) -> int:
        """Distinct context tails with a draft."""
        return len(self._best)

    def add(self, tokens: Int[np.ndarray, "r t"], loss_mask, turn_context_lens: list[list[int]]) -> None:
        """One rollout's answers (a `Trajectories`' columns): row r's answer of turn j starts at
        turn_context_lens[r][j] and runs while the loss mask does. The oldest rollout beyond `keep` is forgotten."""
        table: dict[bytes, collections.Counter] = {}
        for key, answer in self._answers(np.asarray(tokens, np.int32), np.asarray(loss_mask, bool), turn_context_lens):
            table.setdefault(key, collections.Counter())[answer] += 1
        self._rollouts.append(table)
        self._rebuild()

    def add_trajectories(self, traj) -> None:
        """`add` from a rollout's `Trajectories` (the rows whose token columns it holds)."""
        rows = range(traj.num_games)[traj.local_rows] if traj.local_rows is not None else range(traj.num_games)
        self.add(traj.tokens, traj.loss_mask, [traj.turn_context_lens[r] for r in rows])

    def propose(self, contexts: Int[np.ndarray, "b n"]) -> tuple[Int[np.ndarray, "b k"], Int[np.ndarray, " b"]]:
        """Each row's draft for its context tail (`n` last tokens, left-padded with NO_TOKEN): drafts [b, width]
        (0 past a row's length) and lengths [b] (0: none)."""
        contexts = np.ascontiguousarray(contexts, np.int32)
        if contexts.ndim != 2 or contexts.shape[1] != self.n:
            raise ValueError(f"DraftIndex.propose: contexts must be [b, {self.n}], got {contexts.shape}")
        drafts = np.zeros((len(contexts), self.width), np.int32)
        lengths = np.zeros(len(contexts), np.int32)
        if self._best:
            for r, row in enumerate(contexts):
                answer = self._best.get(row.tobytes())
                if answer is not None:
                    lengths[r] = len(answer)
                    drafts[r, :len(answer)] = answer
        return drafts, lengths

    def tail(self, tokens: Int[np.ndarray, " t"]) -> bytes:
        """The key of a context: its last `n` tokens, left-padded with NO_TOKEN."""
        key = np.full(self.n, NO_TOKEN, np.int32)
        last = np.asarray(tokens, np.int32)[-self.n:]
        key[self.n - len(last):] = last
        return key.tobytes()

    def _answers(self, tokens: np.ndarray, mask: np.ndarray, starts: list[list[int]]) -> Iterator[tuple[bytes, tuple]]:
        for r, row_starts in enumerate(starts):
            row, row_mask = tokens[r], mask[r]
            for start in row_starts:
                end = start
                while end < len(row_mask) and row_mask[end] and end - start < self.width:
                    end += 1
                if end > start:
                    yield self.tail(row[:start]), tuple(row[start:end].tolist())

    def _rebuild(self) -> None:
        """The winning answer per key over the kept rollouts: the most seen, then the most recent."""
        score: dict[bytes, dict[tuple, tuple[int, int]]] = {}
        order = 0
        for table in self._rollouts:  # oldest first: a later sighting raises an answer's recency
            for key, answers in table.items():
                slot = score.setdefault(key, {})
                for answer, count in answers.items():
                    order += 1
                    slot[answer] = (slot.get(answer, (0, 0))[0] + count, order)
        self._best = {key: np.asarray(max(slot, key=slot.__getitem__), np.int32) for key, slot in score.items()}
