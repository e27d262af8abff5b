"""Per-device memory model of each stage under a candidate mesh, and the candidate meshes themselves.

Everything here is arithmetic on a `ModelConfig` (no arrays are allocated), so a 72B model on 64
devices is as cheap to plan as the tiny one.

What is counted (bytes per device; "shard" follows the same rule as `mesh.logical_to_spec`: a
dimension is split over its mesh axis only when the axis size divides it, otherwise it is replicated):

* parameters - every weight of the Qwen2 decoder with its logical axes, read from the abstract model
  (`param_groups`): inference stages hold them in bf16 (`param_bytes_inference`), sharded over
  `tensor` along vocab / heads / kv_heads / mlp, replicated along embed (norm scales, biases and the
  embed dimension are replicated: small, but counted). The experience stage holds
  `experience_models` copies (reference + old policy). Training holds the fp32 master weights, fp32
  gradients and the two fp32 AdamW moments (`train_state_bytes_per_param` = 16), sharded over
  `fsdp` along embed and over `tensor` as above; with fsdp > 1 it also holds the bf16 all-gather
  buffers of two layers (current + prefetched) and of the embedding.
* KV cache (rollout) - responses of one data shard x context x kv bytes per token, divided by the
  tensor degree when it divides `num_key_value_heads`. When tensor > kv heads the kv_heads axis is
  not divisible and `logical_to_spec` replicates the whole cache on every tensor rank.
* activations - rollout: one prefill chunk's per-layer workspace (hidden, q/k/v, MLP) plus the
  attention scores of that chunk against the whole cache (float32, the cached attention materializes
  them) plus the decode logits (with --rollout.drafts K: K + 1 positions a row, their layer workspace and
  scores too); experience: one layer's forward workspace for a micro-batch at full context plus the final
  hidden states; train: with per-layer rematerialization the saved layer inputs
  (layers x micro-batch x context x embed, bf16) plus one layer's forward+backward working set.
  Attention scores are full (micro-batch x heads/tensor x q x kv, fp32) unless `attn_q_block` says the
  attention kernel works in query blocks (flash / cuDNN). A rollout extend's scores are full up to
  `EXTEND_SCORES_BYTES` per device and query-blocked past it (`extend_query_block`, the model's own rule).
* logits chunk - micro-batch x chunk x vocab / tensor x 4 bytes, times 2 in experience (logits and
  log-softmax) and 3 in training (logits, softmax, gradient).
* `reserve_bytes` for what is not modeled (XLA scratch, CUDA context, fragmentation).

A stage is priced by its registered memory kind (sharding/stage_registry.py): decode as the rollout, score as
experience, update as training. A candidate fits when total <= budget x safety_fraction.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Iterator

import jax

from earl_jax.models.attention import Q_BLOCK, extend_query_block
from earl_jax.models.model_config import ModelConfig
from earl_jax.parallel.plan import RolloutExtends
from earl_jax.rollout.buckets import PREFILL_CHUNK, bucket
from earl_jax.sharding.mesh import MeshShape, logical_to_spec
from earl_jax.sharding.stage_registry import names_of, stage_names, stage_spec

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_CPU_BUDGET = 4 * GiB


def device_memory_stats(device: jax.Device) -> dict:
    """`device.memory_stats()`, or {} where the backend reports nothing (CPU)."""
    try:
        return device.memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        return {}


def device_memory_budget(device: jax.Device | None = None, default_bytes: int = DEFAULT_CPU_BUDGET) -> int:
    """Bytes one device may use: `memory_stats()["bytes_limit"]` where the backend reports it (GPU,
    TPU), else `default_bytes` (CPU reports nothing)."""
    stats = device_memory_stats(device if device is not None else jax.local_devices()[0])
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return int(default_bytes)


# ---- candidates ---------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tensor_degree(cfg: ModelConfig, tensor: int) -> bool:
    """Tensor degree t is valid when it divides the query heads, and either divides the kv heads or is a
    multiple of them (then kv heads are replicated, see the module docstring). Qwen2.5-72B (64 q / 8 kv)
    takes t in {1, 2, 4, 8, ...}; 0.5B (14 / 2) takes {1, 2, 7, 14}."""
    q, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    return tensor >= 1 and q % tensor == 0 and (kv % tensor == 0 or tensor % kv == 0)


def mesh_problem(cfg: ModelConfig, num_devices: int, stage: str, mesh: MeshShape) -> str | None:
    """Why `mesh` is not a valid `stage` mesh of `cfg` over `num_devices` (None: it is one of
    `candidate_meshes`). A vocabulary the tensor degree does not divide is no problem: it is replicated
    (the game tokenizer's 101 tokens always are), and the memory model counts it so."""
    q, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if mesh.size != num_devices:
        return f"uses {mesh.size} devices; the job has {num_devices}"
    if not stage_spec(stage).updates_weights and mesh.fsdp != 1:
        updating = [s for s in stage_names() if stage_spec(s).updates_weights]
        others = [s for s in stage_names() if s not in updating]
        return (f"has fsdp={mesh.fsdp}; only {names_of(updating)} meshes have an fsdp axis ({names_of(others)}: "
                "dAf1tC)")
    if q % mesh.tensor:
        return f"has tensor={mesh.tensor}, which does not divide {cfg.name}'s {q} attention heads"
    if not valid_tensor_degree(cfg, mesh.tensor):
        return (f"has tensor={mesh.tensor}, which neither divides {cfg.name}'s {kv} key/value heads nor is a "
                "multiple of them")
    return None


def candidate_meshes(cfg: ModelConfig, num_devices: int, stage: str) -> list[MeshShape]:
    """All mesh shapes over exactly `num_devices` valid for `cfg` and `stage`: rollout / experience are
    data x tensor (fsdp = 1); a stage that updates weights (train, sft) is data x fsdp x tensor. Sorted by (tensor,
    fsdp)."""
    updates = stage_spec(stage).updates_weights
    out = []
    for t in divisors(num_devices):
        if not valid_tensor_degree(cfg, t):
            continue
        rest = num_devices // t
        fsdps = divisors(rest) if updates else [1]
        out.extend(MeshShape(rest // f, f, t) for f in fsdps)
    return sorted(out, key=lambda m: (m.tensor, m.fsdp))


# ---- parameters ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ParamGroup:
    name: str  # the parameter's path, "layers/*/..." for the decoder layers
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    count: int = 1  # how many such tensors (decoder layers)

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.count

    @property
    def per_layer(self) -> bool:
        return self.name.startswith("layers/")


@functools.lru_cache(maxsize=64)
def param_groups(cfg: ModelConfig) -> tuple[ParamGroup, ...]:
    """The decoder's parameters, read from the abstract model (shapes and logical axes, no memory).

    Built with one decoder layer (every layer has the same parameters), its groups counted
    num_hidden_layers times: an abstract 80-layer 72B model takes seconds to trace, one layer milliseconds."""
    from flax import nnx

    from earl_jax.models.init import abstract_model

    state = nnx.state(abstract_model(cfg.replace(num_hidden_layers=1)), nnx.Param)
    out = []
    for path, var in nnx.to_flat_state(state):
        in_layer = path[0] == "layers"
        name = "/".join("*" if in_layer and i == 1 else str(k) for i, k in enumerate(path))
        shape = tuple(var.get_value().shape)
        axes = var.get_metadata().get("logical_axes") or (None,) * len(shape)
        out.append(ParamGroup(name, shape, tuple(axes), cfg.num_hidden_layers if in_layer else 1))
    return tuple(out)


def _fake_mesh(mesh: MeshShape):
    return types.SimpleNamespace(shape={"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor})


def shard_factor(shape, axes, stage: str, mesh: MeshShape) -> int:
    """How many ways a tensor is split under the stage's rules (replicated dimensions count 1)."""
    fake = _fake_mesh(mesh)
    spec = logical_to_spec(axes, stage_spec(stage).rules, fake, shape)
    factor = 1
    for entry in spec:
        for a in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
            factor *= fake.shape[a]
    return factor


@functools.lru_cache(maxsize=4096)
def params_per_device(cfg: ModelConfig, stage: str, mesh: MeshShape) -> float:
    """Parameter elements one device holds (exact: a split dimension divides evenly by construction)."""
    return sum(p.numel / shard_factor(p.shape, p.axes, stage, mesh) for p in param_groups(cfg))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_down(n: int) -> list[int]:
    """n, then the powers of two below n, descending (n itself first even when not a power of two)."""
    out = [n] if n >= 1 else []
    p = 1 << (max(n, 1).bit_length() - 1)
    if p == n:
        p //= 2
    while p >= 1:
        out.append(p)
        p //= 2
    return out


# ---- the model ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    budget_bytes: int | None = None  # per device; None -> device_memory_budget()
    safety_fraction: float = 0.9
    reserve_bytes: int = 512 * MiB
    param_bytes_inference: int = 2  # bf16
    train_state_bytes_per_param: int = 16  # fp32 master + fp32 grad + 2 fp32 AdamW moments
    resident_bytes_per_param: int = 12  # fp32 master + 2 AdamW moments stay resident through rollout / experience
    compute_bytes: int = 2  # bf16 activations
    kv_cache_bytes: int = 2
    experience_models: int = 2  # reference + old policy resident together
    prefill_len: int = 256  # rollout tokens prefilled per step before any rollout was measured
    prefill_chunk: int = PREFILL_CHUNK  # the sampler's: a wider extend runs in chunks of this many positions
    cache_buckets: tuple[int, ...] | None = None  # the sampler's cache sizes when not its default: KV at the bucket
    draft_tokens: int = 0  # --rollout.drafts K: a drafted decode step runs K + 1 positions a row (logits for each)
    kv_positions: int = 0  # a paged cache's positions (--rollout.kv-pages x --rollout.page-size); 0: contiguous rows
    # models/attention.py never materializes [t, t] scores: query blocks of Q_BLOCK (CPU), cuDNN flash (GPU)
    attn_q_block: int | None = Q_BLOCK  # None: full attention scores materialized
    remat: bool = True  # per-layer activation checkpointing in training
    min_logprob_chunk: int = 128
    max_logprob_chunk: int | None = None  # user cap on the chunk (RLConfig.logprob_chunk)
    max_micro_batch_tokens: int | None = None  # user cap: tokens per batch shard in one micro-batch

    def __post_init__(self):
        if not 0 < self.safety_fraction <= 1:
            raise ValueError(f"safety_fraction must be in (0, 1], got {self.safety_fraction}")
        for name in ("max_logprob_chunk", "max_micro_batch_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device, by component."""

    stage: str
    mesh: MeshShape
    context_len: int
    micro_batch: int
    logprob_chunk: int
    params: int  # weights (inference) / master weights + grads + optimizer state (train)
    gather: int  # fsdp all-gather buffers (train)
    kv_cache: int
    activations: int
    logits: int
    reserve: int
    resident: int = 0  # the train state that stays on the devices while rollout / experience run

    @property
    def total(self) -> int:
        return self.params + self.gather + self.kv_cache + self.activations + self.logits + self.reserve + self.resident

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["mesh"], d["total"] = str(self.mesh), self.total
        return d

    def describe(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k) / GiB:.2f}" for k in
                          ("params", "gather", "kv_cache", "activations", "logits", "reserve", "resident"))
        return (f"{self.stage} {self.mesh} ctx {self.context_len} mb {self.micro_batch} chunk "
                f"{self.logprob_chunk}: {self.total / GiB:.2f} GiB ({parts} GiB)")


@dataclasses.dataclass(frozen=True)
class Fit:
    """Micro-batch and log-prob chunk chosen for a stage / mesh / context, with its estimate (None for
    rollout, which has neither)."""

    micro_batch: int | None
    logprob_chunk: int | None
    estimate: MemoryEstimate


class MemoryModel:
    def __init__(self, cfg: ModelConfig, memory: MemoryConfig | None = None):
        self.cfg = cfg
        self.mem = memory or MemoryConfig()
        self._budget = self.mem.budget_bytes
        # bytes another stage keeps resident beside rollout / experience (the selector sets the train
        # state of its train layout; 0: those stages are planned alone, as in profiling)
        self.resident_bytes = 0

    @property
    def budget_bytes(self) -> int:
        if self._budget is None:
            self._budget = device_memory_budget()
        return self._budget

    @property
    def usable_bytes(self) -> int:
        return int(self.budget_bytes * self.mem.safety_fraction)

    # -- per-device sizes of the tensor-parallel pieces ------------------------------------------
    def _div(self, n: int, t: int) -> float:
        """n split over t ranks when t divides n, else replicated (the logical_to_spec rule)."""
        return n / t if n % t == 0 else n

    def kv_heads_per_device(self, tensor: int) -> float:
        kv = self.cfg.num_key_value_heads
        return kv / tensor if kv % tensor == 0 else float(kv)

    def kv_bytes_per_token_per_device(self, tensor: int) -> float:
        c = self.cfg
        return 2 * c.num_hidden_layers * self.kv_heads_per_device(tensor) * c.dim_per_head * self.mem.kv_cache_bytes

    def _layer_workspace(self, tokens: int, tensor: int) -> float:
        """One layer's forward activations for `tokens` tokens (bf16): residual, normed input, q, k, v,
        attention output, o-projection, gate, up, silu(gate)*up."""
        c, b = self.cfg, self.mem.compute_bytes
        hd = c.dim_per_head
        q = self._div(c.num_attention_heads, tensor) * hd
        kv = self.kv_heads_per_device(tensor) * hd
        mlp = self._div(c.intermediate_size, tensor)
        return tokens * b * (3 * c.hidden_size + 2 * q + 2 * kv + 3 * mlp)

    def _attn_scores(self, seqs: int, q_len: int, kv_len: int, tensor: int, blocked: bool = True) -> float:
        q_len = q_len if self.mem.attn_q_block is None or not blocked else min(q_len, self.mem.attn_q_block)
        # scores + probabilities, float32
        return 2 * seqs * self._div(self.cfg.num_attention_heads, tensor) * q_len * kv_len * 4

    def _extend_scores(self, seqs: int, q_len: int, kv_len: int, tensor: int) -> float:
        """A rollout extend's attention over its cache: query-blocked only past a per-device size, by the rule the
        model itself follows (models/attention.extend_query_block)."""
        heads = math.ceil(self._div(self.cfg.num_attention_heads, tensor))
        block = extend_query_block(int(seqs), heads, int(q_len), int(kv_len))
        return self._attn_scores(seqs, block, kv_len, tensor, blocked=False)

    def _vocab_dev(self, tensor: int) -> float:
        return self._div(self.cfg.vocab_size, tensor)

    def _layer_params(self, stage: str, mesh: MeshShape, gather: bool) -> float:
        """Elements of one decoder layer on a device; with gather=True the fsdp split is undone."""
        m = MeshShape(mesh.data, 1, mesh.tensor) if gather else mesh
        total = 0.0
        for p in param_groups(self.cfg):
            if p.per_layer:
                total += math.prod(p.shape) / shard_factor(p.shape, p.axes, stage, m)
        return total

    # -- the estimate ------------------------------------------------------------------------------
    def estimate(self, stage: str, mesh: MeshShape, context_len: int, num_responses: int,
                 micro_batch: int | None = None, logprob_chunk: int | None = None,
                 extends: RolloutExtends | None = None) -> MemoryEstimate:
        """Bytes per device of `stage` on `mesh` for `num_responses` sequences of `context_len` tokens.
        `micro_batch` is the sequences one batch shard processes at once (rollout: decoded
        concurrently, default all of the shard's; experience / train: per forward(-backward), default 1);
        `logprob_chunk` the sequence chunk whose logits are materialized at once. `extends`: the rollout's
        measured extend widths (default: `prefill_len` tokens against the whole context). What is priced is the
        stage's registered memory kind (sharding/stage_registry.py)."""
        spec = stage_spec(stage)
        c, m = self.cfg, self.mem
        ctx, t = int(context_len), mesh.tensor
        shards = mesh.data * mesh.fsdp
        per_shard = _ceil_div(num_responses, shards)
        gather = kv = 0.0
        if spec.memory == "decode":
            mb = per_shard if micro_batch is None else micro_batch
            chunk = 1
            params = params_per_device(c, stage, mesh) * m.param_bytes_inference
            cached = ctx if m.cache_buckets is None else bucket(ctx, m.cache_buckets)  # coarse buckets pad more
            rows_kv = mb * cached * self.kv_bytes_per_token_per_device(t)  # every row at the context's cache size
            # a paged cache holds its pages whatever the rows, split by kv head and whole on every batch shard
            kv = m.kv_positions * self.kv_bytes_per_token_per_device(t) if m.kv_positions else rows_kv
            if extends is None:
                pre = min(m.prefill_len, ctx)
                acts = self._layer_workspace(mb * pre, t) + self._extend_scores(mb, pre, ctx, t)
            else:  # the prompt against its first cache, then each turn's observation against the whole context
                acts = max(self._layer_workspace(mb * min(w, m.prefill_chunk), t)
                           + self._extend_scores(mb, min(w, m.prefill_chunk), min(kv, ctx), t)
                           for w, kv in extends.attention(ctx))
            # Growing the cache to its next bucket copies it: the old one (at most 3/4 of the new, the cache
            # buckets' largest ratio) lives beside the new one, in a call of its own (no extend beside it).
            if m.draft_tokens:  # a drafted step: K + 1 positions a row through a layer, their scores on the cache
                k1 = 1 + m.draft_tokens
                acts = max(acts, self._layer_workspace(mb * k1, t) + self._extend_scores(mb, k1, ctx, t))
            # paged: each layer's attention reads its rows' pages gathered into the contiguous view (one layer's keys
            # and values at a time), and growing moves no position
            acts = acts + rows_kv / c.num_hidden_layers if m.kv_positions else max(acts, 0.75 * kv)
            # the step's logits (K + 1 positions a row with drafts) + the last one's gathered for sampling
            logits = mb * ((1 + m.draft_tokens) * self._vocab_dev(t) + c.vocab_size) * 4
        elif spec.memory == "score":
            mb = micro_batch or 1
            chunk = min(logprob_chunk or m.min_logprob_chunk, ctx)
            params = m.experience_models * params_per_device(c, stage, mesh) * m.param_bytes_inference
            acts = (self._layer_workspace(mb * ctx, t) + self._attn_scores(mb, ctx, ctx, t)
                    + mb * ctx * c.hidden_size * m.compute_bytes)  # final hidden states kept for the chunks
            logits = 2 * mb * chunk * self._vocab_dev(t) * 4
        else:  # "update": an update step (train, sft)
            mb = micro_batch or 1
            chunk = min(logprob_chunk or m.min_logprob_chunk, ctx)
            params = params_per_device(c, stage, mesh) * m.train_state_bytes_per_param
            if mesh.fsdp > 1:  # bf16 copies of two gathered layers + the gathered embedding
                emb = c.vocab_size * c.hidden_size / (t if c.vocab_size % t == 0 else 1)
                gather = (2 * self._layer_params(stage, mesh, True) + emb) * m.compute_bytes
            tok = mb * ctx
            layer = self._layer_workspace(tok, t) + self._attn_scores(mb, ctx, ctx, t)
            if m.remat:
                saved = c.num_hidden_layers * tok * c.hidden_size * m.compute_bytes
                acts = saved + 2 * layer  # recomputed forward + its backward
            else:
                acts = c.num_hidden_layers * layer + layer
            acts += 2 * tok * c.hidden_size * 4  # final hidden states and their gradient (fp32)
            logits = 3 * mb * chunk * self._vocab_dev(t) * 4
        resident = 0 if spec.updates_weights else self.resident_bytes
        return MemoryEstimate(stage, mesh, ctx, int(mb), int(chunk), int(params), int(gather), int(kv),
                              int(acts), int(logits), int(m.reserve_bytes), int(resident))

    def train_resident_bytes(self, train_mesh: MeshShape, stage: str = "train") -> int:
        """What the train state of `stage` (one that updates weights) keeps on each device between its steps."""
        return int(params_per_device(self.cfg, stage, train_mesh) * self.mem.resident_bytes_per_param)

    def fits(self, est: MemoryEstimate) -> bool:
        return est.total <= self.usable_bytes

    def choose(self, stage: str, mesh: MeshShape, context_len: int, num_responses: int,
               max_micro_batch: int | None = None, extends: RolloutExtends | None = None) -> Fit | None:
        """The largest micro-batch (then the largest log-prob chunk) that fits; None when nothing does.

        decode (rollout): all of a shard's responses at once (ceil(N / data) rows, no micro-batch or chunk).
        score and update (experience, train, sft): the largest of {per-shard rows, powers of two below} within
        `max_micro_batch` and `max_micro_batch_tokens` that fits with the smallest chunk, then the largest chunk among
        the powers of two <= min(context, `max_logprob_chunk`) (at least `min_logprob_chunk`)."""
        m = self.mem
        ctx = int(context_len)
        per_shard = max(1, _ceil_div(num_responses, mesh.data * mesh.fsdp))
        if stage_spec(stage).memory == "decode":
            est = self.estimate(stage, mesh, ctx, num_responses, per_shard, extends=extends)
            return Fit(None, None, est) if self.fits(est) else None
        cap = per_shard if max_micro_batch is None else max(1, min(per_shard, max_micro_batch))
        if m.max_micro_batch_tokens is not None:
            cap = max(1, min(cap, m.max_micro_batch_tokens // ctx))
        top = min(ctx, m.max_logprob_chunk or ctx)
        min_chunk = min(m.min_logprob_chunk, top)
        for mb in _pow2_down(cap):
            est = self.estimate(stage, mesh, ctx, num_responses, mb, min_chunk)
            if not self.fits(est):
                continue
            for chunk in _pow2_down(1 << (top.bit_length() - 1)):  # powers of two <= top
                if chunk < min_chunk:
                    break
                e2 = self.estimate(stage, mesh, ctx, num_responses, mb, chunk)
                if self.fits(e2):
                    return Fit(mb, chunk, e2)
            return Fit(mb, min_chunk, est)
        return None

    def feasible(self, stage: str, mesh: MeshShape, context_len: int, num_responses: int) -> bool:
        return self.choose(stage, mesh, context_len, num_responses) is not None

    def iter_candidates(self, stage: str, num_devices: int) -> Iterator[MeshShape]:
        yield from candidate_meshes(self.cfg, num_devices, stage)
