"""Tokenizers are `tokenizers.Tokenizer` objects: Hugging Face tokenizer.json files, or the built-in game
tokenizer (one token per character, exact round trip) that the tiny CPU default model uses."""

from __future__ import annotations

import dataclasses
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
GAME_SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3
GAME_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n\t"

# Names that common tokenizer.json files give their special tokens, most specific first.
_EOS_NAMES = (EOS, "<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")
_PAD_NAMES = (PAD, "<|pad|>", "<|endoftext|>", "[PAD]")
_BOS_NAMES = (BOS, "<s>", "<|begin_of_text|>", "[CLS]")
_UNK_NAMES = (UNK, "[UNK]")


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """What the sampler and the model need from a tokenizer. bos/unk are None where a tokenizer has none
    (Qwen has no BOS); pad falls back to eos."""

    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None = None
    unk_id: int | None = None


def _first_id(tok: Tokenizer, names) -> int | None:
    for name in names:
        if (i := tok.token_to_id(name)) is not None:
            return i
    return None


def special_ids(tok: Tokenizer, *, eos: str | None = None, pad: str | None = None) -> TokenizerInfo:
    """Special token ids by their usual names, or by the names given (e.g. eos="<|im_end|>")."""
    eos_id = _first_id(tok, (eos,) if eos else _EOS_NAMES)
    if eos_id is None:
        raise ValueError(f"tokenizer has no end-of-sequence token (looked for {eos or _EOS_NAMES})")
    pad_id = _first_id(tok, (pad,) if pad else _PAD_NAMES)
    if pad is not None and pad_id is None:
        raise ValueError(f"tokenizer has no token {pad!r}")
    return TokenizerInfo(vocab_size=tok.get_vocab_size(with_added_tokens=True),
                         pad_id=eos_id if pad_id is None else pad_id, eos_id=eos_id,
                         bos_id=_first_id(tok, _BOS_NAMES), unk_id=_first_id(tok, _UNK_NAMES))


def game_tokenizer(chars: str = GAME_CHARS) -> Tokenizer:
    """Character-level tokenizer for game text: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then one id per char.

    The pre-tokenizer isolates every character (newlines included) and the Fuse decoder joins tokens
    without the spaces WordLevel's default decoding would insert, so decode(encode(text)) == text for
    any text over `chars`; other characters become <unk>. As in every Hugging Face tokenizer, the
    literal text "<eos>" encodes to the <eos> id (game text never contains it).
    """
    if len(set(chars)) != len(chars):
        raise ValueError("game tokenizer characters must be unique")
    vocab = {t: i for i, t in enumerate(GAME_SPECIALS + tuple(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(GAME_SPECIALS))
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json file, or a folder holding one (Qwen's byte-level BPE loads the same way)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed json
        raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from e


def save_tokenizer(tok: Tokenizer, path: str | Path) -> Path:
    """Write tok as tokenizer.json (into `path` when it is a folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    tok.save(str(path))
    return path
