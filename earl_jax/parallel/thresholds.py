"""Direct per-stage layouts by context length: '0:d8f1t1,1024:d4f1t2' (context:mesh), EARL's thresholds as a flag."""

from __future__ import annotations

from earl_jax.sharding.mesh import MeshShape


def parse_thresholds(text: str) -> list[tuple[int, MeshShape]]:
    """'0:d8f1t1,1024:d4f1t2' -> [(0, d8f1t1), (1024, d4f1t2)] (the selector sorts them)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            ctx, mesh = item.split(":")
            out.append((int(ctx), MeshShape.parse(mesh)))
        except ValueError:
            raise ValueError(f"{item!r} is not CONTEXT:MESH such as 1024:d4f1t2") from None
    return out
