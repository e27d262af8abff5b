"""Action parser: strict about meaning, forgiving about form.

The rule, in one line: **the first number in the answer is the move**; everything after it
(reasoning, a second number, a trailing newline) is ignored. So

    "3"  "[3]"  "column 3"  "3\\n"  " 3 because..."  "I play 3"  "x3"  "3."  "3 or 4"   -> 3

A number means a plain run of ASCII digits. It is not a move, and the answer is invalid, when
that first number is negative ("-3"), fractional ("3.5"), or absurdly long (more than
`MAX_DIGITS` digits). Text with no ASCII digit at all ("three", "", "٣") is invalid. Whether
the number is a *legal* move is the environment's business: the parser only reads text.

Why first-number-wins: the policy is sampled left to right and stops at its first terminator,
so the first number is what it committed to; later numbers are usually explanation
("3, because 4 is blocked"). It is also the cheapest rule to learn and to check by eye.
"""
from __future__ import annotations

import re

MAX_DIGITS = 6
"""Longer digit runs are rejected before `int()` (Python refuses to convert > 4300 digits)."""

# A '-' is a sign only when it does not follow a letter or digit ("x-3" reads as 3, "-3" as -3).
_NUMBER = re.compile(r"(?:(?<![A-Za-z0-9])(-))?([0-9]+)(\.[0-9]+)?", re.ASCII)


def parse_action(text: str) -> int | None:
    """Returns the move the answer names (a non-negative int), or None when it names none.

    Never raises on any `str`; non-`str` input (bytes, None) is also read as "no move".
    """
    if not isinstance(text, str):
        return None
    match = _NUMBER.search(text)
    if match is None:
        return None
    sign, digits, fraction = match.groups()
    if sign or fraction or len(digits) > MAX_DIGITS:
        return None
    return int(digits)


def canonical_action_text(action: int) -> str:
    """The text a scripted policy should answer with for `action`: its decimal id.

    Connect Four: the column, 0 (left) .. 6 (right). Tic-Tac-Toe: the cell, 0 .. 8 row-major
    from the top left. Any other OpenSpiel game: its action id. `parse_action` inverts it.
    """
    return str(int(action))
