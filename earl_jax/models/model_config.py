"""Qwen2-family model configuration with named presets that match the Hugging Face configs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer of the Qwen2 family (Qwen2 / Qwen2.5, 0.5B-72B).

    Field names follow Hugging Face's `Qwen2Config` where one exists, so `from_hf_dict` is a rename.
    """

    vocab_size: int
    hidden_size: int  # d_model ("embed" axis)
    intermediate_size: int  # SwiGLU width ("mlp" axis)
    num_hidden_layers: int
    num_attention_heads: int  # query heads ("heads" axis)
    num_key_value_heads: int  # GQA groups ("kv_heads" axis); == num_attention_heads for MHA
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = True  # Qwen2 puts a bias on q, k, v (not on o)
    max_position_embeddings: int = 32_768
    name: str = "custom"

    def __post_init__(self):
        def fail(msg: str):
            raise ValueError(f"ModelConfig({self.name}): {msg}")

        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads"):
            if getattr(self, f) <= 0:
                fail(f"{f} must be positive, got {getattr(self, f)}")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                 f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            fail(f"hidden_size={self.hidden_size} not divisible by num_attention_heads={self.num_attention_heads}")
        if self.dim_per_head % 2:
            fail(f"head_dim={self.dim_per_head} must be even for RoPE")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def num_params(self) -> int:
        """Exact parameter count (embedding counted once when tied)."""
        d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.dim_per_head
        nq, nkv = self.num_attention_heads, self.num_key_value_heads
        attn = d * nq * h + 2 * d * nkv * h + nq * h * d
        if self.attention_bias:
            attn += nq * h + 2 * nkv * h
        layer = attn + 3 * d * f + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer + d

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token occupies over all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.dim_per_head * dtype_bytes

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- Hugging Face interop ------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "hf") -> "ModelConfig":
        if d.get("model_type", "qwen2") not in ("qwen2",):
            raise ValueError(f"unsupported model_type {d.get('model_type')!r}: earl-jax implements qwen2")
        keys = {f.name for f in dataclasses.fields(cls)} - {"name", "attention_bias"}
        kw = {k: d[k] for k in keys if k in d and d[k] is not None}
        return cls(**kw, name=name)

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        return cls.from_hf_dict(json.loads(path.read_text()), name=path.parent.name or "hf")

    def to_hf_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("name"), d.pop("attention_bias")
        if d["head_dim"] is None:
            d.pop("head_dim")
        return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", **d}

    # ---- presets (numbers from the Hugging Face config.json of each Qwen2.5 model) ------------
    @classmethod
    def tiny(cls, vocab_size: int = 64) -> "ModelConfig":
        """CPU-sized default: trains Connect Four on two cores."""
        return cls(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0,
                   tie_word_embeddings=True, max_position_embeddings=4096, name="tiny")

    @classmethod
    def nano(cls, vocab_size: int = 64) -> "ModelConfig":
        """~21K parameters (2 x 32): the shape of tests and smoke runs, whose steps cost ~1/6 of the tiny model's;
        the tiny model's heads (4, 2 of keys and values), so the same meshes shard it."""
        return cls(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0,
                   tie_word_embeddings=True, max_position_embeddings=4096, name="nano")

    @classmethod
    def small(cls, vocab_size: int = 64) -> "ModelConfig":
        """~5M parameters (6 x 256): on one GPU a decode step of the tiny model is launch-bound, so this one costs
        about as much an iteration with 6x the parameters (the model-size question of docs/learning.md)."""
        return cls(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=4, rope_theta=10_000.0,
                   tie_word_embeddings=True, max_position_embeddings=4096, name="small")

    @classmethod
    def qwen2p5_0p5b(cls) -> "ModelConfig":
        return cls(151936, 896, 4864, 24, 14, 2, tie_word_embeddings=True, name="qwen2.5-0.5b")

    @classmethod
    def qwen2p5_1p5b(cls) -> "ModelConfig":
        return cls(151936, 1536, 8960, 28, 12, 2, tie_word_embeddings=True, name="qwen2.5-1.5b")

    @classmethod
    def qwen2p5_3b(cls) -> "ModelConfig":
        return cls(151936, 2048, 11008, 36, 16, 2, tie_word_embeddings=True, name="qwen2.5-3b")

    @classmethod
    def qwen2p5_7b(cls) -> "ModelConfig":
        return cls(152064, 3584, 18944, 28, 28, 4, name="qwen2.5-7b")

    @classmethod
    def qwen2p5_14b(cls) -> "ModelConfig":
        return cls(152064, 5120, 13824, 48, 40, 8, rms_norm_eps=1e-5, name="qwen2.5-14b")

    @classmethod
    def qwen2p5_32b(cls) -> "ModelConfig":
        return cls(152064, 5120, 27648, 64, 40, 8, rms_norm_eps=1e-5, name="qwen2.5-32b")

    @classmethod
    def qwen2p5_72b(cls) -> "ModelConfig":
        return cls(152064, 8192, 29568, 80, 64, 8, rms_norm_eps=1e-5, name="qwen2.5-72b")


PRESETS = {
    "nano": ModelConfig.nano,
    "tiny": ModelConfig.tiny,
    "small": ModelConfig.small,
    "qwen2.5-0.5b": ModelConfig.qwen2p5_0p5b,
    "qwen2.5-1.5b": ModelConfig.qwen2p5_1p5b,
    "qwen2.5-3b": ModelConfig.qwen2p5_3b,
    "qwen2.5-7b": ModelConfig.qwen2p5_7b,
    "qwen2.5-14b": ModelConfig.qwen2p5_14b,
    "qwen2.5-32b": ModelConfig.qwen2p5_32b,
    "qwen2.5-72b": ModelConfig.qwen2p5_72b,
}


def get_config(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]().replace(**overrides) if overrides else PRESETS[name]()
