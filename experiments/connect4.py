"""The main job: train an LLM policy to play Connect Four by RL.

    python experiments/connect4.py                       # embedded default: CPU, tiny model, random opponent
    python experiments/connect4.py --help                 # every field of RLConfig as a flag
    python experiments/connect4.py --preset qwen0.5b --hf-checkpoint /path/to/Qwen2.5-0.5B-Instruct
    python experiments/connect4.py --preset pod           # GPUs: the largest model that fits them (earl_jax/rl/pod.py)
    python experiments/connect4.py --preset gpu           # one GPU, 15 minutes (earl_jax/rl/gpu_preset.py)

The run folder (--run-dir) receives config.json, metrics.jsonl, checkpoints/ and curves.png.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone: no install needed

from earl_jax.rl.config import RLConfig
from earl_jax.rl.gpu_preset import CONNECT4_GPU_FIELDS, gpu_preset
from earl_jax.rl.pod import pod_preset_for_this_machine

# Constrained moves (the policy picks among the legal moves' tokens, earl_jax/rollout/moves.py) with a higher learning
# rate and an entropy floor over the legal moves: 0.69 -> 0.87-0.92 greedy against random on 2 CPU cores
# (experiments/results/learning_notes.md, section 8). Free-text answers: --constrain-moves false.
DEFAULT = RLConfig(game="connect_four", run_dir="runs/connect4", constrain_moves=True, learning_rate=2e-3,
                   entropy_coef=0.1, entropy_floor=0.5, filter_constant_groups=False)

PRESETS = {
    "tiny-cpu": lambda: DEFAULT,
    # A pretrained Qwen2.5 model from a local Hugging Face folder, on GPU: chat-style prompts, longer answers.
    "qwen0.5b": lambda: dataclasses.replace(
        DEFAULT, model="qwen2.5-0.5b", prompt_style="chat", max_turn_tokens=64, max_context=4096, groups=16,
        group_size=8, learning_rate=1e-6, warmup_steps=10, format_warmup_steps=0, kl_coef=0.001,
        eval_opponents=("random", "alphabeta:2"), micro_batch_tokens=65536, run_dir="runs/connect4-qwen0.5b",
        constrain_moves=False),
    # One GPU, 15 minutes: tiny model, 2048 games, curriculum to alphabeta:2, rehearsal (reasons in gpu_preset.py).
    "gpu": lambda: gpu_preset(DEFAULT, "runs/connect4-gpu", **CONNECT4_GPU_FIELDS),
    # Sized for this machine's devices (count, memory): the largest Qwen2.5 shape that fits, or --hf-checkpoint.
    "pod": lambda flags: pod_preset_for_this_machine(flags, DEFAULT),
    # EARL's setting: REINFORCE++ estimator, free-text answers.
    "earl": lambda: dataclasses.replace(DEFAULT, algorithm="reinforce_pp", constrain_moves=False, run_dir="runs/connect4-earl"),
}


def main(argv: list[str] | None = None, default: RLConfig = DEFAULT, presets=PRESETS, name: str = "connect4") -> None:
    from earl_jax import distributed
    from earl_jax.cli import parse_config
    from earl_jax.compile_cache import enable_compile_cache
    from earl_jax.progress import show_progress_logs
    from earl_jax.rl.plots import plot_run
    from earl_jax.rl.trainer import Trainer

    cfg = parse_config(RLConfig, argv, description=__doc__, presets=presets, base=default)
    # Before anything touches a device: join the multi-process job, if this process is part of one.
    distributed.maybe_initialize(cfg.coordinator, cfg.num_processes, cfg.process_id)
    show_progress_logs(distributed.is_main())  # model creation / loading / cache lines, process 0 only
    enable_compile_cache(cfg.compile_cache or None)  # before the first compile: restarts reuse the programs
    trainer = Trainer(cfg)
    history = trainer.run()
    if distributed.is_main():  # only process 0 writes metrics.jsonl, plots and prints
        png = plot_run(Path(cfg.run_dir) / "metrics.jsonl", Path(cfg.run_dir) / "curves.png", title=name)
        last = history[-1] if history else {}
        print(f"{name}: {trainer.step} iterations; eval win {last.get('eval/win_rate')}, "
              f"draw {last.get('eval/draw_rate')}, invalid {last.get('eval/invalid_rate')}; curves: {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
