"""A stage program that cannot fit its devices' free memory is refused before it runs, as an out-of-memory error."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.compile_cache import count_compiles
from earl_jax.parallel import memory_check
from earl_jax.parallel.memory_check import GIB, ProgramMemoryError, check_fits, program_bytes
from earl_jax.parallel.profile import is_oom_error
from earl_jax.rl.loop.trainer import Trainer
from jobs import SMALL, with_fields


def _fake_compiled(temp: int, out: int, alias: int = 0):
    stats = types.SimpleNamespace(temp_size_in_bytes=temp, output_size_in_bytes=out, alias_size_in_bytes=alias)
    compiled = types.SimpleNamespace(memory_analysis=lambda: stats)
    return lambda: compiled  # what check_fits calls to compile


def test_a_program_larger_than_the_free_memory_is_an_out_of_memory_error(monkeypatch):
    monkeypatch.setattr(memory_check, "free_bytes", lambda devices: 3 * GIB)
    check_fits(_fake_compiled(2 * GIB, GIB, alias=GIB), [], "train/step on d4f1t1")  # 2 GiB: fits
    refused = r"train/step on d4f1t1 needs 4.00 GiB per device .* 3.00 GiB free"
    with pytest.raises(ProgramMemoryError, match=refused) as e:
        check_fits(_fake_compiled(3 * GIB, GIB), [], "train/step on d4f1t1")
    assert is_oom_error(e.value)  # what the planner's fallback and the profile's OOM cells catch


def test_temporaries_must_fit_the_largest_free_block(monkeypatch):
    """XLA's GPU runtime takes a program's temporaries as one buffer: 18 GiB of them failed in a pool with more free
    in all (NOTES.md call 60). Where the allocator reports its largest free block, the temporaries must fit it."""
    monkeypatch.setattr(memory_check, "free_bytes", lambda devices: 20 * GIB)
    monkeypatch.setattr(memory_check, "largest_free_block", lambda devices: 16 * GIB)
    check_fits(_fake_compiled(15 * GIB, GIB), [], "train/step on d4f1t1")  # 16 GiB in all, 15 in one buffer: fits
    with pytest.raises(ProgramMemoryError, match=r"one 18.00 GiB buffer .* largest free block .* 16.00 GiB") as e:
        check_fits(_fake_compiled(18 * GIB, GIB), [], "train/step on d4f1t1")
    assert is_oom_error(e.value)
    monkeypatch.setattr(memory_check, "largest_free_block", lambda devices: None)  # not reported: totals only
    check_fits(_fake_compiled(18 * GIB, GIB), [], "train/step on d4f1t1")


def test_free_memory_is_read_after_compiling(monkeypatch):
    """Compiling can take device memory itself (autotuning, the executable's buffers): what is free for the program
    is what is left after its compile."""
    free = [10 * GIB]
    monkeypatch.setattr(memory_check, "free_bytes", lambda devices: free[0])

    def compile_taking_memory():
        free[0] = 4 * GIB  # the compile took 6 GiB
        return _fake_compiled(5 * GIB, 0)()

    with pytest.raises(ProgramMemoryError, match=r"needs 5.00 GiB .* 4.00 GiB free"):
        check_fits(compile_taking_memory, [], "train/step on d2f1t2")


def test_no_limit_reported_means_no_check():
    # CPU devices report no memory limit: nothing to check against, whatever the program needs
    assert memory_check.free_bytes(jax.devices()) is None
    assert memory_check.largest_free_block(jax.devices()) is None
    check_fits(_fake_compiled(10**15, 0), jax.devices(), "anything")


def test_xla_sizes_count_temporaries_and_outputs_less_donated_reuse():
    x = jnp.ones((256, 256), jnp.float32)  # 256 KiB
    need, _ = program_bytes(jax.jit(lambda a: a @ a + 1).lower(x).compile())
    donated, _ = program_bytes(jax.jit(lambda a: a + 1, donate_argnums=0).lower(x).compile())
    assert need >= x.nbytes  # at least its output
    assert donated < x.nbytes  # the output reuses the donated argument's buffer


def test_the_planner_checks_first_calls_and_falls_back_without_compiling_twice(tmp_path, monkeypatch):
    cfg = with_fields(SMALL, devices=8, run__steps=1, eval__every=0, sft__steps=0, run_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, log=False)
    first = trainer.policy.planner.current.experience.mesh
    checked, refusing = [], [False]
    monkeypatch.setattr(memory_check, "free_bytes", lambda devices: 0 if refusing[0] else 64 * GIB)
    real = memory_check.check_fits

    def check(compile_program, devices, what):
        checked.append(what)
        refusing[0] = what.startswith("experience/") and f" on {first}" in what  # no memory on the first mesh
        real(compile_program, devices, what)

    monkeypatch.setattr(memory_check, "check_fits", check)
    record = trainer.iteration()
    refused = [w for w in checked if w.startswith("experience/") and f" on {first}" in w]
    assert len(refused) == 1  # the first experience program on that mesh: refused, nothing after it ran there
    assert record["parallel/experience_mesh"] != str(first)
    assert any(s == "experience" and m == first for s, m, _ in trainer.policy.planner.selector.oom_marks)
    assert any(w.startswith("train/") for w in checked) and np.isfinite(record["train/loss"])

    # a checked first call lowers and compiles once: the call finds the executable the check compiled
    refusing[0] = False
    probe = jnp.arange(8.0)
    with count_compiles() as c:
        trainer.policy.planner.run("train", lambda r: r.jit("probe_twice", lambda a: a * 2)(probe))
    assert c.lowered == 1, vars(c)
