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
_POW10 = 10 ** np.arange(MAX_DIGITS, dtype=np.int64)


def parse_actions(texts: Sequence[object]) -> Int[np.ndarray, " n"]:
    """parse_action for each answer: the move, or -1 where it names none."""
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
        out[batched] = parse_bytes(*pad_texts(short))
    return out


def pad_texts(texts: Sequence[str]) -> tuple[UInt8[np.ndarray, "n t"], Int[np.ndarray, " n"]]:
    """Texts as NUL-padded ASCII bytes (non-ASCII characters as '?'), and their lengths."""
    lengths = np.fromiter(map(len, texts), np.int64, len(texts))
    flat = np.frombuffer("".join(texts).encode("ascii", "replace"), np.uint8)
    return _pad(flat, lengths), lengths


def _pad(flat: UInt8[np.ndarray, " total"], lengths: Int[np.ndarray, " n"]) -> UInt8[np.ndarray, "n t"]:
    width = int(lengths.max(initial=0))
    out = np.zeros((len(lengths), width), np.uint8)
    out[np.arange(width) < lengths[:, None]] = flat  # row-major fill = the texts in order
    return out


def parse_bytes(text: UInt8[np.ndarray, "n t"], lengths: Int[np.ndarray, " n"] | None = None) -> Int[np.ndarray, " n"]:
    """The rule on NUL-padded byte rows: the move per row, -1 for none. `lengths` is not needed (NUL
    is "anything else") and is accepted for symmetry with `pad_texts`."""
    n, width = text.shape
    # Two NUL columns on the right: the fraction test may look two characters past the run.
    b = np.zeros((n, width + 2), np.uint8)
    b[:, :width] = text
    digit = _DIGIT[b]
    has = digit.any(1)
    first = digit.argmax(1)
    pos = np.arange(width + 2)
    after = pos >= first[:, None]
    end = (~digit & after).argmax(1)  # the padding guarantees a non-digit after every run
    rows = np.arange(n)
    before = b[rows, np.maximum(first - 1, 0)]
    before2 = b[rows, np.maximum(first - 2, 0)]
    sign = (first >= 1) & (before == ord("-")) & ~((first >= 2) & _ALNUM[before2])
    fraction = (b[rows, end] == ord(".")) & digit[rows, end + 1]
    ndigits = end - first
    ok = has & ~sign & ~fraction & (ndigits <= MAX_DIGITS)
    # Value of the run: digit at position p weighs 10 ** (end - 1 - p); only rows that are moves.
    place = end[:, None] - 1 - pos
    run = ok[:, None] & after & (place >= 0)
    weights = np.where(run, _POW10[np.clip(place, 0, MAX_DIGITS - 1)], 0)
    value = ((b.astype(np.int64) - ord("0")) * weights).sum(1)
    return np.where(ok, value, -1)
