"""Install torch into the interpreter that runs this script: the CPU build where no GPU is present.

    python tools/install_torch.py [--dry-run] [-- PIP_INSTALL_OPTIONS...]

`make venv` runs it with .venv's python (`.venv/bin/python tools/install_torch.py -- -q`).

- A GPU (`nvidia-smi` on PATH): `pip install torch` from the default index, the CUDA build.
- No GPU: `pip install torch==2.13.0 --index-url $TORCH_CPU_INDEX --extra-index-url DEFAULT`,
  when the CPU index answers within $TORCH_CPU_INDEX_TIMEOUT seconds (3). On the public index
  `torch==2.13.0` is the Linux wheel that pulls CUDA, cuDNN and NCCL (several GB); PyTorch's
  CPU index holds `2.13.0+cpu`, which a PEP 440 local version ranks above the default
  index's `2.13.0`, so the pin needs no `+cpu` (that would refuse the macOS wheels, which
  carry none). DEFAULT ($PIP_INDEX_URL, else PyPI) serves torch's own dependencies.
- No GPU and the CPU index unreachable: `pip install torch==2.13.0` from the default index,
  as before this script existed (the CUDA wheels on Linux unless the configured index or
  find-links carry a CPU build). Which path was taken, and why, goes to stderr.

Environment: TORCH_CPU_INDEX (default https://download.pytorch.org/whl/cpu; a mirror, or a
stand-in index in the tests), TORCH_CPU_INDEX_TIMEOUT (seconds), TORCH_INSTALL_DRY_RUN=1 (as
--dry-run: print the pip command on stdout, run nothing).

Python rather than shell: the bootstrap already needs Python 3.10+, while curl or wget may be
missing (slim images), and the probe honours the same proxy variables pip does.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DEFAULT_INDEX = "https://pypi.org/simple"
CPU_PIN = "torch==2.13.0"
PROBE_TIMEOUT_S = 3.0  # a slow or silent index costs CI at most this much


def say(msg: str) -> None:
    print(f"install_torch: {msg}", file=sys.stderr, flush=True)


def probe(index: str, timeout_s: float) -> str | None:
    """None when `index` serves a torch project page within timeout_s, else why not."""
    page = index.rstrip("/") + "/torch/"  # PEP 503: one page per project
    if page.startswith("file:"):  # a local mirror directory
        path = urllib.request.url2pathname(urllib.parse.urlparse(page).path)
        return None if os.path.isdir(path) else f"{path} is not a directory"
    result: list[str | None] = []

    def get() -> None:
        try:
            with urllib.request.urlopen(page, timeout=timeout_s) as resp:  # headers only
                result.append(None if resp.status == 200 else f"HTTP {resp.status}")
        except Exception as e:  # URLError, timeouts, refused connections, HTTP errors
            result.append(f"{type(e).__name__}: {getattr(e, 'reason', e)}")

    # urlopen's timeout does not cover name resolution: a hanging DNS is bounded by the join
    worker = threading.Thread(target=get, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return result[0] if result else f"no answer within {timeout_s:g} s"


def pip_command(pip_options: list[str]) -> list[str]:
    pip = [sys.executable, "-m", "pip", "install", *pip_options]
    if shutil.which("nvidia-smi"):
        say("nvidia-smi found: the default (CUDA) build from the default index")
        return [*pip, "torch"]
    index = os.environ.get("TORCH_CPU_INDEX") or CPU_INDEX
    timeout_s = float(os.environ.get("TORCH_CPU_INDEX_TIMEOUT") or PROBE_TIMEOUT_S)
    start = time.monotonic()
    why_not = probe(index, timeout_s)
    if why_not is None:
        say(f"no GPU: the CPU build from {index} (answered in {time.monotonic() - start:.1f} s)")
        default = os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX  # torch's dependencies
        return [*pip, "--index-url", index, "--extra-index-url", default, CPU_PIN]
    say(f"no GPU, but {index} is unreachable ({why_not}): {CPU_PIN} from the default index "
        "(on Linux the CUDA build, several GB, unless that index or find-links carry a CPU "
        "build; set TORCH_CPU_INDEX to a reachable mirror)")
    return [*pip, CPU_PIN]


def main(argv: list[str]) -> int:
    own, pip_options = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    unknown = [a for a in own if a != "--dry-run"]
    if unknown:
        print(__doc__, file=sys.stderr)
        say(f"unknown option(s) {unknown}: pip's own go after `--`")
        return 2
    cmd = pip_command(pip_options)
    if "--dry-run" in own or os.environ.get("TORCH_INSTALL_DRY_RUN") == "1":
        print(shlex.join(cmd))
        return 0
    say("running " + shlex.join(cmd))
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
