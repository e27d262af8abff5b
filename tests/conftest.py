"""Tests run on CPU with 8 fake devices so meshes, resharding and the selector are exercised."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (must come after the flags above)

jax.config.update("jax_enable_x64", False)
# Many tests build the same programs (each Trainer re-jits its stages): a persistent compilation cache,
# shared by the xdist workers, turns the repeats into cache hits. Compiled code is keyed by its HLO.
_CACHE = os.environ.get("EARL_TEST_COMPILE_CACHE",
                        os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "jax_compile"))
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_CACHE))
# Jobs the tests start as subprocesses (connect4.py via fig1, ...) share it instead of the user's cache dir.
os.environ.setdefault("EARL_COMPILE_CACHE", os.path.abspath(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"
