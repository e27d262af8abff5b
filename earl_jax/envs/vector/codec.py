"""Observation text -> token ids and answer token ids -> moves, for a whole batch.

With the built-in character-level game tokenizer (`models.tokenizer.game_tokenizer`: one token per
character, nothing added, Fuse decoder) a token id is a table lookup per byte: `bytes.translate`
turns a whole observation into its ids in C, instead of a tokenizer call (~50 us per observation).
The fast path is taken only when the tokenizer's own definition says it is that kind of tokenizer
and a probe of every character round-trips; a text it cannot vouch for (non-ASCII, a character
outside the vocabulary, the first character of an added token such as "<eos>") goes through the
tokenizer itself. Any other tokenizer: `encode_batch` / `decode_batch` throughout.
"""
from __future__ import annotations

import itertools
import json
from typing import Sequence

import numpy as np
import tokenizers
from jaxtyping import Bool, Int

from earl_jax.envs.parser import parse_action
from earl_jax.envs.vector.batched_parser import MAX_BATCHED_CHARS, MoveCache, pad_rows, parse_actions, parse_bytes

_SKIP, _OTHER = -1, -2  # id -> byte table: a special token (decode drops it), anything else not one byte
_NOT_FAST = 255  # byte -> id table: a character the table does not vouch for (no character's id is 255)


