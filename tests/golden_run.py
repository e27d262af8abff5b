"""One golden case in its own process, with XLA's CPU kernels pinned (tests/test_golden.py starts it).

    python tests/golden_run.py CASE RUN_DIR OUT.json

Pinned so that the float bits do not depend on the host. By default XLA:CPU hands dots to YNNPACK, which picks its
kernels by the CPU it finds; with it off, dots go to Eigen, whose contraction splits the summed dimension into blocks
sized from the host's L1 data cache (32 KiB on AMD EPYC Zen 4: blocks of 200 for a 4000-long sum; 48 KiB on Sapphire
Rapids: longer blocks), so a gradient's sum over tokens rounds differently per host, and Adam turns those ulps into
weight differences of the order of the learning rate wherever a gradient is near zero. So: no YNNPACK / XNNPACK, no
multi-threaded Eigen, and every dot through XLA's own tiled LLVM IR GEMM, which sums the contracted dimension in
order; the instruction set capped at AVX2 (every AVX2 host has FMA) fixes the vector width of that code and of XLA's
reductions. The process runs on at most two CPUs, as recorded (XLA sizes its thread pool from them). The rest of the
suite keeps XLA's default kernels: only this guard compares float bits across machines.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

PINNED = ["--xla_cpu_experimental_ynn_fusion_type=", "--xla_cpu_use_xnnpack=false",
          "--xla_cpu_multi_thread_eigen=false",
          "--xla_backend_extra_options=xla_force_enable_experimental_llvm_ir_gemm"] + (
    ["--xla_cpu_max_isa=AVX2"] if platform.machine() in ("x86_64", "AMD64") else [])
# Metric prefixes that describe what was learned and decided (not how long it took).
KEPT = ("episode/", "eval", "train/", "rollout/context_len", "rollout/turn_context_len_mean", "rollout/tokens",
        "rollout/generated_tokens", "rollout/turn_tokens", "rollout/decode_rows", "parallel/", "curriculum/")


def kept(record: dict) -> dict:
    # the layouts are compared; the selector's reason text (parallel/*_why) is a description of them
    return {k: v for k, v in sorted(record.items()) if k.startswith(KEPT) and not k.endswith("_why")}


def cpuinfo() -> str:
    """/proc/cpuinfo's text, empty where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_vendor() -> str:
    """The CPU's vendor id (`AuthenticAMD`, `GenuineIntel`, ...): the float bits after an update are only shared
    by hosts of the recording's vendor (tests/test_golden.py)."""
    for line in cpuinfo().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(case: str, run_dir: str, out: str) -> None:
    import jax
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    from earl_jax.rl.loop.trainer import Trainer
    from golden_configs import golden_config

    trainer = Trainer(golden_config(case, run_dir), log=False)
    history = trainer.run()
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(trainer.params):
        h.update(np.asarray(leaf).tobytes())
    got = {"jax": jax.__version__, "devices": jax.device_count(), "cpu_vendor": cpu_vendor(),
           "history": [kept(r) for r in history], "params_sha256": h.hexdigest()}
    Path(out).write_text(json.dumps(got))


if __name__ == "__main__":
    assert all(f in os.environ.get("XLA_FLAGS", "") for f in PINNED), "start it from tests/test_golden.py"
    if hasattr(os, "sched_setaffinity"):  # XLA sizes its thread pool from the CPUs it may use: at most two
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
    main(*sys.argv[1:4])
