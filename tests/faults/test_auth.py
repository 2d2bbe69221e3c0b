"""Strangers stay out: SGLang's Bearer-key levels in `moe-rl serve`, keys never in clear, weights
only from trusted directories."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from moe_rl.config import RolloutConfig
from moe_rl.rollout.auth import decide, read_key_file, redact
from moe_rl.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from moe_rl.rollout.launcher import RunIdentity, ServerGroup
from moe_rl.rollout.sglang_api import ADMIN_PATHS
from moe_rl.rollout.sglang_client import SGLangClient


def _sglang_auth():
    """sglang/srt/utils/auth.py loaded alone (its package __init__ needs triton, absent on CPU)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("sglang is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "srt", "utils", "auth.py")
    mod_spec = importlib.util.spec_from_file_location("_sglang_auth", path)
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_spec.name] = mod  # its dataclasses look their module up
    mod_spec.loader.exec_module(mod)
    return mod


def test_decisions_equal_sglangs_own():
    """Reference: sglang/srt/utils/auth.py of the pinned wheel (ADMIN_OPTIONAL for the admin paths)."""
    sg = _sglang_auth()
    for path in ("/generate", "/model_info", "/health", "/health_generate", "/update_weights_from_disk",
                 "/pause_generation", "/flush_cache"):
        level = sg.AuthLevel.ADMIN_OPTIONAL if path in ADMIN_PATHS else sg.AuthLevel.NORMAL
        for api, admin in ((None, None), ("a", None), (None, "b"), ("a", "b")):
            for header in (None, "Bearer a", "Bearer b", "bearer a", "Basic a", "Bearer x"):
                ref = sg.decide_request_auth(method="POST", path=path, authorization_header=header, api_key=api,
                                             admin_api_key=admin, auth_level=level)
                assert (decide(path, "POST", header, api, admin) == 0) == ref.allowed, (path, api, admin, header)


def test_key_file_is_private_and_redacted(tmp_path):
    ident = RunIdentity.for_run(tmp_path / "run", "0.0.0.0")
    assert ident.keys is not None and stat.S_IMODE(os.stat(ident.key_file).st_mode) == 0o600
    assert read_key_file(ident.key_file) == ident.keys
    assert ident.keys.api_key not in repr(ident)
    assert RunIdentity.for_run(tmp_path / "run2", "127.0.0.1").keys is None  # loopback: keyless
    assert redact(["x", "--api-key", "s3", "--admin-api-key=s4"]) == ["x", "--api-key", "***", "--admin-api-key=***"]


def test_keys_never_read_as_flags():
    """SGLang turns the --config file into argv: a key starting with "-" would be taken for a flag."""
    from moe_rl.rollout.auth import RunKeys

    for _ in range(2000):
        keys = RunKeys.new()
        for key in (keys.api_key, keys.admin_api_key):
            assert len(key) >= 32 and not key.startswith("-") and key.isalnum(), key


def _call(url: str, path: str, key: str | None, body: dict | None = None) -> int:
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_keyed_server_refuses_strangers(tiny_hf_dir, tmp_path):
    trusted = tmp_path / "run" / "weights"
    trusted.mkdir(parents=True)
    ident = RunIdentity.for_run(tmp_path / "run", "0.0.0.0", trusted_dirs=[trusted])
    group = ServerGroup.from_config(RolloutConfig(engine="local", host="0.0.0.0"), tiny_hf_dir, tmp_path / "logs",
                                    env={"OMP_NUM_THREADS": "1"}, identity=ident)
    keys = ident.keys
    gen = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    with group:
        group.wait_healthy(timeout=120)
        url = group.urls[0]
        assert _call(url, "/health", None) == 200  # probes stay open, as SGLang's
        assert _call(url, "/generate", None, gen) == 401
        assert _call(url, "/generate", "wrong", gen) == 401
        assert _call(url, "/generate", keys.api_key, gen) == 200
        assert _call(url, "/server_info", None) == 401
        upd = {"model_path": str(tiny_hf_dir)}
        assert _call(url, "/update_weights_from_disk", keys.api_key, upd) == 401  # admin needs the admin key
        assert _call(url, "/update_weights_from_disk", keys.admin_api_key, upd) == 400  # not a trusted dir: a failed load, as SGLang
        # the client: keys sent, the run id checked, an untrusted path refused naming the flag
        req = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2, seed=0))
        with SGLangClient(group.urls, keys=keys, served_name=ident.run_id, no_server_timeout=30) as c:
            assert len(c.generate([req])[0]) == 1
            with pytest.raises(RolloutError, match="--trusted-dir"):
                c.update_weights_from_disk(tiny_hf_dir, "v1")
        with SGLangClient(group.urls, no_server_timeout=2, probe_interval=0.5) as c:
            with pytest.raises(RolloutError, match="401|Unauthorized"):
                c.generate([req])
        pid = group.pids["server-0"]
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode()
        log_text = group.log_paths["server-0"].read_text()
    for secret in (keys.api_key, keys.admin_api_key):
        assert secret not in cmdline and secret not in log_text
    assert stat.S_IMODE(os.stat(group.log_paths["server-0"]).st_mode) == 0o600