class ObservationCodec:
    """`encode(texts)` == [tokenizer.encode(t).ids ...]; `decode(ids)` == tokenizer.decode(ids,
    skip_special_tokens=True) per row; `answers_to_moves(ids)` == parse_action of that text (-1: none)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self.tokenizer = tokenizer
        tables = _char_tables(tokenizer)
        self.fast = tables is not None  # the character-level game tokenizer: table lookups
        self._moves = MoveCache()  # answer ids -> move: answers repeat, a lookup beats decoding
        self._byte_moves = MoveCache()  # the same for answers of <= 8 characters as one integer each
        if self.fast:
            char_ids, self._id_bytes = tables
            self._byte_table = bytes(np.where(char_ids >= 0, char_ids, _NOT_FAST).tolist())  # for bytes.translate
            self._row_table = b"\0" + self._byte_table[1:]  # for NUL-padded byte rows: NUL is padding, id 0

    # ---- observations -> ids -------------------------------------------------------------------
    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        if not self.fast:
            return self._tokenizer_encode(list(texts))
        table = self._byte_table
        if self._all_fast(texts):  # the common case: one C-level translate per text, no checks
            return [list(t.encode("ascii").translate(table)) for t in texts]
        slow = self._slow_rows(texts)
        out = [list(t.encode("ascii", "replace").translate(table)) for t in texts]
        for k, enc in zip(slow, self._tokenizer_encode([texts[k] for k in slow])):
            out[k] = enc
        return out

    def encode_padded(self, texts: Sequence[str],
                      pad_id: int = 0) -> tuple[Int[np.ndarray, "n t"], Int[np.ndarray, " n"]]:
        """Right-padded ids (int32) and each row's length: no Python list per row. Texts that repeat (the first
        observations of a GRPO group's games) are encoded once."""
        distinct = dict.fromkeys(texts)
        if len(distinct) < len(texts) and 2 * len(distinct) <= len(texts):
            index = {t: k for k, t in enumerate(distinct)}
            where = np.fromiter(map(index.__getitem__, texts), np.int64, len(texts))
            ids, lengths = self.encode_padded(list(distinct), pad_id)
            return ids[where], lengths[where]
        lengths = _text_lengths(texts)
        if not self.fast:
            slow = list(range(len(texts)))
        else:
            slow = [] if self._all_fast(texts) else self._slow_rows(texts)
        slow_ids = self._tokenizer_encode([texts[k] for k in slow])
        char_lengths = lengths.copy()
        for k, enc in zip(slow, slow_ids):
            lengths[k] = len(enc)
        width = int(lengths.max(initial=0))
        out = np.full((len(texts), width), pad_id, np.int32)
        if self.fast:
            fast = np.ones(len(texts), bool)
            fast[slow] = False
            data = "".join(texts).encode("ascii", "replace").translate(self._byte_table)
            ids = np.frombuffer(data, np.uint8)[np.repeat(fast, char_lengths)]
            out[(np.arange(width) < lengths[:, None]) & fast[:, None]] = ids
        for k, enc in zip(slow, slow_ids):
            out[k, :len(enc)] = enc
        return out, lengths

    def encode_step(self, step, where: Bool[np.ndarray, " r"] | None = None
                    ) -> tuple[Int[np.ndarray, "k t"], Int[np.ndarray, " k"]]:
        """`encode_padded` of the observations of a vector-env step's entries `where` (default all). From the
        env's byte rows when it has them and this is the game tokenizer: a table lookup over the batch, no
        string per game (and a finished game's text is never rendered)."""
        where = np.ones(len(step), bool) if where is None else np.asarray(where, bool)
        got = step.obs_bytes(where) if self.fast and where.any() else None
        if got is not None:  # rows hold no NUL but their padding (render.py): NUL -> id 0, the pad
            rows, lengths = got
            rows = rows[:, :int(lengths.max(initial=0))]  # as wide as encode_padded's (a table's rows may be wider)
            data = rows.tobytes().translate(self._row_table)
            if bytes([_NOT_FAST]) not in data:  # else a character the table cannot vouch for: the text path
                return np.frombuffer(data, np.uint8).reshape(rows.shape).astype(np.int32), lengths
        obs = step.obs
        return self.encode_padded([o for o, k in zip(obs, where.tolist()) if k])

    def _all_fast(self, texts) -> bool:
        joined = "".join(texts)
        return joined.isascii() and _NOT_FAST not in joined.encode("ascii").translate(self._byte_table)

    def _slow_rows(self, texts) -> list[int]:
        """Texts the table cannot vouch for (non-ASCII, a character outside it): they go to the tokenizer."""
        table = self._byte_table
        return [k for k, t in enumerate(texts) if not t.isascii() or _NOT_FAST in t.encode("ascii").translate(table)]

    def _tokenizer_encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)] if texts else []

    # ---- answer ids -> text, moves ----------------------------------------------------------------
    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        if not self.fast:
            return self.tokenizer.decode_batch([list(r) for r in ids], skip_special_tokens=True)
        chars, kept, slow = self._answer_bytes(ids)
        text = chars.tobytes().decode("ascii")
        ends = np.cumsum(kept)
        out = [text[e - n:e] for e, n in zip(ends.tolist(), kept.tolist())]
        for k in slow:
            out[k] = self.tokenizer.decode(list(ids[k]), skip_special_tokens=True)
        return out

    def answers_to_moves(self, ids: Sequence[Sequence[int]]) -> Int[np.ndarray, " n"]:
        """The move each answer names (parser.parse_action semantics), -1 where it names none."""
        keys = list(map(tuple, ids))
        if max(map(len, keys), default=0) > MAX_BATCHED_CHARS:  # long answers are rare: not worth keeping
            return self._read_moves(ids)
        return self._moves(keys, lambda miss: self._read_moves([ids[k] for k in miss]))

    def padded_answers_to_moves(self, ids: Int[np.ndarray, "n t"],
                                counts: Int[np.ndarray, " n"]) -> Int[np.ndarray, " n"]:
        """`answers_to_moves` of the answers ids[k, :counts[k]], read as arrays (no Python object per answer)."""
        ids, counts = np.asarray(ids), np.asarray(counts)
        if not self.fast or ids.shape[1] > MAX_BATCHED_CHARS:
            return self.answers_to_moves([row[:c] for row, c in zip(ids.tolist(), counts.tolist())])
        table = self._id_bytes
        valid = np.arange(ids.shape[1]) < counts[:, None]
        known = (ids >= 0) & (ids < len(table))
        byte = np.where(valid, table[np.where(known, ids, 0)], _SKIP)
        slow = (valid & (~known | (byte == _OTHER))).any(1)  # an id the table cannot vouch for: the tokenizer
        keep = byte >= 0
        if (keep[:, 1:] & ~keep[:, :-1]).any():  # a special (<eos>) before a character: close up, in order
            order = np.argsort(~keep, axis=1, kind="stable")
            byte, keep = np.take_along_axis(byte, order, 1), np.take_along_axis(keep, order, 1)
        chars = np.where(keep, byte, 0).astype(np.uint8)  # NUL padding reads as the text's end
        if chars.shape[1] <= 8:  # short answers (the common case): one integer key each, parsed once
            keys = np.zeros((len(chars), 8), np.uint8)
            keys[:, :chars.shape[1]] = chars
            moves = self._byte_moves(keys.view(np.uint64)[:, 0].tolist(), lambda miss: parse_bytes(chars[miss]))
        else:
            moves = parse_bytes(chars)
        for k in np.flatnonzero(slow).tolist():
            move = parse_action(self.tokenizer.decode(ids[k, :counts[k]].tolist(), skip_special_tokens=True))
            moves[k] = -1 if move is None else move
        return moves

    def _read_moves(self, ids: Sequence[Sequence[int]]) -> Int[np.ndarray, " n"]:
        if not self.fast:
            return parse_actions(self.decode(ids))
        chars, kept, slow = self._answer_bytes(ids)
        moves = parse_bytes(pad_rows(chars, kept))
        for k in slow:
            move = parse_action(self.tokenizer.decode(list(ids[k]), skip_special_tokens=True))
            moves[k] = -1 if move is None else move
        return moves

    def _answer_bytes(self, ids):
        """(characters of the fast rows' tokens back to back, specials dropped; count per row; slow rows)."""
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum()))
        table = self._id_bytes
        known = (flat >= 0) & (flat < len(table))
        byte = table[np.where(known, flat, 0)]
        other = ~known | (byte == _OTHER)
        keep = byte >= 0
        if keep.all():  # no special token, nothing unknown: every row as it is
            return byte.astype(np.uint8), lengths, []
        row = np.repeat(np.arange(len(ids)), lengths)
        slow = np.zeros(len(ids), bool)
        slow[row[other]] = True  # an id the table cannot vouch for: decode that row with the tokenizer
        keep &= ~slow[row]
        kept = np.bincount(row[keep], minlength=len(ids))
        return byte[keep].astype(np.uint8), kept, np.flatnonzero(slow).tolist()


