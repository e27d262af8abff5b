"""The pod preset: a real-size game job sized for the machine it runs on (`--preset pod` of connect4.py and
tictactoe.py).

    pod_preset(num_devices, bytes_per_device, hf_checkpoint=None, base=JobConfig()) -> JobConfig
    pod_preset_for_this_machine(base, flags) -> JobConfig    # the same, from jax's devices and the flags

Decisions (each one a guess to revisit with measurements, not a tuned setting):

* Model. With `--hf-checkpoint`, that checkpoint (its config.json), which must fit by the rule below. Without
  one, the largest Qwen2.5 preset that fits, random init, with the built-in game tokenizer's vocabulary.
  The rule, from the memory model (parallel/memory.py): on its most sharded train mesh (every device over
  fsdp x tensor), the train stage at the preset's context with one row per batch shard takes at most HALF
  of the usable memory per device (the budget x the memory model's safety fraction). The other half is the
  room for a batch: the train state stays resident while rollout and experience run beside it with their
  own weight copies and KV caches, which the memory model counts per stage, not together with it; and
  micro-batches above one row. With 80 GiB per device this picks 1.5B on one device, 3B on two, 7B on four;
  with 8 x 141 GiB, 32B.
* Batch: 16 games per device in groups of 8 (GRPO compares within a group): a multiple of the device
  count, so every mesh's batch axes divide it; decoding a few rows is bound by weight reads, so more rows
  per device cost little time each.
* Prompts: compact (the board every turn, ~80 tokens) for a random-init model, answers of up to 8 tokens
  ending at EOS, context 4096, learning rate 1e-4 (the tiny model's 1e-3 scaled down for a larger model; not
  tuned), the format warm-up of the base preset; chat (English) for a pretrained checkpoint, answers of up to 128
  tokens, context 8192, a small learning rate with a KL term and no format warm-up (the qwen0.5b preset's choices).
* bfloat16 compute (float32 master weights in training).

Bad input says so before anything compiles: a machine too small for the smallest preset (or for the given
checkpoint) raises `PodTooSmallError` naming the memory per device and what the model needs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from earl_jax.cli import replace_paths
from earl_jax.models.model_config import ModelConfig, get_config
from earl_jax.parallel.memory import GiB, MemoryConfig, MemoryModel, candidate_meshes
from earl_jax.rl.loop.job_config import JobConfig
from earl_jax.sharding.mesh import MeshShape

POD_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b",
              "qwen2.5-72b")  # ascending size: the preset picks the last that fits
TRAIN_SHARE = 0.5  # of the usable memory per device, for the train stage (the rest is the batch's room)
GAMES_PER_DEVICE = 16
GROUP_SIZE = 8
# rollout_cache_growth 4: the cold first iteration on 4 H100s was 122 s of decode compiles (one program per batch x
# cache size as games grow); KV sizes 512, 2048, 8192 compile 16 sampler programs for the first evaluation and
# iteration of this job where the default sizes compile 33 (experiments/lab/count_decode_programs.py), at up
# to 4x padded decode attention.
# Free-text answers (constrain_moves off): the pod job is EARL's setting, whose contexts grow with the answers.
RANDOM_INIT = {("env", "prompt_style"): "compact", ("rollout", "max_turn_tokens"): 8, ("rollout", "max_context"): 4096,
               ("rollout", "cache_growth"): 4.0, ("optim", "learning_rate"): 1e-4, ("loss", "kl_coef"): 0.0,
               ("rollout", "constrain_moves"): False}
PRETRAINED = {("env", "prompt_style"): "chat", ("rollout", "max_turn_tokens"): 128, ("rollout", "max_context"): 8192,
              ("optim", "learning_rate"): 1e-6, ("loss", "kl_coef"): 0.001, ("sft", "steps"): 0,
              ("eval", "opponents"): ("random", "alphabeta:2"), ("rollout", "constrain_moves"): False}


class PodTooSmallError(ValueError):
    """No model of the pod preset fits this machine's memory."""


@dataclasses.dataclass(frozen=True)
class TrainFit:
    model: ModelConfig
    mesh: MeshShape  # the most sharded train mesh (the smallest estimate)
    train_bytes: int  # its train estimate per device
    budget_bytes: int  # per device
    safety_fraction: float  # the memory model's: usable = budget x safety

    @property
    def needed_bytes_per_device(self) -> float:
        """The device memory at which the train estimate is exactly TRAIN_SHARE of the usable memory."""
        return self.train_bytes / TRAIN_SHARE / self.safety_fraction

    @property
    def fits(self) -> bool:
        return self.needed_bytes_per_device <= self.budget_bytes

    def describe(self) -> str:
        return (f"{self.model.name} ({self.model.num_params() / 1e9:.2f}B parameters) trains on {self.mesh} in "
                f"{self.train_bytes / GiB:.1f} GiB per device, so it needs {self.needed_bytes_per_device / GiB:.1f} "
                f"GiB per device (the train stage may take {TRAIN_SHARE:.0%} of the usable memory)")


