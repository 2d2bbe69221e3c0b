"""Scoring a batch of completions, surviving reward functions that raise.

A reward function that raises on one sample must not kill a long run (a
user's checker may choke on one odd completion), but one that fails often is
a bug that would silently train on zeros. So a failure scores 0.0, is logged
and counted over the whole run; once more than `max_failure_frac` of at least
`min_samples` samples have failed, `RewardFailure` stops the run.
"""
from __future__ import annotations

import inspect
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from moe_rl.data.dataset import Prompt

__all__ = ["RewardFailure", "RewardRunner"]

log = logging.getLogger(__name__)

# Keyword names of the reward contract; metadata fields with these names stay in prompt.metadata.
_RESERVED = ("prompt", "completion_ids", "completion_text", "answer")
_CLIP = 200  # characters of prompt/completion shown in a failure log line


class RewardFailure(RuntimeError):
    """Too many samples' reward function calls raised."""


class RewardRunner:
    """Calls a reward function on every sample of a step and keeps run-wide failure counts.

    fn: a reward function (see `moe_rl.reward.registry`).
    max_failure_frac: the share of failed samples tolerated (`reward.max_failure_frac`).
    min_samples: no verdict before this many samples, so one early failure is not 100%.
    name: how messages call `fn` (default: its module:qualname).
    """

    def __init__(self, fn: Callable[..., float], max_failure_frac: float = 0.1, *,
                 min_samples: int = 20, name: str | None = None):
        if not 0.0 <= max_failure_frac <= 1.0:
            raise ValueError(f"max_failure_frac must be in [0, 1], got {max_failure_frac}")
        self.fn = fn
        self.max_failure_frac = max_failure_frac
        self.min_samples = min_samples
        self.name = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
        self.failures = 0
        self.total = 0
        self.first_error: str | None = None
        self._call_failures, self._call_first = 0, None  # this `score` call's
        self._accepts = _accepted_keywords(fn)

    @property
    def reads_ids(self) -> bool:
        """Whether the function can score from `completion_ids`: as registered (the built-in
        rewards read text only), else whether it takes them (by name, or **kwargs)."""
        declared = getattr(self.fn, "reads_ids", None)
        if declared is not None:
            return bool(declared)
        return self._accepts is None or "completion_ids" in self._accepts

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str],
              completion_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
        """Rewards of `completions[i]` for `prompts[i]` (repeat a prompt for each of its samples).

        Raises RewardFailure after scoring when the run's failure share is too high.
        """
        if len(prompts) != len(completions) or (completion_ids is not None
                                                and len(completion_ids) != len(completions)):
            raise ValueError(f"score: {len(prompts)} prompts, {len(completions)} completions and "
                             f"{'no' if completion_ids is None else len(completion_ids)} id lists must match")
        ids = completion_ids if completion_ids is not None else [None] * len(completions)
        self._call_failures, self._call_first = 0, None
        rewards = [self._score_one(p, c, i) for p, c, i in zip(prompts, completions, ids)]
        if self._call_failures:  # one line per call (a step), not one per sample: 100+ lines a step otherwise
            log.warning("reward %s failed on %d of %d samples, scored 0.0 (%d failures in %d samples so far); "
                        "first: %s", self.name, self._call_failures, len(completions), self.failures, self.total,
                        self._call_first)
        self._check_failure_rate()
        return rewards

    def _score_one(self, prompt: Prompt, completion: str, ids: Sequence[int] | None) -> float:
        self.total += 1
        kwargs = {k: v for k, v in prompt.metadata.items() if k not in _RESERVED}
        kwargs.update(prompt=prompt, completion_ids=None if ids is None else list(ids))
        if self._accepts is not None:  # the function takes no **kwargs: pass only what it names
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepts}
        try:
            return _as_reward(self.fn(completion, prompt.answer, **kwargs))
        except Exception as e:  # any bug in a reward function is contained to its sample
            self._record_failure(prompt, completion, e)
            return 0.0

    def _record_failure(self, prompt: Prompt, completion: str, error: Exception) -> None:
        self.failures += 1
        self._call_failures += 1
        what = f"{type(error).__name__}: {error}"
        sample = f"prompt {prompt.uid} {_clip(prompt.prompt_text)!r}, completion {_clip(completion)!r}"
        if self._call_first is None:
            self._call_first = f"{what} (on {sample})"
        if self.first_error is None:
            self.first_error = self._call_first
            # The run's first traceback is what a user needs; `score` logs the counts once per call.
            log.warning("reward %s raised on its first failure of the run:", self.name, exc_info=error)

    def _check_failure_rate(self) -> None:
        if self.total < self.min_samples or self.failures <= self.max_failure_frac * self.total:
            return
        raise RewardFailure(
            f"reward function {self.name} failed on {self.failures} of {self.total} samples "
            f"({self.failures / self.total:.1%}), more than reward.max_failure_frac="
            f"{self.max_failure_frac:g}; first error: {self.first_error}")

    def state_dict(self) -> dict[str, Any]:
        """Run-wide counts, so a resumed run keeps judging the whole run."""
        return {"failures": self.failures, "total": self.total, "first_error": self.first_error}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.failures, self.total = int(state["failures"]), int(state["total"])
        self.first_error = state.get("first_error")


def _as_reward(value: Any) -> float:
    """`value` as a finite float; anything else is the reward function's bug."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"reward function returned {value!r}, expected a number")
    out = float(value)  # accepts numpy / torch scalars
    if not math.isfinite(out):
        raise ValueError(f"reward function returned {out}, expected a finite number")
    return out


def _accepted_keywords(fn: Callable[..., float]) -> frozenset[str] | None:
    """Keyword names `fn` can take, or None when it takes **kwargs (or cannot be inspected)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params
                     if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def _clip(text: str, limit: int = _CLIP) -> str:
    """Head and tail of long text: the end of a completion is usually where it went wrong."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} ... {text[-half:]}"
