"""Train-stage and experience-stage throughput of earl-jax on one device: Qwen2.5-0.5B shape, bf16 compute,
float32 master weights, AdamW (`rl.algorithm.optim.make_optimizer`), GRPO/PPO-clip loss; the stages the trainer runs
(`rl.stages.train_stage.train_stage`, `rl.stages.experience_stage.experience_stage`: one policy, no reference) on random
tokens, rewards and advantages, at the plan's micro-batch split (one layout on one device, no finer length split).

Reports tokens/s, MFU = (6 N tokens + causal attention flops) / time / peak (2 N + attention for the
forward-only experience stage; N = all parameters, the tied embedding counted once, as
../shared/bench/peer_train.py does), the peak memory (`memory_stats()["peak_bytes_in_use"]`) and the first call's
extra seconds over a steady call (its compiles). The stages run one program per micro-batch shape, so there is no
single XLA memory estimate (`xla_mem_estimate_bytes` stays empty). Peak dense bf16: 989 TFLOP/s for H100 SXM and H200
(from the device kind).

Each case (shape x remat policy x micro-batches x log-prob chunk) runs in its own subprocess on GPU, so the
peak memory is the case's own and an out-of-memory case does not end the run (`--isolate`). Cases start
only while `--time-budget` seconds have not passed, so one device call stays bounded.

Run (GPU, one device call, ~6-8 min):      python experiments/benchmarks/bench_train.py
Only the train variants you name:          python experiments/benchmarks/bench_train.py --shapes 8x4096 \
                                               --remat none,dots
CPU smoke test (< 60 s):                   python experiments/benchmarks/bench_train.py --tiny
Writes experiments/results/bench_train_<device>.json (and $OUT/ when set). The peer: ../shared/bench/peer_train.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

RESULTS = Path(__file__).resolve().parents[1] / "results"
PEAK_BF16 = (("h200", 989e12), ("h100 pcie", 756e12), ("h100", 989e12), ("h800", 989e12), ("a100", 312e12),
             ("l40s", 362e12), ("b200", 2250e12), ("gh200", 989e12))
PEER = {"8x4096": {"tok_s": 18400, "mfu": 0.065}, "16x2048": {"tok_s": 34500, "mfu": 0.113},
        "note": "tunix Qwen2 in a plain jitted optax step, one H100, 57 GiB (../shared/bench/README.md)"}


def peak_flops(kind: str) -> float | None:
    k = kind.lower()
    for name, peak in PEAK_BF16:
        if name in k:
            return peak
    return None


def model_flops(cfg, b: int, t: int, train: bool) -> float:
    """6 N (train) or 2 N (forward) per token, plus causal attention (QK^T and PV over half the square)."""
    n = cfg.num_params()
    attn_fwd = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.dim_per_head * t * t * b / 2
    return (6 if train else 2) * n * b * t + (3 if train else 1) * attn_fwd


def parse_shapes(s: str) -> list[tuple[int, int]]:
    out = []
    for v in s.split(","):
        b, t = v.lower().split("x")
        out.append((int(b), int(t)))
    return out


def _remat_arg(v: str):
    return False if v in ("none", "false", "0") else v


# ---- one case, in this process ------------------------------------------------------------------

def run_case(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from earl_jax.models.model_config import ModelConfig, get_config
    from earl_jax.models.qwen2 import Qwen2
    from earl_jax.parallel.dispatch import Dispatcher
    from earl_jax.parallel.plan import StageLayout
    from earl_jax.parallel.planner import ProgramCache, StageRun
    from earl_jax.rl.algorithm.losses import LossConfig
    from earl_jax.rl.algorithm.micro_steps import ExperienceBatch
    from earl_jax.rl.algorithm.optim import make_optimizer
    from earl_jax.rl.algorithm.packing import scored_spans
    from earl_jax.rl.stages.experience_stage import ExperienceResult, RolloutBatch, experience_stage
    from earl_jax.rl.stages.train_stage import train_stage
    from earl_jax.sharding.mesh import MeshShape, make_mesh
    from earl_jax.sharding.stage_registry import STAGE_RULES

    cfg = (ModelConfig.tiny(vocab_size=2048).replace(num_hidden_layers=2) if case["model"] == "tiny"
           else get_config(case["model"]))
    b, t, mb, chunk = case["B"], case["T"], case["micro_batches"], case["chunk"]
    train = case["kind"] == "train"
    remat = _remat_arg(case["remat"])
    dev = jax.devices()[0]
    stage, shape = ("train" if train else "experience"), MeshShape.parse("d1f1t1")
    run = StageRun(stage, StageLayout(shape, b // mb, chunk), make_mesh(shape, [dev]), STAGE_RULES[stage],
                   ProgramCache())  # micro_batch = rows per micro-batch: b // mb rows make mb micro-batches
    # (ProgramCache's default program service: the plan's split, each at its own width, nothing compiled ahead)
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=remat if train else False)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0), **kw)))
    params = jax.jit(lambda: nnx.state(Qwen2(cfg, rngs=nnx.Rngs(0), **kw), nnx.Param))()
    params = jax.device_put(params, run.shardings(params))
    rng = np.random.default_rng(case.get("seed", 0))
    tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    prompt = t // 4  # the first quarter is "prompt": no loss there
    mask = np.broadcast_to(np.arange(t)[None] >= prompt, (b, t))
    spans = scored_spans(mask)
    loss_cfg = LossConfig(filter_constant_groups=False)

    if train:
        optimizer = make_optimizer(1e-6, 10, 1000, 0.0, 1.0)
        state = [params, jax.jit(optimizer.init)(params)]
        del params
        # Old log-probs near the new ones (ratios around 1, as in a real first epoch), random advantages.
        batch = ExperienceBatch(*run.put_rows({
            "tokens": tokens, "loss_mask": mask, "old_logp": -rng.uniform(5, 15, (b, t)).astype(np.float32),
            "ref_logp": -rng.uniform(5, 15, (b, t)).astype(np.float32),
            "advantages": rng.normal(size=(b, t)).astype(np.float32)}).values())
        experience = ExperienceResult(batch, {}, np.arange(b), spans)  # rows in their own order
        dispatcher = Dispatcher()

        def call():  # donates the weights and optimizer state: the updated ones go into the next call
            state[0], state[1], metrics = train_stage(run, state[0], state[1], experience, dispatcher,
                                                      graphdef=graphdef, loss=loss_cfg,
                                                      optimizer=optimizer, epochs=1, mini_batches=1)
            return metrics
    else:
        groups = max(1, b // 2)
        rewards = np.zeros((b, t), np.float32)
        rewards[:, -1] = rng.normal(size=b)
        batch = RolloutBatch(tokens, mask, rewards, (np.arange(b) % groups).astype(np.int32))

        def call():
            out = experience_stage(run, params, None, batch, spans, graphdef=graphdef, loss=loss_cfg,
                                   num_groups=groups).batch
            return jax.block_until_ready((out.old_logp, out.advantages))

    t0 = time.perf_counter()
    out = call()  # compiles every micro-batch program
    first_s = time.perf_counter() - t0
    mem_est = None  # several programs: no one XLA estimate
    for _ in range(max(case["warmup"] - 1, 0)):
        out = call()
    times = []
    for _ in range(case["repeats"]):
        t1 = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t1)
    step_s = statistics.median(times)
    compile_s = max(first_s - step_s, 0.0)
    check = {}
    if train:
        check = {k: float(out[k]) for k in ("loss", "grad_norm", "skipped")}
        ok = np.isfinite(check["loss"]) and np.isfinite(check["grad_norm"]) and check["skipped"] == 0
    else:
        lp = np.asarray(out[0], np.float32)
        check = {"mean_logp": float(lp[:, 1:].mean())}  # random weights: about -log(vocab)
        ok = bool(np.isfinite(lp).all())
    flops = model_flops(cfg, b, t, train)
    peak = peak_flops(dev.device_kind) if dev.platform == "gpu" else None
    stats = {}
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001
        pass
    return {**case, "device": dev.device_kind, "platform": dev.platform, "params": cfg.num_params(),
            "tokens": b * t, "compile_s": round(compile_s, 2), "step_s": step_s, "times_s": times,
            "tok_s": b * t / step_s, "tflops": flops / step_s / 1e12,
            "mfu": flops / step_s / peak if peak else None, "peak_bytes": stats.get("peak_bytes_in_use"),
            "bytes_limit": stats.get("bytes_limit"), "xla_mem_estimate_bytes": mem_est, "finite": bool(ok),
            **check, "status": "ok"}


def _is_oom(msg: str) -> bool:
    return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()


_PARENT_NO_PREALLOC = False


def run_isolated(case: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(case)]
    env = dict(os.environ)
    if _PARENT_NO_PREALLOC:  # the parent's own setting, not meant for the worker
        env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # jax's default 0.75 would cap an 80 GB card at 60
    if case.get("xla_flags"):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + case["xla_flags"]).strip()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**case, "status": "timeout"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    err = (p.stderr or "")[-3000:]
    return {**case, "status": "oom" if _is_oom(err) else "error", "error": err[-800:]}


def run_inline(case: dict) -> dict:
    try:
        return run_case(case)
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        return {**case, "status": "oom" if _is_oom(msg) else "error", "error": msg[-800:]}


# ---- driver --------------------------------------------------------------------------------------

def build_cases(args) -> list[dict]:
    """Most important first, so the time budget cuts the tail: every shape's first variant and its experience
    stage, then the other train variants."""
    common = dict(model=args.model, warmup=args.warmup, repeats=args.repeats)
    first, rest = [], []
    flag_sets = [f.strip() for f in args.xla_flags.split(";")] if args.xla_flags else [""]
    for b, t in args.shapes:
        variants = [(remat, mb, chunk, fl) for remat in args.remat.split(",") for mb in args.micro_batches
                    for chunk in args.chunks for fl in flag_sets if b % mb == 0]
        for i, (remat, mb, chunk, fl) in enumerate(variants):
            case = dict(kind="train", B=b, T=t, remat=remat, micro_batches=mb, chunk=chunk, **common)
            if fl:
                case["xla_flags"] = fl
            (first if i == 0 else rest).append(case)
        if args.experience:
            first.append(dict(kind="experience", B=b, T=t, remat="none", micro_batches=1, chunk=args.chunks[0],
                              **common))
    return first + rest


def print_table(results: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    tab = Table(title=title)
    for c in ("stage", "B x T", "remat", "mb", "chunk", "status", "step ms", "tok/s", "TFLOP/s", "MFU",
              "peak GiB", "XLA est GiB", "compile s"):
        tab.add_column(c, justify="right")
    gib = lambda v: "-" if v is None else f"{v / 2**30:.1f}"  # noqa: E731
    for r in results:
        ok = r.get("status") == "ok"
        tab.add_row(r["kind"] + (" +flags" if r.get("xla_flags") else ""), f"{r['B']}x{r['T']}", str(r["remat"]),
                    str(r["micro_batches"]), str(r["chunk"]),
                    r["status"], f"{r['step_s'] * 1e3:.1f}" if ok else "-", f"{r['tok_s']:,.0f}" if ok else "-",
                    f"{r['tflops']:.1f}" if ok else "-",
                    f"{r['mfu'] * 100:.1f}%" if ok and r.get("mfu") else "-",
                    gib(r.get("peak_bytes")), gib(r.get("xla_mem_estimate_bytes")),
                    f"{r['compile_s']:.0f}" if ok else "-")
    Console(width=160).print(tab)


def _write(results: list[dict], args, dev, jax_version: str, device_count: int) -> Path:
    from earl_jax.parallel.profile import device_slug

    slug = device_slug(dev.device_kind)
    best = {}
    for r in results:
        if r.get("status") == "ok":
            key = f"{r['kind']}_{r['B']}x{r['T']}"
            if key not in best or r["tok_s"] > best[key]["tok_s"]:
                best[key] = {k: r.get(k) for k in ("remat", "micro_batches", "chunk", "xla_flags", "tok_s", "mfu",
                                                   "peak_bytes")}
    out = {"device": dev.device_kind, "platform": dev.platform, "device_count": device_count,
           "jax": jax_version, "model": args.model, "peak_flops": peak_flops(dev.device_kind),
           "mfu_formula": "(6 N tokens + 12 L H hd T^2 B / 2) / step_s / peak (train, as peer_train.py); "
                          "(2 N tokens + 4 L H hd T^2 B / 2) (experience)",
           "best": best, "peer_baseline": PEER, "results": results,
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_train_{slug}.json"
    path.write_text(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / path.name).write_text(json.dumps(out, indent=1))
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model, small shapes, CPU smoke test")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--shapes", type=parse_shapes, default=None, help="BxT list (default 8x4096,16x2048)")
    p.add_argument("--remat", default=None, help="comma list of none|full|dots|<jax.checkpoint_policies name> "
                   "(default dots,full,none)")
    p.add_argument("--micro-batches", type=lambda s: [int(v) for v in s.split(",")], default=[1])
    p.add_argument("--chunks", type=lambda s: [int(v) for v in s.split(",")], default=None,
                   help="log-prob sequence chunk(s) (default 1024)")
    p.add_argument("--xla-flags", default="", help="';'-separated XLA_FLAGS variants of the train cases "
                   "(isolated runs only); write --xla-flags='--xla_gpu_enable_triton_gemm=false;'")
    p.add_argument("--no-experience", dest="experience", action="store_false")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="one subprocess per case (default: on for GPU, off on CPU)")
    p.add_argument("--time-budget", type=float, default=420.0, help="start no new case after this many seconds")
    p.add_argument("--case-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.one is not None:  # subprocess worker
        print("RESULT " + json.dumps(run_inline(json.loads(args.one))), flush=True)
        return {}

    if args.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.model = "tiny"
        args.shapes = args.shapes or [(2, 128), (4, 64)]
        args.remat = args.remat or "dots"
        args.chunks = args.chunks or [32]
        args.warmup, args.repeats = min(args.warmup, 1), min(args.repeats, 2)
    args.shapes = args.shapes or [(8, 4096), (16, 2048)]
    args.remat = args.remat or "dots,full,none"
    args.chunks = args.chunks or [1024]

    global _PARENT_NO_PREALLOC
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
        # The driver only reads the device kind: it must not grab 75% of the GPU the workers need.
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        _PARENT_NO_PREALLOC = True
    import jax

    dev = jax.devices()[0]
    isolate = args.isolate if args.isolate is not None else dev.platform == "gpu"
    cases = build_cases(args)
    start = time.perf_counter()
    results = []
    for case in cases:
        elapsed = time.perf_counter() - start
        if elapsed > args.time_budget:
            results.append({**case, "status": "skipped (time budget)"})
            continue
        r = run_isolated(case, min(args.case_timeout, max(30.0, args.time_budget + 120 - elapsed))) if isolate \
            else run_inline(case)
        results.append(r)
        brief = {k: r.get(k) for k in ("kind", "B", "T", "remat", "micro_batches", "chunk", "status")}
        if r.get("status") == "ok":
            brief.update(step_ms=round(r["step_s"] * 1e3, 1), tok_s=round(r["tok_s"]),
                         mfu=None if r.get("mfu") is None else round(r["mfu"], 4),
                         peak_gib=None if r.get("peak_bytes") is None else round(r["peak_bytes"] / 2**30, 2))
        else:
            brief["error"] = (r.get("error") or "")[-300:]
        print(json.dumps(brief), flush=True)
        path = _write(results, args, dev, jax.__version__, jax.device_count())  # after each case: a timeout keeps them

    path = _write(results, args, dev, jax.__version__, jax.device_count())
    print_table(results, f"earl-jax train / experience throughput, {args.model} on {dev.device_kind}")
    print(f"wrote {path}")
    return json.loads(path.read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
