"""What we send to SGLang, checked against the installed sglang 0.5.23 and sglang-router 0.3.2.

- every request body: the bodies SGLangClient really sends (captured by a recording
  server) and the weight-sync bodies, validated by sglang's own request types the
  way its HTTP server does (see sglang_oracle.py, which runs them in a subprocess);
- every `sglang.launch_server` command line we build (launcher and SLURM script)
  parsed by sglang's ServerArgs, with the intended values;
- every endpoint we call exists, with that method, in sglang's http_server.py route
  table (read with `ast`: importing it needs uvicorn and a GPU stack) and in
  `moe-rl serve`'s;
- the router's command line parsed by sglang_router's own parser.

Skipped only when sglang is not installed (`make venv` installs it with --no-deps).
"""
from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.launcher import plan_servers, router_command, sglang_server_command
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_api import bucket_payloads, init_group_payload
from moe_rl.rollout.weight_sync import TensorMeta

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="sglang is not installed (`make venv` installs sglang==0.5.23 --no-deps)")

# Every (method, path) our code calls on an SGLang server, and who calls it.
CALLS = {
    ("POST", "/generate"): "sglang_client",
    ("GET", "/health"): "sglang_client, launcher, launch.task",
    ("GET", "/health_generate"): "sglang_client (re-probing a failed server)",
    ("GET", "/model_info"): "sglang_client",
    ("GET", "/get_model_info"): "sglang_client (fallback for servers before 0.5.23)",
    ("GET", "/server_info"): "sglang_client (is the server this run's: served_model_name)",
    ("POST", "/update_weights_from_disk"): "sglang_client",
    ("POST", "/flush_cache"): "sglang_client",
    ("POST", "/pause_generation"): "sglang_client",
    ("POST", "/continue_generation"): "sglang_client",
    ("POST", "/release_memory_occupation"): "sglang_client",
    ("POST", "/resume_memory_occupation"): "sglang_client",
    ("POST", "/init_weights_update_group"): "weight_sync",
    ("POST", "/destroy_weights_update_group"): "weight_sync",
    ("POST", "/begin_weight_update"): "weight_sync",
    ("POST", "/end_weight_update"): "weight_sync",
    ("POST", "/update_weights_from_distributed"): "weight_sync",
    ("POST", "/update_weight_version"): "weight_sync (the last word of a push when rank 0 sent no tensor)",
    ("POST", "/weights_checker"): "weight_sync (rollout.verify_weights: the servers' checksums)",
}
CALLERS = ["moe_rl/rollout/sglang_client.py", "moe_rl/rollout/wire.py", "moe_rl/rollout/launcher.py",
           *sorted(str(p.relative_to(REPO)) for p in (REPO / "moe_rl/rollout/weight_sync").glob("*.py")),
           *sorted(str(p.relative_to(REPO)) for p in (REPO / "moe_rl/launch").glob("*.py"))]
# The router's own endpoint (launcher waits for it; the router test exercises it): not an SGLang server's.
ROUTER_CALLS = {("GET", "/readiness")}
NOT_ENDPOINTS = {"/proc", "/stat", "/tmp", "/run", "/local"}  # path literals in those files that name files, not URLs


# The oracle (sglang_oracle.py in a subprocess) is conftest.py's session fixture `oracle`.

def _accepted(reply: dict[str, Any], what: str) -> dict[str, Any]:
    assert reply["ok"], f"sglang 0.5.23 refuses {what}: {reply['error']}"
    # The server silently drops keys its request type does not have: one we send would be lost.
    assert reply["unknown_keys"] == [], f"{what}: sglang ignores {reply['unknown_keys']}"
    return reply


# ----------------------------------------------------------------------------- captured client bodies

