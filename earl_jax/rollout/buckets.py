"""Length buckets: the few sizes that rows, caches and widths are rounded up to, so compiled programs stay few.

The sampler (new-token counts, cache sizes, generation lengths), the memory model (the cache a context
occupies) and the experience and train stages (batch widths) all round with `bucket`; none of them needs the
others to do it.
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np
from jaxtyping import Bool, Int

# An extend (a prompt's prefill, a turn's observation) longer than this runs through the layer stack in chunks of
# this many positions: its activations are a chunk's, not the whole prompt's (a 16K-token prompt at batch 32 asked
# 70 GiB of one H200 in one piece, for a 1.5B model). The memory model prices the same chunks.
PREFILL_CHUNK = 1024
DEFAULT_LENGTH_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_CACHE_BUCKETS = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384,
                         24576, 32768)


def geometric_cache_buckets(growth: float, top: int = 1 << 17) -> tuple[int, ...]:
    """Cache sizes 128 x growth, 128 x growth^2, ... (multiples of 128) up to `top`: growth 4 walks a game to
    2048 tokens through 2 sizes (512, 2048) where DEFAULT_CACHE_BUCKETS takes 7 (128 ... 1536), so fewer
    decode programs compile, while a row's attention reads up to 4x its context instead of 1.5x."""
    if growth < 1.5:
        raise ValueError(f"cache bucket growth must be >= 1.5, got {growth}")
    out = [-(-int(128 * growth) // 128) * 128]
    while out[-1] < top:
        out.append(-(-int(out[-1] * growth) // 128) * 128)
    return tuple(out)


def bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; past the largest, the next multiple of the largest."""
    i = bisect.bisect_left(buckets, n)
    if i < len(buckets):
        return buckets[i]
    top = buckets[-1]
    return -(-n // top) * top


def scored_spans(loss_mask: Bool[np.ndarray, "n t"]) -> Int[np.ndarray, " n"]:
    """Each row's length up to and including its last scored token (0: none). A game's last observation (the
    result) is never scored, and with causal attention the tokens after a row's last scored one change nothing
    before it: experience and train group and cut rows by these spans, not by the games' lengths."""
    mask = np.asarray(loss_mask, bool)
    return np.where(mask.any(1), mask.shape[1] - np.argmax(mask[:, ::-1], axis=1), 0)
