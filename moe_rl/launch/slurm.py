"""Render the sbatch script of an RL job, and submit it.

`render_script()` fills `launch/slurm/rl_job.sbatch.tmpl`. The template holds the
job's logic (node list, rendezvous, servers, health wait, trainer, signals, cleanup);
this module only computes the values that differ between jobs and quotes them for
bash. Server command lines come from `moe_rl.rollout.launcher`, the same functions
single-machine runs use, with bash variables put in where the node is known only
at run time.

Placeholders in the template are `@{name}`: bash never writes `@{`, so the template
stays plain bash around them.

Every srun step states its own --nodes, --ntasks and --ntasks-per-node. A step that
leaves one out inherits the job's value from the environment (srun reads SLURM_NTASKS
and SLURM_NTASKS_PER_NODE, which sbatch sets for the whole allocation): a trainer step
on fewer nodes than the job then asks for the job's task count, and SLURM 22.05 warns
"can't honor --ntasks-per-node" and places the job's tasks on the trainer nodes.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import string
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from moe_rl.launch.plan import TP_FLAGS, LaunchError, NodeShape, ServerLayout
from moe_rl.rollout.engines import engine_kind

TEMPLATE = Path(__file__).resolve().parents[2] / "launch" / "slurm" / "rl_job.sbatch.tmpl"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Default NCCL interface choice: anything but loopback and docker bridges (NCCL's `^` excludes prefixes).
DEFAULT_NCCL_IFNAME = "^lo,docker"
# The rendezvous port is derived from the job id, so two jobs sharing a node do not collide;
# the range stays below SGLang's 30000 and below Linux's ephemeral ports.
MASTER_PORT_BASE, MASTER_PORT_SPAN = 20000, 9000
_SAFE_SBATCH = re.compile(r"^[^\s'\"\\]*$")


class _Template(string.Template):
    """`@{name}` placeholders only (bash uses `$` and `${...}` everywhere)."""

    delimiter = "@"
    pattern = r"@(?:(?P<escaped>(?!))|(?P<named>(?!))|\{(?P<braced>[a-z_][a-z0-9_]*)\}|(?P<invalid>(?!)))"


@dataclass
class SlurmOptions:
    """Cluster settings that are not part of the run config (flags of `moe-rl launch slurm`)."""

    job_name: str | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    signal_secs: int = 300
    requeue: bool = True
    nccl_ifname: str | None = DEFAULT_NCCL_IFNAME
    gloo_ifname: str | None = None
    container_image: str | None = None
    container_mounts: str | None = None
    python: str | None = None
    master_port: int | None = None
    health_timeout: float = 1800.0
    stop_timeout: float = 60.0
    servers_per_node: int | None = None
    sbatch_args: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Rendered:
    """A rendered script and what it was rendered from."""

    text: str
    shape: NodeShape
    servers: ServerLayout
    run_dir: Path
    train_overrides: tuple[str, ...]
    notes: tuple[str, ...]


# ----------------------------------------------------------------------------- bash words

# Sentinel strings passed through the launcher's command builders in place of values
# known only when the job runs; `bash_word` turns them into variable expansions.
_VARS = {"@@PYTHON@@": "PYTHON", "@@MODEL@@": "MODEL_PATH", "@@NODE@@": "node",
         "@@ROUTER_NODE@@": "ROUTER_NODE", "@@ROUTER_ADDR@@": "ROUTER_ADDR", "@@RUN_DIR@@": "RUN_DIR",
         "@@CONFIG@@": "CONFIG", "@@KEY_FILE@@": "KEY_FILE", "@@SERVED_NAME@@": "SERVED_NAME"}
_ARRAYS = {"@@WORKERS@@": '"${WORKER_URLS[@]}"'}
_SENTINEL = re.compile("|".join(re.escape(s) for s in _VARS))


def bash_word(arg: str) -> str:
    """One argument as a bash word: quoted literally, with sentinels as `"${VAR}"` expansions."""
    if arg in _ARRAYS:
        return _ARRAYS[arg]
    if not _SENTINEL.search(arg):
        return shlex.quote(arg)
    out, pos = [], 0
    for m in _SENTINEL.finditer(arg):
        out.append(_dq_escape(arg[pos:m.start()]) + "${" + _VARS[m.group(0)] + "}")
        pos = m.end()
    return '"' + "".join(out) + _dq_escape(arg[pos:]) + '"'


def _dq_escape(text: str) -> str:
    return re.sub(r'([\\"$`])', r"\\\1", text)


def bash_command(argv: Sequence[str], indent: str = "    ", width: int = 100) -> str:
    """argv as one bash command, wrapped with backslash-newlines at about `width` columns."""
    lines, line = [], ""
    for word in map(bash_word, argv):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = indent + word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return " \\\n".join(lines)


# ----------------------------------------------------------------------------- pieces of the script

def _directives(name: str, shape: NodeShape, servers: ServerLayout, run_dir: Path, opts: SlurmOptions,
                chdir: Path) -> list[str]:
    """#SBATCH lines; values are checked because sbatch does not unquote them.

    CPU mode requests no GPU (a cluster without GPU GRES refuses any GPU request) and
    sizes each node for its busiest role: the trainer's ranks or a serving node's servers,
    `cpus_per_task` CPUs each.
    """
    if shape.cpu:
        per_node = max(shape.ranks_per_node, servers.per_node)
        tasks: list[tuple[str, Any]] = [("ntasks-per-node", per_node), ("cpus-per-task", shape.cpus_per_task)]
    else:
        tasks = [("ntasks-per-node", shape.gpus_per_node), ("gpus-per-node", shape.gpus_per_node)]
    pairs: list[tuple[str, Any]] = [
        ("job-name", name), ("nodes", shape.nodes), *tasks, ("exclusive", None), ("mem", 0),
        ("time", opts.time), ("partition", opts.partition), ("account", opts.account),
        ("chdir", chdir), ("output", run_dir / "logs" / "slurm-%j.out"), ("open-mode", "append"),
        ("signal", f"B:USR1@{opts.signal_secs}" if opts.signal_secs else None),
    ]
    lines = []
    for key, value in pairs:
        if key != "exclusive" and value is None:
            continue
        text = f"--{key}" if value is None else f"--{key}={value}"
        if not _SAFE_SBATCH.match(text):
            raise LaunchError(f"#SBATCH {text}: sbatch directives cannot hold spaces or quotes; "
                              "use a path / value without them")
        lines.append(f"#SBATCH {text}")
    if opts.requeue:
        lines.append("#SBATCH --requeue")
    for extra in opts.sbatch_args:
        if not extra.startswith("-") or not _SAFE_SBATCH.match(extra):
            raise LaunchError(f"--sbatch-arg {extra!r}: give one sbatch option without spaces, e.g. --qos=high")
        lines.append(f"#SBATCH {extra}")
    return lines


def _node_split(shape: NodeShape) -> str:
    if shape.colocated:
        return ('# colocated: every node runs trainer ranks and rollout servers on the same GPUs\n'
                'TRAIN_NODES=("${NODES[@]}")\n'
                'ROLLOUT_NODES=("${NODES[@]}")')
    return (f"# disaggregated: the first {shape.train_nodes} node(s) train, the other "
            f"{shape.rollout_nodes} serve rollouts\n"
            f'TRAIN_NODES=("${{NODES[@]:0:{shape.train_nodes}}}")\n'
            f'ROLLOUT_NODES=("${{NODES[@]:{shape.train_nodes}}}")')


def _env_exports(opts: SlurmOptions, shape: NodeShape) -> str:
    lines = []
    if shape.cpu:
        # torch sizes its thread pool from OMP_NUM_THREADS; without it (and without SLURM task
        # affinity) every rank and server would start one thread per core of the node.
        lines.append(f"export OMP_NUM_THREADS={shape.cpus_per_task}  # CPU mode: threads = --cpus-per-task")
        # No GPU was requested: on nodes that have GPUs anyway, torch must not pick them (and NCCL).
        lines.append('export CUDA_VISIBLE_DEVICES=""  # CPU mode: ranks use gloo, servers the CPU')
    if opts.nccl_ifname:
        lines.append(f"export NCCL_SOCKET_IFNAME={shlex.quote(opts.nccl_ifname)}  # NCCL bootstrap + socket transport")
    else:
        lines.append("# NCCL_SOCKET_IFNAME: unset, NCCL picks the interface")
    if opts.gloo_ifname:
        lines.append(f"export GLOO_SOCKET_IFNAME={shlex.quote(opts.gloo_ifname)}  # gloo: CPU collectives, barriers")
    else:
        lines.append("# GLOO_SOCKET_IFNAME: unset, gloo uses the interface of the address the node name resolves to")
    return "\n".join(lines)


def _run_task(opts: SlurmOptions) -> str:
    """The bash function that runs `moe_rl.launch.task` helpers where moe_rl is installed.

    Without a container that is the batch host's `$PYTHON`. With one, moe_rl exists only
    inside the image, so each helper is a one-task step in it (`--overlap`, in SRUN_OPTS
    with the container flags, shares the node with the running steps) on the batch host
    itself: `wait-healthy --watch` checks the pids of this shell's srun steps, and enroot
    shares the host's process and network namespaces (it isolates users and mounts only),
    so those pids are visible there.
    """
    if not opts.container_image:
        return ("# moe_rl's helpers (moe_rl.launch.task) run on this batch host\n"
                'run_task() { "$PYTHON" -m moe_rl.launch.task "$@"; }')
    return ("# moe_rl's helpers (moe_rl.launch.task) run where moe_rl is installed: in the container,\n"
            "# as a one-task step on this batch host (wait-healthy watches this shell's srun pids)\n"
            "run_task() {\n"
            '  srun "${SRUN_OPTS[@]}" --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist="$SLURMD_NODENAME" \\\n'
            '    "$PYTHON" -m moe_rl.launch.task "$@"\n'
            "}")


def _model_setup(cfg: Any, base_overrides: Sequence[str]) -> str:
    if cfg.model.hf_path:
        return f"MODEL_PATH={shlex.quote(str(cfg.model.hf_path))}  # model.hf_path: the trainer reads it too"
    args = ["run_task", "prepare-model", "--config", "@@CONFIG@@", "--run-dir", "@@RUN_DIR@@", *base_overrides]
    cmd = bash_command(args)
    return ("# model.hf_path is unset: write the fresh model once, where the trainer looks for it,\n"
            "# so the servers can load it before the trainer starts.\n"
            f"MODEL_PATH=$({cmd} | tail -n 1)\n"
            'echo "fresh model: ${MODEL_PATH}"')


def _server_argv(cfg: Any, servers: ServerLayout, index: int, host: str, colocated: bool) -> list[str]:
    """Server `index`'s command: the launcher's for the engine (`SERVER_COMMANDS`), with the job's
    placeholders for what the script fills in (model, python, keys, served name)."""
    from moe_rl.rollout.launcher import SERVER_COMMANDS

    kind = engine_kind(servers)
    # --tp-size is folded into servers.tp (plan.server_tp read the last one)
    rollout = dataclasses.replace(cfg.rollout, sglang_args=_without_tp_flags(list(map(str, cfg.rollout.sglang_args))))
    argv, _ = SERVER_COMMANDS[kind.name](
        rollout, "@@MODEL@@", host=host, port=servers.ports[index], python="@@PYTHON@@", own=list(SERVER_IDENTITY),
        identity=None, saver=["--enable-memory-saver"] if colocated else [],  # colocated: released between phases
        gpu=index * servers.tp if kind.tensor_parallel else None, tp=servers.tp, ep=int(cfg.rollout.ep_size))
    return argv


# Every server reads the job's keys from a mode-600 file (SGLang's --config) and serves under the
# job's id, which the trainer checks (moe_rl/rollout/auth.py); neither key is in the script.
SERVER_IDENTITY = ("--config", "@@KEY_FILE@@", "--served-model-name", "@@SERVED_NAME@@")


def _keys_setup() -> str:
    return ("# Per-job keys, mode 600 on the shared run dir: the servers (--config) and the trainer\n"
            "# (rollout.api_key_file) read them there; they are never on a command line or in this script.\n"
            'KEY_FILE="${RUN_DIR}/servers/auth.yaml"\n'
            'SERVED_NAME="moe-rl-${SLURM_JOB_ID}"\n'
            'run_task write-keys "$KEY_FILE"')


def _without_tp_flags(args: list[str]) -> list[str]:
    """`args` less `--tp-size N` / `--tp-size=N` (plan.server_tp already read them)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in TP_FLAGS:
            skip = True
        elif arg.partition("=")[0] not in TP_FLAGS:
            out.append(arg)
    return out


