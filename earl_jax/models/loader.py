"""Hugging Face Qwen2 checkpoints <-> earl-jax models (tunix-style `params.py`).

A small table maps each Hugging Face tensor name to a module path plus an einops-like layout rule
("(n h) d -> d n h": HF q_proj.weight is [out, in] = [n*h, d]; ours is q_dnh). Loading is leaf by leaf
and shard by shard: `jax.make_array_from_callback` asks for each device's index, and the callback reads
only the rows of the safetensors file that index covers (`safe_open(...).get_slice`), so no device - and
no host buffer - ever holds a whole sharded tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy reader needs)
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, Sharding, SingleDeviceSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from earl_jax.errors import CheckpointError
from earl_jax.models.init import abstract_model
from earl_jax.models.model_config import ModelConfig
from earl_jax.models.qwen2 import Qwen2
from earl_jax.models.tokenizer import load_tokenizer
from earl_jax.progress import mesh_str, params_str, phase, track
from earl_jax.sharding.mesh import INFERENCE_RULES, Rules, state_shardings

# (Hugging Face name, module path, layout "hf axes -> our axes"); {i} is the layer index.
_L = "model.layers.{i}."
PARAM_TABLE: tuple[tuple[str, str, str], ...] = (
    ("model.embed_tokens.weight", "embed_vd", "v d -> v d"),
    (_L + "input_layernorm.weight", "layers.{i}.input_norm.scale", "d -> d"),
    (_L + "self_attn.q_proj.weight", "layers.{i}.attn.q_dnh", "(n h) d -> d n h"),
    (_L + "self_attn.k_proj.weight", "layers.{i}.attn.k_dkh", "(k h) d -> d k h"),
    (_L + "self_attn.v_proj.weight", "layers.{i}.attn.v_dkh", "(k h) d -> d k h"),
    (_L + "self_attn.o_proj.weight", "layers.{i}.attn.o_nhd", "d (n h) -> n h d"),
    (_L + "self_attn.q_proj.bias", "layers.{i}.attn.q_bias", "(n h) -> n h"),
    (_L + "self_attn.k_proj.bias", "layers.{i}.attn.k_bias", "(k h) -> k h"),
    (_L + "self_attn.v_proj.bias", "layers.{i}.attn.v_bias", "(k h) -> k h"),
    (_L + "post_attention_layernorm.weight", "layers.{i}.post_attn_norm.scale", "d -> d"),
    (_L + "mlp.gate_proj.weight", "layers.{i}.mlp.gate_df", "f d -> d f"),
    (_L + "mlp.up_proj.weight", "layers.{i}.mlp.up_df", "f d -> d f"),
    (_L + "mlp.down_proj.weight", "layers.{i}.mlp.down_fd", "d f -> f d"),
    ("model.norm.weight", "final_norm.scale", "d -> d"),
    ("lm_head.weight", "lm_head_dv", "v d -> d v"),
)
# Tensors some checkpoints carry that the model recomputes (RoPE tables of older exports).
_IGNORED = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)
_TIED_HEAD = "lm_head.weight"


def _template_regex(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)"))


_HF_RULES = tuple((_template_regex(hf), hf, ours, layout) for hf, ours, layout in PARAM_TABLE)
_OUR_RULES = tuple((_template_regex(ours), hf, ours, layout) for hf, ours, layout in PARAM_TABLE)


@dataclasses.dataclass(frozen=True)
class Layout:
    """`hf_groups` ((n, h), (d,)) -> target axes (d, n, h): target = hf.reshape(n, h, d).transpose(perm)."""

    hf_groups: tuple[tuple[str, ...], ...]
    target: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> "Layout":
        lhs, rhs = spec.split("->")
        groups = [tuple(g.strip("()").split()) for g in re.findall(r"\([^)]*\)|\S+", lhs)]
        return cls(tuple(groups), tuple(rhs.split()))

    @property
    def split_axes(self) -> tuple[str, ...]:
        return tuple(a for g in self.hf_groups for a in g)

    @property
    def perm(self) -> tuple[int, ...]:
        return tuple(self.split_axes.index(a) for a in self.target)

    def hf_shape(self, target_shape: tuple[int, ...]) -> tuple[int, ...]:
        size = dict(zip(self.target, target_shape))
        return tuple(math.prod(size[a] for a in g) for g in self.hf_groups)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """Inverse of the load transform, for saving."""
        inv = tuple(self.target.index(a) for a in self.split_axes)
        return np.ascontiguousarray(x.transpose(inv)).reshape(self.hf_shape(x.shape))

    def read(self, get: Callable[[tuple[slice, ...]], np.ndarray], target_shape: tuple[int, ...],
             index: tuple[slice, ...]) -> np.ndarray:
        """The `index` block of the target array, reading only the HF rows that cover it."""
        size = dict(zip(self.target, target_shape))
        want = {a: range(*s.indices(size[a])) for a, s in zip(self.target, index)}
        hf_index, sub_index, piece_shape = [], [], []
        for g in self.hf_groups:
            # A merged HF axis (n h) is contiguous in its leading sub-axis: read those rows whole,
            # then cut the inner sub-axes after the reshape.
            lead, inner = want[g[0]], math.prod(size[a] for a in g[1:])
            hf_index.append(slice(lead.start * inner, (lead.start + len(lead)) * inner))
            piece_shape += [len(lead)] + [size[a] for a in g[1:]]
            sub_index += [slice(None)] + [slice(want[a].start, want[a].start + len(want[a])) for a in g[1:]]
        piece = get(tuple(hf_index)).reshape(piece_shape)[tuple(sub_index)]
        return piece.transpose(self.perm)


_LAYOUTS = {layout: Layout.parse(layout) for _, _, layout in PARAM_TABLE}


def hf_to_path(hf_name: str) -> tuple[str, Layout] | None:
    """'model.layers.3.mlp.up_proj.weight' -> ('layers.3.mlp.up_df', layout); None when not in the table."""
    for regex, _, ours, layout in _HF_RULES:
        if m := regex.fullmatch(hf_name):
            return ours.format(**m.groupdict()), _LAYOUTS[layout]
    return None


def path_to_hf(path: str) -> tuple[str, Layout]:
    for regex, hf, _, layout in _OUR_RULES:
        if m := regex.fullmatch(path):
            return hf.format(**m.groupdict()), _LAYOUTS[layout]
    raise KeyError(f"model parameter {path!r} has no Hugging Face name in PARAM_TABLE")


# ---- config ---------------------------------------------------------------------------------------
def config_from_hf(d: Mapping[str, Any], name: str = "hf") -> ModelConfig:
    """ModelConfig from a config.json dict, old (rope_theta) or new (rope_parameters) transformers."""
    d = dict(d)
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    if rope:
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{name}: rope_type {kind!r} is not supported (only default RoPE)")
        if "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
    if d.get("use_sliding_window"):
        raise ValueError(f"{name}: use_sliding_window=true is not supported")
    return ModelConfig.from_hf_dict(d, name=name)


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    d = cfg.to_hf_dict()
    # Both spellings, so transformers before and after 5.0 read the same theta.
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {**d, "torch_dtype": dtype, "dtype": dtype, "use_sliding_window": False}


# ---- safetensors ----------------------------------------------------------------------------------
def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} names {f.name}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {path}")
    return files


@contextlib.contextmanager
def _open_tensors(path: Path) -> Iterator[dict[str, Any]]:
    """name -> open safe_open handle, over every file of the checkpoint."""
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        for f in _checkpoint_files(path):
            try:
                h = stack.enter_context(safe_open(str(f), framework="numpy"))
                keys = list(h.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{f}: corrupt or truncated safetensors file ({e})") from e
            _check_size(f)
            for k in keys:
                if k in handles:
                    raise CheckpointError(f"tensor {k!r} appears in more than one file ({f.name})")
                handles[k] = h
        yield handles


def _check_size(f: Path) -> None:
    """safe_open maps the file lazily; check the header's byte ranges against the file size up front."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > f.stat().st_size:
        raise CheckpointError(f"{f}: truncated safetensors file ({f.stat().st_size} bytes, header needs "
                              f"{8 + n + end})")


