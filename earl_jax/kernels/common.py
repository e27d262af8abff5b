"""What every kernel here shares: the Triton compiler parameters, and the shape rules of Triton blocks."""

from __future__ import annotations

from jax.experimental import pallas as pl


def compiler_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """`pallas_call` keyword arguments for the Triton lowering (none under the interpreter)."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltr
    return {"compiler_params": pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def pow2_at_least(n: int, floor: int = 16) -> int:
    """Triton blocks are powers of two, and its dot wants every side >= 16."""
    return max(floor, pl.next_power_of_2(n))


def largest_divisor(n: int, candidates: tuple[int, ...]) -> int | None:
    """The largest candidate dividing n (candidates in any order), or None."""
    fits = [c for c in candidates if n % c == 0]
    return max(fits) if fits else None