def test_serve_takes_sglangs_key_flags_over_its_config_file_and_warns(tiny_hf_dir, tmp_path):
    """`moe-rl serve --api-key K --admin-api-key A`, SGLang's own flags, as SGLang takes them: a flag
    wins over the --config file's line (CLI > config), with a warning that argv is visible."""
    from moe_rl.testing.serve import start_serve_process, stop_process

    conf = tmp_path / "keys.yaml"
    conf.write_text("api-key: from-file\nadmin-api-key: admin-from-file\n")
    srv = start_serve_process(tiny_hf_dir, "--config", str(conf), "--api-key", "from-argv",
                              "--admin-api-key", "admin-from-argv")
    gen = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    try:
        assert _call(srv.url, "/generate", "from-argv", gen) == 200
        assert _call(srv.url, "/generate", "from-file", gen) == 401
        assert _call(srv.url, "/flush_cache", "from-argv", {}) == 401  # admin endpoints: the admin key only
        assert _call(srv.url, "/flush_cache", "admin-from-argv", {}) == 200
    finally:
        stop_process(srv.proc)
    printed = "".join(srv.log)
    assert "visible to other users of this machine" in printed and "--config FILE" in printed


def test_unreadable_or_malformed_key_file_is_refused_before_any_work(tmp_path):
    from moe_rl.config import load_config
    from moe_rl.train.preflight import preflight

    bad = tmp_path / "auth.yaml"
    bad.write_text("apikey = x\n")
    for path, needle in ((tmp_path / "missing.yaml", "cannot read"), (bad, "auth.yaml:1: expected 'api-key: KEY'")):
        cfg = load_config("launch/configs/tiny_cpu.yaml", [f"rollout.api_key_file={path}"])
        problem = preflight(cfg, 2)
        assert problem.startswith("rollout.api_key_file: ") and needle in problem, problem


def test_router_refuses_callers_without_the_run_key(tmp_path):
    """sglang-router 0.3.2 given the run's api key (read from the key file by moe_rl.rollout.router_main,
    as the launcher and the SLURM script start it) checks callers' Bearer keys itself, and passes the
    key on to the workers."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from moe_rl.rollout.auth import RunKeys, write_key_file
    from moe_rl.rollout.launcher import router_command
    from moe_rl.testing import free_ports

    pytest.importorskip("sglang_router")
    seen: list[str | None] = []

    class Worker(BaseHTTPRequestHandler):  # answers every probe; records the key /generate arrives with
        def _reply(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/generate":
                seen.append(self.headers.get("Authorization"))
            body = json.dumps({"text": "", "meta_info": {}, "model_path": "m", "is_generation": True}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _reply

        def log_message(self, *_: object) -> None:
            pass

    worker = ThreadingHTTPServer(("127.0.0.1", 0), Worker)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    keys = RunKeys.new()
    key_file = write_key_file(tmp_path / "auth.yaml", keys)
    port = free_ports(2)
    argv = router_command([f"http://127.0.0.1:{worker.server_address[1]}"], host="127.0.0.1", port=port,
                          prometheus_port=port + 1, api_key_file=key_file)
    assert keys.api_key not in " ".join(argv)
    router = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert keys.api_key not in open(f"/proc/{router.pid}/cmdline", "rb").read().decode()  # from its start
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _call(url, "/readiness", None) == 200:
                    break
            except urllib.error.URLError:  # not listening yet
                pass
            assert time.monotonic() < deadline and router.poll() is None, "the router did not become ready"
            time.sleep(0.3)
        gen = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        assert _call(url, "/generate", None, gen) == 401
        assert _call(url, "/generate", "wrong", gen) == 401
        assert _call(url, "/generate", keys.api_key, gen) == 200
    finally:
        router.terminate()
        router.wait(30)
        worker.shutdown()
    assert seen == [f"Bearer {keys.api_key}"]



def test_no_launched_process_has_a_key_on_its_command_line(tiny_hf_dir, tmp_path):
    """`ps` shows every user of the node each process's argv: the keys travel in mode-600 files only
    (the servers' --config, the router's --api-key-file)."""
    from moe_rl.rollout.processes import _group_members
    from moe_rl.testing import free_ports

    pytest.importorskip("sglang_router")
    ident = RunIdentity.for_run(tmp_path / "run", "0.0.0.0")
    cfg = RolloutConfig(engine="local", host="0.0.0.0", router=True, base_port=free_ports(3))
    group = ServerGroup.from_config(cfg, tiny_hf_dir, tmp_path / "logs", env={"OMP_NUM_THREADS": "1"},
                                    identity=ident)
    assert group.router is not None
    with group:
        group.wait_healthy(timeout=120)
        assert _call(group.urls[0], "/generate", None, {"input_ids": [1], "sampling_params": {}}) == 401
        procs = [p for pgid in group.pids.values() for p in _group_members(pgid)]
        cmdlines = {p: open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode() for p in procs}
    assert len(procs) >= 2
    for secret in (ident.keys.api_key, ident.keys.admin_api_key):
        for pid, cmdline in cmdlines.items():
            assert secret not in cmdline, f"process {pid} has a key on its command line: {cmdline[:200]}"
        assert not any(secret in " ".join(s.argv) for s in group.specs)
