"""Start, health-check and stop the rollout servers a run needs.

Two kinds of servers, chosen by `rollout.engine`:

- `local`: `python -m moe_rl.cli serve --model-path DIR --host H --port P` (HF
  transformers on CPU, SGLang's HTTP API). Several of them are balanced by
  `SGLangClient` itself, unless `rollout.router` is true: then the real
  sglang-router goes in front of them too (the CPU rehearsal of a cluster run).
- `sglang`: `python -m sglang.launch_server --model-path P --tp-size N ...`, whose
  log-probs are log_softmax(logits / T) by default: the distribution the tokens
  were sampled from, which the trainer recomputes (sglang/srt/layers/sampler.py;
  `SGLANG_RETURN_ORIGINAL_LOGPROB` stays unset). With several servers an
  sglang-router (`python -m sglang_router.launch_router --worker-urls ...`) goes in
  front (`rollout.router`: None = only then, true = always, false = never); `urls`
  is then the router and `admin_urls` the workers, which is where weight updates
  must go (the router does not fan them out) and where `SGLangClient` sends the
  requests that ask for routed experts (the router drops that field).

The command lines are built by pure functions (`sglang_server_command`,
`router_command`, `local_server_command`, `plan_servers`) so they are checked
without a GPU. Flags were read from the sglang 0.5.23 and sglang-router 0.3.2
wheels (sglang/srt/arg_groups/fields/*.py, sglang_router/router_args.py).

`ServerGroup` owns the processes: each one runs in its own session (process
group), so `stop()` reaches the children SGLang spawns (scheduler, detokenizer)
too; it sends SIGTERM to the group, then SIGKILL after `stop_timeout`. `stop()` is
registered with atexit, and the group is a context manager. Each process writes
stdout + stderr to `<log_dir>/<name>.log`; a failed start names that file and
shows its last lines.
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from moe_rl.dist.ports import free_ports
from moe_rl.rollout.auth import RunKeys, needs_keys, redact, write_key_file
from moe_rl.rollout.config import pushes_in_place
from moe_rl.rollout.engines import engine_kind
from moe_rl.rollout.processes import (_WILDCARD_HOSTS, _die_with_parent, _group_members, _http_ok,
                                      _wait_port_free, port_is_free, tail)
from moe_rl.rollout.sglang_api import HEALTH, READINESS

log = logging.getLogger(__name__)


class LauncherError(RuntimeError):
    """A server could not be started or did not become healthy; the message names its log file."""


@dataclass(frozen=True)
class ServerSpec:
    """One process to launch: its command line, extra environment and where it answers."""

    name: str
    argv: tuple[str, ...]
    host: str
    port: int
    env: Mapping[str, str] = field(default_factory=dict)
    health_path: str = HEALTH

    @property
    def url(self) -> str:
        """Base URL a client on this machine uses (a wildcard bind address becomes loopback)."""
        host = "127.0.0.1" if self.host in _WILDCARD_HOSTS else self.host
        if ":" in host and not host.startswith("["):  # IPv6 literal
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


# ----------------------------------------------------------------------------- command lines

def local_server_command(model_dir: str | Path, *, host: str, port: int, python: str | None = None,
                         extra_args: Sequence[str] = ()) -> list[str]:
    """argv of one `moe-rl serve` process, with SGLang's flag names. Routes are returned
    (`--enable-return-routed-experts`, as `sglang_server_command` asks SGLang): without the flag
    `moe-rl serve`, as SGLang, returns none."""
    return [python or sys.executable, "-m", "moe_rl.cli", "serve", "--model-path", str(model_dir),
            "--host", host, "--port", str(port), "--enable-return-routed-experts", *map(str, extra_args)]


def radix_cache_args(cfg: Any) -> list[str]:
    """`--disable-radix-cache` for a run whose pushes pause in place (`rollout.inflight_update=in_place`).

    A server keeps a prompt prefix it computed (KV and, captured per KV slot, routes) until its cache is
    flushed, and reuses it for every later request that starts with it: a chat template, a shared system
    prompt, an episode's earlier turns. SGLang refuses a flush under requests paused in place, so an in-place
    push asks for none; and an asynchronous run keeps its servers busy, so a flush "at the next idle point"
    may never come. With the cache on, prefixes computed by version 0 would then serve every later version,
    unseen by the staleness metrics (they read the output tokens' versions) and replayed by R3. Without
    the cache every prompt is computed by the weights that sample from it."""
    return ["--disable-radix-cache"] if pushes_in_place(cfg) else []


def sglang_server_command(model_path: str | Path, *, host: str, port: int, tp_size: int = 1, ep_size: int = 1,
                          mem_fraction: float = 0.8, base_gpu_id: int = 0, python: str | None = None,
                          extra_args: Sequence[str] = ()) -> list[str]:
    """argv of one `sglang.launch_server`.

    Routed experts are returned (`--enable-return-routed-experts`, for R3 and the
    mismatch metrics) and the tokenizer is skipped (we send token ids). `extra_args`
    (the config's `sglang_args`) come last, so a repeated flag there wins.
    SGLang requires ep_size * moe_dp_size == tp_size when ep_size > 1.
    """
    if tp_size < 1 or ep_size < 1:
        raise ValueError(f"tp_size and ep_size must be >= 1, got tp_size={tp_size}, ep_size={ep_size}")
    if ep_size > 1 and tp_size % ep_size:
        raise ValueError(f"SGLang needs ep_size to divide tp_size (ep_size * moe_dp_size == tp_size); "
                         f"got tp_size={tp_size}, ep_size={ep_size}")
    if not 0.0 < mem_fraction <= 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    argv = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--host", host, "--port", str(port), "--tp-size", str(tp_size)]
    if ep_size > 1:
        argv += ["--ep-size", str(ep_size)]
    argv += ["--mem-fraction-static", f"{mem_fraction:g}", "--base-gpu-id", str(base_gpu_id),
             "--enable-return-routed-experts", "--skip-tokenizer-init"]
    return argv + [str(a) for a in extra_args]


def router_command(worker_urls: Sequence[str], *, host: str, port: int, prometheus_port: int | None = None,
                   python: str | None = None, extra_args: Sequence[str] = (),
                   api_key_file: str | Path | None = None) -> list[str]:
    """argv of `sglang_router.launch_router` in front of `worker_urls`.

    `prometheus_port`: where the router's metrics exporter listens, on `host`. Left
    None the router takes its default, 0.0.0.0:29000, and a second router on the same
    machine then dies at startup ("Address already in use"). `api_key_file`: the run's key
    file; the router then checks its callers' key and passes it on to the workers, started
    through `moe_rl.rollout.router_main`, which reads the key from the file (sglang-router
    takes it only as `--api-key KEY`: on a command line, which every user of the node can read).
    """
    if not worker_urls:
        raise ValueError("the router needs at least one worker URL")
    if any(str(a) == "--api-key" or str(a).startswith("--api-key=") for a in extra_args):
        raise ValueError("--api-key would put the router's key on its command line: pass api_key_file")
    entry = ["moe_rl.rollout.router_main", "--api-key-file", str(api_key_file)] if api_key_file is not None \
        else ["sglang_router.launch_router"]
    argv = [python or sys.executable, "-m", *entry, "--host", host, "--port", str(port)]
    if prometheus_port is not None:
        argv += ["--prometheus-host", host, "--prometheus-port", str(prometheus_port)]
    return argv + ["--worker-urls", *worker_urls, *map(str, extra_args)]


def _local_server(cfg: Any, model_path: str | Path, *, host: str, port: int, python: str | None, own: list[str],
                  identity: "RunIdentity | None", saver: list[str], gpu: int | None, tp: int,
                  ep: int) -> tuple[list[str], dict[str, str]]:
    """`moe-rl serve`: this run's identity and trusted dirs, its device (`--device cuda:N`)."""
    extra = own + saver + radix_cache_args(cfg)
    extra += [a for d in (identity.trusted_dirs if identity else ()) for a in ("--trusted-dir", str(d))]
    extra += [] if gpu is None else ["--device", f"cuda:{gpu}"]
    return local_server_command(model_path, host=host, port=port, python=python, extra_args=extra), _local_env()


def _sglang_server(cfg: Any, model_path: str | Path, *, host: str, port: int, python: str | None, own: list[str],
                   identity: "RunIdentity | None", saver: list[str], gpu: int | None, tp: int,
                   ep: int) -> tuple[list[str], dict[str, str]]:
    """`python -m sglang.launch_server` on `tp` GPUs from `gpu`; `rollout.sglang_args` come last (they win)."""
    extra = [a for a in saver + radix_cache_args(cfg) if a not in cfg.sglang_args] + list(cfg.sglang_args)
    argv = sglang_server_command(model_path, host=host, port=port, tp_size=tp, ep_size=ep,
                                 mem_fraction=float(cfg.mem_fraction), base_gpu_id=gpu, python=python,
                                 extra_args=own + extra)
    return argv, {}


# The command of one server, per engine that runs as servers (moe_rl/rollout/engines.py).
SERVER_COMMANDS = {"local": _local_server, "sglang": _sglang_server}


def wants_router(cfg: Any) -> bool:
    """Whether `plan_servers` puts sglang-router in front of the servers `cfg` describes.

    `rollout.router`: true = always (for `moe-rl serve` workers too), false = never,
    None (or absent) = when the engine is sglang and there is more than one server.
    """
    choice = getattr(cfg, "router", None)
    if choice is None:
        return engine_kind(cfg).router_when_many and int(cfg.num_servers) > 1
    if not isinstance(choice, bool):
        raise ValueError(f"rollout.router must be true, false or null (auto), got {choice!r}")
    return choice


def plan_servers(cfg: Any, model_path: str | Path, *, tp_size: int | None = None, ep_size: int | None = None,
                 python: str | None = None, identity: "RunIdentity | None" = None,
                 gpus: Sequence[int | None] | None = None) -> tuple[list[ServerSpec], ServerSpec | None]:
    """The servers (and the router, or None) a `RolloutConfig` asks for.

    Server i listens on `cfg.base_port + i`; the router, when there is one (see
    `wants_router`), on `cfg.base_port + cfg.num_servers` and its metrics exporter on the
    port after. Without a base_port, consecutive ports free now are used (below the
    kernel's ephemeral range, so that no connection takes them before the servers bind).
    `gpus[i]` is server i's first GPU (`plan_devices`: SGLang's `--base-gpu-id`, `moe-rl
    serve`'s `--device cuda:N`; None = the CPU); left None, SGLang server i starts at GPU
    `i * tp_size` and `moe-rl serve` picks its own device. Colocated servers
    (`cfg.colocated`) start with `--enable-memory-saver`, without which their memory cannot
    be released. tp_size / ep_size default to the config's `tp_size` / `ep_size` fields when
    it has them, else 1.
    `identity` adds what makes the servers this run's: `--served-model-name` (the run id),
    `--config` with the keys file, and for `moe-rl serve` its `--trusted-dir`s; with keys the
    router gets the api key (it checks its callers' keys and passes the key on to the workers) and binds
    loopback only: the trainer is on this machine.
    """
    if getattr(cfg, "urls", None):
        raise ValueError(f"rollout.urls is set ({', '.join(cfg.urls)}): those servers already run; "
                         "connect to them instead of launching new ones")
    n = int(cfg.num_servers)
    if n < 1:
        raise ValueError(f"rollout.num_servers must be >= 1, got {n}")
    tp = int(tp_size if tp_size is not None else getattr(cfg, "server_tp_size", getattr(cfg, "tp_size", 1)) or 1)
    ep = int(ep_size if ep_size is not None else getattr(cfg, "ep_size", 1) or 1)
    host = str(cfg.host)
    base = int(cfg.base_port) if cfg.base_port else free_ports(n + 2)
    if base + n + 1 > 65535:
        raise ValueError(f"rollout.base_port={base} leaves no room for {n} servers and a router below 65536")
    servers: list[ServerSpec] = []
    own = identity.server_args() if identity is not None else []
    saver = ["--enable-memory-saver"] if getattr(cfg, "colocated", False) else []
    if gpus is not None and len(gpus) != n:
        raise ValueError(f"{n} servers but {len(gpus)} GPU assignments")
    kind = engine_kind(cfg)
    if not kind.runs_as_servers:
        raise ValueError(f"rollout.engine={kind.name} runs as {kind.what}: there are no servers to launch")
    command = SERVER_COMMANDS[kind.name]
    for i in range(n):
        port, gpu = base + i, (None if gpus is None else gpus[i])
        argv, env = command(cfg, model_path, host=host, port=port, python=python, own=own, identity=identity,
                            saver=saver, gpu=gpu if gpu is not None or not kind.tensor_parallel else i * tp,
                            tp=tp, ep=ep)
        servers.append(ServerSpec(f"server-{i}", tuple(argv), host, port, env))
    router = None
    if wants_router(cfg):
        keyed = identity is not None and identity.keys is not None
        rhost = "127.0.0.1" if keyed else host
        argv = router_command([s.url for s in servers], host=rhost, port=base + n, prometheus_port=base + n + 1,
                              python=python, api_key_file=identity.key_file if keyed else None)
        # /readiness, not /health: the router answers /health at once, but refuses
        # /generate (503) until it has registered a healthy worker.
        router = ServerSpec("router", tuple(argv), rhost, base + n, _local_env() if keyed else {},
                            health_path=READINESS)
    return servers, router


@dataclass(frozen=True)
class RunIdentity:
    """What tells this run's servers from any other: the run id they serve under, the keys
    file (None = keyless, loopback-only runs) and where `moe-rl serve` may load weights from."""

    run_id: str
    key_file: Path | None = None
    keys: "RunKeys | None" = None
    trusted_dirs: tuple[Path, ...] = ()

    @classmethod
    def for_run(cls, out: str | Path, host: str, trusted_dirs: Sequence[str | Path] = ()) -> "RunIdentity":
        """A fresh id (and, when `host` is not loopback, fresh keys in `<out>/servers/auth.yaml`, mode 600)."""
        out = Path(out)
        run_id = f"moe-rl-{out.name}-{secrets.token_hex(4)}".replace(":", "-")
        keys = key_file = None
        if needs_keys(host):
            keys = RunKeys.new()
            key_file = write_key_file(out / "servers" / "auth.yaml", keys)
        return cls(run_id, key_file, keys, tuple(Path(d) for d in trusted_dirs))

    def server_args(self) -> list[str]:
        args = ["--served-model-name", self.run_id]
        return args + (["--config", str(self.key_file)] if self.key_file is not None else [])

    def scrub(self, text: str) -> str:
        """`text` with the keys replaced by *** (server logs hold them: SGLang logs its arguments)."""
        if self.keys is not None:
            for k in (self.keys.api_key, self.keys.admin_api_key):
                text = text.replace(k, "***")
        return text


def _local_env() -> dict[str, str]:
    """PYTHONPATH that makes `-m moe_rl.cli` importable even when the package is not installed."""
    root = str(Path(__file__).resolve().parents[2])
    old = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": root + (os.pathsep + old if old else "")}


# ----------------------------------------------------------------------------- helpers

# ----------------------------------------------------------------------------- the group

@dataclass
class _Running:
    spec: ServerSpec
    proc: subprocess.Popen
    log_path: Path


class ServerGroup:
    """Rollout servers (and an optional router) as child processes.

    `with ServerGroup.from_config(cfg.rollout, model_dir, log_dir) as group:
    group.wait_healthy(600); client = SGLangClient(group.urls, admin_urls=group.admin_urls)`.
    """

    def __init__(self, servers: Sequence[ServerSpec], log_dir: str | Path, *, router: ServerSpec | None = None,
                 env: Mapping[str, str] | None = None, stop_timeout: float = 15.0,
                 identity: RunIdentity | None = None, max_restarts: int = 3):
        if not servers:
            raise ValueError("a ServerGroup needs at least one server")
        self.servers, self.router = list(servers), router
        self.log_dir = Path(log_dir)
        self.env = dict(env or {})
        self.stop_timeout = float(stop_timeout)
        self.identity = identity
        self.max_restarts = int(max_restarts)
        self.restarts: dict[str, int] = {}
        self._running: list[_Running] = []
        self._lock = threading.Lock()
        self._watching: threading.Event | None = None

    @classmethod
    def from_config(cls, cfg: Any, model_path: str | Path, log_dir: str | Path, *, tp_size: int | None = None,
                    ep_size: int | None = None, env: Mapping[str, str] | None = None,
                    identity: RunIdentity | None = None, gpus: Sequence[int | None] | None = None) -> "ServerGroup":
        """The group a `RolloutConfig` describes (see `plan_servers`)."""
        servers, router = plan_servers(cfg, model_path, tp_size=tp_size, ep_size=ep_size, identity=identity,
                                       gpus=gpus)
        return cls(servers, log_dir, router=router, env=env, identity=identity,
                   max_restarts=int(getattr(cfg, "max_restarts", 3)))

    @property
    def specs(self) -> list[ServerSpec]:
        return self.servers + ([self.router] if self.router else [])

    @property
    def urls(self) -> list[str]:
        """Where generate requests go: the router when there is one, else every server."""
        return [self.router.url] if self.router else [s.url for s in self.servers]

    @property
    def admin_urls(self) -> list[str]:
        """Where weight updates, pause and flush go: always the servers themselves."""
        return [s.url for s in self.servers]

    @property
    def log_paths(self) -> dict[str, Path]:
        return {s.name: self.log_dir / f"{s.name}.log" for s in self.specs}

    @property
    def pids(self) -> dict[str, int]:
        """Process id (= process group id) of each started process."""
        return {r.spec.name: r.proc.pid for r in self._running}

    # ------------------------------------------------------------------- start
    def start(self) -> "ServerGroup":
        """Check every port is free, then launch all processes (the router waits for its workers)."""
        if self._running:
            raise LauncherError("this ServerGroup is already started")
        busy = [f"{s.name} port {s.port}" for s in self.specs if not port_is_free(s.host, s.port)]
        if busy:
            raise LauncherError(f"ports already in use on {self.specs[0].host}: {', '.join(busy)}; stop what "
                                "holds them or choose another rollout.base_port")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            for spec in self.specs:
                self._running.append(self._launch(spec))
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, spec: ServerSpec, append: bool = False) -> _Running:
        path = self.log_paths[spec.name]
        env = {**os.environ, **spec.env, **self.env}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o600)  # SGLang logs its keys
        with os.fdopen(fd, "wb") as logf:  # the child keeps its own descriptor
            logf.write(f"$ {' '.join(redact(spec.argv))}\n".encode())
            logf.flush()
            # A session of its own: stop() signals the whole process group, children included.
            # preexec_fn only calls prctl (no locks, no allocation that could deadlock after fork)
            proc = subprocess.Popen(list(spec.argv), stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True,
                                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        log.info("started %s (pid %d) on %s; log %s", spec.name, proc.pid, spec.url, path)
        return _Running(spec, proc, path)

    # ------------------------------------------------------------------ health
    def wait_healthy(self, timeout: float = 600.0, interval: float = 0.5, stop_on_failure: bool = True) -> None:
        """Poll every process's /health until all answer 200.

        Fails early when a process exits. On failure raises LauncherError naming each
        unhealthy process, its log file and the last lines of that log (and stops the
        group unless `stop_on_failure` is False).
        """
        if not self._running:
            raise LauncherError("start() the ServerGroup before wait_healthy()")
        deadline = time.monotonic() + timeout
        pending = list(self._running)
        while pending:
            dead = [r for r in pending if r.proc.poll() is not None]
            if dead:
                self._fail([(r, f"exited with code {r.proc.returncode} before becoming healthy") for r in dead],
                           stop_on_failure)
            pending = [r for r in pending if not _http_ok(r.spec.url + r.spec.health_path, min(interval * 4, 5.0))]
            if not pending:
                break
            if time.monotonic() > deadline:
                self._fail([(r, f"not healthy after {timeout:g} s") for r in pending], stop_on_failure)
            time.sleep(interval)
        log.info("rollout servers healthy: %s", ", ".join(self.urls))

    def _fail(self, problems: list[tuple[_Running, str]], stop: bool) -> None:
        parts = []
        for r, why in problems:
            parts.append(f"{r.spec.name} ({r.spec.url}) {why}; log: {r.log_path}\n"
                         f"--- last lines of {r.log_path} ---\n{self._scrub(tail(r.log_path))}\n---")
        message = "rollout servers failed to start:\n" + "\n".join(parts)
        log.error(message)
        if stop:
            self.stop()
        raise LauncherError(message)

    def alive(self) -> dict[str, bool]:
        """Whether each started process is still running."""
        return {r.spec.name: r.proc.poll() is None for r in self._running}

    def _scrub(self, text: str) -> str:
        return self.identity.scrub(text) if self.identity is not None else text

    # --------------------------------------------------------------- supervision
    def restart_dead(self) -> list[str]:
        """Relaunch every process that exited (same argv, same port), at most `max_restarts`
        times each; returns the names restarted. The clients find them by probing: a
        restarted server proves it is this run's and gets the current weights before use."""
        done = []
        with self._lock:
            for i, r in enumerate(self._running):
                if r.proc.poll() is None:
                    continue
                name = r.spec.name
                if self.restarts.get(name, 0) >= self.max_restarts:
                    continue
                self._signal(r.proc.pid, signal.SIGKILL)  # what is left of its group (SGLang's children)
                self._wait_groups_gone([r.proc.pid], 5.0)
                if not _wait_port_free(r.spec.host, r.spec.port, 10.0):
                    log.error("%s exited (code %s) but port %d is held by another process: not restarted; "
                              "the client will not use what answers there unless it is this run's",
                              name, r.proc.returncode, r.spec.port)
                    continue
                self.restarts[name] = self.restarts.get(name, 0) + 1
                log.warning("%s exited with code %s; restarting it (%d of %d); log %s", name, r.proc.returncode,
                            self.restarts[name], self.max_restarts, r.log_path)
                self._running[i] = self._launch(r.spec, append=True)
                done.append(name)
        return done

    def watch(self, interval: float = 1.0) -> "ServerGroup":
        """Supervise in a daemon thread: `restart_dead()` every `interval` s until `stop()`."""
        if self._watching is None:
            self._watching = threading.Event()
            stopped = self._watching

            def loop() -> None:
                while not stopped.wait(interval):
                    try:
                        self.restart_dead()
                    except Exception:  # noqa: BLE001 - a supervisor must not die of one failed restart
                        log.exception("restarting a rollout server failed")

            threading.Thread(target=loop, name="server-supervisor", daemon=True).start()
        return self

    # -------------------------------------------------------------------- stop
    def stop(self) -> None:
        """SIGTERM every process group (router first), SIGKILL what is left after `stop_timeout`."""
        if self._watching is not None:
            self._watching.set()
            self._watching = None
        with self._lock:
            running, self._running = self._running, []
        atexit.unregister(self.stop)
        if not running:
            return
        for r in reversed(running):  # router first: it stops sending work to the servers
            self._signal(r.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for r in running:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for r in running:
            # The leader may be gone while its children live on: kill what is left of the group.
            if r.proc.poll() is None or _group_members(r.proc.pid):
                log.warning("%s did not stop on SIGTERM within %g s; killing it", r.spec.name, self.stop_timeout)
                self._signal(r.proc.pid, signal.SIGKILL)
        for r in running:
            try:
                r.proc.wait(10)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) survived SIGKILL", r.spec.name, r.proc.pid)
        self._wait_groups_gone([r.proc.pid for r in running], 5.0)

    @staticmethod
    def _signal(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _wait_groups_gone(pgids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(_group_members(g) for g in pgids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> "ServerGroup":
        return self.start() if not self._running else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
