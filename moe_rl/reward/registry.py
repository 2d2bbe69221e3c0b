"""Reward functions by name: built-ins registered here, user functions as `module:function`.

The reward function contract (built-ins and user functions alike):

    fn(completion_text: str, answer: str | None, *,
       prompt: Prompt | None = None, completion_ids: list[int] | None = None,
       **metadata) -> float

- completion_text: the generated text (for toy tasks, `ToyTokenizer.decode` of
  the ids, so it may end in "<eos>").
- answer: the prompt's reference answer (`data.answer_key`), or None.
- prompt: the whole `Prompt` (uid, prompt_ids, prompt_text, metadata).
- completion_ids: the generated token ids, including a final EOS when the
  engine stopped on it.
- metadata: the dataset row's other fields, as keyword arguments.

Keyword arguments the function does not declare are not passed (unless it
takes `**kwargs`), so `def my_reward(text, answer): ...` is a valid reward.
Return a finite float (usually 1.0 / 0.0). Raising is allowed: `RewardRunner`
scores that sample 0.0, logs it and counts it against `reward.max_failure_frac`.
"""
from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from moe_rl.data.dataset import Prompt

__all__ = ["RewardFn", "get_reward", "known_rewards", "register_reward", "resolve_reward_name"]

AUTO = "auto"
TOY_PREFIX = "toy:"


class RewardFn(Protocol):
    """The reward function signature (see the module docstring)."""

    def __call__(self, completion_text: str, answer: str | None, *, prompt: Prompt | None = None,
                 completion_ids: list[int] | None = None, **metadata: object) -> float: ...


_REGISTRY: dict[str, Callable[..., float]] = {}


def register_reward(name: str, *, reads_ids: bool | None = None
                    ) -> Callable[[Callable[..., float]], Callable[..., float]]:
    """Decorator: make `fn` available as `reward.name=<name>`.

    reads_ids: whether `fn` can score from `completion_ids` alone (False for rewards that read
    only the text, which a run without a tokenizer refuses); None = judged from its signature.
    """
    if name == AUTO or ":" in name:
        raise ValueError(f"reward name {name!r} is reserved ('auto' and names with ':' mean other things)")

    def deco(fn: Callable[..., float]) -> Callable[..., float]:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered to {_describe(_REGISTRY[name])}")
        _REGISTRY[name] = fn
        if reads_ids is not None:
            fn.reads_ids = reads_ids  # type: ignore[attr-defined]
        return fn
    return deco


def known_rewards() -> list[str]:
    """Registered names plus 'auto', sorted."""
    return sorted([*_REGISTRY, AUTO])


def resolve_reward_name(name: str, data: str | None = None) -> str:
    """The concrete name for `name`: 'auto' becomes 'toy' for `toy:` data and 'math' otherwise."""
    if name != AUTO:
        return name
    return "toy" if data is not None and data.startswith(TOY_PREFIX) else "math"


def get_reward(name_or_path: str, *, data: str | None = None) -> Callable[..., float]:
    """The reward function for a registry name, 'auto' (resolved against the `data` spec),
    or a user function given as `module:function` (`module:Class.method` also works).

    Raises KeyError for an unknown name (listing the known ones) and ImportError
    for a `module:function` that cannot be imported or found.
    """
    if ":" in name_or_path:
        return _import_function(name_or_path)
    name = resolve_reward_name(name_or_path, data)
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, known_rewards(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KeyError(f"unknown reward {name!r}{hint}; known rewards: {', '.join(known_rewards())}; "
                       "or give your own function as module:function")
    return _REGISTRY[name]


def _import_function(path: str) -> Callable[..., float]:
    module_name, _, attr_path = path.partition(":")
    if not module_name or not attr_path:
        raise ImportError(f"reward {path!r}: expected module:function, e.g. my_pkg.rewards:score")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or anything the module raises while it is imported
        raise ImportError(f"reward {path!r}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e}); is it on PYTHONPATH?") from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ImportError(f"reward {path!r}: {getattr(obj, '__name__', obj)!s} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ImportError(f"reward {path!r}: {attr_path} is a {type(obj).__name__}, not a function")
    return obj


def _describe(fn: Callable[..., object]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
