"""A process forked inside `die_with_this_process()` is killed when its parent is (megatron's
checkpoint writers outlived a SIGKILLed rank and kept `moe-rl train` from seeing it die)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import os, sys, time
from contextlib import nullcontext
from moe_rl.dist.orphans import die_with_this_process
with (die_with_this_process() if sys.argv[2] == "inside" else nullcontext()):
    pid = os.fork()
if pid == 0:  # the writer: waits for a parent that will never signal it
    time.sleep(60)
    os._exit(0)
open(sys.argv[1], "w").write(str(pid))
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("where", ["inside", "outside"])
def test_fork_dies_with_its_killed_parent_only_inside(tmp_path, where):
    out = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(out), where])
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(out.read_text())
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 2  # the kernel signals at the parent's exit: 2 s is ample
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(child) == (where == "outside")
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
