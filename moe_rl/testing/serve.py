"""`moe-rl serve` as a subprocess for tests: start it on a free port, wait for it, stop it."""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from moe_rl.dist.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def start_serve_process(model_dir: str | Path, *extra: str, timeout: float = 120.0,
                        port: int | None = None, routed_experts: bool = True) -> SimpleNamespace:
    """Start `moe-rl serve --model-path model_dir` on a free loopback port (or `port`) with `extra` flags
    (and `--enable-return-routed-experts` unless `routed_experts` is false: what an R3 run launches).

    Returns once it prints its "serving ..." line: `.url`, `.proc`, `.log` (every line it
    printed so far and later: the pipe is drained for its whole life). A server that exits
    or stays silent for `timeout` s is killed, and RuntimeError shows what it printed.
    """
    port = free_port() if port is None else port
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    flags = ["--enable-return-routed-experts"] if routed_experts else []
    proc = subprocess.Popen([sys.executable, "-m", "moe_rl.cli", "serve", "--model-path", str(model_dir),
                             "--port", str(port), *flags, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    log: list[str] = []

    def pump() -> None:  # keep draining the pipe for the server's lifetime
        for line in proc.stdout:
            log.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("moe-rl serve did not start:\n" + "".join(log))
        if line.startswith("serving "):
            return SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=proc, log=log, first_line=line)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
