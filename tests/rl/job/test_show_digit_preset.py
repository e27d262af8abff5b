"""`--preset show-digit` is the probe's measured candidate: the config the preset gives equals the one
experiments/show_digit_probe.py ran for "format_mixed_mb8_g8x16" (docs/learning.md quotes those runs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from earl_jax.rl.job.entry import parse_job

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "experiments" / "configs" / "train"


def _probe():
    spec = importlib.util.spec_from_file_location("show_digit_probe", ROOT / "experiments" / "show_digit_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_preset_is_the_measured_candidate():
    probe = _probe()
    same = ["--run.run-dir", "/tmp/x", "--run.resume", "auto", "--run.wandb-mode", "disabled",
            "--run.progress", "false"]
    ran = parse_job([*probe.BASE, *probe.CANDIDATES["format_mixed_mb8_g8x16"], *same], CONFIGS).config
    preset = parse_job(["--preset", "show-digit", *same], CONFIGS).config
    assert preset.to_dict() == ran.to_dict()
    other = parse_job([*probe.BASE, *probe.CANDIDATES["format_mixed_mb16"], *same], CONFIGS).config
    assert preset.to_dict() != other.to_dict()  # the comparison sees a changed field
