"""The environment interface of multi-turn rollouts.

An episode starts from a dataset prompt. `reset(prompt)` gives the ids appended after it before
the model's first turn (usually none). Each model turn ends on EOS, on one of the environment's
`stop_token_ids` (a tool call, say) or on the token budget; `step(completion_ids)` reads the
turn's ids and answers with a `Turn`: the observation ids appended to the context (a tool's
result, feedback), the turn's reward, and whether the episode is over. Token in, token out: the
trainer trains on exactly the ids the engine produced and the environment appended, nothing is
decoded and encoded again between turns, and the observation's ids are context, not actions
(masked out of the loss).

One environment object serves one episode (the registry makes a fresh one per episode), so an
implementation may keep the episode's state on `self`. `step` may be a coroutine function; the
episode loop awaits it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from moe_rl.data.dataset import Prompt


@dataclass
class Turn:
    """The environment's answer to one model turn."""

    observation: list[int] = field(default_factory=list)
    """Token ids appended to the context after the model's turn (ignored when `done`)."""
    reward: float = 0.0
    """This turn's reward; the episode's reward is the sum over its turns."""
    done: bool = False
    """The episode is over (an answer was given, the game was won or lost)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything worth logging; not used by training."""


@runtime_checkable
class Environment(Protocol):
    """What the episode loop asks of an environment (see the module docstring)."""

    stop_token_ids: Sequence[int]
    """Ids that end a model turn besides EOS (e.g. the end of a tool call); may be empty."""

    def reset(self, prompt: Prompt) -> list[int]:
        """Start an episode on `prompt`; the ids appended before the model's first turn."""
        ...

    def step(self, completion_ids: list[int]) -> Turn:
        """The model's turn (its ids, a final EOS or stop id included): the environment's answer."""
        ...
