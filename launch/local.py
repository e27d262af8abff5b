"""Run one command as N local processes of one jax.distributed job, and wait for all of them.

    python launch/local.py --num-processes 2 --cpu-devices 4 -- python experiments/connect4.py --steps 2

Each process gets EARL_COORDINATOR (127.0.0.1 and a free port), EARL_NUM_PROCESSES and EARL_PROCESS_ID,
which `earl_jax.distributed.maybe_initialize` reads. With --cpu-devices K every process runs on CPU
with K fake devices (a multi-host test on one machine); without it the processes see the machine's
accelerators (give each its own with --devices-per-process on a multi-GPU host).

Process 0's output goes to the terminal; the others' to <log-dir>/process_<i>.log (all of them with
--log-dir and --quiet-main). If any process fails, the others are stopped and the exit code is that
process's; --timeout bounds the whole job.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_xla_flags(flags: str, devices: int) -> str:
    """XLA_FLAGS with the fake CPU device count set to `devices` (any earlier count dropped, other flags kept)."""
    kept = [f for f in flags.split() if "xla_force_host_platform_device_count" not in f]
    return " ".join(kept + [f"--xla_force_host_platform_device_count={devices}"])


def process_env(i: int, n: int, coordinator: str, cpu_devices: int | None = None,
                devices_per_process: int | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(EARL_COORDINATOR=coordinator, EARL_NUM_PROCESSES=str(n), EARL_PROCESS_ID=str(i))
    if cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = cpu_xla_flags(env.get("XLA_FLAGS", ""), cpu_devices)
    if devices_per_process:
        ids = range(i * devices_per_process, (i + 1) * devices_per_process)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
    return env


def launch(command: list[str], num_processes: int, *, cpu_devices: int | None = None,
           devices_per_process: int | None = None, log_dir: str | Path | None = None, quiet_main: bool = False,
           timeout: float | None = None, port: int | None = None, cwd: str | Path | None = None,
           grace: float = 60.0) -> int:
    """Start the processes, wait for all; the first failure stops the rest. Returns the job's exit code. Processes
    being stopped get SIGTERM and `grace` seconds to finish their iteration and write a checkpoint, then SIGKILL."""
    coordinator = f"127.0.0.1:{port or free_port()}"
    logs = Path(log_dir) if log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i in range(num_processes):
        out = None
        if logs and (i > 0 or quiet_main):
            out = open(logs / f"process_{i}.log", "w")
        elif i > 0:
            out = subprocess.DEVNULL
        files.append(out)
        procs.append(subprocess.Popen(command, env=process_env(i, num_processes, coordinator, cpu_devices,
                                                               devices_per_process),
                                      stdout=out, stderr=subprocess.STDOUT if out is not None else None,
                                      cwd=cwd, start_new_session=True))
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0

    def stop(signum, frame):  # SIGTERM to the launcher stops the whole job (the finally below)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while [p.poll() for p in procs].count(None):  # poll every process (any() would stop at the first)
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0].returncode
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"launch/local.py: timed out after {timeout:.0f}s", file=sys.stderr)
                code = 124
                break
            time.sleep(0.2)
        else:
            code = next((p.returncode for p in procs if p.returncode), 0)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs:  # a process whose peer died would wait for it forever
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in files:
            if f not in (None, subprocess.DEVNULL):
                f.close()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", "-n", type=int, required=True)
    parser.add_argument("--cpu-devices", type=int, default=None, help="run on CPU with this many fake devices each")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="GPUs per process on a multi-GPU host (sets CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--log-dir", default=None, help="write process i's output to LOG_DIR/process_i.log")
    parser.add_argument("--quiet-main", action="store_true", help="process 0 logs to the folder too")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the whole job is stopped")
    parser.add_argument("--grace", type=float, default=60.0,
                        help="seconds a stopped process gets to write its checkpoint before SIGKILL (default 60)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every process runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- python experiments/connect4.py")
    if args.num_processes < 1:
        parser.error("--num-processes must be >= 1")
    if shutil.which(command[0]) is None:  # before any process starts: no half-started job to stop
        parser.error(f"{command[0]!r} is not a program this shell can run; give the command in full, e.g. -- python "
                     "experiments/connect4.py")
    return launch(command, args.num_processes, cpu_devices=args.cpu_devices,
                  devices_per_process=args.devices_per_process, log_dir=args.log_dir, quiet_main=args.quiet_main,
                  timeout=args.timeout, port=args.port, grace=args.grace)


if __name__ == "__main__":
    sys.exit(main())
