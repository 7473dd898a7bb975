"""One copy of a JAX check script per GPU under jax.distributed: the launcher the scripts share.
The parent runs each copy with --process-id, --coordinator (a free local port) and --seed (one
fresh seed for all, so that every process draws the same inputs)."""

import argparse
import os
import socket
import subprocess
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--processes", type=int, default=0,
                        help="launch this many processes, one GPU each (0: one process, every GPU)")
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)


def launch(script: str, processes: int) -> int:
    """Runs `processes` copies of `script` with this process's arguments; the worst exit status
    (a copy still running 20 s before the model's limit, MESHLA_LAUNCH_TIMEOUT, is killed and
    counts as failed)."""
    timeout_s = float(os.environ.get("MESHLA_LAUNCH_TIMEOUT", "300")) - 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    seed = int.from_bytes(os.urandom(4), "little")
    children = [subprocess.Popen([sys.executable, script, *sys.argv[1:], "--process-id", str(i),
                                  "--coordinator", coordinator, "--seed", str(seed)])
                for i in range(processes)]
    deadline = time.monotonic() + timeout_s  # one limit for all: a hang costs it once
    statuses = []
    for child in children:
        try:
            statuses.append(child.wait(timeout=max(deadline - time.monotonic(), 0)))
        except subprocess.TimeoutExpired:
            child.kill()
            statuses.append(-9)
    return max(abs(status) for status in statuses)
