"""What every part of `moe-rl serve` shares: the app's keys, limits, request-field checks and replies."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

DEFAULT_PORT = 30000  # SGLang's default

ENGINE: web.AppKey[Any] = web.AppKey("engine", object)
BATCHER: web.AppKey[Any] = web.AppKey("batcher", object)  # batcher._Batcher
UPDATE_EXECUTOR: web.AppKey[ThreadPoolExecutor] = web.AppKey("update_executor", ThreadPoolExecutor)
MAX_BODY: web.AppKey[int] = web.AppKey("client_max_size", int)
GROUPS: web.AppKey[Any] = web.AppKey("update_groups", object)  # updates._UpdateGroups
UPDATE_LOCK: web.AppKey[Any] = web.AppKey("model_update_lock", object)  # update_lock.ModelUpdateLock
SERVER_ARGS: web.AppKey[dict] = web.AppKey("server_args", dict)
HEALTH_TIMEOUT: web.AppKey[float] = web.AppKey("health_timeout", float)
MAX_REQUEST_TOKENS: web.AppKey[int] = web.AppKey("max_request_tokens", int)
KEYS: web.AppKey[tuple] = web.AppKey("keys", tuple)
TRUSTED: web.AppKey[Any] = web.AppKey("trusted_dirs", object)
RETURN_ROUTES: web.AppKey[bool] = web.AppKey("enable_return_routed_experts", bool)
LIVE: web.AppKey[Any] = web.AppKey("live_requests", object)  # live.LiveRequests
DEFAULT_MAX_REQUEST_TOKENS = 1 << 18  # 256k new tokens: a full RL step of the demo is ~4k

HEALTH_CHECK_TIMEOUT = 20.0  # s; SGLang's default (SGLANG_HEALTH_CHECK_TIMEOUT, http_server.py)


class BadRequest(ValueError):
    """A malformed request: answered with 400 and the message."""


class ContractError(BadRequest):
    """A /generate body that SGLang's api/v1 JSON contract refuses: 400 with {"error": "<message>"} (a string,
    not SGLang's usual {"message": ...} object: http_server.generate_request answers so)."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the request body nests JSON too deeply") from None


# Request fields (sglang 0.5.23 io_struct.py): name -> (accepted types, default; _REQUIRED = no default).
_REQUIRED = object()


_INIT_GROUP_FIELDS = {"master_address": (str, _REQUIRED), "master_port": (int, _REQUIRED),
                      "rank_offset": (int, _REQUIRED), "world_size": (int, _REQUIRED),
                      "group_name": (str, "weight_update_group"), "backend": (str, "nccl")}


_UPDATE_FIELDS = {"names": (list, _REQUIRED), "dtypes": (list, _REQUIRED), "shapes": (list, _REQUIRED),
                  "group_name": (str, "weight_update_group"), "flush_cache": (bool, True),
                  "abort_all_requests": (bool, False), "weight_version": ((str, type(None)), None),
                  "load_format": ((str, type(None)), None), "nnz": ((list, type(None)), None)}


_CHECK_FIELDS = {"action": (str, "checksum"), "skip_tensor_list": ((list, type(None)), None)}


_GROUP_NAME_FIELDS = {"group_name": (str, "weight_update_group")}


_VERSION_FIELDS = {"new_version": (str, _REQUIRED), "abort_all_requests": (bool, True)}


_MEMORY_FIELDS = {"tags": ((list, type(None)), None)}


def _fields(body: Any, path: str, spec: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The request's fields with their defaults; a missing or mistyped one is a 400 naming it.

    Unknown fields (rid, selector, ...) are ignored.
    """
    if not isinstance(body, dict):
        raise BadRequest(f"{path}: the request body must be a JSON object")
    out = {}
    for name, (types, default) in spec.items():
        if name not in body:
            if default is _REQUIRED:
                raise BadRequest(f"{path}: field {name!r} is required")
            out[name] = default
            continue
        value = body[name]
        plain = types if isinstance(types, tuple) else (types,)
        if not isinstance(value, plain) or (isinstance(value, bool) and bool not in plain):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in plain)
            raise BadRequest(f"{path}: field {name!r} must be {want}, got {value!r}")
        out[name] = value
    return out


def _outcome(ok: bool, message: str, **extra: Any) -> web.Response:
    """SGLang's {"success", "message"} reply: 200, or 400 when not successful."""
    return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)


def refused_flush(engine: Any) -> str | None:
    """Why a cache flush after a weight load fails the call (None: it flushed). SGLang flushes only an
    idle scheduler, and a refused flush fails the call although the weights were loaded
    (flush_cache_after_weight_update): a push under requests paused in place must not ask for one."""
    if not engine.flush_cache():
        return ("Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache.")
    return None
