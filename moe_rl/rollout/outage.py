"""When no rollout server recovers: every rank learns it at the same point and the run ends cleanly.

Rank 0 (or each data-parallel head: rollout.intake=heads) talks to the servers; the other ranks
wait for its samples in a hand-off. A
`RolloutError` on rank 0 is therefore sent through that hand-off as a `RolloutLost` value
(`attempt`), and every rank raises it (`unwrap`): the trainer then saves the checkpoint of the
last finished step and exits non-zero, naming the servers (see trainer.train_rank). Any other
failure of rank 0 there (a reward function that raised, a bug) goes the same way as a
`RankZeroFailed` for the others, and rank 0 raises its own exception: nobody is left waiting.
"""
from __future__ import annotations

from typing import Any, Callable

from moe_rl.rollout.engine import RolloutError

EXIT_NO_SERVER = 3  # `moe-rl train` exit status when no rollout server recovered in time


class RolloutLost(RuntimeError):
    """No rollout server answered within `rollout.timeout_s`; raised on every rank."""


class RankZeroFailed(RuntimeError):
    """Rank 0 failed while the other ranks waited for it; raised on them (rank 0 raises its own)."""


class _Failure:
    """Rank 0's exception on its way through a hand-off: the others get its description (an
    exception may not pickle), rank 0 keeps the exception itself."""

    def __init__(self, error: BaseException, rank: int = 0) -> None:
        self.error: BaseException | None = error
        self.text = f"rank {rank} failed: {type(error).__name__}: {error}"

    def __getstate__(self) -> dict[str, Any]:
        return {"error": None, "text": self.text}


def attempt(fn: Callable[[], Any], rank: int = 0) -> Any:
    """Rank 0 (or the `rank` that talks to the engine): `fn()`, or what went wrong as a value (not
    raised): `RolloutLost` when the engine gave up, a failure every rank raises in `unwrap` for
    anything else."""
    try:
        return fn()
    except RolloutError as e:
        return RolloutLost(str(e))
    except RolloutLost as e:  # another rank's, already raised here by `unwrap`
        return e
    except Exception as e:  # noqa: BLE001 - re-raised by unwrap, on the failing rank as itself
        return _Failure(e, rank)


def failed(payload: Any) -> bool:
    """Whether a hand-off's payload is a failure (`attempt`'s) rather than a result."""
    return isinstance(payload, (RolloutLost, _Failure))


def unwrap(payload: Any) -> Any:
    """Every rank, after the hand-off: raise rank 0's `RolloutLost` or failure, else pass the payload on."""
    if isinstance(payload, RolloutLost):
        raise payload
    if isinstance(payload, _Failure):
        if payload.error is not None:
            raise payload.error
        raise RankZeroFailed(payload.text)
    return payload
