"""Commands under a time limit, as ``timeout -k 10 LIMIT CMD`` runs them, and a log that is also printed: what
scripts/gpu_check.py and scripts/gpu_train.py share.

Each command starts in its own process group, from the repository root. One still running at its deadline is sent
TERM (the whole group: torchrun's workers, compile workers), and KILL ``GRACE`` seconds later; its status is then
timeout's: 124 (TERM ended it) or 137 (KILL did). Ctrl-C stops every command started here before it is raised.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
GRACE = 10.0  # seconds between TERM and KILL
TIMED_OUT, KILLED = 124, 137  # timeout's statuses


def start(cmd: list[str], output: int | IO = subprocess.PIPE, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``cmd`` in the repository root, stdout and stderr together into ``output``, in a process group of its own."""
    return subprocess.Popen(cmd, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_all(procs: list[subprocess.Popen], deadline: float) -> list[int]:
    """Each process's exit status, waiting until ``deadline`` (a ``time.monotonic()`` value); a process still running
    then is stopped and gets timeout's status."""
    statuses = []
    try:
        for proc in procs:
            try:
                statuses.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                statuses.append(stop(proc))
    except KeyboardInterrupt:
        for proc in procs:
            if proc.poll() is None:
                stop(proc)
        raise
    return statuses


def stop(proc: subprocess.Popen) -> int:
    """TERM to the process's group, KILL ``GRACE`` seconds later if it is still running; timeout's status."""
    _signal(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=GRACE)
        return TIMED_OUT
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGKILL)
        proc.wait()
        return KILLED


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the group has ended meanwhile
        pass


class Log:
    """Text to stdout and to a log file (and to ``more`` files: a step's own log)."""

    def __init__(self, path: Path):
        self.file = path.open("w")

    def say(self, text: str, *more: IO) -> None:
        for sink in (sys.stdout, self.file, *more):
            sink.write(text)
            sink.flush()
