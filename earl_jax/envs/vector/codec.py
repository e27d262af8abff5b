"""Observation text -> token ids and answer token ids -> moves, for a whole batch.

With the built-in character-level game tokenizer (`models.tokenizer.game_tokenizer`: one token per
character, nothing added, Fuse decoder) a token id is a table lookup per byte, so encoding 512
observations is one `join`, one `frombuffer` and one gather instead of 512 tokenizer calls (~50 us
each). The fast path is taken only when the tokenizer's own definition says it is that tokenizer
and a probe of every character round-trips; a text it cannot vouch for (non-ASCII, a character
outside the vocabulary, the first character of a special token such as "<eos>") goes through the
tokenizer itself. Any other tokenizer: `encode_batch` / `decode_batch` throughout.
"""
from __future__ import annotations

import itertools
import json
from typing import Sequence

import numpy as np
import tokenizers
from jaxtyping import Int

from earl_jax.envs.parser import parse_action
from earl_jax.envs.vector.parser import _pad, parse_actions, parse_bytes

_SKIP, _OTHER = -1, -2  # id -> byte table: a special token (decode drops it), anything else not one byte


class ObservationCodec:
    """`encode(texts)` == [tokenizer.encode(t).ids ...]; `decode(ids)` == tokenizer.decode(ids,
    skip_special_tokens=True) per row; `answers_to_moves(ids)` == parse_action of that text (-1: none)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self.tokenizer = tokenizer
        tables = _char_tables(tokenizer)
        self.fast = tables is not None
        self._char_ids, self._id_bytes = tables if tables is not None else (None, None)

    # ---- observations -> ids -------------------------------------------------------------------
    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        ids, starts, lengths, slow = self._encode_flat(texts)
        flat = ids.tolist()
        out = [flat[s:s + n] for s, n in zip(starts.tolist(), lengths.tolist())]
        for k, enc in zip(slow, self._tokenizer_encode([texts[k] for k in slow])):
            out[k] = enc
        return out

    def encode_padded(self, texts: Sequence[str], pad_id: int = 0) -> tuple[Int[np.ndarray, "n t"], Int[np.ndarray, " n"]]:
        """Right-padded ids (int32) and each row's length: no Python list per row."""
        ids, _, lengths, slow = self._encode_flat(texts)
        slow_ids = self._tokenizer_encode([texts[k] for k in slow])
        for k, enc in zip(slow, slow_ids):
            lengths[k] = len(enc)
        width = int(lengths.max(initial=0))
        out = np.full((len(texts), width), pad_id, np.int32)
        if self.fast:
            fast = np.ones(len(texts), bool)
            fast[slow] = False
            out[(np.arange(width) < lengths[:, None]) & fast[:, None]] = ids[np.repeat(fast, _text_lengths(texts))]
        for k, enc in zip(slow, slow_ids):
            out[k, :len(enc)] = enc
        return out, lengths

    def _encode_flat(self, texts):
        """(ids of all fast texts back to back, start of each text, lengths, indices of texts to tokenize)."""
        lengths = _text_lengths(texts)
        starts = np.cumsum(lengths) - lengths
        if not self.fast:
            return np.zeros(0, np.int32), starts, lengths, list(range(len(texts)))
        joined = "".join(texts)
        ascii_ok = np.ones(len(texts), bool) if joined.isascii() else np.array([t.isascii() for t in texts], bool)
        data = joined.encode("ascii", "replace")  # '?' per non-ASCII char keeps offsets; those rows are redone
        ids = self._char_ids[np.frombuffer(data, np.uint8)]
        bad = np.flatnonzero(ids < 0)
        if len(bad):  # a character the table cannot vouch for: its text goes to the tokenizer
            ascii_ok[np.searchsorted(starts + lengths, bad, side="right")] = False
        return ids, starts, lengths, np.flatnonzero(~ascii_ok).tolist()

    def _tokenizer_encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

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
        if not self.fast:
            return parse_actions(self.decode(ids))
        chars, kept, slow = self._answer_bytes(ids)
        moves = parse_bytes(_pad(chars, kept))
        for k in slow:
            move = parse_action(self.tokenizer.decode(list(ids[k]), skip_special_tokens=True))
            moves[k] = -1 if move is None else move
        return moves

    def _answer_bytes(self, ids):
        """(bytes of every fast row's kept tokens back to back, kept count per row, rows to decode slowly)."""
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum()))
        row = np.repeat(np.arange(len(ids)), lengths)
        known = (flat >= 0) & (flat < len(self._id_bytes))
        byte = np.where(known, self._id_bytes[np.where(known, flat, 0)], _OTHER)
        slow_rows = np.unique(row[byte == _OTHER])
        keep = byte >= 0
        keep[np.isin(row, slow_rows)] = False
        kept = np.bincount(row[keep], minlength=len(ids))
        return byte[keep].astype(np.uint8), kept, slow_rows.tolist()


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
        if len(token) == 1 and token.isascii():
            char_ids[ord(token)] = i
            id_bytes[i] = ord(token)
    for a in added:
        if a.get("content"):
            char_ids[ord(a["content"][0])] = -1  # "<eos>" in a text is the special token: let the tokenizer see it
        if a.get("special"):
            id_bytes[a["id"]] = _SKIP
        elif len(a.get("content", "")) != 1:
            id_bytes[a["id"]] = _OTHER
    # Trust, but check: every table entry must round-trip through the tokenizer itself.
    chars = "".join(chr(c) for c in np.flatnonzero(char_ids >= 0))
    probe = chars + chars[::-1]
    if tok.encode(probe).ids != char_ids[np.frombuffer(probe.encode("ascii"), np.uint8)].tolist():
        return None
    byte_ids = np.flatnonzero(id_bytes >= 0).tolist()
    if tok.decode(byte_ids, skip_special_tokens=True) != "".join(chr(id_bytes[i]) for i in byte_ids):
        return None
    return char_ids, id_bytes
