"""When no rollout server recovers: every rank learns it at the same point and the run ends cleanly.

Rank 0 alone talks to the servers; the other ranks wait for its samples in a broadcast. A
`RolloutError` on rank 0 is therefore sent through that broadcast as a `RolloutLost` value
(`attempt`), and every rank raises it (`unwrap`): the trainer then saves the checkpoint of the
last finished step and exits non-zero, naming the servers (see trainer.train_rank).
"""
from __future__ import annotations

from typing import Any, Callable

from moe_rl.rollout.engine import RolloutError

EXIT_NO_SERVER = 3  # `moe-rl train` exit status when no rollout server recovered in time


class RolloutLost(RuntimeError):
    """No rollout server answered within `rollout.timeout_s`; raised on every rank."""


def attempt(fn: Callable[[], Any]) -> Any:
    """Rank 0: `fn()`, or a `RolloutLost` value (not raised) when the engine gave up."""
    try:
        return fn()
    except RolloutError as e:
        return RolloutLost(str(e))


def unwrap(payload: Any) -> Any:
    """Every rank, after the broadcast: raise rank 0's `RolloutLost`, else pass the payload on."""
    if isinstance(payload, RolloutLost):
        raise payload
    return payload
