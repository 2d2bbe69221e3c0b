"""SGLang's own request types and argument parser, answering over stdin/stdout.

Run as a subprocess by test_sglang_contract.py: one JSON request per line in, one
JSON reply per line out. It lives in its own process because sglang 0.5.23's
import chain needs `triton` and `torchvision` at module level (sglang.srt.utils.common,
sglang.srt.configs), and neither can be installed here without a CUDA torch. Both
are stubbed below, in this process only: a stub that torch, transformers or
megatron-core saw in the test session would change what they do there.

Requests:
- {"op": "generate", "body": {...}, "vocab_size": V}: the /generate body through the
  steps sglang's HTTP server takes (http_server.generate_request and
  tokenizer_manager._create_tokenized_object): the pydantic validation FastAPI runs
  on GenerateReqInput, the api/v1 JSON contract gate, normalize_batch_and_arguments,
  then SamplingParams(**sampling_params), normalize and verify.
- {"op": "request", "cls": "InitWeightsUpdateGroupReqInput", "body": {...}}: an admin
  body validated as FastAPI does for `Annotated[cls, Body()]`.
- {"op": "server_args", "argv": [...]}: `sglang.launch_server`'s flags through
  ServerArgs.add_cli_args + from_cli_args (a --config YAML merged first, as SGLang does).
- {"op": "weight_versions", "events": [[old_version, num_output_tokens], ...], "current": v,
  "num_tokens": n}: meta_info's weight_version(s) for a sample whose weights changed after
  those many output tokens (scheduler: record_weight_version_events; output streamer:
  compute_weight_version_spans; tokenizer manager: add_weight_versions_to_meta_info).
Replies: {"ok": true, ...} or {"ok": false, "error": "<type>: <message>"}.
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import types
from typing import Any

STUBBED = ("triton", "torchvision")


class _Anything:
    """Stands for any attribute of a stubbed module: callable, subscriptable, a decorator
    that returns what it decorates, and usable as a base class."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Anything":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Anything(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:  # @triton.jit
            return args[0]
        return _Anything(f"{self._name}()")

    def __getitem__(self, key: Any) -> "_Anything":
        return self

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of `triton.*` / `torchvision.*` get empty modules whose attributes are `_Anything`."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # transformers parses it when it sees torchvision

        def getattr_(attr: str, _name: str = spec.name) -> _Anything:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Anything(f"{_name}.{attr}")

        module.__getattr__ = getattr_  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _import_sglang() -> dict[str, Any]:
    # torch's compiler modules look for triton when first imported (sglang's
    # @torch.compile decorators import them): import them first, so torch records
    # that there is no triton.
    import torch._dynamo.repro.after_dynamo  # noqa: F401
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401

    sys.meta_path.insert(0, _StubFinder())
    import pydantic
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

    return {"pydantic": pydantic, "io_struct": io_struct, "contract": generate_contract_error,
            "SamplingParams": SamplingParams, "ServerArgs": ServerArgs, "builtins": msgspec_to_builtins}


def _field_names(cls: type) -> set[str]:
    import dataclasses

    import msgspec

    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return {f.name for f in msgspec.structs.fields(cls)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _generate(sg: dict[str, Any], body: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    cls = sg["io_struct"].GenerateReqInput
    unknown = sorted(set(body) - _field_names(cls))  # FastAPI drops them silently
    obj = sg["pydantic"].TypeAdapter(cls).validate_python(body)
    error = sg["contract"](body)
    if error is not None:
        raise ValueError(f"api/v1 contract: {error}")
    obj.normalize_batch_and_arguments()
    params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
    sampling = []
    for d in params:
        sp = sg["SamplingParams"](**d)
        sp.normalize(None)  # token ids only: no tokenizer, as with --skip-tokenizer-init
        sp.verify(vocab_size)
        sampling.append({k: _jsonable(getattr(sp, k)) for k in (
            "temperature", "top_p", "top_k", "max_new_tokens", "n", "ignore_eos", "stop_token_ids",
            "sampling_seed")})
    return {"unknown_keys": unknown, "is_single": obj.is_single, "batch_size": obj.batch_size,
            "input_ids": obj.input_ids, "return_logprob": obj.return_logprob,
            "return_routed_experts": obj.return_routed_experts, "sampling": sampling}


def _request(sg: dict[str, Any], cls_name: str, body: dict[str, Any]) -> dict[str, Any]:
    cls = getattr(sg["io_struct"], cls_name)
    unknown = sorted(set(body) - _field_names(cls))
    obj = sg["pydantic"].TypeAdapter(cls).validate_python(body)
    return {"unknown_keys": unknown, "fields": _jsonable(sg["builtins"](obj))}


class _Parser(argparse.ArgumentParser):
    """argparse that raises with its message instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def _server_args(sg: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    parser = _Parser(prog="sglang.launch_server")
    sg["ServerArgs"].add_cli_args(parser)
    if "--config" in argv:  # as prepare_server_args does: the YAML file's options, then the command line's
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    args = sg["ServerArgs"].from_cli_args(parser.parse_args(argv))
    import msgspec

    return {"fields": _jsonable(msgspec.structs.asdict(args))}


def _weight_versions(events: list[list[Any]], current: str, num_tokens: int) -> dict[str, Any]:
    from sglang.srt.utils import weight_versions as wv

    spans = wv.compute_weight_version_spans([wv.WeightVersionEvent(old_version=str(v), num_output_tokens=int(n))
                                             for v, n in events], current_version=str(current),
                                            num_output_tokens=num_tokens)
    meta: dict[str, Any] = {}
    wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=num_tokens)
    return {"meta_info": meta}


def main() -> int:
    out = sys.stdout  # replies only: whatever sglang prints goes to stderr
    sys.stdout = sys.stderr
    try:
        sg = _import_sglang()
    except Exception as e:  # noqa: BLE001  (reported to the test, which fails with it)
        import traceback

        traceback.print_exc()
        print(json.dumps({"ok": False, "fatal": f"{type(e).__name__}: {e}"}), file=out, flush=True)
        return 1
    print(json.dumps({"ok": True, "ready": True}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "generate":
                result = _generate(sg, req["body"], int(req.get("vocab_size", 1 << 20)))
            elif req["op"] == "request":
                result = _request(sg, req["cls"], req["body"])
            elif req["op"] == "server_args":
                result = _server_args(sg, req["argv"])
            elif req["op"] == "weight_versions":
                result = _weight_versions(req["events"], req["current"], int(req["num_tokens"]))
            else:
                raise ValueError(f"unknown op {req['op']!r}")
            reply = {"ok": True, **result}
        except Exception as e:  # noqa: BLE001
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
