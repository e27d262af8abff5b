"""Behaviour guard: the main jobs' first iterations reproduce recorded values (CPU, 8 fake devices).

Each case runs in its own process with XLA's CPU kernels pinned (tests/golden_run.py says which and why). Two checks:
- on any host, the first iteration (a rollout from the initial weights, its losses and gradients) equals the
  recording within float rounding (`_close`: floats to a relative 1e-5, everything else exactly);
- on a host of the recording's CPU vendor and jax build, every iteration and the final weights equal it to the float
  bit (`_differences`). After an update the bits are the host's: on an Intel Xeon (jax 0.10.2 and 0.11.2)
  `train/grad_norm` differs in its seventh digit, Adam turns such ulps into weight differences near the learning rate
  where a gradient is near zero, and the next rollout samples other tokens. On another host that part skips, saying so.
Recorded from the code before a refactor (`EARL_RECORD_GOLDEN=1 python -m pytest tests/test_golden.py`); a change that
alters behaviour on purpose re-records them and says so in its commit. What is compared: returns, win rates, losses,
KL, entropy, gradient norms, context lengths, the layouts chosen, evaluation rates, and a digest of the final weights;
not wall times, compile counts or memory figures, nor metrics added since the recording.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from golden_configs import CASES
from golden_run import PINNED, cpuinfo

FIXTURES = Path(__file__).parent / "fixtures" / "golden"
RECORD = os.environ.get("EARL_RECORD_GOLDEN") == "1"


def _run(case: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{case}.json"
    env = {**os.environ, "XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""), *PINNED]).strip()}
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "golden_run.py"), case,
                           str(tmp_path / case), str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _differences(got: dict, want: dict) -> list[str]:
    """Every way `got` differs from the recorded `want`, to the float bit; empty when equal."""
    if len(got["history"]) != len(want["history"]):
        return [f"{len(got['history'])} iterations, recorded {len(want['history'])}"]
    out = []
    for step, (g, w) in enumerate(zip(got["history"], want["history"]), start=1):
        # a metric logged since the recording is a new measurement, not new behaviour: the recorded ones must all
        # be there, to the bit
        if set(w) - set(g):
            out.append(f"iteration {step}: recorded metrics missing: {sorted(set(w) - set(g))}")
            continue
        diff = {k: (w[k], g[k]) for k in w if g[k] != w[k]}
        if diff:
            out.append(f"iteration {step}: (recorded, now) {diff}")
    if got["params_sha256"] != want["params_sha256"]:
        out.append("the final weights differ")
    return out


def _close(got: dict, want: dict, rtol: float = 1e-5) -> list[str]:
    """Every recorded metric of the first iteration that `got` does not match within float rounding: floats to
    `rtol` (relative; 1e-7 absolute near zero), integers, strings and layouts exactly."""
    g, w = got["history"][0], want["history"][0]
    out = [f"iteration 1: recorded metrics missing: {sorted(set(w) - set(g))}"] if set(w) - set(g) else []
    for k, v in w.items():
        if k not in g:
            continue
        both_float = isinstance(v, float) and isinstance(g[k], float)
        if not (np.isclose(g[k], v, rtol=rtol, atol=1e-7) if both_float else g[k] == v):
            out.append(f"iteration 1: {k} recorded {v!r}, now {g[k]!r}")
    return out


def test_the_first_iteration_check_takes_rounding_and_sees_a_change():
    want = json.loads((FIXTURES / f"{CASES[0]}.json").read_text())
    first = want["history"][0]
    floats = [k for k, v in first.items() if isinstance(v, float) and abs(v) > 1e-3]
    ints = [k for k, v in first.items() if isinstance(v, int) and not isinstance(v, bool)]
    assert len(floats) > 5 and ints
    for k in floats:
        got = json.loads(json.dumps(want))
        got["history"][0][k] = float(np.nextafter(np.float32(first[k]), np.float32(np.inf)))  # one float32 ulp
        assert _close(got, want) == [], k
        got["history"][0][k] = first[k] * (1 + 1e-4)
        assert _close(got, want), k
    got = json.loads(json.dumps(want))
    got["history"][0][ints[0]] += 1
    assert _close(got, want)


def test_the_guard_sees_a_one_ulp_change_in_any_compared_field():
    want = json.loads((FIXTURES / f"{CASES[0]}.json").read_text())
    assert _differences(json.loads(json.dumps(want)), want) == []
    floats = [(i, k) for i, r in enumerate(want["history"]) for k, v in r.items() if isinstance(v, float) and v != 0]
    assert len(floats) > 20
    for i, k in floats[:: max(1, len(floats) // 25)] + [(1, "train/grad_norm")]:
        got = json.loads(json.dumps(want))
        v = got["history"][i][k]
        got["history"][i][k] = float(np.nextafter(np.float32(v), np.float32(np.inf)))  # one float32 ulp
        assert got["history"][i][k] != v and _differences(got, want), k
    got = json.loads(json.dumps(want))
    got["params_sha256"] = "0" * 64
    assert _differences(got, want) == ["the final weights differ"]
    got = json.loads(json.dumps(want))
    del got["history"][0]["train/kl"]
    got["history"][1]["train/new_metric"] = 1.0
    assert _differences(got, want) == ["iteration 1: recorded metrics missing: ['train/kl']"]


@pytest.mark.skipif("avx2" not in cpuinfo(),
                    reason="recorded with XLA's CPU kernels capped at AVX2; this host has no AVX2")
@pytest.mark.parametrize("case", CASES)
def test_first_iterations_match_the_recorded_values(case, tmp_path):
    got = json.loads(json.dumps(_run(case, tmp_path)))  # the JSON round trip the fixture went through
    path = FIXTURES / f"{case}.json"
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"recorded {path.name}")
    want = json.loads(path.read_text())
    if want["devices"] != got["devices"]:
        pytest.skip(f"recorded on {want['devices']} devices; this run has {got['devices']}")
    problems = _close(got, want)
    assert not problems, "\n".join(problems)
    # EARL_GOLDEN_ANY_JAX=1 compares the bits across jax versions (see the module docstring for what differs)
    same_build = want["jax"] == got["jax"] or os.environ.get("EARL_GOLDEN_ANY_JAX") == "1"
    if not same_build or want["cpu_vendor"] != got["cpu_vendor"]:
        pytest.skip(f"the first iteration matched within float rounding; the bits after it are compared only on "
                    f"hosts of vendor {want['cpu_vendor']} with jax {want['jax']} "
                    f"(this: {got['cpu_vendor']}, jax {got['jax']})")
    problems = _differences(got, want)
    assert not problems, "\n".join(problems)