def _cpu_setup(shape: NodeShape, servers: ServerLayout) -> str:
    """Bash that sets TRAIN_CPUS and SERVER_CPUS, the --cpus-per-task of each trainer rank and each
    server (the router: as a server). srun 22.05 no longer reads the job's SLURM_CPUS_PER_TASK, and on
    clusters that bind tasks to cores a step without --cpus-per-task gets one CPU per task: a TP-2
    SGLang server or a trainer rank would run on one core. GPU mode: `--cpus-per-task` when given,
    else the node's CPUs shared by its tasks (the job is --exclusive: SLURM_CPUS_ON_NODE is the
    node's); CPU mode: `--cpus-per-task` (default 1)."""
    if shape.cpu:
        return (f"TRAIN_CPUS={shape.cpus_per_task}   # CPU mode: --cpus-per-task\n"
                f"SERVER_CPUS={shape.cpus_per_task}")
    if shape.cpus_per_task:
        return (f"TRAIN_CPUS={shape.cpus_per_task}   # --cpus-per-task\n"
                f"SERVER_CPUS={shape.cpus_per_task}")
    train_tasks = shape.ranks_per_node + (servers.per_node if shape.colocated else 0)
    serve_tasks = servers.per_node + (shape.ranks_per_node if shape.colocated else 0)
    return ("# the node's CPUs, shared by the tasks that run on it (--cpus-per-task N sets them instead)\n"
            'NODE_CPUS="${SLURM_CPUS_ON_NODE:-$(nproc)}"\n'
            f"TRAIN_CPUS=$(( NODE_CPUS / {train_tasks} > 0 ? NODE_CPUS / {train_tasks} : 1 ))"
            f"   # {shape.ranks_per_node} trainer rank(s){' + the servers' if shape.colocated else ''} per node\n"
            f"SERVER_CPUS=$(( NODE_CPUS / {serve_tasks} > 0 ? NODE_CPUS / {serve_tasks} : 1 ))"
            f"   # {servers.per_node} server(s){' + the trainer ranks' if shape.colocated else ''} per node\n"
            'echo "CPUs per task: ${TRAIN_CPUS} per trainer rank, ${SERVER_CPUS} per server (${NODE_CPUS} per node)"')


