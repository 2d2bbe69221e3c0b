"""Free TCP ports on this machine: for trainer ranks' rendezvous and for rollout servers started later."""
from __future__ import annotations

import random
import socket


def free_port(host: str = "127.0.0.1", avoid: int | None = None) -> int:
    """A TCP port free right now on `host` ("" = every interface: for peers on other nodes), never `avoid`."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port != avoid:
            return port


def free_ports(n: int = 1, low: int = 20000, high: int = 32000) -> int:
    """The first of `n` consecutive loopback TCP ports that are free now, for servers started later.

    Taken below the kernel's ephemeral range (32768 and up), which `free_port` draws from:
    gloo's listeners and outgoing connections get ports there too, so a port found free
    there may be taken by the time a server binds it, seconds later.
    """
    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(low, high - n)
        if all(_bindable(p) for p in range(start, start + n)):
            return start
    raise RuntimeError(f"no {n} consecutive free ports in [{low}, {high})")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
