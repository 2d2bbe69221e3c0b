"""tools/install_torch.py, the torch step of `make venv`: the CPU index when it answers, the default
index when it does not, the CUDA build with a GPU. No network: the CPU index is a local stand-in
(PEP 503 layout, one tiny fake torch wheel) or a closed or silent local port; pip runs with no
config and --dry-run, so no venv is modified."""
from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "install_torch.py"
WHEEL = "torch-2.13.0-py3-none-any.whl"


def fake_wheel(path: Path) -> None:
    """A minimal installable torch 2.13.0 wheel: a package, METADATA, WHEEL and RECORD."""
    files = {
        "torch/__init__.py": b"__version__ = '2.13.0'\n",
        "torch-2.13.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n",
        "torch-2.13.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("torch-2.13.0.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("torch-2.13.0.dist-info/RECORD", "\n".join(record) + "\n")


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A PEP 503 index on a free local port: (its URL, the paths it was asked for)."""
    root = tmp_path_factory.mktemp("index")
    project = root / "simple" / "torch"
    project.mkdir(parents=True)
    fake_wheel(project / WHEEL)
    sha = hashlib.sha256((project / WHEEL).read_bytes()).hexdigest()
    (project / "index.html").write_text(f'<a href="{WHEEL}#sha256={sha}">{WHEEL}</a>\n')
    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def do_GET(self):
            asked.append(self.path)
            super().do_GET()

        def log_message(self, *a):  # quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", asked
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: connecting is refused at once
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path, index: str, *args: str, gpu: bool = False, **env) -> tuple[subprocess.CompletedProcess, float]:
    """The script under a clean environment: no pip config, PATH holding only a fake nvidia-smi (gpu)."""
    bin_dir = tmp_path / ("gpu_bin" if gpu else "bin")
    bin_dir.mkdir(exist_ok=True)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\nexit 0\n")
        smi.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "TORCH_"))}
    clean.update(PATH=str(bin_dir), TORCH_CPU_INDEX=index, PIP_CONFIG_FILE=os.devnull,
                 PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1", **env)
    start = time.monotonic()
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                         env=clean, timeout=120)
    return res, time.monotonic() - start


def test_reachable_cpu_index_is_chosen(tmp_path, stand_in):
    url, asked = stand_in
    res, _ = run(tmp_path, url, "--dry-run", "--", "-q")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout)
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"] and "-q" in cmd
    assert cmd[cmd.index("--index-url") + 1] == url
    assert cmd[cmd.index("--extra-index-url") + 1] == "https://pypi.org/simple"  # torch's dependencies
    assert cmd[-1] == "torch==2.13.0"
    assert "/simple/torch/" in asked  # the probe asked the stand-in for torch's project page
    assert "CPU build from " + url in res.stderr


def test_pip_resolves_torch_from_the_cpu_index(tmp_path, stand_in):
    """A real resolution: pip --dry-run against the stand-in (also as the default index, so no network)."""
    url, _ = stand_in
    report = tmp_path / "report.json"
    res, _ = run(tmp_path, url, "--", "-q", "--dry-run", "--no-deps", "--ignore-installed",
                 "--report", str(report), PIP_INDEX_URL=url)
    assert res.returncode == 0, res.stdout + res.stderr
    ran = shlex.split(res.stderr.split("running ", 1)[1].splitlines()[0])
    assert ran[ran.index("--extra-index-url") + 1] == url  # the default index is $PIP_INDEX_URL's
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == "torch" and item["metadata"]["version"] == "2.13.0"
    assert item["download_info"]["url"] == f"{url}/torch/{WHEEL}"


def test_unreachable_cpu_index_falls_back_quickly(tmp_path):
    index = f"http://127.0.0.1:{closed_port()}/simple"
    res, took = run(tmp_path, index, "--dry-run")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout)
    assert "--index-url" not in cmd and "--extra-index-url" not in cmd and cmd[-1] == "torch==2.13.0"
    assert f"{index} is unreachable" in res.stderr and "default index" in res.stderr
    assert took < 10  # interpreter start-up on a loaded machine; a refusal itself is instant


def test_silent_cpu_index_falls_back_after_the_timeout(tmp_path):
    with socket.socket() as silent:  # listens (the kernel accepts) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        index = f"http://127.0.0.1:{silent.getsockname()[1]}/simple"
        res, took = run(tmp_path, index, "--dry-run", TORCH_CPU_INDEX_TIMEOUT="0.5")
    assert res.returncode == 0, res.stderr
    assert "--index-url" not in shlex.split(res.stdout) and "unreachable" in res.stderr
    assert took < 10


def test_default_probe_timeout_is_a_few_seconds():
    src = SCRIPT.read_text()
    assert "PROBE_TIMEOUT_S = 3.0" in src  # CI's install time: a silent index costs at most this


def test_gpu_gets_the_default_build_without_probing(tmp_path, stand_in):
    url, asked = stand_in
    before = len(asked)
    res, _ = run(tmp_path, url, "--dry-run", "--", "-q", gpu=True)
    assert res.returncode == 0, res.stderr
    assert shlex.split(res.stdout) == [sys.executable, "-m", "pip", "install", "-q", "torch"]
    assert len(asked) == before  # the CPU index was not asked
    assert "nvidia-smi found" in res.stderr


def test_dry_run_from_the_environment(tmp_path):
    res, _ = run(tmp_path, f"http://127.0.0.1:{closed_port()}/simple", TORCH_INSTALL_DRY_RUN="1")
    assert res.returncode == 0 and shlex.split(res.stdout)[-1] == "torch==2.13.0"


def test_unknown_option_is_refused(tmp_path):
    res, _ = run(tmp_path, f"http://127.0.0.1:{closed_port()}/simple", "-q")
    assert res.returncode == 2 and "after `--`" in res.stderr and res.stdout == ""


def test_make_venv_installs_torch_through_the_script(tmp_path):
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    res = subprocess.run([make, "-n", "-B", f"VENV={tmp_path / 'v'}", "venv"], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert f"{tmp_path / 'v'}/bin/python tools/install_torch.py -- -q" in res.stdout
    assert "torch==" not in res.stdout  # the pin lives in the script, not the Makefile
