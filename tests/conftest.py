"""Tests run on CPU with 8 fake devices so meshes, resharding and the selector are exercised."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# The suite is mostly XLA compiles of tiny programs: LLVM's optimizations cost more than they save here
# (one compile-bound test, cold: 88 -> 76 s). Every program of a test is built the same way, so comparisons hold.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
# XLA's newer MLIR fusion emitters compile slower than the classic ones on these tiny programs (one compile-bound
# test, cold, alone: 64 -> 45 s; the suite in CI had grown past its 15 minutes on the same code).
if "xla_cpu_use_fusion_emitters" not in _flags:
    _flags += " --xla_cpu_use_fusion_emitters=false"
# LLVM: one module per program instead of split parts (two workers already fill two cores) and no expensive passes:
# two compile-bound tests alone, cold, 55.7 / 57.6 s against 60.7 / 66.2 s.
for _flag in ("--xla_cpu_parallel_codegen_split_count=1", "--xla_llvm_disable_expensive_passes=true"):
    if _flag.split("=")[0] not in _flags:
        _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()

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


# The longest tests first (measured from a clean clone, 2 workers), then the other `slow` ones: started last,
# they would run alone at the end of `pytest -n 2` with the other worker idle.
_FIRST = ("test_constrained_policy_learns_the_digit_shown_on_turn_two",
          "test_policy_learns_to_read_the_first_observation", "test_fig1_small_runs_static_and_selector",
          "test_each_stage_receives_what_the_plan_says",
          "test_coarse_cache_sizes_reach_the_stages_and_compile_fewer_decode_programs",
          "test_train_pass_scores_exactly_the_sampled_tokens", "test_short_run_logs_every_metric_and_checkpoints",
          "test_connect4_two_processes_match_one", "test_small_figure_runs_merge_into_one_json_and_refuse_other_settings")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = getattr(item, "originalname", None) or item.name
        if name in _FIRST:
            return 0, _FIRST.index(name)
        return (1, 0) if item.get_closest_marker("slow") else (2, 0)

    items.sort(key=rank)  # stable: the rest keep their order