class Recorder:
    """An SGLang stand-in that records every request SGLangClient makes and answers minimally."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        ready = threading.Event()

        def main() -> None:
            self.loop = asyncio.new_event_loop()
            self.loop.run_until_complete(self._start())
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=main, daemon=True).start()
        assert ready.wait(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.calls.append((request.method, request.path, body))
        if request.path == "/model_info":
            return web.json_response({"model_path": "m", "num_hidden_layers": 1, "num_experts_per_tok": 1,
                                      "num_experts": 2, "moe_layer_ids": [0], "weight_version": "v"})
        if request.path == "/generate":  # one reply per item (a batch: list input_ids), n copies each
            import base64

            import numpy as np

            batch = isinstance(body["sampling_params"], list)
            items = zip(body["input_ids"], body["sampling_params"]) if batch else \
                [(body["input_ids"], body["sampling_params"])]
            replies = []
            for ids, sp in items:
                n = sp["max_new_tokens"]
                routes = base64.b64encode(np.zeros((len(ids) + n - 1, 1, 1), dtype=np.int32).tobytes()).decode()
                replies += [{"output_ids": [3] * n, "meta_info": {
                    "finish_reason": {"type": "length"}, "prompt_tokens": len(ids),
                    "output_token_logprobs": [[-1.0, 3, None]] * n, "routed_experts": routes}}] * sp.get("n", 1)
            return web.json_response(replies[0] if len(replies) == 1 and not batch else replies)
        return web.json_response({"success": True, "message": ""})

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


GENERATE_CASES = [
    GenerateRequest([1, 2, 3]),
    GenerateRequest([5, 6], SamplingParams(temperature=0.0, max_new_tokens=2), return_routed_experts=False),
    GenerateRequest([7], SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=3,
                                        stop_token_ids=(2, 4), ignore_eos=True, seed=11)),
    GenerateRequest([8, 9], SamplingParams(max_new_tokens=2, n=3)),
    GenerateRequest([8, 9], SamplingParams(max_new_tokens=2, n=2, seed=5)),  # one batch of 2 seeded items
]


@pytest.fixture(scope="module")
def captured():
    """(method, path, body) of every call SGLangClient makes for generate and the admin calls."""
    rec = Recorder()
    try:
        with SGLangClient([rec.url], request_timeout=10) as client:
            client.generate(GENERATE_CASES)
            client.update_weights_from_disk("/ckpt/step_1", version=1)
            client.update_weights_from_disk("/ckpt/step_2")
            client.flush_cache()
            for mode in ("abort", "retract", "in_place"):
                client.pause_generation(mode)
            client.continue_generation()
            client.release_memory_occupation()
            client.resume_memory_occupation()
    finally:
        rec.stop()
    return rec.calls


def test_generate_bodies_pass_sglangs_parse_contract_and_sampling_checks(oracle, captured):
    bodies = [b for m, p, b in captured if p == "/generate"]
    assert len(bodies) == 5  # one per request, the seeded n=2 one as a batch of two items
    for body in bodies:
        reply = _accepted(oracle.ask(op="generate", body=body, vocab_size=151936), f"/generate {body}")
        batch = isinstance(body["sampling_params"], list)
        assert not (batch and reply["is_single"])
        # one per item of a batch; a single request's n copies (parallel sampling) each carry its params
        ours_each = body["sampling_params"] if batch else [body["sampling_params"]] * len(reply["sampling"])
        assert len(reply["sampling"]) == len(ours_each)
        for ours, sp in zip(ours_each, reply["sampling"]):  # what sglang's SamplingParams made of ours
            greedy = ours["temperature"] == 0.0
            for key in ("top_p", "max_new_tokens", "n", "ignore_eos", "sampling_seed") + (() if greedy else
                                                                                           ("temperature",)):
                assert sp[key] == ours.get(key, sp[key]), (key, sp, ours)
            assert sp["stop_token_ids"] == sorted(ours.get("stop_token_ids", [])) or \
                (not ours.get("stop_token_ids") and not sp["stop_token_ids"])
            if greedy:  # sglang turns temperature 0 into top_k = 1 at temperature 1
                assert (sp["top_k"], sp["temperature"]) == (1, 1.0)
            elif ours["top_k"] > 0:
                assert sp["top_k"] == ours["top_k"]
            else:  # our -1 means the whole vocabulary; sglang says so with its largest top_k
                assert sp["top_k"] >= 151936
        assert reply["return_routed_experts"] == body["return_routed_experts"]
        ids = reply["input_ids"] if reply["is_single"] or batch else reply["input_ids"][0]
        assert ids == body["input_ids"]
        rl = reply["return_logprob"]
        assert (rl if reply["is_single"] else all(rl)) is True
    group = next(b for b in bodies if isinstance(b["sampling_params"], list))
    assert group["input_ids"] == [[8, 9], [8, 9]]  # the prompt once per sample, each n=1 with seeds s, s + 1
    assert [(sp["n"], sp["sampling_seed"]) for sp in group["sampling_params"]] == [(1, 5), (1, 6)]


def test_the_oracle_refuses_what_sglang_refuses(oracle):
    """The checks above have teeth: sglang's contract rejects unknown sampling keys and bad values."""
    base = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
    assert oracle.ask(op="generate", body=base)["ok"]
    bad_key = {**base, "sampling_params": {"max_new_tokens": 1, "seed": 3}}
    assert not oracle.ask(op="generate", body=bad_key)["ok"]
    bad_value = {**base, "sampling_params": {"max_new_tokens": 1, "top_p": 0.0}}
    assert "top_p" in oracle.ask(op="generate", body=bad_value)["error"]
    assert not oracle.ask(op="request", cls="PauseGenerationReqInput", body={"mode": "later"})["ok"]
    assert oracle.ask(op="request", cls="InitWeightsUpdateGroupReqInput",
                      body={**init_group_payload("h", 1, 1, 2, "g"), "extra": 1})["unknown_keys"] == ["extra"]


