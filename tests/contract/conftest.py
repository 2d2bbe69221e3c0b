"""The contract tier's oracle: sglang_oracle.py (sglang 0.5.23's own request types, parsers and span code)
in one subprocess for the whole session, which every contract test asks."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ORACLE = Path(__file__).with_name("sglang_oracle.py")


class Oracle:
    """sglang_oracle.py as a subprocess: one JSON request, one JSON reply."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ORACLE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        first = self.proc.stdout.readline()
        hello = json.loads(first) if first else {"fatal": self.proc.stderr.read()[-2000:]}
        if not hello.get("ready"):
            self.close()
            pytest.fail(f"sglang is installed but its request types do not import on CPU: {hello.get('fatal')}. "
                        "setup.py's [dev] extra lists the modules they need (reinstall with `make venv`)")

    def ask(self, **request: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def server_args(self, argv: list[str]) -> dict[str, Any]:
        """`sglang.launch_server`'s arguments in `argv` (what follows the module name) through ServerArgs."""
        i = argv.index("sglang.launch_server")
        reply = self.ask(op="server_args", argv=argv[i + 1:])
        assert reply["ok"], f"sglang 0.5.23 refuses {' '.join(argv[i + 1:])}: {reply['error']}"
        return reply["fields"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="session")
def oracle():
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (`make venv` installs sglang==0.5.23 --no-deps)")
    o = Oracle()
    yield o
    o.close()
