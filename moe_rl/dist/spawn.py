"""Run a function on N local processes joined in one torch.distributed group.

`run_ranks(fn, world_size)` starts fresh interpreters (`spawn`: no state leaks from the
caller), or with `start_method="forkserver"` forks them from a server that imported
megatron-core and transformers once (`PRELOAD`; the tests' choice, `moe_rl.testing.run_ranks`:
a fresh interpreter spends ~5 s of CPU on those imports, most of a short test). Either way
each rank gets the caller's environment of the call, sets the torchrun environment variables
on a free port, and returns its return value. A failing rank's traceback is
raised in the parent; a rank that hangs is killed after `timeout` seconds instead of
blocking the test suite forever.
"""
from __future__ import annotations

import os
import pickle
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from moe_rl.dist.ports import free_port


class RankFailed(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def set_local_rank_env(rank: int, world_size: int, port: int) -> None:
    """The torchrun environment of rank `rank` of `world_size` processes on this machine, meeting on `port`
    (the variables megatron and `torch.distributed`'s env:// read; `moe-rl train` and `run_ranks` set them)."""
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })


# What the fork server imports before it starts any rank (a module name: this module imports no megatron).
# Benchmarks and `check-parity` keep `spawn`: side-by-side step times of forked ranks were within
# this machine's noise of spawned ones, not shown equal.
PRELOAD = ["moe_rl.policy.preload"]


def _entry(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple,
           kwargs: dict, queue: Any, pg_timeout: float | None, env: dict[str, str]) -> None:
    # the fork server's children start with the environment the server had when it started
    os.environ.clear()
    os.environ.update(env)
    set_local_rank_env(rank, world_size, port)
    # One intra-op thread per rank: ranks share the machine's cores.
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
        from datetime import timedelta

        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                **({"timeout": timedelta(seconds=pg_timeout)} if pg_timeout else {}))
        result = fn(*args, **kwargs)
        try:
            payload = pickle.dumps(result)
        except Exception:  # an unpicklable result is not the test's point
            payload = pickle.dumps(None)
        queue.put((rank, True, payload))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 300.0, pg_timeout: float | None = None, start_method: str = "spawn",
              **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` processes; return the per-rank results.
    `pg_timeout`: the default group's timeout in seconds (torch's default when None).
    `start_method`: "spawn" or "forkserver" (see the module's docstring).

    `fn` must be importable by name (a module-level function). The default process
    group is created here with `backend`; `fn` adds megatron's groups with
    `moe_rl.policy.parallel.init_distributed`, which reuses it.
    """
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call of this process
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, fn, args, kwargs, queue, pg_timeout, env),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and failure is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, payload = queue.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    failure = (dead[0], f"process exited with code {procs[dead[0]].exitcode} (no traceback)")
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failure = (rank, payload)
    finally:
        if failure is not None or len(results) < world_size:
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failure is not None:
        raise RankFailed(f"rank {failure[0]} of {world_size} failed:\n{failure[1]}")
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s")
    return [results[r] for r in range(world_size)]