def train_fit(model: ModelConfig, num_devices: int, bytes_per_device: int, context: int) -> TrainFit:
    """The train stage of `model` on its most sharded mesh over `num_devices`, one row per batch shard at `context`."""
    memory = MemoryModel(model, MemoryConfig(budget_bytes=int(bytes_per_device)))
    best = None
    for mesh in candidate_meshes(model, num_devices, "train"):
        est = memory.estimate("train", mesh, context, num_devices, micro_batch=1,
                              logprob_chunk=memory.mem.min_logprob_chunk)
        if best is None or est.total < best.total:
            best = est
    return TrainFit(model, best.mesh, best.total, int(bytes_per_device), memory.mem.safety_fraction)


def choose_model(num_devices: int, bytes_per_device: int, vocab_size: int, context: int) -> TrainFit:
    """The largest of POD_MODELS (with `vocab_size`) whose train stage fits by the module's rule."""
    fits = [train_fit(get_config(name, vocab_size=vocab_size), num_devices, bytes_per_device, context)
            for name in POD_MODELS]
    ok = [f for f in fits if f.fits]
    if not ok:
        raise PodTooSmallError(f"{_machine(num_devices, bytes_per_device)} is too small for any pod model: the "
                               f"smallest, {fits[0].describe()}. Use more devices, or the CPU default (no --preset).")
    return ok[-1]


def _machine(num_devices: int, bytes_per_device: int) -> str:
    return f"{num_devices} device{'s' if num_devices > 1 else ''} x {bytes_per_device / GiB:.1f} GiB"


def _preset_name(model: ModelConfig, fallback: str) -> str:
    """The Qwen2.5 preset with the checkpoint's shape (the name only matters for logs), else `fallback`."""
    shape = lambda c: (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,  # noqa: E731
                       c.num_key_value_heads)
    return next((n for n in POD_MODELS if shape(get_config(n)) == shape(model)), fallback)


def pod_preset(num_devices: int, bytes_per_device: int, hf_checkpoint: str | None = None,
               base: JobConfig = JobConfig()) -> JobConfig:
    """The pod job for `num_devices` devices of `bytes_per_device` each (see the module docstring)."""
    if num_devices < 1 or bytes_per_device <= 0:
        raise ValueError(f"pod preset: needs at least one device with memory (got {num_devices} devices x "
                         f"{bytes_per_device} bytes)")
    games = GAMES_PER_DEVICE * num_devices
    common = {("model", "dtype"): "bfloat16", ("rollout", "groups"): games // GROUP_SIZE,
              ("rollout", "group_size"): GROUP_SIZE, ("optim", "warmup_steps"): 10,
              ("planner", "micro_batch_tokens"): 65536, ("run", "run_dir"): f"{base.run.run_dir}-pod"}
    if hf_checkpoint:
        config_json = Path(hf_checkpoint) / "config.json"
        if not config_json.exists():
            raise ValueError(f"--model.hf-checkpoint {hf_checkpoint}: no config.json there")
        model = ModelConfig.from_hf_json(config_json)
        fit = train_fit(model, num_devices, bytes_per_device, PRETRAINED[("rollout", "max_context")])
        if not fit.fits:
            raise PodTooSmallError(f"{_machine(num_devices, bytes_per_device)} is too small for "
                                   f"--model.hf-checkpoint {hf_checkpoint}: {fit.describe()}.")
        return replace_paths(base, {**common, **PRETRAINED, ("model", "hf_checkpoint"): str(hf_checkpoint),
                                    ("model", "name"): _preset_name(model, model.name)})
    from earl_jax.models.tokenizer import game_tokenizer

    fit = choose_model(num_devices, bytes_per_device, game_tokenizer().get_vocab_size(),
                       RANDOM_INIT[("rollout", "max_context")])
    return replace_paths(base, {**common, **RANDOM_INIT, ("model", "name"): fit.model.name,
                                ("model", "hf_checkpoint"): None})


def pod_preset_for_this_machine(base: JobConfig, flags: Mapping[tuple[str, ...], Any]) -> JobConfig:
    """`pod_preset` for jax's devices (the first --planner.devices of them) and their memory (or
    --planner.memory-budget-gib), `flags` the fields the command line sets. Joins the multi-process job the flags
    name first: devices must not be touched before that."""
    import jax

    from earl_jax import distributed
    from earl_jax.parallel.memory import device_memory_budget

    get = lambda section, name: flags.get((section, name), getattr(getattr(base, section), name))  # noqa: E731
    distributed.maybe_initialize(get("dist", "coordinator"), get("dist", "num_processes"), get("dist", "process_id"))
    devices = jax.devices()[: get("planner", "devices") or None]
    budget = int(get("planner", "memory_budget_gib") * GiB) or device_memory_budget(devices[0])
    # a checkpoint typed here is trained as a pretrained model; the default preset's small base is not a pod model
    return pod_preset(len(devices), budget, flags.get(("model", "hf_checkpoint")), base)
