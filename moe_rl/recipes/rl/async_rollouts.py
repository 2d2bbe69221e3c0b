"""The rollouts of an asynchronous RL run (`algo.max_staleness` = K >= 1): rank 0 keeps the
batches of the next K steps generating while the trainer trains, and no token older than K
weight versions is trained on.

    step s takes its batch (asked for at step s - K, or now after a start or a resume),
    then asks for step s + K's, so the servers always hold K steps of work.

A batch asked for at weight version v and taken at version w has tokens from versions v..w-1
(newer ones when a push lands while it generates: `rollout.inflight_update=in_place`), so at
most w - v = K behind. Where the engine reports each token's version, a group with a token
more than K versions old (a server that fell behind) is dropped and generated again from the
current weights, counted in `rollout/dropped_stale_groups`; `rollout/staleness_max` above K
after that is a bug, and raises.

Resuming trains every prompt once: the data order a checkpoint saves is the sampler's as of the
oldest batch not yet trained (`sampler_state`), and a resumed run asks for that batch again.
"""
from __future__ import annotations

import copy
import functools
import logging
import math
import operator
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from moe_rl.recipes.rl.rollouts import next_prompts, request, to_samples

log = logging.getLogger(__name__)


@dataclass
class _Ask:
    step: int
    prompts: list[Any]
    future: Future
    version: int                 # the trainer's weight version when it was asked for
    sampler_before: dict[str, Any]  # the data order before its prompts were drawn


@dataclass
class StalenessGovernor:
    """`algo.auto_staleness`: lower K by one after `steps` steps in a row whose within-step KL
    (loss/approx_kl) exceeded `kl`; the run then trains on fresher samples, down to on-policy."""

    kl: float
    steps: int
    over: int = 0

    def lower(self, metrics: dict[str, Any]) -> bool:
        value = metrics.get("loss/approx_kl")
        hot = isinstance(value, (int, float)) and math.isfinite(value) and value > self.kl
        self.over = self.over + 1 if hot else 0
        if self.over < self.steps:
            return False
        self.over = 0
        return True


class AsyncRollouts:
    """The asynchronous source of a step's samples (the synchronous one is rollouts.SyncRollouts;
    both `take(run, step)`): rank 0's batches in flight, oldest first (`depth` = K of them between
    steps; `bound`, the configured K, stays the staleness allowed when a governor lowers `depth`).

    `request(run, prompts, step, greedy)` asks the engine (in a worker thread), `samples_of(run,
    prompts, payload)` makes Samples of its answer, `draw(run)` draws a batch: the engine's, by
    default (rollouts.py)."""

    def __init__(self, depth: int, governor: StalenessGovernor | None = None, *,
                 request: Callable[..., Any] = request, samples_of: Callable[..., Any] = to_samples,
                 draw: Callable[[Any], list[Any]] = next_prompts) -> None:
        if depth < 1:
            raise ValueError(f"asynchronous rollouts need algo.max_staleness >= 1, got {depth}")
        self.depth = self.bound = depth
        self.governor = governor
        self.request, self.samples_of, self.draw = request, samples_of, draw
        self.asked: deque[_Ask] = deque()
        self.current: _Ask | None = None  # the batch of the step in progress (until the next take)
        self._pool = ThreadPoolExecutor(max_workers=depth + 1, thread_name_prefix="async-rollouts")

    def take(self, run: Any, step: int) -> tuple[Any, int, dict[str, float]]:
        """Step `step`'s samples, how many versions behind they were asked for, and the drop metrics."""
        if not self.asked:  # the first step, or after a resume or a failed step: nothing in flight
            self._ask(run, step)
        head = self.current = self.asked.popleft()
        if head.step != step:
            raise RuntimeError(f"internal: the asynchronous rollouts hold step {head.step}'s batch at step {step}")
        while len(self.asked) < self.depth:  # keep K steps of work on the servers while this one trains
            self._ask(run, step + len(self.asked) + 1)
        samples = self.samples_of(run, head.prompts, head.future.result())
        samples, dropped = self._fresh(run, samples, head)
        return samples, run.weight_version - head.version, {"rollout/dropped_stale_groups": float(dropped),
                                                            "rollout/staleness_bound": float(self.depth)}

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        """After step `step`'s updates: the governor's verdict on its metrics (lower K by one: the
        next steps ask for one batch fewer ahead, so the samples trained get fresher)."""
        if self.governor is None or self.depth == 0 or not self.governor.lower(metrics):
            return
        self.depth -= 1
        log.warning("algo.auto_staleness: K %d -> %d after step %d (loss/approx_kl above %g on %d steps in a "
                    "row: the updates move the policy too far for samples that stale)", self.depth + 1,
                    self.depth, step, self.governor.kl, self.governor.steps)

    def _ask(self, run: Any, step: int) -> None:
        before = copy.deepcopy(run.sampler.state_dict())
        prompts = self.draw(run)
        future = self._pool.submit(self.request, run, prompts, step, False)
        self.asked.append(_Ask(step, prompts, future, run.weight_version, before))

    def _fresh(self, run: Any, samples: Any, head: _Ask) -> tuple[Any, int]:
        """`samples` with every group that has a token more than K versions old generated again."""
        if samples.versions is None:
            return samples, 0
        g = run.cfg.rollout.n_samples
        stale = [i for i in range(len(head.prompts))
                 if any(v.numel() and run.weight_version - int(v.min()) > self.bound
                        for v in samples.versions[i * g:(i + 1) * g])]
        if not stale:
            return samples, 0
        again = self.samples_of(run, [head.prompts[i] for i in stale],
                                self.request(run, [head.prompts[i] for i in stale], head.step, False))
        redo = {i: k for k, i in enumerate(stale)}  # group i of the batch -> group k of `again`
        group = lambda s, j: s.select(list(range(j * g, (j + 1) * g)))  # noqa: E731
        groups = [group(again, redo[i]) if i in redo else group(samples, i) for i in range(len(head.prompts))]
        return functools.reduce(operator.add, groups), len(stale)

    def drain(self) -> None:
        """Wait until every batch asked for has its answer (they stay queued for their steps)."""
        for ask in self.asked:
            ask.future.exception()

    def sampler_state(self) -> dict[str, Any] | None:
        """The data order as of the oldest batch not trained yet (None: nothing in flight)."""
        return self.asked[0].sampler_before if self.asked else None

    def reset(self, sampler: Any) -> None:
        """After a failed step: forget what is in flight and rewind the data order to the failed
        step's batch, so it and the ones after it are drawn again."""
        state = self.current.sampler_before if self.current is not None else self.sampler_state()
        self.current = None
        self.drain()
        self.asked.clear()
        if state is not None:
            sampler.load_state_dict(state)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_staleness(metrics: dict[str, float], bound: int) -> None:
    """No trained token is more than `bound` versions old: anything else is a bug, not a setting."""
    worst = metrics.get("rollout/staleness_max")
    if worst is not None and worst > bound:
        raise RuntimeError(f"a trained token is {worst:g} weight versions old, beyond algo.max_staleness={bound}")
