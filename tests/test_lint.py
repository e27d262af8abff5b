"""`ruff check` (pyproject.toml's [tool.ruff]: pycodestyle, pyflakes, isort; lines up to 120) is clean on the repo.

ruff is in requirements.txt, so a missing ruff fails here rather than skipping: CI installs the requirements.
`ruff format` is not enforced (pyproject.toml says why)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True)
    if "No module named ruff" in run.stderr:
        raise AssertionError("ruff is not installed: pip install -r requirements.txt")
    assert run.returncode == 0, f"ruff check found problems (fix them or `ruff check --fix`):\n{run.stdout}{run.stderr}"
