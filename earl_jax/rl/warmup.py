"""The format warm-up's data: games of uniformly random legal moves, generated straight from the rules.

Each game is played by reading the environment's own `info["legal_actions"]` (never by parsing the prompt
text) and answering with the move's canonical text and the end token, exactly as the agent loop would
tokenize a policy's answers. No model and no sampling loop run, so a warm-up batch costs only the game
steps. The warm-up teaches the answer format (a legal move number, then the end token), not the game.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tokenizers
from jaxtyping import Bool, Int


def random_legal_games(envs: Sequence[Any], tokenizer: tokenizers.Tokenizer, seeds: Sequence[int],
                       rng: np.random.Generator, *, eos_id: int, bos_id: int | None, max_context: int
                       ) -> tuple[Int[np.ndarray, "n t"], Bool[np.ndarray, "n t"]]:
    """One game per env: token ids (right-padded with 0) and a mask on the answer tokens."""
    rows, masks = [], []
    for env, seed in zip(envs, seeds):
        obs, info = env.reset(seed=int(seed))
        toks = ([bos_id] if bos_id is not None else []) + tokenizer.encode(obs).ids
        mask = [False] * len(toks)
        while True:
            legal = info.get("legal_actions")
            if not legal:
                raise ValueError(f"format warm-up: {type(env).__name__} gives no info['legal_actions'] to draw "
                                 "random legal moves from; pass --format-warmup-steps 0 for such environments")
            move = legal[int(rng.integers(len(legal)))]
            text = env.canonical_action_text(move) if hasattr(env, "canonical_action_text") else str(move)
            answer = tokenizer.encode(text, add_special_tokens=False).ids + [eos_id]
            if len(toks) + len(answer) > max_context:
                break
            toks += answer
            mask += [True] * len(answer)
            obs, _, terminated, truncated, info = env.step(text)
            if terminated or truncated:
                break
            obs_ids = tokenizer.encode(obs).ids
            if len(toks) + len(obs_ids) + 1 > max_context:  # no room for another answer
                break
            toks += obs_ids
            mask += [False] * len(obs_ids)
        rows.append(toks)
        masks.append(mask)
    width = max(len(r) for r in rows)
    tokens = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    loss_mask = np.array([m + [False] * (width - len(m)) for m in masks], bool)
    return tokens, loss_mask