def _srun_line(nodelist: str, log: str, argv: Sequence[str]) -> str:
    """A one-task step on one node (a server or the router), every count stated (see the module doc)."""
    head = (f'  srun "${{SRUN_OPTS[@]}}" --nodes=1 --ntasks=1 --ntasks-per-node=1 --cpus-per-task="$SERVER_CPUS" \\\n'
            f'    --nodelist={nodelist} --output={log} \\\n    ')
    return head + bash_command(argv, indent="    ") + " &"


def _server_lines(cfg: Any, servers: ServerLayout, bind_node: bool, colocated: bool) -> str:
    host = "@@NODE@@" if bind_node else str(cfg.rollout.host)
    blocks = []
    for i, port in enumerate(servers.ports):
        argv = _server_argv(cfg, servers, i, host, colocated)
        blocks.append(_srun_line('"$node"', f'"${{LOG_DIR}}/rollout-${{node}}-{i}.log"', argv) + "\n"
                      '  SERVER_PIDS+=("$!")\n'
                      f'  WORKER_URLS+=("http://${{node}}:{port}")')
    return "\n".join(blocks)


def _router_setup(cfg: Any, servers: ServerLayout, bind_node: bool) -> str:
    from moe_rl.rollout.launcher import router_command

    if not servers.use_router:
        return ("# No router: the trainer's client spreads requests over the servers itself and\n"
                "# keeps going without one that stops answering.\n"
                'GENERATE_URLS=("${WORKER_URLS[@]}")')
    port = servers.router_port
    host = "@@ROUTER_ADDR@@" if bind_node else str(cfg.rollout.host)
    # Its metrics exporter gets the next port (the default 0.0.0.0:29000 is shared by every router on a node).
    # The router checks its callers' api key and calls the workers with it: read from the key file by
    # moe_rl.rollout.router_main, never on a command line (`ps` shows every user of the node an argv).
    argv = router_command(["@@WORKERS@@"], host=host, port=port, prometheus_port=port + 1, python="@@PYTHON@@",
                          api_key_file="@@KEY_FILE@@")
    srun = _srun_line('"$ROUTER_NODE"', '"${LOG_DIR}/router-${ROUTER_NODE}.log"', argv).removeprefix("  ")
    return ("# sglang-router in front of every server: generation requests go to it, weight\n"
            "# updates go to each server (rollout.admin_urls), which the router does not relay.\n"
            'ROUTER_NODE="${ROLLOUT_NODES[0]}"\n'
            f'ROUTER_URL="http://${{ROUTER_NODE}}:{port}"\n'
            f"{_router_addr() if bind_node else ''}"
            f"{srun}\n"
            'SERVER_PIDS+=("$!")\n'
            '# /readiness: the router answers /health before it has registered a worker\n'
            'run_task wait-healthy --path /readiness --timeout "$HEALTH_TIMEOUT" --watch "${SERVER_PIDS[*]}" \\\n'
            '  --logs "$LOG_DIR" "$ROUTER_URL"\n'
            'GENERATE_URLS=("$ROUTER_URL")')


