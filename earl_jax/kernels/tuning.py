"""Launch parameters of the decode kernels per shape, and which backend runs each op, as measured on GPU.

`plan(cfg, batch, cache_len, impl)` answers for one decode program: for each matmul of a layer (q/k/v, out,
gate/up, down) and for the logits, a `LinearConfig` (Pallas) or None (XLA's dot), and the attention's launch
(None: XLA's). impl "pallas" runs every op in Pallas where a launch exists (the measured launch where there is
one); "auto" runs an op in Pallas only where it was measured faster than XLA at that shape (nearest measured
batch). The measurements come from experiments/benchmarks/bench_decode_ops.py, whose tuning JSON either
fills MEASURED below or, for a sweep followed by a benchmark in one device call, is read from the file named
by the environment variable EARL_DECODE_TUNING.
"""

from __future__ import annotations

import dataclasses
import json
import os

from earl_jax.kernels.decode_attention import block_size, num_splits
from earl_jax.kernels.linear import LinearConfig, default_config, fit_smem
from earl_jax.models.config import ModelConfig

OPS = ("qkv", "out", "gate_up", "down", "logits")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    block: int
    splits: int
    warps: int = 4
    stages: int = 2


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Per op: a Pallas launch, or None for XLA. Hashable: the decode program is traced from it."""
    qkv: LinearConfig | None
    out: LinearConfig | None
    gate_up: LinearConfig | None
    down: LinearConfig | None
    logits: LinearConfig | None
    attention: AttentionConfig | None
    interpret: bool = False

    def describe(self) -> str:
        ops = " ".join(f"{op}={'xla' if getattr(self, op) is None else 'pallas'}" for op in OPS)
        att = self.attention
        return ops + (" attention=xla" if att is None else f" attention=pallas(block {att.block}, splits {att.splits})")


def op_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, bool]]:
    """(K, N, swiglu) of each matmul of the decode step (N = output width)."""
    d, h = cfg.hidden_size, cfg.dim_per_head
    heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
    return {"qkv": (d, heads * h, False), "out": (cfg.num_attention_heads * h, d, False),
            "gate_up": (d, cfg.intermediate_size, True), "down": (cfg.intermediate_size, d, False),
            "logits": (d, cfg.vocab_size, False)}


# op -> {(K, N, batch): (Pallas launch, Pallas us, XLA us)}, measured on one H200 (jax 0.11).
MEASURED: dict[str, dict[tuple[int, int, int], tuple[LinearConfig, float, float]]] = {op: {} for op in OPS}
# (kv heads, head dim, batch, cache length) -> (launch or None for XLA, Pallas us, XLA us)
MEASURED_ATTENTION: dict[tuple[int, int, int, int], tuple[AttentionConfig | None, float, float]] = {}


def load_tuning(path: str) -> None:
    """Add a tuning JSON of bench_decode_ops.py to the measured tables (later entries win)."""
    data = json.loads(open(path).read())
    for op, rows in data.get("linear", {}).items():
        for k, n, batch, launch, us, xla_us in rows:
            MEASURED[op][k, n, batch] = (LinearConfig(**launch), us, xla_us)
    for kv, h, batch, s, launch, us, xla_us in data.get("attention", []):
        MEASURED_ATTENTION[kv, h, batch, s] = (None if launch is None else AttentionConfig(**launch), us, xla_us)


if os.environ.get("EARL_DECODE_TUNING"):
    load_tuning(os.environ["EARL_DECODE_TUNING"])


def _measured(op: str, k: int, n: int, batch: int):
    rows = [(abs(b - batch), v) for (kk, nn, b), v in MEASURED[op].items() if (kk, nn) == (k, n)]
    return min(rows, key=lambda r: r[0])[1] if rows else None


def linear_plan(op: str, k: int, n: int, batch: int, swiglu: bool, impl: str) -> LinearConfig | None:
    found = _measured(op, k, n, batch)
    if found is None:
        return None if impl == "auto" else default_config(batch, k, n, swiglu)
    launch, us, xla_us = found
    if impl == "auto" and us >= xla_us:
        return None
    return fit_smem(dataclasses.replace(launch, bm=min(launch.bm, default_config(batch, k, n).bm)), swiglu)


def attention_plan(kv: int, h: int, batch: int, cache_len: int, impl: str) -> AttentionConfig | None:
    block = block_size(cache_len)
    found = MEASURED_ATTENTION.get((kv, h, batch, cache_len))
    if found is not None and (found[0] is not None or impl == "auto"):
        launch, us, xla_us = found
        if launch is None or (impl == "auto" and us >= xla_us):
            return None
        return launch
    return AttentionConfig(block, num_splits(batch, kv, cache_len, block))


def plan(cfg: ModelConfig, batch: int, cache_len: int, impl: str = "pallas", interpret: bool = False) -> DecodePlan:
    """The decode program's plan (impl "pallas": every op in Pallas; "auto": where measured faster)."""
    if impl not in ("pallas", "auto"):
        raise ValueError(f"decode plan: impl must be 'pallas' or 'auto', got {impl!r}")
    if block_size(cache_len) is None:
        raise ValueError(f"decode plan: cache length {cache_len} has no block of 16..128 slots")
    linears = {op: linear_plan(op, k, n, batch, sw, impl) for op, (k, n, sw) in op_shapes(cfg).items()}
    att = attention_plan(cfg.num_key_value_heads, cfg.dim_per_head, batch, cache_len, impl)
    return DecodePlan(**linears, attention=att, interpret=interpret)