def _read_fn(handle, name: str, dtype) -> Callable[[tuple[slice, ...]], np.ndarray]:
    def get(index: tuple[slice, ...]) -> np.ndarray:
        try:
            x = handle.get_slice(name)[index]
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read tensor {name!r}: {e}") from e
        return np.asarray(x).astype(dtype, copy=False)

    return get


def _shard_reader(layout: Layout, get, shape) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """Callback for make_array_from_callback; replicas of one shard are read once."""
    memo: dict[tuple, np.ndarray] = {}

    def read(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if key not in memo:
            memo[key] = layout.read(get, shape, index)
        return memo[key]

    return read


# ---- load -----------------------------------------------------------------------------------------
def _flat_path(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def load_params(path: str | Path, model: Qwen2, shardings: Any) -> nnx.State:
    """The checkpoint's tensors as `model`'s (abstract) state, each leaf built in its sharding.

    `shardings` is a state of Shardings with `model`'s structure, or one Sharding for every leaf.
    """
    path = Path(path)
    _, abstract_state = nnx.split(model)
    flat = list(nnx.to_flat_state(abstract_state))
    if isinstance(shardings, Sharding):
        flat_shardings = {_flat_path(p): shardings for p, _ in flat}
    else:
        flat_shardings = {_flat_path(p): (s.get_value() if isinstance(s, nnx.Variable) else s)
                          for p, s in nnx.to_flat_state(shardings)}
    tied = model.cfg.tie_word_embeddings
    with _open_tensors(path) as handles:
        wanted: dict[str, str] = {}  # module path -> HF name
        unexpected = []
        for name in handles:
            hit = hf_to_path(name)
            if hit is None:
                if not any(r.fullmatch(name) for r in _IGNORED):
                    unexpected.append(name)
            elif not (tied and name == _TIED_HEAD):  # tied checkpoints may still store the head
                wanted[hit[0]] = name
        ours = {_flat_path(p) for p, _ in flat}
        unexpected += sorted(wanted[p] for p in set(wanted) - ours)
        if unexpected:
            raise CheckpointError(f"{path}: unexpected tensors {sorted(unexpected)[:8]} "
                                  f"(not part of a {model.cfg.num_hidden_layers}-layer "
                                  f"{'tied' if tied else 'untied'} Qwen2)")
        missing = [path_to_hf(_flat_path(p))[0] for p, _ in flat if _flat_path(p) not in wanted]
        if missing:
            raise CheckpointError(f"{path}: missing tensors {missing[:8]}"
                                  + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))

        # Every shape first, so a bad checkpoint fails before any device memory is filled.
        for p, var in flat:
            key = _flat_path(p)
            hf_name, shape = wanted[key], tuple(var.get_value().shape)
            need = hf_to_path(hf_name)[1].hf_shape(shape)
            got = tuple(handles[hf_name].get_slice(hf_name).get_shape())
            if got != need:
                raise CheckpointError(f"tensor {hf_name!r} has shape {list(got)}, the config needs "
                                      f"{list(need)} (for {key}{list(shape)})")
        leaves = []
        for p, var in track(flat, total=len(flat), description=f"loading {path.name}"):
            key = _flat_path(p)
            hf_name, abstract = wanted[key], var.get_value()
            layout, shape = hf_to_path(hf_name)[1], tuple(abstract.shape)
            read = _shard_reader(layout, _read_fn(handles[hf_name], hf_name, abstract.dtype), shape)
            leaves.append((p, var.replace(value=jax.make_array_from_callback(shape, flat_shardings[key], read))))
    return nnx.from_flat_state(leaves)


def from_pretrained(path: str | Path, *, mesh: Mesh | None = None, rules: Rules | None = None,
                    dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32):
    """(model, tokenizer) from a Hugging Face Qwen2 folder (config.json, *.safetensors, tokenizer.json).

    With `mesh`, every parameter lands directly in its sharding under `rules` (default inference
    rules); without, on the first local device. `tokenizer` is None when the folder has no tokenizer.json.
    """
    path = Path(path)
    if rules is not None and mesh is None:
        raise ValueError("from_pretrained: rules need a mesh")
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), name=path.name or "hf")
    where = "one device" if mesh is None else f"mesh {mesh_str(mesh)}"
    with phase(f"model: {cfg.name}, {params_str(cfg.num_params())} params, loading {path} onto {where}"):
        model = abstract_model(cfg, dtype=dtype, param_dtype=param_dtype)
        graphdef, abstract_state = nnx.split(model)
        if mesh is None:
            shardings: Any = SingleDeviceSharding(jax.local_devices()[0])
        else:
            shardings = state_shardings(abstract_state, mesh, INFERENCE_RULES if rules is None else rules)
        state = load_params(path, model, shardings)
    tokenizer = load_tokenizer(path) if (path / "tokenizer.json").exists() else None
    return nnx.merge(graphdef, state), tokenizer


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


