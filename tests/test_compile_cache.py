"""The persistent compilation cache helper, in fresh processes (the test process already has a cache)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax

from earl_jax.compile_cache import enable_compile_cache

ROOT = Path(__file__).resolve().parents[1]

# Compiles two small programs (arange, then the jitted function): both well under jax's default 1 s
# threshold, so seeing them cached also shows the thresholds were lowered.
CHILD = """
import json, sys
import jax, jax.numpy as jnp
from earl_jax.compile_cache import count_compiles, enable_compile_cache

if sys.argv[2]:
    jax.config.update("jax_compilation_cache_dir", sys.argv[2])  # a cache someone configured before us,
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # with their own thresholds
folder = enable_compile_cache(sys.argv[1] or None)
with count_compiles() as c:
    jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(8.0)).block_until_ready()
print(json.dumps({"folder": folder, "compiled": c.compiled, "hits": c.cache_hits, "trace_s": c.trace_s,
                  "lower_s": c.lower_s}))
"""


def _run(tmp_path, arg: str = "", preset: str = "", env: dict | None = None) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("EARL_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")}
    base.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path / "xdg"), **(env or {}))
    out = subprocess.run([sys.executable, "-c", CHILD, arg, preset], env=base, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_second_process_loads_every_program_from_the_default_cache(tmp_path):
    default = tmp_path / "xdg" / "earl_jax" / "jax_compile"  # $XDG_CACHE_HOME/earl_jax/jax_compile
    first = _run(tmp_path)
    assert first["folder"] == str(default) and first["compiled"] >= 2 and first["hits"] == 0
    assert len(_files(default)) >= first["compiled"]
    second = _run(tmp_path)
    assert second["compiled"] == 0 and second["hits"] == first["compiled"]
    assert second["trace_s"] > 0 and second["lower_s"] > 0  # a warm start still traces and lowers: counted


def test_argument_beats_environment(tmp_path):
    got = _run(tmp_path, arg=str(tmp_path / "arg"), env={"EARL_COMPILE_CACHE": str(tmp_path / "env")})
    assert got["folder"] == str(tmp_path / "arg") and _files(tmp_path / "arg")
    assert not (tmp_path / "env").exists()
    got = _run(tmp_path, env={"EARL_COMPILE_CACHE": str(tmp_path / "env")})
    assert got["folder"] == str(tmp_path / "env") and _files(tmp_path / "env")


def test_off_leaves_every_folder_untouched(tmp_path):
    for kw in (dict(arg="off"), dict(env={"EARL_COMPILE_CACHE": "off"}), dict(arg="OFF")):
        got = _run(tmp_path, **kw)
        assert got["folder"] is None and got["hits"] == 0 and got["compiled"] >= 2
    assert not (tmp_path / "xdg").exists()


def test_an_already_configured_cache_is_respected(tmp_path):
    preset = tmp_path / "preset"
    got = _run(tmp_path, arg=str(tmp_path / "mine"), preset=str(preset))
    assert got["folder"] == str(preset) and _files(preset)
    assert not (tmp_path / "mine").exists() and not (tmp_path / "xdg").exists()
    # and in this process, where conftest configured the test suite's cache
    configured = jax.config.jax_compilation_cache_dir
    assert configured and enable_compile_cache(str(tmp_path / "other")) == configured
    assert not (tmp_path / "other").exists()


def test_nested_counters_count_the_same_program_and_close_cleanly():
    import jax.numpy as jnp

    from earl_jax.compile_cache import count_compiles

    with count_compiles() as outer:
        with count_compiles() as inner:  # equal fields at the start: each still leaves only itself
            jax.jit(lambda x: x * 7 + 2)(jnp.arange(5.0)).block_until_ready()
        assert inner.lowered >= 1 and outer.lowered == inner.lowered
        jax.jit(lambda x: x * 5 - 1)(jnp.arange(6.0)).block_until_ready()  # the outer one still counts
        assert outer.lowered > inner.lowered
    with count_compiles() as later:
        pass
    assert later.lowered == 0
