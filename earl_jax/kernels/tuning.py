"""Launch parameters of the decode kernels per shape, and which backend runs each op, as measured on GPU.

`plan(cfg, batch, cache_len, impl)` answers for one decode program: for each matmul of a layer (q/k/v, out,
gate/up, down) and for the logits, a `LinearConfig` (Pallas) or None (XLA's dot), and the attention's
launch. impl "pallas" runs every matmul in Pallas where a launch exists; "auto" only where MEASURED says
Pallas was faster at that shape. MEASURED is filled from experiments/benchmarks/bench_decode_ops.py
(its JSON in experiments/results/): op -> {(K, N, batch): (LinearConfig, pallas_us, xla_us)}.
"""

from __future__ import annotations

import dataclasses

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
    """Per op: a Pallas launch, or None for XLA's dot. Hashable: the decode program is traced from it."""
    qkv: LinearConfig | None
    out: LinearConfig | None
    gate_up: LinearConfig | None
    down: LinearConfig | None
    logits: LinearConfig | None
    attention: AttentionConfig
    interpret: bool = False

    def describe(self) -> str:
        ops = " ".join(f"{op}={'xla' if getattr(self, op) is None else 'pallas'}" for op in OPS)
        return f"{ops} attention(block {self.attention.block}, splits {self.attention.splits})"


def op_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, bool]]:
    """(K, N, swiglu) of each matmul of the decode step (N = output width)."""
    d, h = cfg.hidden_size, cfg.dim_per_head
    heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
    return {"qkv": (d, heads * h, False), "out": (cfg.num_attention_heads * h, d, False),
            "gate_up": (d, cfg.intermediate_size, True), "down": (cfg.intermediate_size, d, False),
            "logits": (d, cfg.vocab_size, False)}


# Measured on one H200 (jax 0.11): op -> {(K, N, batch): (launch, Pallas us, XLA us)}; batch is the decode
# batch the launch was timed at (other batches take the nearest measured one).
MEASURED: dict[str, dict[tuple[int, int, int], tuple[LinearConfig, float, float]]] = {op: {} for op in OPS}


def _measured(op: str, k: int, n: int, batch: int):
    rows = [(abs(b - batch), v) for (kk, nn, b), v in MEASURED[op].items() if (kk, nn) == (k, n)]
    return min(rows, key=lambda r: r[0])[1] if rows else None


def linear_plan(op: str, k: int, n: int, batch: int, swiglu: bool, impl: str) -> LinearConfig | None:
    found = _measured(op, k, n, batch)
    if impl == "auto":
        if found is None or found[1] >= found[2]:
            return None
        return fit_smem(dataclasses.replace(found[0], bm=min(found[0].bm, default_config(batch, k, n).bm)), swiglu)
    if found is not None:
        return fit_smem(dataclasses.replace(found[0], bm=min(found[0].bm, default_config(batch, k, n).bm)), swiglu)
    return default_config(batch, k, n, swiglu)


def plan(cfg: ModelConfig, batch: int, cache_len: int, impl: str = "pallas", interpret: bool = False) -> DecodePlan:
    """The decode program's plan (impl "pallas": every matmul in Pallas; "auto": where measured faster)."""
    if impl not in ("pallas", "auto"):
        raise ValueError(f"decode plan: impl must be 'pallas' or 'auto', got {impl!r}")
    block = block_size(cache_len)
    if block is None:
        raise ValueError(f"decode plan: cache length {cache_len} has no block of 16..128 slots")
    linears = {op: linear_plan(op, k, n, batch, sw, impl) for op, (k, n, sw) in op_shapes(cfg).items()}
    splits = num_splits(batch, cfg.num_key_value_heads, cache_len, block)
    return DecodePlan(**linears, attention=AttentionConfig(block, splits), interpret=interpret)
