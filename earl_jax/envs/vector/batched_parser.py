"""`parser.parse_action` for a batch of answers, as array code over their bytes.

The rule (parser.py): the first run of ASCII digits is the move, unless a '-' right before it is a
sign (no ASCII letter or digit before the '-'), a '.' and a digit right after it make it a fraction,
or it has more than MAX_DIGITS digits. Only the class of each character matters (digit, ASCII letter,
'-', '.', anything else), so an answer is read as bytes with every non-ASCII character replaced by
'?' (one byte per character) and padded with NUL: padding reads as "anything else", which is what
the start and end of the text mean to the rule. Answers longer than `MAX_BATCHED_CHARS` (rare,
and the padded array would grow with the longest one) and non-`str` answers take the scalar path.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from jaxtyping import Int, UInt8

from earl_jax.envs.parser import MAX_DIGITS, parse_action

MAX_BATCHED_CHARS = 64
_DIGIT = np.zeros(256, bool)
_DIGIT[ord("0"):ord("9") + 1] = True
_ALNUM = _DIGIT.copy()
_ALNUM[ord("A"):ord("Z") + 1] = True
_ALNUM[ord("a"):ord("z") + 1] = True
# _WEIGHTS[d, j]: the weight of digit j in a run of d digits (d <= MAX_DIGITS); the last row is zeros.
_WEIGHTS = np.array([[10 ** (d - 1 - j) if j < d else 0 for j in range(MAX_DIGITS)]
                     for d in range(MAX_DIGITS + 2)], np.int64)
_WINDOW = 2 + MAX_DIGITS + 3  # two before the run, the run, one more digit (too long), '.', a digit


class MoveCache:
    """Answers already read, and their moves: a policy repeats itself ("3\n", "4\n"), and a dict lookup
    costs a fraction of the batched parse. Never more than `limit` entries: emptied when a batch of
    new answers would pass it."""

    def __init__(self, limit: int = 1 << 16):
        self.limit, self.moves = limit, {}

    def __call__(self, keys: list, parse) -> Int[np.ndarray, " n"]:
        """The moves of `keys` (hashable answers), `parse(indices of misses)` reading the ones not seen yet."""
        moves = list(map(self.moves.get, keys))
        if None in moves:
            miss = [k for k, m in enumerate(moves) if m is None]
            if len(self.moves) + len(miss) > self.limit:
                self.moves.clear()
            for k, m in zip(miss, parse(miss).tolist()):
                moves[k] = m
                if len(self.moves) < self.limit:
                    self.moves[keys[k]] = m
        return np.array(moves, np.int64).reshape(len(keys))


_TEXT_MOVES = MoveCache()


def parse_actions(texts: Sequence[object]) -> Int[np.ndarray, " n"]:
    """parse_action for each answer: the move, or -1 where it names none."""
    # Short texts only as keys: the cache must not keep a 200 kB junk answer alive.
    if all(type(t) is str and len(t) <= MAX_BATCHED_CHARS for t in texts):
        return _TEXT_MOVES(list(texts), lambda miss: _parse_actions([texts[k] for k in miss]))
    return _parse_actions(texts)


def _parse_actions(texts: Sequence[object]) -> Int[np.ndarray, " n"]:
    n = len(texts)
    out = np.full(n, -1, np.int64)
    batched = [k for k, t in enumerate(texts) if type(t) is str and len(t) <= MAX_BATCHED_CHARS]
    if len(batched) < n:
        for k, t in enumerate(texts):
            if not (type(t) is str and len(t) <= MAX_BATCHED_CHARS):
                move = parse_action(t) if isinstance(t, str) else None
                out[k] = -1 if move is None else move
    if batched:
        short = [texts[k] for k in batched] if len(batched) < n else texts
        out[batched] = parse_bytes(pad_texts(short)[0])
    return out


def pad_texts(texts: Sequence[str]) -> tuple[UInt8[np.ndarray, "n t"], Int[np.ndarray, " n"]]:
    """Texts as NUL-padded ASCII bytes (non-ASCII characters as '?'), and their lengths."""
    lengths = np.fromiter(map(len, texts), np.int64, len(texts))
    flat = np.frombuffer("".join(texts).encode("ascii", "replace"), np.uint8)
    return pad_rows(flat, lengths), lengths


def pad_rows(flat: UInt8[np.ndarray, " total"], lengths: Int[np.ndarray, " n"]) -> UInt8[np.ndarray, "n t"]:
    width = int(lengths.max(initial=0))
    out = np.zeros((len(lengths), width), np.uint8)
    out[np.arange(width) < lengths[:, None]] = flat  # row-major fill = the texts in order
    return out


def parse_bytes(text: UInt8[np.ndarray, "n t"]) -> Int[np.ndarray, " n"]:
    """The rule on NUL-padded byte rows: the move per row, -1 for none.

    Only the first digit run matters, so after one pass to find it the rest looks at a window of
    11 bytes per row: two before it (the sign test) and nine from it (six digits, one more, '.', a
    digit). Lookups use `take` on flat arrays: fancy indexing costs several times more at this size.
    """
    n, width = text.shape
    if width == 0:  # every answer empty
        return np.full(n, -1, np.int64)
    first = _DIGIT.take(text).argmax(1)  # 0 when there is no digit: then window[:, 2] is no digit either
    stride = width + _WINDOW
    padded = np.zeros((n, stride), np.uint8)  # NUL around the text: the start and end of it
    padded[:, 2:width + 2] = text
    window = padded.ravel().take((np.arange(n) * stride + first)[:, None] + np.arange(_WINDOW))  # [:, 2]: first digit
    wdigit = _DIGIT.take(window)
    run = wdigit[:, 2:]
    ndigits = np.where(run.all(1), _WINDOW - 2, (~run).argmax(1))  # all nine digits: too long anyway
    after = np.minimum(ndigits, MAX_DIGITS + 1) + 2 + np.arange(n) * _WINDOW  # the byte after the run, flat
    fraction = (window.ravel().take(after) == ord(".")) & wdigit.ravel().take(after + 1)
    sign = (window[:, 1] == ord("-")) & ~_ALNUM.take(window[:, 0])
    ok = wdigit[:, 2] & ~sign & ~fraction & (ndigits <= MAX_DIGITS)
    # Digit j of a run of d digits weighs 10 ** (d - 1 - j); row MAX_DIGITS + 1 of the table is zeros.
    weights = _WEIGHTS.take(np.where(ok, ndigits, MAX_DIGITS + 1), axis=0)
    value = ((window[:, 2:2 + MAX_DIGITS].astype(np.int64) - ord("0")) * weights).sum(1)
    return np.where(ok, value, -1)