ADMIN_TYPES = {
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}


def test_client_admin_bodies_are_sglang_request_types(oracle, captured):
    admin = [(m, p, b) for m, p, b in captured if p not in ("/generate", "/model_info")]
    assert {p for _, p, _ in admin} == set(ADMIN_TYPES) | {"/flush_cache"}
    for method, path, body in admin:
        assert (method, path) in CALLS
        if path == "/flush_cache":  # sglang's handler takes no body (only a ?timeout= query)
            assert body is None
            continue
        reply = _accepted(oracle.ask(op="request", cls=ADMIN_TYPES[path], body=body), f"{path} {body}")
        for key, value in body.items():
            assert reply["fields"][key] == value, (path, key)
    disk = [b for _, p, b in admin if p == "/update_weights_from_disk"]
    assert disk == [{"model_path": "/ckpt/step_1", "weight_version": "1"}, {"model_path": "/ckpt/step_2"}]
    assert [b["mode"] for _, p, b in admin if p == "/pause_generation"] == ["abort", "retract", "in_place"]


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_weight_sync_bodies_are_sglang_request_types(oracle, load_format):
    init = init_group_payload("10.0.0.1", 29600, 1, 5, "moe_rl_weight_sync", backend="nccl")
    _accepted(oracle.ask(op="request", cls="InitWeightsUpdateGroupReqInput", body=init), "init group")
    buckets = [[TensorMeta("model.embed_tokens.weight", (32, 8), "bfloat16")],
               [TensorMeta("model.layers.0.mlp.experts.0.up_proj.weight", (16, 8), "float32"),
                TensorMeta("lm_head.weight", (32, 8), "bfloat16")]]
    for body in bucket_payloads(buckets, "moe_rl_weight_sync", 7, load_format=load_format):
        reply = _accepted(oracle.ask(op="request", cls="UpdateWeightsFromDistributedReqInput", body=body),
                          f"update_weights_from_distributed {body}")
        assert reply["fields"]["load_format"] == load_format
        assert reply["fields"]["shapes"] == body["shapes"] and reply["fields"]["dtypes"] == body["dtypes"]
    # The session and teardown bodies weight_sync.NcclSync sends ({} and {"group_name"}).
    for cls, body in [("BeginWeightUpdateReqInput", {}), ("EndWeightUpdateReqInput", {}),
                      ("DestroyWeightsUpdateGroupReqInput", {"group_name": "moe_rl_weight_sync"}),
                      # a push's last word when rank 0 sent no tensor, and rollout.verify_weights
                      ("UpdateWeightVersionReqInput", {"new_version": "7", "abort_all_requests": False}),
                      ("CheckWeightsReqInput", {"action": "checksum"})]:
        _accepted(oracle.ask(op="request", cls=cls, body=body), cls)


# ----------------------------------------------------------------------------- command lines

@pytest.mark.parametrize("kw, expected", [
    ({}, {"tp_size": 1, "ep_size": 1, "mem_fraction_static": 0.8, "base_gpu_id": 0}),
    ({"tp_size": 4, "ep_size": 4, "mem_fraction": 0.7, "base_gpu_id": 4},
     {"tp_size": 4, "ep_size": 4, "mem_fraction_static": 0.7, "base_gpu_id": 4}),
    ({"tp_size": 8, "ep_size": 2, "extra_args": ["--enable-memory-saver", "--dtype", "bfloat16", "--tp-size", "4"]},
     {"tp_size": 4, "ep_size": 2, "enable_memory_saver": True, "dtype": "bfloat16"}),  # a repeated flag wins
])
def test_sglang_server_flags_parse_with_server_args(oracle, kw, expected):
    argv = sglang_server_command("/models/qwen3", host="0.0.0.0", port=30001, **kw)
    fields = oracle.server_args(argv)
    want = {"model_path": "/models/qwen3", "host": "0.0.0.0", "port": 30001, "enable_return_routed_experts": True,
            "skip_tokenizer_init": True, **expected}
    assert {k: fields[k] for k in want} == want