def _router_addr() -> str:
    """Bash that sets ROUTER_ADDR, the IPv4 address the router node's name resolves to.

    sglang-router 0.3.2 binds IP addresses only: a host name as --host fails at start
    ("Invalid address: invalid socket address syntax"), and as --prometheus-host it
    quietly becomes 0.0.0.0. Node names resolve alike on every node of a cluster, so the
    batch host resolves it.
    """
    return ("# sglang-router binds IP addresses only (a host name fails): the router node's address\n"
            "ROUTER_ADDR=$(getent ahostsv4 \"$ROUTER_NODE\" | awk 'NR == 1 { print $1 }' || true)\n"
            'if [[ -z $ROUTER_ADDR ]]; then\n'
            '  echo "cannot resolve the router node ${ROUTER_NODE} to an IPv4 address (getent ahostsv4)" >&2\n'
            "  exit 1\n"
            "fi\n")


def _rollout_fields(cfg: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(type(cfg.rollout))}


def _server_overrides(rollout: Any, servers: ServerLayout, colocated: bool, fields: set[str]) -> list[str]:
    """Overrides that tell the trainer about the servers the job runs, besides their URLs.

    `rollout.tp_size`: the servers' --tp-size, which may come from `rollout.sglang_args`;
    the nccl weight sync sizes its group by it (each server joins with tp ranks).
    `rollout.router=null` when the config asks for a router: the job has started it, and
    the trainer, given `rollout.urls`, refuses to start another.
    """
    out = []
    if getattr(rollout, "router", None):
        out.append("rollout.router=null")
    if engine_kind(servers).tensor_parallel:
        out.append(f"rollout.tp_size={servers.tp}")
        if colocated and "colocated" in fields:
            out.append("rollout.colocated=true")
    return out


