"""Forked helpers that die with the process that forked them.

megatron's checkpoint writers are `fork`ed from the rank (dist_checkpointing's
`FileSystemWriterAsync`: one process per write bucket, on every save, sync or async). A
rank killed mid-save (SIGKILL, the OOM killer) leaves them waiting forever on a queue
condition only the rank would signal, and as forked copies they hold the rank's
multiprocessing sentinel and its stdout: `moe-rl train` never sees the rank die, so it
never stops the other ranks, and a caller reading its output waits too. Within
`die_with_this_process()` every fork gets `PR_SET_PDEATHSIG` = SIGKILL (Linux), so the
kernel ends it when its parent ends. Written by hand: neither megatron nor
multiprocessing offers it, and `subprocess` children (no Python fork hooks) are unaffected.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from contextlib import contextmanager
from typing import Iterator

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_active = 0
_forking_pid = 0


def _record_parent() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _die_with_parent() -> None:
    if not _active:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _forking_pid:  # the parent died before prctl: nobody would send the signal
        os._exit(1)


if sys.platform.startswith("linux"):
    os.register_at_fork(before=_record_parent, after_in_child=_die_with_parent)


@contextmanager
def die_with_this_process() -> Iterator[None]:
    """Processes forked inside (and forks of those) are killed when their parent exits."""
    global _active
    _active += 1
    try:
        yield
    finally:
        _active -= 1
