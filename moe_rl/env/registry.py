"""Environments by name: built-ins registered here, user classes as `module:Class`.

`make_env(name, **kwargs)` returns a factory of fresh environments (one per episode):
`make_env("calculator", eos_id=2)()`. The keyword arguments are what the run knows that an
environment may need (`eos_id`, the `tokenizer`, `vocab_size`); a class declares the ones it
takes and is given only those.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any, Callable

from moe_rl.env.base import Environment

_REGISTRY: dict[str, type] = {}
# The built-ins, by where they live: imported when named (moe_rl/env/toy.py imports nothing of this module)
BUILTINS = {"calculator": "moe_rl.env.toy:CalculatorEnv", "guess": "moe_rl.env.toy:GuessEnv"}


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: make the environment available as `rollout.env=<name>`."""
    if ":" in name:
        raise ValueError(f"environment name {name!r} is reserved (names with ':' are module:Class)")

    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"environment {name!r} is already registered to {_REGISTRY[name].__qualname__}")
        _REGISTRY[name] = cls
        return cls
    return deco


def known_envs() -> list[str]:
    return sorted({*BUILTINS, *_REGISTRY})


def env_class(name: str) -> type:
    """The class `name` names; KeyError (known names listed) or ImportError with the reason."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in BUILTINS:
        return env_class(BUILTINS[name])
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception as e:  # ImportError, or anything the module raises while imported
            raise ImportError(f"rollout.env={name!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); "
                              "is it on PYTHONPATH?") from e
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ImportError(f"rollout.env={name!r}: {getattr(obj, '__name__', obj)} has no attribute {part!r}")
            obj = getattr(obj, part)
        if not inspect.isclass(obj):
            raise ImportError(f"rollout.env={name!r}: {attr} is not a class")
        return obj
    close = difflib.get_close_matches(name, known_envs(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise KeyError(f"rollout.env: unknown environment {name!r}{hint}; known: {', '.join(known_envs())}; "
                   "or give your own class as module:Class")


def make_env(name: str, **available: Any) -> Callable[[], Environment]:
    """A factory of fresh `name` environments, each given the `available` arguments it declares."""
    cls = env_class(name)
    params = inspect.signature(cls).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in available.items() if takes_all or k in params}

    def factory() -> Environment:
        env = cls(**kwargs)
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing or not hasattr(env, "stop_token_ids"):
            raise TypeError(f"rollout.env={name!r}: {cls.__qualname__} lacks "
                            f"{', '.join(missing) or 'stop_token_ids'} (see moe_rl/env/base.py)")
        return env
    factory()  # fail now, naming the class, not in the middle of a rollout
    return factory
