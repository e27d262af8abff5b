"""Tests run on CPU with 8 fake devices so meshes, resharding and the selector are exercised."""
import gc
import logging
import os
from importlib.metadata import version

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Subprocesses (golden runs, jobs, workers) import this checkout, not whatever an editable install points to.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
_flags = os.environ.get("XLA_FLAGS", "")
_JAXLIB = tuple(int(x) for x in version("jaxlib").split(".")[:2])  # read before jax is imported: the flags go first
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# The suite is mostly XLA compiles of tiny programs: LLVM's optimizations cost more than they save here
# (one compile-bound test, cold: 88 -> 76 s). Every program of a test is built the same way, so comparisons hold.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
# XLA's newer MLIR fusion emitters compile slower than the classic ones on these tiny programs (one compile-bound
# test, cold, alone: 64 -> 45 s; the suite in CI had grown past its 15 minutes on the same code). jaxlib 0.11's XLA
# has no such flag and aborts on it.
if _JAXLIB < (0, 11) and "xla_cpu_use_fusion_emitters" not in _flags:
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
# Not 0 (every program, as earl_jax.compile_cache does for users): tried, the whole suite was no faster (17 min 47 s
# from a clean clone, in the machine's noise) and a cached control program hid the XLA warning that
# test_dispatch's rematerialization check needs, so that test skipped.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_configure(config):
    # -n 2 on CI's 2 cores: -n 3 was slower from a clean clone (past 17.5 minutes, stopped, against 14.5)
    # `-n N` without --dist means xdist's "load", which first hands each worker a run of consecutive tests (a quarter
    # of its share): with the longest tests first (below) one worker got all of them while the other idled (a
    # ~5-minute tail). worksteal lets an idle worker take tests from the busy one. Not in addopts: `-p no:xdist`
    # would then refuse the unknown --dist. A worker then runs other modules' tests between one module's, which tears
    # a module-scoped fixture down and builds it again: the fixtures that build something are session-scoped.
    if getattr(config.option, "dist", "no") == "load" and "--dist" not in " ".join(config.invocation_params.args):
        config.option.dist = "worksteal"


def pytest_report_header(config):
    dist = getattr(config.option, "dist", "no")
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}, xdist: {dist}"


