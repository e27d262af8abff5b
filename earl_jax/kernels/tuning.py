"""Launch parameters of the decode kernels per shape, and which backend runs each op, as measured on GPU.

`plan(cfg, batch, cache_len, impl)` answers for one decode program: for each matmul of a layer (q/k/v, out,
gate/up, down) and for the logits, a `LinearConfig` (Pallas) or None (XLA's dot), and the attention's launch
(None: XLA's). impl "pallas" runs every op in Pallas where a launch exists (the measured launch where there is
one); "auto" runs a matmul in Pallas only where the sweep measured it at least 1/AUTO_MARGIN times faster than
XLA at that shape (nearest measured batch), and the attention in Pallas. The margin: in the decode step at 0.5B
b32 the kernels the sweep had 10-20% ahead (q/k/v, out, gate/up) made the step slower than the XLA path's
(1.262 vs 1.191 ms), so a sweep lead that small is not taken. The attention kernel reads each row's valid prefix
at the copy bandwidth (3.6-4.3 TB/s at 16K contexts, half the time of XLA's pass over the bucketed cache),
hence Pallas wherever it applies. Measurements: experiments/benchmarks/bench_decode_ops.py (one H200,
experiments/results/bench_decode_ops_nvidia_h200.json); a sweep's tuning JSON can also be loaded from the file
named by the environment variable EARL_DECODE_TUNING (a sweep and a benchmark in one device call).
"""

from __future__ import annotations

import dataclasses
import json
import os

from earl_jax.kernels.decode_attention import block_size, num_splits
from earl_jax.kernels.linear import LinearConfig, default_config, fit_smem
from earl_jax.models.model_config import ModelConfig

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


AUTO_MARGIN = 0.8

# op -> {(K, N, batch): (fastest Pallas launch, its us, XLA's us)}: one op over distinct weight copies, one H200
# (jax 0.11.2), experiments/benchmarks/bench_decode_ops.py.
MEASURED: dict[str, dict[tuple[int, int, int], tuple[LinearConfig, float, float]]] = {op: {} for op in OPS}
for (_op, _k, _n, _b), _v in {
    ("qkv", 896, 1152, 32): (LinearConfig(32, 16, 128, 4, 3), 11.8, 15.2),
    ("out", 896, 896, 32): (LinearConfig(32, 128, 64, 4, 3), 13.4, 14.6),
    ("gate_up", 896, 4864, 32): (LinearConfig(32, 64, 128, 4, 3), 19.2, 23.3),
    ("down", 4864, 896, 32): (LinearConfig(32, 16, 128, 4, 3), 18.2, 10.0),
    ("logits", 896, 151936, 32): (LinearConfig(32, 64, 128, 4, 3), 78.6, 78.1),
    ("qkv", 896, 1152, 128): (LinearConfig(128, 64, 128, 4, 3), 12.4, 19.4),
    ("out", 896, 896, 128): (LinearConfig(128, 64, 128, 4, 3), 8.3, 8.6),
    ("gate_up", 896, 4864, 128): (LinearConfig(128, 64, 128, 4, 3), 17.8, 16.2),
    ("down", 4864, 896, 128): (LinearConfig(128, 16, 128, 4, 3), 22.0, 38.0),
    ("logits", 896, 151936, 128): (LinearConfig(128, 128, 64, 4, 3), 106.6, 95.6),
    ("qkv", 3584, 4608, 32): (LinearConfig(32, 64, 128, 4, 3), 48.9, 24.2),
    ("out", 3584, 3584, 32): (LinearConfig(32, 16, 128, 4, 3), 16.9, 15.0),
    ("gate_up", 3584, 18944, 32): (LinearConfig(32, 128, 64, 4, 3), 112.8, 76.1),
    ("down", 18944, 3584, 32): (LinearConfig(32, 16, 128, 4, 3), 74.4, 47.8),
    ("logits", 3584, 152064, 32): (LinearConfig(32, 128, 128, 4, 3), 270.0, 264.2),
    ("qkv", 3584, 4608, 128): (LinearConfig(128, 64, 128, 4, 3), 35.6, 29.4),
    ("out", 3584, 3584, 128): (LinearConfig(128, 32, 128, 4, 3), 19.7, 27.2),
    ("gate_up", 3584, 18944, 128): (LinearConfig(128, 64, 128, 4, 3), 139.2, 93.9),
    ("down", 18944, 3584, 128): (LinearConfig(128, 32, 128, 4, 3), 88.3, 56.8),
    ("logits", 3584, 152064, 128): (LinearConfig(128, 128, 64, 4, 3), 314.0, 303.5),
}.items():
    MEASURED[_op][_k, _n, _b] = _v
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
    if impl == "auto" and us >= AUTO_MARGIN * xla_us:
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
    if cache_len <= 2048 and cache_len % 64 == 0:  # short caches: 64-slot blocks, 3 stages (sweep: 7.9 vs 10.3 us)
        return AttentionConfig(64, 1, 4, 3)
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