def _text_lengths(texts) -> Int[np.ndarray, " n"]:
    return np.fromiter(map(len, texts), np.int64, len(texts))


def _char_tables(tok: tokenizers.Tokenizer):
    """(byte -> id, id -> byte) for a character-level game tokenizer, or None for any other."""
    spec = json.loads(tok.to_str())
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    one_char_each = (pre.get("type") == "Split" and pre.get("pattern") == {"Regex": r"[\s\S]"}
                     and pre.get("behavior") == "Isolated" and not pre.get("invert"))
    if (model.get("type") != "WordLevel" or not one_char_each or spec.get("normalizer") is not None
            or spec.get("post_processor") is not None or (spec.get("decoder") or {}).get("type") != "Fuse"):
        return None
    vocab = tok.get_vocab(with_added_tokens=True)
    added = spec.get("added_tokens") or []
    char_ids = np.full(256, -1, np.int64)
    id_bytes = np.full(max(vocab.values()) + 1, _OTHER, np.int64)
    for token, i in vocab.items():
        if len(token) == 1 and token.isascii() and i < _NOT_FAST:  # ids must fit the bytes.translate table
            char_ids[ord(token)] = i
            id_bytes[i] = ord(token)
    for a in added:
        content = a.get("content") or ""
        if content[:1].isascii() and content:
            char_ids[ord(content[0])] = -1  # "<eos>" in a text is the special token: let the tokenizer see it
        id_bytes[a["id"]] = _SKIP if a.get("special") else (ord(content) if len(content) == 1 and content.isascii()
                                                             and a["id"] < _NOT_FAST else _OTHER)
    # Trust, but check: every table entry must round-trip through the tokenizer itself.
    chars = "".join(chr(c) for c in np.flatnonzero(char_ids >= 0))
    probe = chars + chars[::-1]
    if not chars or tok.encode(probe).ids != char_ids[np.frombuffer(probe.encode("ascii"), np.uint8)].tolist():
        return None
    byte_ids = np.flatnonzero(id_bytes >= 0).tolist()
    if tok.decode(byte_ids, skip_special_tokens=True) != "".join(chr(id_bytes[i]) for i in byte_ids):
        return None
    return char_ids, id_bytes
