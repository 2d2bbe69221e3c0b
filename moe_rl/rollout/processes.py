"""Child processes of the launcher, as the operating system sees them: a parent-death signal, whether a
port is free, the end of a log file, an HTTP probe, the live members of a process group."""
from __future__ import annotations

import os
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux), so a
    server never outlives a trainer killed with -9, holding its port."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux / no glibc: the atexit stop() is all there is
        pass


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port now (a bind test, as the server itself would do)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in _WILDCARD_HOSTS else ("::" if family == socket.AF_INET6 else ""), port))
        except OSError:
            return False
    return True


def _wait_port_free(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not port_is_free(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def tail(path: str | Path, lines: int = 25) -> str:
    """The last `lines` lines of a text file ('' when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))  # enough for 25 long lines, never the whole log
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _http_ok(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc; [] when none."""
    proc = Path("/proc")
    if not proc.is_dir():  # no procfs: ask the kernel whether anything is left in the group
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    found = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # fields after the ")" that ends the command name: state ppid pgrp ...
        rest = stat[stat.rfind(")") + 2:].split()
        if len(rest) > 2 and rest[0] != "Z" and int(rest[2]) == pgid:
            found.append(int(d.name))
    return found
