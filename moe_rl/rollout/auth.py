"""Who may call the rollout servers: SGLang's Bearer-key scheme, for both kinds of server.

SGLang 0.5.23 (`--api-key`, `--admin-api-key`; sglang/srt/utils/auth.py) decides per
endpoint level, and `moe-rl serve` decides the same way (`decide`):

- health probes (`/health*`, `/ready*`, `/metrics*`) are always open;
- normal endpoints (`/generate`, `/model_info`, `/server_info`, ...) need the api key
  when one is set;
- admin endpoints (weight updates, pause / continue, flush, memory release: SGLang's
  `ADMIN_OPTIONAL` ones, `ADMIN_PATHS` in moe_rl/rollout/sglang_api.py) need the admin key when one is set (the
  plain key is then refused), else the api key, else nothing.

A wrong or missing key is 401. The launcher makes one pair of keys per run (`RunKeys.new`)
when its servers bind a non-loopback address; runs on loopback only stay keyless. Keys
never go on a command line in clear: they are written to a YAML file of mode 600
(`write_key_file`) that SGLang reads with `--config FILE` (its `api-key` / `admin-api-key`
keys) and `moe-rl serve` with the same flag; the trainer reads the same file
(`rollout.api_key_file`, `read_key_file`). `redact` hides them in any argv that is logged.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from moe_rl.rollout.sglang_api import ADMIN_PATHS, OPEN_PREFIXES  # SGLang's endpoint levels

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class RunKeys:
    """The api key (generate, info) and admin key (weights, control) of one run's servers."""

    api_key: str
    admin_api_key: str

    @classmethod
    def new(cls) -> "RunKeys":
        # Hex, not urlsafe base64: SGLang turns its --config file into argv, and a key starting with
        # "-" would then be read as a flag ("--api-key: expected one argument").
        return cls(secrets.token_hex(32), secrets.token_hex(32))

    def header(self, path: str) -> dict[str, str]:
        """The Authorization header a client sends to `path` (admin key for admin endpoints)."""
        key = self.admin_api_key if path.split("?", 1)[0] in ADMIN_PATHS else self.api_key
        return {"Authorization": f"Bearer {key}"}

    def __repr__(self) -> str:  # never print a key by accident
        return "RunKeys(<redacted>)"


def needs_keys(host: str) -> bool:
    """Whether servers bound to `host` are reachable from other machines (then they get keys)."""
    return host not in LOOPBACK_HOSTS


def decide(path: str, method: str, authorization: str | None, api_key: str | None,
           admin_api_key: str | None) -> int:
    """HTTP status for a request: 0 = allowed, 401 = missing or wrong key (SGLang's decision)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return 0
    want = (admin_api_key or api_key) if path in ADMIN_PATHS else api_key
    if not want:
        return 0
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), want.encode()):
        return 401
    return 0


def write_key_file(path: str | Path, keys: RunKeys) -> Path:
    """Write `keys` as SGLang `--config` YAML, readable by the owner only (mode 600 from creation)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {keys.api_key}\nadmin-api-key: {keys.admin_api_key}\n")
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT
    return path


def read_key_file(path: str | Path) -> RunKeys:
    """The keys of a file written by `write_key_file` (or by hand, same two lines)."""
    found: dict[str, str] = {}
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition(":")
        if not sep or key.strip() not in ("api-key", "admin-api-key"):
            raise ValueError(f"{path}:{n}: expected 'api-key: KEY' or 'admin-api-key: KEY'")
        found[key.strip()] = value.strip().strip("'\"")
    if "api-key" not in found:
        raise ValueError(f"{path}: no 'api-key:' line")
    return RunKeys(found["api-key"], found.get("admin-api-key") or found["api-key"])


def redact(argv: Sequence[str]) -> list[str]:
    """`argv` with the value of every key flag replaced by `***` (for logs)."""
    out, hide = [], False
    for a in map(str, argv):
        if hide:
            out.append("***")
            hide = False
            continue
        flag, eq, _ = a.partition("=")
        if flag.endswith("api-key") and flag.startswith("--"):
            out.append(f"{flag}=***" if eq else a)
            hide = not eq
            continue
        out.append(a)
    return out
