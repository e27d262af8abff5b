"""A skinny matmul for the decode step, `y = epilogue(r * (x @ W) + bias)`, with its neighbours fused in.

A decode step multiplies a few rows (one token per sequence, 32-128 of them) by every weight matrix once,
so each matmul is a pass over its weights at the memory bandwidth, and what costs is everything around it:
XLA runs the RMS norm, the bias, RoPE, SiLU x up and the residual add as separate small fusions of 1.3-2.5 us
each, 10 per layer (experiments/results/bench_rollout_notes.md). Here one kernel reads each weight block once
and applies, in registers, what the decode step does before and after it:

- `norm_eps`: the input RMS norm. Its scale is folded into W's K axis once per weight version
  (rollout/decode_step.prepare), and the row statistic r = rsqrt(mean(x^2) + eps) is accumulated from the
  x tiles the matmul loads anyway: RMSNorm(x) @ W == r * (x @ (scale * W)).
- `bias` (q/k/v), `swiglu` (W holds [gate; up]: out = silu(gate) * up), `residual` (out = residual + y).

Grid: (N / bn) x (M / bm) programs, each owning a [bm, bn] output tile and looping over K in bk steps (Triton
pipelines the loads num_stages deep). W is [N, K] ("nk", each program's block contiguous) or [K, N] ("kn",
the model's own layout, for the untied lm_head with no copy). `linear_xla` is the same function in XLA: the
reference, and the backend where Pallas measured slower (kernels/tuning.py).

Measured on one H200 (experiments/benchmarks/bench_decode_ops.py): ahead of XLA on a few 0.5B shapes in isolation
(q/k/v 12.4 vs 19.4 us, down 22.0 vs 38.0 us at b128), behind it on every 7B matrix (gate/up 112.8 vs 76.1 us at
b32: 2.4 against 3.6 TB/s). Both are latency-bound at 0.5B: a program streams its K range one tile after another.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from earl_jax.kernels.common import compiler_params, largest_divisor, pow2_at_least

# Hopper's shared memory per block is 227 KiB; Triton keeps num_stages copies of each loaded tile there.
SMEM_BYTES = 200 * 1024


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    bm: int  # rows per program (a power of two >= 16; rows past M are masked)
    bn: int  # output columns per program (divides N)
    bk: int  # K per loop step (divides K)
    warps: int = 4
    stages: int = 3

    def smem_bytes(self, swiglu: bool, itemsize: int = 2) -> int:
        return self.stages * (self.bm + self.bn * (2 if swiglu else 1)) * self.bk * itemsize


def default_config(m: int, k: int, n: int, swiglu: bool = False, programs: int = 128) -> LinearConfig | None:
    """A launch for [m, k] x [k, n] that fits Triton's rules: bn the largest power of two dividing n that still
    gives `programs` programs (else 16), bk 128 or the largest power of two dividing k; None where k or n has no
    power-of-two divisor >= 16 (the XLA backend runs those)."""
    bm = min(pow2_at_least(m), 128)
    bk = largest_divisor(k, (128, 64, 32, 16))
    sizes = [c for c in (128, 64, 32, 16) if n % c == 0]
    if bk is None or not sizes:
        return None
    rows = -(-m // bm)
    bn = next((c for c in sizes if (n // c) * rows >= programs), sizes[-1])
    return fit_smem(LinearConfig(bm, bn, bk), swiglu)


def fit_smem(cfg: LinearConfig, swiglu: bool) -> LinearConfig:
    """Fewer pipeline stages, then smaller K steps, until the tiles fit in shared memory."""
    while cfg.smem_bytes(swiglu) > SMEM_BYTES and cfg.stages > 2:
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    while cfg.smem_bytes(swiglu) > SMEM_BYTES and cfg.bk > 16:
        cfg = dataclasses.replace(cfg, bk=cfg.bk // 2)
    return cfg


def _silu_times(gate, up):
    return gate / (1.0 + jnp.exp(-gate)) * up


def linear_xla(x: Float[Array, "m k"], w: Array, *, w_layout: str = "nk", bias: Array | None = None,
               residual: Array | None = None, norm_eps: float | None = None, swiglu: bool = False,
               out_dtype=None) -> Float[Array, "m n"]:
    """`linear` in XLA ops (float32 accumulation and epilogue, like the kernel)."""
    out_dtype = out_dtype or x.dtype
    dims = (((1,), (1,)), ((), ())) if w_layout == "nk" else (((1,), (0,)), ((), ()))
    y = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    if norm_eps is not None:
        x32 = x.astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + norm_eps)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if swiglu:
        gate, up = jnp.split(y, 2, axis=-1)
        y = _silu_times(gate, up)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(out_dtype)


def _kernel(*refs, m: int, k: int, n: int, cfg: LinearConfig, nk: bool, norm_eps: float | None, has_bias: bool,
            has_res: bool, swiglu: bool):
    it = iter(refs)
    x_ref, w_ref = next(it), next(it)
    b_ref = next(it) if has_bias else None
    r_ref = next(it) if has_res else None
    o_ref = next(it)
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    j, i = pl.program_id(0), pl.program_id(1)
    row0, col0 = i * bm, j * bn
    ragged = m % bm != 0
    rmask = (row0 + jnp.arange(bm) < m)[:, None]

    def rows(ref, cols):
        if not ragged:
            return ref[pl.ds(row0, bm), cols]
        from jax.experimental.pallas import triton as pltr
        return pltr.load(ref.at[pl.ds(row0, bm), cols], mask=rmask, other=0)

    def w_block(c0, kb):  # [bk, bn]
        if nk:
            return w_ref[pl.ds(c0, bn), pl.ds(kb * bk, bk)].T
        return w_ref[pl.ds(kb * bk, bk), pl.ds(c0, bn)]

    def body(kb, carry):
        acc, acc_up, ss = carry
        xt = rows(x_ref, pl.ds(kb * bk, bk))
        if norm_eps is not None:
            x32 = xt.astype(jnp.float32)
            ss = ss + jnp.sum(x32 * x32, axis=1)
        acc = acc + jnp.dot(xt, w_block(col0, kb), preferred_element_type=jnp.float32)
        if swiglu:
            acc_up = acc_up + jnp.dot(xt, w_block(n + col0, kb), preferred_element_type=jnp.float32)
        return acc, acc_up, ss

    zeros = jnp.zeros((bm, bn), jnp.float32)
    acc, acc_up, ss = jax.lax.fori_loop(0, k // bk, body, (zeros, zeros, jnp.zeros((bm,), jnp.float32)))
    if norm_eps is not None:
        r = jax.lax.rsqrt(ss / k + norm_eps)[:, None]
        acc, acc_up = acc * r, acc_up * r
    if has_bias:
        acc = acc + b_ref[pl.ds(col0, bn)].astype(jnp.float32)[None, :]
    if swiglu:
        acc = _silu_times(acc, acc_up)
    if has_res:
        acc = acc + rows(r_ref, pl.ds(col0, bn)).astype(jnp.float32)
    out = acc.astype(o_ref.dtype)
    if ragged:
        from jax.experimental.pallas import triton as pltr
        pltr.store(o_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)], out, mask=rmask)
    else:
        o_ref[pl.ds(row0, bm), pl.ds(col0, bn)] = out


def linear(x: Float[Array, "m k"], w: Array, *, w_layout: str = "nk", bias: Array | None = None,
           residual: Array | None = None, norm_eps: float | None = None, swiglu: bool = False, out_dtype=None,
           config: LinearConfig | None = None, interpret: bool = False) -> Float[Array, "m n"]:
    """`epilogue(r * (x @ W) + bias)` as one Pallas kernel (see the module docstring); W is [N, K] for
    w_layout "nk", [K, N] for "kn"; with `swiglu` it holds gate then up along N and the output is N / 2 wide."""
    if w_layout not in ("nk", "kn"):
        raise ValueError(f"linear: w_layout must be 'nk' or 'kn', got {w_layout!r}")
    m, k = x.shape
    n_w, k_w = w.shape if w_layout == "nk" else w.shape[::-1]
    if k_w != k:
        raise ValueError(f"linear: x has K={k} but W ({w_layout}) has K={k_w}")
    n = n_w // 2 if swiglu else n_w
    if swiglu and bias is not None:
        raise ValueError("linear: swiglu with a bias is not supported")
    cfg = config or default_config(m, k, n, swiglu)
    if cfg is None or n % cfg.bn or k % cfg.bk:
        raise ValueError(f"linear: no Triton launch for [{m}, {k}] x [{k}, {n}] (config {cfg})")
    out_dtype = out_dtype or x.dtype
    kernel = functools.partial(_kernel, m=m, k=k, n=n, cfg=cfg, nk=w_layout == "nk", norm_eps=norm_eps,
                               has_bias=bias is not None, has_res=residual is not None, swiglu=swiglu)
    args = [x, w] + [a for a in (bias, residual) if a is not None]
    return pl.pallas_call(
        kernel,
        grid=(n // cfg.bn, -(-m // cfg.bm)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        interpret=interpret,
        name="earl_linear" + ("_swiglu" if swiglu else "") + ("_norm" if norm_eps is not None else ""),
        **compiler_params(interpret, cfg.warps, cfg.stages),
    )(*args)
