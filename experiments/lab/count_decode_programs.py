"""How many sampler programs (init, grow, take, extend, generate) the first evaluation and the first RL iteration
of the pod-shaped job compile, with the default KV cache sizes and with --rollout.cache-growth 4.

    python experiments/lab/count_decode_programs.py  # CPU, 4 fake devices, tiny model (counts do not depend on
                                                            # size)

Compact prompts, 8-token answers, max context 4096, 64 games: the pod preset's rollout shape. Writes
experiments/results/count_decode_programs_cpu.json.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from earl_jax.rl.loop.job_config import JobConfig  # noqa: E402
from earl_jax.rl.loop.trainer import Trainer  # noqa: E402
from earl_jax.rollout import sampler as sampler_module  # noqa: E402

KINDS = {"_init_impl": lambda a: a[:2], "_grow_impl": lambda a: a[1:2], "_take_impl": lambda a: a[2:3],
         "_extend_impl": lambda a: tuple(a[2].shape), "_generate_impl": lambda a: a[4:5]}


def count(growth: float) -> dict:
    traced = collections.Counter()
    originals = {name: getattr(sampler_module.Sampler, name) for name in KINDS}

    def spy(name):
        def traced_fn(self, *args, **kw):  # runs once per new program (jax traces it)
            traced[f"{name.strip('_').removesuffix('_impl')} {KINDS[name](args)}"] += 1
            return originals[name](self, *args, **kw)
        return traced_fn

    for name in KINDS:
        setattr(sampler_module.Sampler, name, spy(name))
    try:
        cfg = JobConfig.from_dict({
            "env": {"game": "connect_four", "prompt_style": "compact"},
            "rollout": {"max_turn_tokens": 8, "max_context": 4096, "groups": 8, "group_size": 8,
                        "cache_growth": growth},
            "run": {"steps": 1, "checkpoint_every": 0, "progress": False, "wandb_mode": "disabled",
                    "run_dir": tempfile.mkdtemp()},
            "sft": {"steps": 0}, "eval": {"games": 16, "every": 0}, "planner": {"devices": 4}})
        trainer = Trainer(cfg, log=False)
        trainer.evaluate()
        evaluation = sum(traced.values())
        trainer.iteration()
    finally:
        for name, fn in originals.items():
            setattr(sampler_module.Sampler, name, fn)
    return {"rollout_cache_growth": growth, "evaluation": evaluation,
            "first_iteration": sum(traced.values()) - evaluation, "programs": dict(sorted(traced.items()))}


def main() -> None:
    rows = [count(0.0), count(4.0)]
    for r in rows:
        print(f"growth {r['rollout_cache_growth']}: evaluation {r['evaluation']}, "
              f"first iteration {r['first_iteration']}")
    path = ROOT / "experiments" / "results" / "count_decode_programs_cpu.json"
    path.write_text(json.dumps({"device": "cpu (4 fake devices)", "rows": rows}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