def test_planned_sglang_servers_parse_with_server_args(oracle):
    cfg = SimpleNamespace(engine="sglang", num_servers=2, host="0.0.0.0", base_port=31000, mem_fraction=0.6,
                          sglang_args=["--dtype", "bfloat16"], tp_size=2, ep_size=2, router=None)
    servers, _ = plan_servers(cfg, "/ckpt")
    for i, spec in enumerate(servers):
        fields = oracle.server_args(list(spec.argv))
        assert (fields["port"], fields["tp_size"], fields["ep_size"], fields["base_gpu_id"], fields["dtype"]) == \
            (31000 + i, 2, 2, 2 * i, "bfloat16")


def _script_commands(text: str, module: str) -> list[list[str]]:
    """argv of every `-m module` line in a rendered sbatch script (continuations joined)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        if f"-m {module} " in line:
            words = shlex.split(line.rstrip().removesuffix("&"))
            out.append(words[words.index("-m"):])
    return out


@pytest.mark.parametrize("nodes, rollout_nodes, overrides", [
    (4, 2, ["parallel.ep=4"]),
    (2, 0, ["parallel.ep=4", "parallel.pp=2", "rollout.weight_sync=disk", "algo.max_staleness=0"]),  # colocated
])
def test_slurm_script_server_and_router_lines_parse(oracle, tmp_path, nodes, rollout_nodes, overrides):
    from moe_rl.launch.plan import NodeShape
    from moe_rl.launch.slurm import SlurmOptions, render_script

    text = render_script(REPO / "launch/configs/qwen3_30b_a3b_gspo.yaml", overrides, NodeShape(nodes, rollout_nodes, 8),
                         SlurmOptions(python="/opt/venv/bin/python"), run_dir=tmp_path / "run", chdir="/work").text
    servers = _script_commands(text, "sglang.launch_server")
    assert servers
    from moe_rl.rollout.auth import RunKeys, write_key_file

    keys = write_key_file(tmp_path / "auth.yaml", RunKeys.new())  # what `run_task write-keys` makes at run time
    for argv in servers:
        fields = oracle.server_args([str(keys) if a == "${KEY_FILE}" else a for a in argv])
        assert fields["api_key"] and fields["admin_api_key"] and fields["served_model_name"] == "${SERVED_NAME}"
        assert fields["enable_return_routed_experts"] and fields["skip_tokenizer_init"]
        assert fields["model_path"] == "${MODEL_PATH}"
        if rollout_nodes == 0:  # colocated: the trainer releases SGLang's memory between phases
            assert fields["enable_memory_saver"]
    for argv in _script_commands(text, "moe_rl.rollout.router_main"):
        args = _router_args(argv)
        assert args.worker_urls == ["${WORKER_URLS[@]}"]


def _router_args(argv: list[str]) -> Any:
    """The router's own arguments, parsed by sglang-router 0.3.2; through `moe_rl.rollout.router_main`
    (which reads the api key from --api-key-file), what it passes on to the router."""
    from sglang_router.launch_router import parse_router_args

    if "moe_rl.rollout.router_main" in argv:
        i = argv.index("moe_rl.rollout.router_main")
        assert argv[i + 1] == "--api-key-file", argv
        return parse_router_args(argv[i + 3:])
    i = argv.index("sglang_router.launch_router")
    return parse_router_args(argv[i + 1:])


def test_sglang_reads_the_run_keys_and_id_we_pass(oracle, tmp_path):
    """The launcher's key file, given with --config, sets SGLang's --api-key / --admin-api-key."""
    from moe_rl.rollout.launcher import RunIdentity

    ident = RunIdentity.for_run(tmp_path / "run", "0.0.0.0")
    argv = sglang_server_command("/models/qwen3", host="0.0.0.0", port=30001, extra_args=ident.server_args())
    assert ident.keys.api_key not in " ".join(argv)
    fields = oracle.server_args(argv)
    assert fields["api_key"] == ident.keys.api_key and fields["admin_api_key"] == ident.keys.admin_api_key
    assert fields["served_model_name"] == ident.run_id


def test_router_flags_parse_with_sglang_routers_parser():
    argv = router_command(["http://10.0.0.1:30000", "http://10.0.0.2:30000"], host="10.0.0.1", port=30002,
                          prometheus_port=30003, extra_args=["--policy", "round_robin"])
    args = _router_args(argv)
    assert args.worker_urls == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert (args.host, args.port, args.prometheus_host, args.prometheus_port, args.policy) == \
        ("10.0.0.1", 30002, "10.0.0.1", 30003, "round_robin")
    cfg = SimpleNamespace(engine="local", num_servers=2, host="127.0.0.1", base_port=40000, router=True)
    _, router = plan_servers(cfg, "/ckpt")
    args = _router_args(list(router.argv))
    assert args.worker_urls == ["http://127.0.0.1:40000", "http://127.0.0.1:40001"]
    assert (args.port, args.prometheus_port) == (40002, 40003)


# ----------------------------------------------------------------------------- endpoints

def _sglang_routes() -> set[tuple[str, str]]:
    """(method, path) of every route in the installed sglang's http_server.py, read with ast."""
    spec = importlib.util.find_spec("sglang")  # the top-level package only: nothing is imported
    source = Path(spec.submodule_search_locations[0]) / "srt" / "entrypoints" / "http_server.py"
    routes = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
                continue
            if not (dec.args and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                continue
            path, kind = dec.args[0].value, dec.func.attr
            if kind == "api_route":
                methods = next((ast.literal_eval(k.value) for k in dec.keywords if k.arg == "methods"), ["GET"])
            elif kind in ("get", "post", "put", "delete", "patch"):
                methods = [kind.upper()]
            else:
                continue
            routes |= {(m, path) for m in methods}
    return routes


def _paths_in_our_code() -> set[str]:
    found = set()
    for rel in CALLERS:
        for node in ast.walk(ast.parse((REPO / rel).read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"/[a-z_]+", node.value):
                found.add(node.value)
    for tmpl in (REPO / "launch/slurm").glob("*"):  # URLs the sbatch template itself calls
        found |= set(re.findall(r"https?://[^\s/\"']+(/[a-z_]+)", tmpl.read_text()))
    return found - NOT_ENDPOINTS


def test_every_path_our_code_calls_is_listed_here():
    assert _paths_in_our_code() <= {p for _, p in set(CALLS) | ROUTER_CALLS}, "a new endpoint: add it to CALLS"


def test_every_endpoint_we_call_exists_in_sglang_with_that_method():
    routes = _sglang_routes()
    assert ("POST", "/generate") in routes and len(routes) > 50  # the parse found the table
    missing = {call: who for call, who in CALLS.items() if call not in routes}
    assert not missing, f"sglang 0.5.23's http_server.py has no route for {missing}"


def test_every_endpoint_we_call_is_served_by_moe_rl_serve():
    from moe_rl.rollout.server import make_app

    app = make_app(SimpleNamespace())  # the route table only: nothing is served
    served = {(r.method, r.resource.canonical) for r in app.router.routes()}
    missing = {call: who for call, who in CALLS.items() if call not in served}
    assert not missing, f"moe-rl serve has no route for {missing}"


@pytest.mark.parametrize("versions", [["3"] * 5, ["3", "3", "4", "4", "4"], ["1", "2", "2", "5"], []])
def test_weight_version_spans_are_sglangs(oracle, versions):
    """moe-rl serve's meta_info weight_version(s) for a sample whose tokens came from these versions
    equal SGLang's, built from the events its scheduler records when the weights change mid-sample."""
    from moe_rl.rollout.engine import GenerateResult, version_spans
    from moe_rl.rollout.server.protocol import sample_json
    from moe_rl.rollout.wire import parse_version_spans

    current = versions[-1] if versions else "9"
    events = [[versions[i - 1], i] for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
    theirs = oracle.ask(op="weight_versions", events=events, current=current, num_tokens=len(versions))
    assert theirs["ok"], theirs
    res = GenerateResult(prompt_ids=[1], output_ids=list(range(len(versions))), output_logprobs=[0.0] * len(versions),
                         finish_reason="length", weight_version=current,
                         weight_versions=version_spans(versions, current))
    req = GenerateRequest(prompt_ids=[1], sampling=SamplingParams(max_new_tokens=max(len(versions), 1)))
    ours = sample_json(res, req, "rid", False, SimpleNamespace(tokenizer=None))["meta_info"]
    assert {k: ours[k] for k in ("weight_version", "weight_versions")} == theirs["meta_info"]
    back = parse_version_spans("here", ours, len(versions))  # and the client reads them back per token
    assert GenerateResult(prompt_ids=[1], output_ids=res.output_ids, output_logprobs=res.output_logprobs,
                          finish_reason="length", weight_versions=back).token_versions() == versions