# ---- save -----------------------------------------------------------------------------------------
def save_pretrained(model: Qwen2, path: str | Path, tokenizer=None, *, dtype: Any = None,
                    max_shard_bytes: int = 4 << 30) -> None:
    """Write a Hugging Face folder: config.json, model.safetensors (or shards + index), tokenizer.json.

    Tensors are written in the parameters' own dtype unless `dtype` is given (e.g. jnp.bfloat16).
    Parameters are gathered to host one at a time, so host memory peaks at one file's worth. With
    several processes, every process must call this (parameters are all-gathered); process 0 writes.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _, state = nnx.split(model)
    flat = [(_flat_path(p), v) for p, v in nnx.to_flat_state(state)]
    plan, size = [[]], 0  # files of (path, var), each under max_shard_bytes
    for key, var in flat:
        nbytes = var.get_value().size * np.dtype(dtype or var.get_value().dtype).itemsize
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append((key, var))
        size += nbytes
    names = (["model.safetensors"] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    weight_map, total = {}, 0
    out_dtype = None
    for fname, group in zip(names, plan):
        tensors = {}
        for key, var in group:
            hf_name, layout = path_to_hf(key)
            x = _to_host(var.get_value())
            if dtype is not None:
                x = x.astype(dtype)
            out_dtype = x.dtype
            tensors[hf_name] = layout.to_hf(x)
            weight_map[hf_name] = fname
            total += x.nbytes
        if jax.process_index() == 0:
            save_file(tensors, str(path / fname), metadata={"format": "pt"})
    if jax.process_index() != 0:
        return
    if len(plan) > 1:
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config_to_hf(model.cfg, str(np.dtype(out_dtype))), indent=2))
    if tokenizer is not None:
        tokenizer.save(str(path / "tokenizer.json"))