def _train_args(rollout: Any, base: Sequence[str], servers: ServerLayout, colocated: bool,
                fields: set[str]) -> list[str]:
    """Bash words of the trainer's config overrides (the URLs are filled in at run time).

    Generation goes to GENERATE_URLS (the router, when there is one); the workers behind
    a router are `rollout.admin_urls`, where weight updates and the generate requests
    that ask for routed experts go (sglang-router drops `return_routed_experts`).
    """
    words = [bash_word(o) for o in base]
    words.append('"rollout.urls=[$(join_by_comma "${GENERATE_URLS[@]}")]"')
    if servers.use_router:
        words.append('"rollout.admin_urls=[$(join_by_comma "${WORKER_URLS[@]}")]"')
    words += _server_overrides(rollout, servers, colocated, fields)
    if "api_key_file" in fields:
        words += ['"rollout.api_key_file=${KEY_FILE}"', '"rollout.served_model_name=${SERVED_NAME}"']
    return ["  " + w for w in words]


# ----------------------------------------------------------------------------- the script

def default_python(opts: SlurmOptions) -> str:
    """The interpreter the job runs: this one, or `python` inside a container image."""
    if opts.python:
        return opts.python
    return "python" if opts.container_image else sys.executable


def resolve_run_dir(cfg: Any, run_dir: str | Path | None) -> Path:
    """`--run-dir`, else `log.run_dir`, else `runs/<name>-<time>`: absolute, as the job starts elsewhere."""
    if run_dir:
        return Path(run_dir).absolute()
    if cfg.log.run_dir:
        return Path(cfg.log.run_dir).absolute()
    import time

    return (Path("runs") / f"{cfg.log.name}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()


def render_script(config_path: str | Path, overrides: Sequence[str], shape: NodeShape, opts: SlurmOptions,
                  run_dir: str | Path | None = None, chdir: str | Path | None = None) -> Rendered:
    """Validate the config, the node shape and the trainer layout; return the sbatch script.

    CPU mode (`shape.gpus_per_node == 0`): the returned `Rendered.shape` has the ranks per
    node and CPUs per task filled in (`plan.with_cpu_ranks`).
    """
    from moe_rl.config import ConfigError, load_config
    from moe_rl.launch.plan import check_trainer_layout, check_weight_sync, plan_servers, with_cpu_ranks

    shape.validate()
    try:
        cfg = load_config(str(config_path), list(overrides))
    except (ConfigError, FileNotFoundError) as e:
        raise LaunchError(str(e)) from None
    shape = with_cpu_ranks(shape, int(cfg.train.world_size))
    check_weight_sync(cfg.rollout, shape)
    out = resolve_run_dir(cfg, run_dir)
    base = [*overrides, "log.run_dir=@@RUN_DIR@@", "train.resume=auto"]
    fields = _rollout_fields(cfg)
    servers = plan_servers(cfg.rollout, shape, opts.servers_per_node, router_supported="admin_urls" in fields)
    layout = check_trainer_layout(cfg.parallel, shape.world_size,
                                  "--tasks-per-node" if shape.cpu else "--gpus-per-node")
    _check_overrides(config_path, overrides, out, cfg.rollout, servers, shape, fields)
    notes = _notes(cfg, shape, servers, fields) + _node_local_notes(
        {"the run directory (--run-dir / log.run_dir)": out, "the job's working directory (--chdir)": chdir or os.getcwd(),
         "the interpreter (--python)": default_python(opts) if not opts.container_image else None,
         "the config file": config_path})
    bind_node = str(cfg.rollout.host) not in WILDCARD_HOSTS
    name = opts.job_name or f"moe_rl-{cfg.log.name}"
    values = {
        "header": _header(name, cfg, shape, servers, layout, config_path, overrides, out),
        "directives": "\n".join(_directives(name, shape, servers, out, opts, Path(chdir or os.getcwd()).absolute())),
        "log_root": shlex.quote(str(out / "logs")),
        "run_dir": shlex.quote(str(out)), "config": shlex.quote(str(Path(config_path).absolute())),
        "python": shlex.quote(default_python(opts)), "run_task": _run_task(opts),
        "ranks_per_node": str(shape.ranks_per_node),
        "health_timeout": f"{opts.health_timeout:g}", "stop_timeout": f"{opts.stop_timeout:g}",
        "train_steps": str(cfg.train.steps), "srun_opts": " ".join(_srun_opts(opts, out, shape)),
        "nodes": str(shape.nodes), "node_split": _node_split(shape), "cpu_setup": _cpu_setup(shape, servers),
        "master_port": str(opts.master_port) if opts.master_port else
        f"$(( {MASTER_PORT_BASE} + SLURM_JOB_ID % {MASTER_PORT_SPAN} ))",
        "env_exports": _env_exports(opts, shape), "model_setup": _model_setup(cfg, base[:-1]),
        "keys_setup": _keys_setup(),
        "server_lines": _server_lines(cfg, servers, bind_node, shape.colocated),
        "router_setup": _router_setup(cfg, servers, bind_node),
        "train_args": "\n".join(_train_args(cfg.rollout, base, servers, shape.colocated, fields)),
    }
    text = _Template(TEMPLATE.read_text()).substitute(values)
    return Rendered(text, shape, servers, out, tuple(base), tuple(notes))


def _srun_opts(opts: SlurmOptions, run_dir: Path, shape: NodeShape) -> list[str]:
    """Options of every step (each step states its own --cpus-per-task, see `_cpu_setup`)."""
    words = ["--overlap"]
    if opts.container_image:
        mounts = opts.container_mounts or f"{run_dir}:{run_dir}"
        words += [bash_word(f"--container-image={opts.container_image}"), bash_word(f"--container-mounts={mounts}")]
    return words


def _check_overrides(config_path: str | Path, overrides: Sequence[str], run_dir: Path, rollout: Any,
                     servers: ServerLayout, shape: NodeShape, fields: set[str]) -> None:
    """Load the config with every override the job adds (sample URLs), so the job cannot fail on them."""
    from moe_rl.config import ConfigError, load_config

    added = [f"log.run_dir={run_dir}", "train.resume=auto", "rollout.urls=[http://node:1]"]
    if servers.use_router:
        added.append("rollout.admin_urls=[http://node:1]")
    added += _server_overrides(rollout, servers, shape.colocated, fields)
    try:
        load_config(str(config_path), [*overrides, *added])
    except ConfigError as e:
        raise LaunchError(f"the trainer would refuse the job's overrides: {e}") from None


def _notes(cfg: Any, shape: NodeShape, servers: ServerLayout, fields: set[str]) -> list[str]:
    """Warnings for the user: things that will run, but maybe not as they expect."""
    notes = []
    if servers.engine == "sglang" and shape.colocated and "colocated" not in fields:
        notes.append("colocated SGLang: this trainer has no rollout.colocated, so it never calls "
                     "/release_memory_occupation; SGLang keeps rollout.mem_fraction of every GPU while the "
                     "trainer runs (lower rollout.mem_fraction so both fit)")
    if servers.engine == "sglang" and "admin_urls" not in fields and servers.per_node * shape.serve_nodes > 1:
        notes.append("no sglang-router: this trainer has no rollout.admin_urls to reach the servers behind a "
                     "router for weight updates, so it talks to every server directly")
    total = servers.per_node * shape.serve_nodes
    if cfg.rollout.num_servers != total:
        notes.append(f"rollout.num_servers={cfg.rollout.num_servers} is ignored: the job runs {total} server(s) "
                     f"({servers.per_node} on each of {shape.serve_nodes} node(s))")
    if cfg.train.world_size != shape.world_size:
        per_node = "--tasks-per-node" if shape.cpu else "--gpus-per-node"
        notes.append(f"train.world_size={cfg.train.world_size} is ignored: the job runs {shape.world_size} trainer "
                     f"rank(s) ({shape.ranks_per_node} on each of {shape.train_nodes} node(s), {per_node})")
    return notes


# Directories each machine has for itself (a temporary directory of the submitting host among them).
NODE_LOCAL_ROOTS = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/scratch/local", "/local")


def _node_local_notes(paths: Mapping[str, str | Path | None]) -> list[str]:
    """Warnings for paths every node must see that look node-local (the job's nodes would not find
    them, or each would write its own)."""
    import tempfile

    roots = {*NODE_LOCAL_ROOTS, tempfile.gettempdir(), os.environ.get("TMPDIR") or "/tmp"}
    notes = []
    for what, path in paths.items():
        if path is None or not os.path.isabs(str(path)):
            continue
        p = os.path.realpath(str(path))
        root = next((r for r in sorted(roots, key=len, reverse=True)
                     if p == r.rstrip("/") or p.startswith(r.rstrip("/") + "/")), None)
        if root is not None:
            notes.append(f"{what} is {path}, under {root}, which is usually local to each machine: every node of "
                         "the job must see it (shared storage), or the job fails there")
    return notes


def _header(name: str, cfg: Any, shape: NodeShape, servers: ServerLayout, layout: str, config_path: str | Path,
            overrides: Sequence[str], run_dir: Path) -> str:
    if shape.colocated:
        nodes = f"{shape.nodes} node(s), each running trainer ranks and rollout servers"
    else:
        nodes = f"{shape.nodes} node(s) = {shape.train_nodes} trainer + {shape.rollout_nodes} rollout"
    kind = {"local": "moe-rl serve (CPU)", "sglang": f"SGLang tp={servers.tp}"}[servers.engine]
    router = f"; sglang-router on port {servers.router_port}" if servers.use_router else ""
    if shape.cpu:
        ranks = f"{shape.ranks_per_node} per node, CPU mode: {shape.cpus_per_task} CPU(s) each, gloo"
    else:
        ranks = f"{shape.gpus_per_node} per node"
    lines = [
        f"# moe_rl RL job {name}: {shape.name}, {nodes}",
        f"#   trainer:  {shape.world_size} rank(s) ({ranks}), layout {layout}",
        f"#   rollouts: {servers.per_node} x {kind} per node, ports {servers.ports[0]}-{servers.ports[-1]}{router}",
        f"#   config:   {Path(config_path).absolute()} {' '.join(overrides)}".rstrip(),
        f"#   run dir:  {run_dir} (checkpoints, metrics, report/; logs/ per job and restart)",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- submit

def write_job(rendered: Rendered, script: Path) -> Path:
    """Write the script (executable) and create the log directory sbatch's --output needs."""
    script.parent.mkdir(parents=True, exist_ok=True)
    (rendered.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    script.write_text(rendered.text)
    script.chmod(0o755)
    return script


def freeze_config(config_path: str | Path, run_dir: Path) -> Path:
    """Copy the config into the run dir: the queued job must not see later edits of the file."""
    dest = run_dir / "launch" / "config.yaml"
    dest.parent.mkdir(parents=True, exist_ok=True)
    if Path(config_path).absolute() != dest:
        shutil.copyfile(config_path, dest)
    return dest


def submit(script: Path, env: Mapping[str, str] | None = None) -> str:
    """`sbatch --parsable SCRIPT`; returns the job id."""
    if shutil.which("sbatch", path=(env or os.environ).get("PATH")) is None:
        raise LaunchError("sbatch is not on PATH: run this on a SLURM login node (or use --dry-run)")
    res = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                         env=dict(env) if env is not None else None)
    if res.returncode != 0:
        raise LaunchError(f"sbatch failed (exit {res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    job = res.stdout.strip().splitlines()[-1].split(";")[0] if res.stdout.strip() else ""
    if not job.isdigit():
        raise LaunchError(f"sbatch printed no job id: {res.stdout!r}")
    return job