# The longest tests first, longest to shortest (each name's slowest case from a clean clone, 2 workers, in seconds
# after it), then the other `slow` ones: a long test started last runs alone at the end of `pytest -n 2` with the
# other worker idle (a 2-minute tail before this list covered every test over ~12 s).
_FIRST = (
    "test_first_iterations_match_the_recorded_values",  # 65
    "test_constrained_policy_learns_the_digit_shown_on_turn_two",  # 48
    "test_policy_learns_to_read_the_first_observation",  # 44
    "test_small_figure_runs_merge_into_one_json_and_refuse_other_settings",  # 39
    "test_connect4_two_processes_match_one",  # 30
    "test_the_fork_doc_task_trains_from_the_stock_command_line_and_resumes",  # 29
    "test_partial_rollouts_ahead_of_training_keep_the_bound_on_each_rollouts_own_tokens",  # 29
    "test_the_same_command_builds_the_same_base",  # 26
    "test_a_corrupt_newest_checkpoint_costs_one_warning_line",  # 25
    "test_each_stage_receives_what_the_plan_says",  # 23
    "test_bench_overlap_compares_each_mode_with_the_synchronous_loop",  # 22
    "test_fig1_small_runs_static_and_selector",  # 22
    "test_a_budget_nothing_reaches_is_the_run_without_one_bit_for_bit",  # 21
    "test_fig3_small_real_measure_and_profile_table",  # 20
    "test_the_entropy_floor_keeps_a_collapsed_run_learning",  # 20
    "test_a_paged_cache_with_room_for_every_game_plays_the_lock_step_games",  # 19
    "test_fused_attention_and_multi_step_loop_give_the_same_generation",  # 18
    "test_a_collapsed_run_has_no_gradient_and_says_so",  # 18
    "test_killed_and_resumed_run_is_bit_exact",  # 17
    "test_two_processes_under_sigterm_save_the_same_step",  # 17
    "test_the_trainer_compiles_compaction_ahead_when_the_next_rollout_compacts",  # 16
    "test_a_run_reads_its_clock_and_a_resumed_part_continues_it",  # 16
    "test_ppo_mini_batches_make_that_many_updates_an_iteration",  # 16
    "test_a_stop_signal_mid_iteration_checkpoints_the_last_one_and_the_resumed_run_is_bit_exact",  # 15
    "test_trainer_promotes_on_a_forced_evaluation_and_the_rung_survives_resume",  # 15
    "test_a_build_from_saved_games_adds_their_mirror_images_and_learns_best_sets",  # 15
    "test_rollouts_ahead_keep_the_bound_on_their_own_devices_and_a_stopped_run_resumes_with_the_same_batches",  # 15
    "test_train_keeps_one_model_and_rollout_keeps_one_per_mesh",  # 15
    "test_the_job_loads_the_base_and_plays_the_games_the_build_reported",  # 13
    "test_carried_episodes_train_later_with_the_version_and_log_prob_of_each_token",  # 13
    "test_evaluate_run_plays_a_task_runs_held_out_split",  # 13
    "test_few_new_widths_per_iteration_compile_less_and_change_nothing",  # 13
    "test_bench_train_tiny",  # 12
    "test_drafted_programs_are_compiled_ahead_and_change_nothing",  # 12
    "test_a_resume_plays_the_carried_groups_again_from_their_start",  # 12
    "test_resume_without_flags_keeps_the_run_and_prints_each_override",  # 11
    "test_deferred_widths_of_experience_and_train_are_compiled_ahead",  # 11
    "test_predicted_programs_are_compiled_before_the_calls_and_change_nothing",  # 11
    "test_a_resume_with_rollouts_ahead_keeps_the_waiting_batches_and_the_carry_into_the_next",  # 11
    "test_train_pass_scores_exactly_the_sampled_tokens",  # 11
    "test_several_runs_give_each_result_and_the_mean_and_spread",  # 11
    "test_on_shared_devices_the_rollout_ahead_interleaves_with_training",  # 11
    "test_league_iterations_play_frozen_snapshots_that_do_not_train",  # 10
    "test_the_kl_reference_is_the_warmed_up_policy_and_a_resume_keeps_it",  # 10
    "test_trainer_plays_the_same_games_with_and_without_compiling_ahead",  # 10
    "test_a_carried_game_sampled_again_from_a_prefilled_cache_draws_the_same_tokens",  # 10
    "test_short_run_logs_every_metric_and_checkpoints",  # 10
    "test_sft_runs_on_the_layout_the_planner_chose_and_its_loss_falls",  # 10
    "test_another_scripts_resume_is_refused_naming_both",  # 10
    "test_grouped_equals_padded",  # 9
    "test_dispatcher_across_two_processes",  # 9
    "test_a_job_keeps_its_index_across_iterations_and_logs_what_was_drafted",  # 9
    "test_no_full_rematerialization_on_stage_layouts",  # 9
    # the rest: under ~9 s in that run, in the order of an earlier one
    "test_same_outputs_on_every_mesh",
    "test_a_tiny_build_trains_measures_and_writes_a_loadable_base",
    "test_connect_four_turns_are_a_legal_move_then_the_stop_token",
    "test_a_greedy_rollout_drafted_from_its_own_answers_plays_the_same_games",
    "test_a_registered_loss_logs_its_own_metrics_and_is_listed_in_the_help",
    "test_drafts_verify_on_a_mesh_as_on_one_device",
    "test_with_the_digit_hidden_every_game_gets_one_answer",
    "test_out_of_memory_in_a_stage_reruns_it_on_the_next_mesh",
    "test_the_trainer_collects_automatically_again_after_its_first_iteration",
    "test_evaluates_the_checkpoint_against_each_opponent_and_leaves_the_run_as_it_was",
    "test_trainer_leaves_a_stalled_rung_from_the_flag",
    "test_the_planner_checks_first_calls_and_falls_back_without_compiling_twice",
    "test_halves_played_apart_are_the_games_of_the_whole_batch_and_gather_back",
    "test_micro_batched_stages_equal_one_batch_on_every_mesh",
    "test_rehearsal_replays_the_rungs_below_in_turn_in_the_last_groups",
    "test_train_measure_holds_one_copy_of_the_weights",
    "test_coarse_cache_sizes_reach_the_stages_and_compile_fewer_decode_programs",
    "test_training_beats_at_every_phase_under_the_configured_timeout",
    "test_sft_trains_the_float32_weights_whatever_the_compute_dtype",
    "test_rehearsal_and_the_league_share_a_batch",
    "test_a_stuck_cell_ends_its_process_and_the_next_run_records_it_hung",
    "test_the_guide_s_stage_runs_under_its_plan_and_is_logged",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = getattr(item, "originalname", None) or item.name
        if name in _FIRST:
            return 0, _FIRST.index(name)
        return (1, 0) if item.get_closest_marker("slow") else (2, 0)

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _collect_then_freeze():
    """After each test its garbage is collected and what survives it (JAX's caches, session fixtures) frozen, so that
    a later full collection (each Trainer makes one after its first iteration, rl/loop/gc_control.py) walks only the
    newer objects, not everything earlier tests left alive. A frozen object that later becomes cyclic garbage is
    freed only by its reference count."""
    yield
    gc.collect()
    gc.freeze()


_EARL_LOG = logging.getLogger("earl_jax")
_EARL_LOG_AT_START = (list(_EARL_LOG.handlers), _EARL_LOG.propagate, _EARL_LOG.level)


def _earl_log_as_at_start() -> None:
    _EARL_LOG.handlers[:] = _EARL_LOG_AT_START[0]
    _EARL_LOG.propagate, _EARL_LOG.level = _EARL_LOG_AT_START[1:]


@pytest.fixture(autouse=True)
def _earl_logger_as_at_start():
    """A job's `main` (earl_jax.progress.show_progress_logs) leaves the "earl_jax" logger printing to the stderr of the
    test that ran it, closed after it, and no longer propagating: a later test's caplog would see none of its lines.
    Every test starts and ends with the logger as the session found it (a module fixture may have run a main too)."""
    _earl_log_as_at_start()
    yield
    _earl_log_as_at_start()
